//! An acceld server in this process, on a temporary image and socket, for tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use accel_dataplane::drive::{DiscardMode, Drive, DriveConfig, ErrorPolicy};
use accel_dataplane::engine::{Engine, FileEngine, FileEngineConfig, IoMode};
use accel_dataplane::vhost::{Server, ShutdownHandle};

#[derive(Clone)]
pub struct ServerOptions {
    pub size: u64,
    pub queues: u16,
    pub read_only: bool,
    pub direct: bool,
    pub serial: String,
    pub logical_block_size: u32,
    pub discard: DiscardMode,
    /// The file engine's I/O mode.
    pub io: IoMode,
    /// Most microseconds each queue busy-polls (0: never).
    pub poll_us: u32,
    /// The drive's name: its queue threads are NAME-qN (tests that watch a thread pick one
    /// no other test uses).
    pub name: String,
    pub werror: ErrorPolicy,
    pub rerror: ErrorPolicy,
    /// Whose device the guest sees (the protocol and parity tests: QEMU's export's).
    pub model: accel_dataplane::drive::DeviceModel,
}

impl ServerOptions {
    /// The ways the file engine can run, for tests that must hold for each: io_uring and
    /// inline I/O, each sleeping between events, and inline I/O with adaptive polling.
    pub fn modes() -> [(&'static str, ServerOptions); 3] {
        [
            (
                "io_uring",
                ServerOptions {
                    io: IoMode::Uring,
                    ..Default::default()
                },
            ),
            (
                "inline",
                ServerOptions {
                    io: IoMode::Inline,
                    ..Default::default()
                },
            ),
            (
                "inline+poll",
                ServerOptions {
                    io: IoMode::Inline,
                    poll_us: 50,
                    ..Default::default()
                },
            ),
        ]
    }

    /// Runs `test` once in each of [`ServerOptions::modes`], naming the mode first.
    pub fn each_mode(test: fn(&ServerOptions)) {
        for (mode, base) in Self::modes() {
            println!("mode {mode}");
            test(&base);
        }
    }
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            size: 64 << 20,
            queues: 1,
            read_only: false,
            direct: true,
            serial: "accel-test-serial".into(),
            logical_block_size: 512,
            discard: DiscardMode::Unmap,
            io: IoMode::Uring,
            poll_us: 0,
            name: "test".into(),
            werror: ErrorPolicy::Enospc,
            rerror: ErrorPolicy::Report,
            model: accel_dataplane::drive::DeviceModel::Export,
        }
    }
}

impl ServerOptions {
    /// The drive config these options describe, for a disk of `capacity` bytes.
    pub fn drive_config(&self, capacity: u64) -> DriveConfig {
        DriveConfig {
            name: self.name.clone(),
            serial: self.serial.clone(),
            capacity_bytes: capacity,
            logical_block_size: self.logical_block_size,
            read_only: self.read_only,
            num_queues: self.queues,
            queue_size: 1024,
            discard: self.discard,
            poll_us: self.poll_us,
            werror: self.werror,
            rerror: self.rerror,
            model: self.model,
            chs: None,
        }
    }
}

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub image: PathBuf,
    pub drive: Arc<Drive>,
    stop: ShutdownHandle,
    thread: Option<JoinHandle<()>>,
}

pub fn file_engine(image: &Path, o: &ServerOptions) -> Arc<FileEngine> {
    Arc::new(
        FileEngine::open(FileEngineConfig {
            path: image.to_path_buf(),
            read_only: o.read_only,
            direct: o.direct,
            logical_block_size: o.logical_block_size,
            lock: false,
            io: o.io,
            identity: None,
        })
        .expect("open image"),
    )
}

impl TestServer {
    /// Creates a sparse image of `o.size` bytes in a new temp dir (on disk, not tmpfs, so
    /// O_DIRECT behaves as on a host) and serves it.
    pub fn start(o: &ServerOptions) -> Self {
        init_logs();
        let dir = tempfile::Builder::new()
            .prefix("accel-test")
            .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
            .expect("temp dir");
        let image = dir.path().join("disk.raw");
        let f = std::fs::File::create(&image).expect("create image");
        f.set_len(o.size).expect("size image");
        drop(f);
        Self::serve(dir, image, o)
    }

    pub fn serve(dir: tempfile::TempDir, image: PathBuf, o: &ServerOptions) -> Self {
        let engine = file_engine(&image, o);
        let size = engine.size();
        Self::serve_engine(dir, image, engine, size, o)
    }

    /// Serves `capacity` bytes through any engine (the image path is for the test's checks).
    pub fn serve_engine(
        dir: tempfile::TempDir,
        image: PathBuf,
        engine: Arc<dyn Engine>,
        capacity: u64,
        o: &ServerOptions,
    ) -> Self {
        init_logs();
        let socket = dir.path().join("vhost.sock");
        let drive = Drive::new(o.drive_config(capacity), engine);
        let mut server = Server::bind(&socket, drive.clone()).expect("bind");
        let stop = server.shutdown_handle();
        let thread = std::thread::spawn(move || server.run().expect("server run"));
        TestServer {
            dir,
            socket,
            image,
            drive,
            stop,
            thread: Some(thread),
        }
    }

    /// A front-end with `queues` queues and the default options, connected and set up.
    pub fn frontend(&self, queues: usize) -> crate::BlkFrontend {
        crate::BlkFrontend::connect(
            &self.socket,
            crate::FrontendOptions {
                queues,
                ..Default::default()
            },
        )
        .expect("connect")
    }

    /// Drains and stops the server; returns once its thread ended.
    pub fn stop(&mut self) {
        self.stop.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().expect("server thread");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Logs of the server in tests, filtered by ACCELD_LOG (e.g. `ACCELD_LOG=debug`).
pub fn init_logs() {
    if let Ok(f) = std::env::var("ACCELD_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(f))
            .with_test_writer()
            .try_init();
    }
}

/// Waits until something accepts connections on a unix socket.
pub fn wait_socket(path: &Path, timeout: std::time::Duration) -> std::io::Result<()> {
    let t0 = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        if t0.elapsed() > timeout {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{} did not come up within {timeout:?}", path.display()),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// Waits until qemu-storage-daemon has written its pid file: it does so once every export
/// and NBD server of its command line is up, before it accepts a connection (its documented
/// order). Nothing connects to probe: probe connections that closed at once were seen to
/// make qemu-storage-daemon 10.0.2 abort at start-up (`qemu_socket_set_nonblock`), and a
/// probe of the NBD socket could come before the export existed.
fn wait_pidfile(child: &mut std::process::Child, pidfile: &Path) -> std::io::Result<()> {
    let t0 = std::time::Instant::now();
    while !std::fs::metadata(pidfile).is_ok_and(|m| m.len() > 0) {
        if let Some(st) = child.try_wait()? {
            return Err(std::io::Error::other(format!(
                "qemu-storage-daemon exited at start-up ({st})"
            )));
        }
        if t0.elapsed() > std::time::Duration::from_secs(30) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "qemu-storage-daemon did not write its pid file within 30 s",
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Ok(())
}

/// How to run QEMU's own vhost-user-blk export for comparison.
#[derive(Clone, Debug)]
pub struct QsdOptions {
    pub queues: u16,
    pub writable: bool,
    pub logical_block_size: u32,
    /// `aio=io_uring` on the file node (QEMU's fastest setting, for benchmarks).
    pub aio_io_uring: bool,
    /// Pin to this CPU (taskset).
    pub cpu: Option<usize>,
    /// Serve the exports from an iothread instead of the main loop.
    pub iothread: bool,
    /// Also export the node over NBD (named `disk0`, writable) on this unix socket: what the
    /// VM's QEMU gives a drive on the qemu engine.
    pub nbd: Option<PathBuf>,
}

impl Default for QsdOptions {
    fn default() -> Self {
        QsdOptions {
            queues: 1,
            writable: true,
            logical_block_size: 512,
            aio_io_uring: false,
            cpu: None,
            iothread: false,
            nbd: None,
        }
    }
}

/// `qemu-storage-daemon --export type=vhost-user-blk` on an image (O_DIRECT, raw over file),
/// killed on drop.
pub struct Qsd(std::process::Child);

impl Qsd {
    /// Starts it and returns once its sockets accept connections.
    pub fn start(image: &Path, socket: &Path, o: &QsdOptions) -> std::io::Result<Self> {
        use std::process::{Command, Stdio};
        let _ = std::fs::remove_file(socket);
        if let Some(nbd) = &o.nbd {
            let _ = std::fs::remove_file(nbd);
        }
        let mut c = match o.cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpu.to_string()).arg("qemu-storage-daemon");
                c
            }
            None => Command::new("qemu-storage-daemon"),
        };
        let iothread = if o.iothread { ",iothread=io0" } else { "" };
        if o.iothread {
            c.args(["--object", "iothread,id=io0"]);
        }
        c.arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=file0,filename={},cache.direct=on{}",
                image.display(),
                if o.aio_io_uring { ",aio=io_uring" } else { "" }
            ))
            .args(["--blockdev", "driver=raw,node-name=disk0,file=file0"])
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=exp0,node-name=disk0{iothread},addr.type=unix,addr.path={},writable={},num-queues={},logical-block-size={}",
                socket.display(),
                if o.writable { "on" } else { "off" },
                o.queues,
                o.logical_block_size
            ));
        if let Some(nbd) = &o.nbd {
            c.arg("--nbd-server")
                .arg(format!("addr.type=unix,addr.path={}", nbd.display()))
                .arg("--export")
                .arg(format!(
                    "type=nbd,id=nbd0,node-name=disk0,name=disk0,writable={}{iothread}",
                    if o.writable { "on" } else { "off" }
                ));
        }
        let pidfile = socket.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        c.arg("--pidfile").arg(&pidfile);
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = c.spawn().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot run qemu-storage-daemon (qemu-utils; integration/setup.sh): {e}"),
            )
        })?;
        let mut q = Qsd(child);
        wait_pidfile(&mut q.0, &pidfile)?;
        Ok(q)
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Whether the process has ended.
    pub fn exited(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(Some(_)))
    }

    /// SIGKILL: the exports disappear with whatever is in flight.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `qemu-storage-daemon` serving an image as an NBD export on a unix socket (QEMU's block
/// layer: what the qemu engine talks to), killed on drop.
pub struct QsdNbd {
    child: std::process::Child,
    pub socket: PathBuf,
    pub export: String,
}

impl QsdNbd {
    /// `format` is the image format (raw, qcow2); the export is named `disk0`, writable, and
    /// takes no image lock (tests open the image from the host too).
    pub fn start(image: &Path, format: &str, socket: &Path) -> std::io::Result<Self> {
        use std::process::{Command, Stdio};
        let _ = std::fs::remove_file(socket);
        let pidfile = socket.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=file0,filename={},cache.direct=on,locking=off",
                image.display()
            ))
            .arg("--blockdev")
            .arg(format!("driver={format},node-name=disk0,file=file0"))
            .arg("--nbd-server")
            .arg(format!("addr.type=unix,addr.path={}", socket.display()))
            .args([
                "--export",
                "type=nbd,id=exp0,node-name=disk0,name=disk0,writable=on",
            ])
            .arg("--pidfile")
            .arg(&pidfile)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let mut q = QsdNbd {
            child,
            socket: socket.to_path_buf(),
            export: "disk0".into(),
        };
        wait_pidfile(&mut q.child, &pidfile)?;
        Ok(q)
    }

    /// SIGKILL: the export disappears with whatever is in flight.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for QsdNbd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The uid and gid of `nobody` (Debian's), the stand-in for QEMU's unprivileged user.
pub const NOBODY: u32 = 65534;

/// Runs the calling test binary's ignored test `child` again as `nobody`, from a copy in
/// `dir` (the checkout may sit where only root can enter), with `env`; returns whether it
/// passed and its stdout and stderr together.
pub fn run_child_test_as_nobody(dir: &Path, child: &str, env: &[(&str, &str)]) -> (bool, String) {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let exe = dir.join(format!("{child}-bin"));
    std::fs::copy(std::env::current_exe().expect("test binary"), &exe)
        .expect("copy the test binary");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = std::process::Command::new(&exe)
        .args(["--exact", child, "--ignored", "--nocapture"])
        .envs(env.iter().copied())
        .current_dir("/")
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run the test binary as nobody");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A directory under /var/tmp (prefix `prefix`) holding `d0.raw`, a sparse raw image of
/// `size` bytes.
pub fn temp_image(prefix: &str, size: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .expect("temporary directory");
    let image = dir.path().join("d0.raw");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(size))
        .expect("image file");
    (dir, image)
}
