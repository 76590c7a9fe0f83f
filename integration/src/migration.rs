//! Live-migration helpers shared by the migration tests and `accel-integration
//! migration-bench`: a QEMU instance with a side monitor, a plain QMP `migrate` with its
//! figures, and who has the image open or locked.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::supervised::{AcceldRun, SideQmp};
use crate::Guest;

/// A running QEMU of the VM: the guest process and a side monitor.
pub struct Instance {
    pub guest: Guest,
    pub side: SideQmp,
    pub side_path: PathBuf,
}

impl Instance {
    /// QEMU with `args` (the VM's contract) plus a side monitor at `side` and `extra`.
    pub fn boot(args: &[String], side: &Path, extra: &[String], script: &str) -> Result<Self> {
        Self::boot_in(&[], args, side, extra, script)
    }

    /// [`Instance::boot`], QEMU run through `prefix` (inside a host of `two-hosts.sh`); `side`
    /// must be a path both QEMU and this process see.
    pub fn boot_in(
        prefix: &[&str],
        args: &[String],
        side: &Path,
        extra: &[String],
        script: &str,
    ) -> Result<Self> {
        let mut x = vec![
            "-qmp".to_string(),
            format!("unix:{},server=on,wait=off", side.display()),
        ];
        x.extend_from_slice(extra);
        let guest = Guest::boot_contract_in(prefix, args, &x, script)?;
        let side_qmp = SideQmp::connect(side)?;
        Ok(Instance {
            guest,
            side: side_qmp,
            side_path: side.to_path_buf(),
        })
    }

    /// QEMU with the contract of `vm` from `acc` (`accelctl qemu-args`).
    pub fn boot_registered(
        acc: &AcceldRun,
        vm: &str,
        side: &Path,
        extra: &[String],
        script: &str,
    ) -> Result<Self> {
        let contract: Vec<String> = acc
            .ctl_ok(&["qemu-args", "--vm", vm, "--memory", "256M"])?
            .lines()
            .map(String::from)
            .collect();
        Self::boot(&contract, side, extra, script)
    }

    /// QEMU's run state.
    pub fn status(&self) -> Result<String> {
        Ok(self.side.cmd("query-status", Value::Null)?["status"]
            .as_str()
            .unwrap_or("")
            .to_string())
    }

    pub fn wait_status(&self, want: &str, timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        loop {
            let s = self.status()?;
            if s == want {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > timeout {
                bail!("QEMU is {s}, not {want}, after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// One migration's figures.
#[derive(Clone, Copy, Debug)]
pub struct Migrated {
    /// QEMU's `total-time` and `downtime` (ms).
    pub total_ms: u64,
    pub downtime_ms: u64,
    /// From the source's `completed` to the destination `running`, as polled.
    pub to_running: Duration,
}

/// Migrates with a plain QMP `migrate` on the source's monitor, as any management tool would,
/// and waits for the destination to run.
pub fn migrate(src: &Instance, dst: &Instance, uri: &str) -> Result<Migrated> {
    src.side.cmd(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "events", "state": true}]}),
    )?;
    src.side.cmd("migrate", json!({ "uri": uri }))?;
    let t0 = Instant::now();
    let info = loop {
        let m = src.side.cmd("query-migrate", Value::Null)?;
        match m["status"].as_str().unwrap_or("") {
            "completed" => break m,
            s @ ("failed" | "cancelled") => bail!("migration {s}: {m}"),
            _ => {}
        }
        if t0.elapsed() > Duration::from_secs(90) {
            bail!("migration not completed after 90 s: {m}");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let tc = Instant::now();
    dst.wait_status("running", Duration::from_secs(30))?;
    Ok(Migrated {
        total_ms: info["total-time"].as_u64().unwrap_or(0),
        downtime_ms: info["downtime"].as_u64().unwrap_or(0),
        to_running: tc.elapsed(),
    })
}

/// Waits for the MIGRATION event that ends a migration (completed or failed) on `qmp`'s
/// `events`, then returns `query-migrate`, which must say completed.
pub fn wait_migration_end(
    qmp: &SideQmp,
    events: &mut tokio::sync::broadcast::Receiver<qmp_client::Event>,
    timeout: Duration,
) -> Result<Value> {
    qmp.wait_event(
        events,
        "MIGRATION",
        |d| d["status"] == "completed" || d["status"] == "failed",
        timeout,
    )?;
    let m = qmp.cmd("query-migrate", Value::Null)?;
    if m["status"] != "completed" {
        bail!("the migration did not complete: {m}");
    }
    Ok(m)
}

/// Whether process `pid` has `image` open with a lock on it (QEMU-style OFD locks show in
/// the fd's fdinfo).
pub fn holds_lock(pid: u32, image: &Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|t| t == image)
            && std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .is_ok_and(|i| i.contains("lock:"))
    })
}

/// Whether process `pid` has `image` open at all.
pub fn has_open(pid: u32, image: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == image))
        })
        .unwrap_or(false)
}

/// Runs `accelctl migrate VM` from `a` to `b` in a thread (migration over `DIR/mig.sock`, the
/// destination's QMP at `DIR/qmp-b.sock`), boots the destination QEMU with `-incoming` once
/// accelctl registered the VM there (it waits for it), and returns accelctl's output and the
/// destination instance.
pub fn accelctl_migrate(
    a: &AcceldRun,
    b: &AcceldRun,
    vm: &str,
    dir: &Path,
    script: &str,
    extra: &[&str],
) -> Result<(String, Instance)> {
    let mig = dir.join("mig.sock");
    let uri = format!("unix:{}", mig.display());
    let dqmp = dir.join("qmp-b.sock");
    let accelctl = crate::supervised::accelctl_bin()?;
    let mut cmd = std::process::Command::new(accelctl);
    cmd.arg("--run-dir")
        .arg(&a.run_dir)
        .args(["migrate", vm, "--to"])
        .arg(&b.run_dir)
        .arg("--dest-qmp")
        .arg(dqmp)
        .args(["--uri", &uri, "--timeout", "120"])
        .args(extra);
    let t = std::thread::spawn(move || cmd.output());
    let t0 = Instant::now();
    while b.status()?["vms"]
        .as_array()
        .is_none_or(|v| !v.iter().any(|v| v["vm"] == vm))
    {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("accelctl migrate did not register the destination");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let dst = Instance::boot_registered(
        b,
        vm,
        &dir.join("side-b.sock"),
        &["-incoming".to_string(), uri],
        script,
    )?;
    let out = t
        .join()
        .map_err(|_| anyhow::anyhow!("the accelctl thread panicked"))??;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    if !out.status.success() {
        bail!(
            "accelctl migrate failed: {text}\nsource acceld:\n{}\ndestination acceld:\n{}",
            a.log_text(),
            b.log_text()
        );
    }
    Ok((text, dst))
}
