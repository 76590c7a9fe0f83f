//! Two libvirt hosts on one machine (`integration/two-hosts.sh`) from Rust: each host's
//! commands run inside its namespaces; its files are reachable from here through
//! `/proc/INIT/root` (its private /run included).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::serial::Serial;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    A,
    B,
}

impl Host {
    pub fn arg(self) -> &'static str {
        match self {
            Host::A => "A",
            Host::B => "B",
        }
    }
    /// Its hostname (what libvirt URIs name).
    pub fn name(self) -> &'static str {
        match self {
            Host::A => "hosta",
            Host::B => "hostb",
        }
    }
    pub fn other(self) -> Host {
        match self {
            Host::A => Host::B,
            Host::B => Host::A,
        }
    }
    /// `qemu+tcp://NAME/system`: this host's libvirtd, from the other host.
    pub fn uri(self) -> String {
        format!("qemu+tcp://{}/system", self.name())
    }
}

/// The two hosts, up while this lives (`down` on drop).
pub struct TwoHosts {
    dir: PathBuf,
    script: PathBuf,
}

impl TwoHosts {
    /// `two-hosts.sh up` (an earlier pair is stopped first).
    pub fn up() -> Result<Self> {
        let script = crate::crate_dir().join("two-hosts.sh");
        let dir = PathBuf::from(
            std::env::var("ACCEL_HOSTS_DIR").unwrap_or_else(|_| "/var/tmp/accel-hosts".into()),
        );
        let out = Command::new(&script)
            .arg("up")
            .output()
            .context("two-hosts.sh up")?;
        if !out.status.success() {
            bail!(
                "two-hosts.sh up failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(TwoHosts { dir, script })
    }

    /// The command prefix that runs a program inside host `h` (`two-hosts.sh exec H`).
    pub fn exec_prefix(h: Host) -> Vec<String> {
        vec![
            crate::crate_dir()
                .join("two-hosts.sh")
                .to_string_lossy()
                .into_owned(),
            "exec".into(),
            h.arg().into(),
        ]
    }

    /// Storage both hosts see at the same path.
    pub fn shared(&self) -> PathBuf {
        self.dir.join("shared")
    }

    /// Runs `args` inside host `h`; its stdout, or an error with its stderr.
    pub fn exec(&self, h: Host, args: &[&str]) -> Result<String> {
        let out = Command::new(&self.script)
            .arg("exec")
            .arg(h.arg())
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!(
                "on {}: {}: {}{}",
                h.name(),
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub fn virsh(&self, h: Host, args: &[&str]) -> Result<String> {
        let mut a = vec!["virsh", "-c", "qemu:///system"];
        a.extend_from_slice(args);
        self.exec(h, &a)
    }

    /// `accelctl` inside `h` (the build's binary).
    pub fn accelctl(&self, h: Host, args: &[&str]) -> Result<String> {
        let bin = crate::supervised::accelctl_bin()?;
        let bin = bin.to_str().ok_or_else(|| anyhow!("accelctl path"))?;
        let mut a = vec![bin];
        a.extend_from_slice(args);
        self.exec(h, &a)
    }

    /// The status of `h`'s acceld.
    pub fn status(&self, h: Host) -> Result<Value> {
        Ok(serde_json::from_str(
            &self.accelctl(h, &["status", "--json"])?,
        )?)
    }

    /// The VMs `h`'s acceld serves.
    pub fn vms(&self, h: Host) -> Result<Vec<String>> {
        Ok(self.status(h)?["vms"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["vm"].as_str().map(str::to_string))
            .collect())
    }

    /// Drive `drive` of `vm` in `h`'s acceld's status.
    pub fn drive(&self, h: Host, vm: &str, drive: &str) -> Result<Value> {
        let st = self.status(h)?;
        crate::supervised::drive_in(&st, vm, drive)
            .ok_or_else(|| anyhow!("no drive {vm}/{drive} on {}: {st}", h.name()))
    }

    /// Polls until `h`'s acceld serves `vm`'s `drive` on `engine`.
    pub fn wait_engine(
        &self,
        h: Host,
        vm: &str,
        drive: &str,
        engine: &str,
        timeout: Duration,
    ) -> Result<Value> {
        let t0 = Instant::now();
        loop {
            let d = self.drive(h, vm, drive);
            if let Ok(d) = &d {
                if d["engine"] == engine {
                    return Ok(d.clone());
                }
            }
            if t0.elapsed() > timeout {
                bail!(
                    "{vm}/{drive} on {} is not on the {engine} engine after {timeout:?}: {d:?}",
                    h.name()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls until `h`'s acceld no longer lists `vm`.
    pub fn wait_forgotten(&self, h: Host, vm: &str, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        while self.vms(h)?.iter().any(|v| v == vm) {
            if t0.elapsed() > timeout {
                bail!("{}'s acceld still serves {vm} after {timeout:?}", h.name());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Stops (`false`) or starts (`true`) host `h`'s acceld.
    pub fn set_acceld(&self, h: Host, running: bool) -> Result<()> {
        let out = Command::new(&self.script)
            .args(["acceld", h.arg(), if running { "start" } else { "stop" }])
            .output()?;
        if !out.status.success() {
            bail!(
                "two-hosts.sh acceld {}: {}",
                h.arg(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Host `h`'s files as seen from here.
    pub fn root(&self, h: Host) -> Result<PathBuf> {
        let pid = std::fs::read_to_string(self.dir.join(h.arg()).join("init.pid"))?;
        Ok(PathBuf::from(format!("/proc/{}/root", pid.trim())))
    }

    /// The serial console a domain of `h` listens on at `path` (inside `h`).
    pub fn serial(&self, h: Host, path: &Path) -> Result<Serial> {
        let rel = path.strip_prefix("/").unwrap_or(path);
        Serial::connect(&self.root(h)?.join(rel))
    }

    /// `h`'s acceld log.
    pub fn acceld_log(&self, h: Host) -> String {
        std::fs::read_to_string(self.dir.join(h.arg()).join("acceld.log")).unwrap_or_default()
    }

    /// The lines of `h`'s acceld log at WARN or ERROR.
    pub fn acceld_warnings(&self, h: Host) -> Vec<String> {
        self.acceld_log(h)
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .map(str::to_string)
            .collect()
    }

    /// `h`'s libvirt log of domain `dom`.
    pub fn domain_log(&self, h: Host, dom: &str) -> String {
        self.root(h)
            .and_then(|r| {
                Ok(std::fs::read_to_string(
                    r.join(format!("var/log/libvirt/qemu/{dom}.log")),
                )?)
            })
            .unwrap_or_default()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        if std::env::var_os("ACCEL_KEEP").is_none() {
            let _ = Command::new(&self.script).arg("down").status();
        }
    }
}
