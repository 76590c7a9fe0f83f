//! `acceld run`, the whole daemon, in a child process, as systemd starts it: the test binary
//! runs itself again with one ignored test that calls [`acceld::run::run`] (see
//! [`child_main`]), with `NOTIFY_SOCKET` naming a datagram socket the parent reads. The
//! parent learns that acceld serves from its `READY=1` (no polling) and stops it with SIGTERM.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use acceld::control::{Reply, Request};

/// The child's settings, passed in the environment.
const CONFIG_ENV: &str = "ACCEL_TEST_RUN_CONFIG";
const RUN_DIR_ENV: &str = "ACCEL_TEST_RUN_DIR";

/// A running `acceld run`.
pub struct AcceldRun {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub run_dir: PathBuf,
    notify: UnixDatagram,
    log: PathBuf,
}

impl AcceldRun {
    /// Starts `acceld run` with the TOML `config` (`run-dir` is set here), running the ignored
    /// test `child_test` of the calling test binary (which must call [`child_main`]).
    pub fn start(child_test: &str, config: &str) -> Self {
        Self::start_under(&[], child_test, config)
    }

    /// Like [`AcceldRun::start`], with `wrapper` (a program and its arguments, such as
    /// `setpriv --bounding-set …`) running acceld's process.
    pub fn start_under(wrapper: &[String], child_test: &str, config: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("accel-run")
            .tempdir()
            .unwrap();
        let run_dir = dir.path().join("run");
        let cfg = dir.path().join("acceld.toml");
        std::fs::write(&cfg, config).unwrap();
        let notify_path = dir.path().join("notify.sock");
        let notify = UnixDatagram::bind(&notify_path).unwrap();
        let log = dir.path().join("acceld.log");
        let out = std::fs::File::create(&log).unwrap();
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((prog, args)) => {
                let mut c = Command::new(prog);
                c.args(args).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let child = cmd
            .args(["--exact", child_test, "--ignored", "--nocapture"])
            .env(CONFIG_ENV, &cfg)
            .env(RUN_DIR_ENV, &run_dir)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("ACCELD_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        AcceldRun {
            child: Some(child),
            dir,
            run_dir,
            notify,
            log,
        }
    }

    /// The next notification acceld sends the service manager (`READY=1`, …), waiting at
    /// most `timeout`.
    pub fn notification(&self, timeout: Duration) -> String {
        self.notify.set_read_timeout(Some(timeout)).unwrap();
        let mut b = [0u8; 4096];
        match self.notify.recv(&mut b) {
            Ok(n) => String::from_utf8_lossy(&b[..n]).into_owned(),
            Err(e) => panic!(
                "no notification within {timeout:?} ({e}); log:\n{}",
                self.log()
            ),
        }
    }

    /// Waits for `READY=1`.
    pub fn wait_ready(&self) {
        let n = self.notification(Duration::from_secs(30));
        assert_eq!(n, "READY=1", "log:\n{}", self.log());
    }

    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join("acceld.sock")
    }

    /// A `status` request on acceld's control socket.
    pub fn status(&self, timeout: Duration) -> Reply {
        acceld::control::call(&self.control_socket(), &Request::Status, timeout)
            .unwrap_or_else(|e| panic!("status: {e}; log:\n{}", self.log()))
    }

    /// acceld's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGTERM, as `systemctl stop` sends it.
    pub fn terminate(&self) {
        let pid = self.pid();
        // SAFETY: kill() takes plain integers; the pid is our own child's, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) }, 0);
    }

    /// Waits for the child to exit.
    pub fn wait(&mut self) -> ExitStatus {
        self.child.take().expect("running").wait().unwrap()
    }

    /// What acceld (and the test harness around it) printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AcceldRun {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The child's side: `acceld run` with the parent's config and run directory, until SIGTERM.
/// Call it from an `#[ignore]`d test named as [`AcceldRun::start`] was told.
pub fn child_main() {
    let (Some(cfg), Some(run_dir)) = (std::env::var_os(CONFIG_ENV), std::env::var_os(RUN_DIR_ENV))
    else {
        panic!("run by AcceldRun::start only");
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_writer(std::io::stderr)
        .try_init();
    let args = acceld::run::RunArgs {
        config: Some(PathBuf::from(cfg)),
        run_dir: Some(PathBuf::from(run_dir)),
    };
    if let Err(e) = acceld::run::run(&args) {
        panic!("acceld run: {}", acceld::error_chain(&e));
    }
    // What acceld spawns (qemu-img, qemu-storage-daemon) gets this process's environment.
    assert!(
        std::env::var_os("NOTIFY_SOCKET").is_none(),
        "acceld's children would inherit NOTIFY_SOCKET"
    );
}
