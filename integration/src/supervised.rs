//! `acceld run` as a process and `accelctl` as a command, for scenarios and the demo; and the
//! guest's verifying random writer.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::acceld_bin;

/// The `accelctl` binary next to acceld (or `ACCELCTL_BIN`).
pub fn accelctl_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ACCELCTL_BIN") {
        return Ok(PathBuf::from(p));
    }
    let acceld = acceld_bin()?;
    let p = acceld.with_file_name("accelctl");
    if !p.is_file() {
        bail!(
            "accelctl not found at {}; run `cargo build -p accelctl`",
            p.display()
        );
    }
    Ok(p)
}

/// `acceld run --run-dir DIR` with a config file, killed on drop.
pub struct AcceldRun {
    child: Option<Child>,
    pub run_dir: PathBuf,
    pub config: PathBuf,
    pub log: PathBuf,
}

impl AcceldRun {
    /// Starts acceld with `config` (TOML) in `run_dir`; returns once its control socket
    /// answers.
    pub fn start(run_dir: &Path, config: &str) -> Result<Self> {
        std::fs::create_dir_all(run_dir)?;
        let cfg = run_dir.with_extension("toml");
        std::fs::write(&cfg, config)?;
        let mut me = AcceldRun {
            child: None,
            run_dir: run_dir.to_path_buf(),
            config: cfg,
            log: run_dir.with_extension("log"),
        };
        me.spawn()?;
        Ok(me)
    }

    fn spawn(&mut self) -> Result<()> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(acceld_bin()?)
            .args(["run", "--config"])
            .arg(&self.config)
            .arg("--run-dir")
            .arg(&self.run_dir)
            .env(
                "ACCELD_LOG",
                std::env::var("ACCELD_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("spawning acceld run")?;
        self.child = Some(child);
        let t0 = Instant::now();
        loop {
            if self.ctl(&["status", "--json"]).map(|o| o.0 == 0)? {
                return Ok(());
            }
            if let Some(st) = self.child.as_mut().expect("spawned").try_wait()? {
                bail!("acceld run exited ({st}):\n{}", self.log_text());
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!(
                    "acceld run did not answer within 10 s:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, wait for a clean exit, and start again on the same run dir.
    pub fn restart(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        let st = self.terminate()?;
        if !st.success() {
            bail!("acceld exited with {st} on SIGTERM:\n{}", self.log_text());
        }
        self.spawn()?;
        Ok(t0.elapsed())
    }

    /// SIGKILL (no drain, nothing saved at exit) and start again on the same run dir, as
    /// systemd's `Restart=on-failure` would.
    pub fn kill_and_start(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        self.spawn()
    }

    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        let Some(mut c) = self.child.take() else {
            bail!("acceld is not running");
        };
        crate::sigterm_and_wait(&mut c, Duration::from_secs(60))
    }

    /// The acceld process's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of acceld's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Runs accelctl; returns (exit code, stdout, stderr).
    pub fn ctl(&self, args: &[&str]) -> Result<(i32, String, String)> {
        let out = Command::new(accelctl_bin()?)
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(args)
            .output()
            .context("running accelctl")?;
        Ok((
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }

    /// Runs accelctl and fails unless it exits 0; returns stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> Result<String> {
        let (code, out, err) = self.ctl(args)?;
        if code != 0 {
            bail!("accelctl {} exited {code}: {err}{out}", args.join(" "));
        }
        Ok(out)
    }

    /// `accelctl register --vm VM --qmp QMP --drive DRIVE` plus `flags` (`--cont`,
    /// `--incoming`).
    pub fn register(&self, vm: &str, qmp: &Path, drive: &str, flags: &[&str]) -> Result<()> {
        let qmp = qmp.to_string_lossy();
        let mut args = vec!["register", "--vm", vm, "--qmp", &qmp, "--drive", drive];
        args.extend_from_slice(flags);
        self.ctl_ok(&args)?;
        Ok(())
    }

    pub fn status(&self) -> Result<Value> {
        Ok(serde_json::from_str(&self.ctl_ok(&["status", "--json"])?)?)
    }

    /// One drive's status.
    pub fn drive(&self, vm: &str, drive: &str) -> Result<Value> {
        let st = self.status()?;
        drive_in(&st, vm, drive)
            .ok_or_else(|| anyhow!("no drive {vm}/{drive} in status: {st}\n{}", self.log_text()))
    }

    /// Polls until acceld has attached to the VM over QMP.
    pub fn wait_attached(&self, vm: &str, timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        loop {
            let st = self.status()?;
            let attached = st["vms"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|v| v["vm"] == vm && v["attached"] == true);
            if attached {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > timeout {
                bail!(
                    "{vm} not attached within {timeout:?}: {st}\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls until the drive runs on `engine`; returns how long it took.
    pub fn wait_engine(
        &self,
        vm: &str,
        drive: &str,
        engine: &str,
        timeout: Duration,
    ) -> Result<Duration> {
        let t0 = Instant::now();
        loop {
            let d = self.drive(vm, drive)?;
            if d["engine"] == engine {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > timeout {
                bail!(
                    "{vm}/{drive} not on {engine} within {timeout:?}: {d}\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// The guest command that runs `guest/accel-writer.sh` (in the initramfs): `workers`
/// writers, each owning `blocks` 4 KiB blocks of `dev`, write random blocks (O_DIRECT) and
/// read random ones back, comparing with a copy in guest RAM, until a line `STOP` arrives on
/// the serial console; then each compares its whole region. Prints `READY`, `progress=N`,
/// `iterations=`, `errors=` (I/O errors + mismatches), `kernel_errors=`, `md5=` of the expected
/// region contents and `RESULT: PASS|FAIL`.
pub fn writer_script(dev: &str, workers: u32, blocks: u32) -> String {
    format!("accel-writer {dev} {workers} {blocks}\n")
}

/// A second QMP monitor on the VM, for tests and the demo to look at QEMU (acceld holds the
/// VM's own monitor). Add `-qmp unix:PATH,server=on,wait=off` to the guest.
pub struct SideQmp {
    rt: tokio::runtime::Runtime,
    qmp: qmp_client::Qmp,
}

impl SideQmp {
    pub fn connect(path: &Path) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let qmp = rt.block_on(qmp_client::connect_with_retry(
            path,
            200,
            Duration::from_millis(50),
        ))?;
        Ok(SideQmp { rt, qmp })
    }

    pub fn cmd(&self, name: &str, args: Value) -> Result<Value, qmp_client::QmpError> {
        let a = if args.is_null() { None } else { Some(args) };
        self.rt.block_on(self.qmp.execute_raw(name, a))
    }

    /// Events from now on (take it before the command that causes them).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<qmp_client::Event> {
        self.qmp.events()
    }

    /// The next event `name` whose data satisfies `want`, within `timeout`.
    pub fn wait_event(
        &self,
        rx: &mut tokio::sync::broadcast::Receiver<qmp_client::Event>,
        name: &str,
        want: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<qmp_client::Event> {
        self.rt.block_on(async {
            tokio::time::timeout(timeout, async {
                loop {
                    match rx.recv().await {
                        Ok(e) if e.name == name && want(&e.data) => return Ok(e),
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(e) => bail!("QMP events ended: {e}"),
                    }
                }
            })
            .await
            .map_err(|_| anyhow::anyhow!("no {name} event within {timeout:?}"))?
        })
    }

    /// The throttle filter nodes QEMU has: (node name, group).
    pub fn throttle_filters(&self) -> Result<Vec<String>> {
        let nodes = self.cmd("query-named-block-nodes", serde_json::json!({"flat": true}))?;
        Ok(nodes
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["drv"] == "throttle")
            .filter_map(|n| n["node-name"].as_str().map(String::from))
            .collect())
    }
}

/// Boots the tiny guest with the VM contract of `vm` (from `accelctl qemu-args`) plus a side
/// QMP monitor at `side_qmp`.
pub fn boot_registered(
    acc: &AcceldRun,
    vm: &str,
    memory: &str,
    side_qmp: &Path,
    script: &str,
) -> Result<crate::Guest> {
    let contract: Vec<String> = acc
        .ctl_ok(&["qemu-args", "--vm", vm, "--memory", memory])?
        .lines()
        .map(String::from)
        .collect();
    let extra = vec![
        "-qmp".to_string(),
        format!("unix:{},server=on,wait=off", side_qmp.display()),
    ];
    crate::Guest::boot_contract(&contract, &extra, script)
}

/// Drive `drive` of `vm` in an acceld status (`accelctl status --json`).
pub fn drive_in(status: &Value, vm: &str, drive: &str) -> Option<Value> {
    status["vms"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["vm"] == vm)
        .flat_map(|v| v["drives"].as_array().cloned().unwrap_or_default())
        .find(|d| d["drive"] == drive)
}
