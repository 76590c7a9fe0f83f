//! libvirt: the emulator wrapper's decision (`argv`), the domain XML (`xml`: conversion and
//! the facts the hook needs), the hook (`hook`) and the wrapper's config. docs/libvirt.md.

use std::path::{Path, PathBuf};

use accel_api::status::{Status, VmStatus};
use serde::Deserialize;
use thiserror::Error;

pub mod apparmor;
pub mod argv;
pub mod hook;
pub mod relay;
pub mod xml;

/// Where the wrapper looks for its config when `ACCEL_QEMU_CONF` is not set and there is none
/// next to the wrapper itself.
pub const DEFAULT_CONF: &str = "/etc/accel/accel-qemu.conf";

/// The wrapper's and the hook's config (`accelctl libvirt install` writes it).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WrapperConf {
    /// acceld's run directory.
    #[serde(default = "default_run_dir")]
    pub run_dir: PathBuf,
    /// The real QEMU binary.
    #[serde(default = "default_qemu")]
    pub qemu: PathBuf,
    /// acceld's iothread name (acceld's `iothread` config).
    #[serde(default = "default_iothread")]
    pub iothread: String,
    /// acceld to start from the hook's `prepare` when it is not running (hosts without
    /// systemd); none: the hook refuses to start the VM instead.
    #[serde(default)]
    pub acceld: Option<PathBuf>,
    /// Every converted disk is registered with `lend=on`: on the qemu engine its rings are
    /// lent to QEMU's own vhost-user-blk export (docs/qemu-engine.md says what the guest then
    /// sees differently).
    #[serde(default)]
    pub lend: bool,
}

fn default_run_dir() -> PathBuf {
    PathBuf::from("/run/accel")
}
fn default_qemu() -> PathBuf {
    PathBuf::from("/usr/bin/qemu-system-x86_64")
}
fn default_iothread() -> String {
    "accel-io".into()
}

impl Default for WrapperConf {
    fn default() -> Self {
        WrapperConf {
            run_dir: default_run_dir(),
            qemu: default_qemu(),
            iothread: default_iothread(),
            acceld: None,
            lend: false,
        }
    }
}

#[derive(Debug, Error)]
pub enum ConfError {
    #[error("cannot read {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("{0} is not valid: {1}")]
    Parse(PathBuf, String),
}

impl WrapperConf {
    pub fn load(path: &Path) -> Result<Self, ConfError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| ConfError::Read(path.to_path_buf(), e))?;
        let c: WrapperConf = toml::from_str(&text)
            .map_err(|e| ConfError::Parse(path.to_path_buf(), e.to_string()))?;
        if !c.run_dir.is_absolute() || !c.qemu.is_absolute() {
            return Err(ConfError::Parse(
                path.to_path_buf(),
                "run-dir and qemu must be absolute paths".into(),
            ));
        }
        Ok(c)
    }

    /// The config the wrapper named `argv0` uses: `$ACCEL_QEMU_CONF`, else `accel-qemu.conf`
    /// beside the wrapper, else [`DEFAULT_CONF`], else the defaults.
    pub fn find(argv0: &Path) -> Result<Self, ConfError> {
        if let Some(p) = std::env::var_os("ACCEL_QEMU_CONF") {
            return Self::load(Path::new(&p));
        }
        let beside = argv0.with_file_name("accel-qemu.conf");
        if argv0.parent().is_some_and(|d| !d.as_os_str().is_empty()) && beside.exists() {
            return Self::load(&beside);
        }
        if Path::new(DEFAULT_CONF).exists() {
            return Self::load(Path::new(DEFAULT_CONF));
        }
        Ok(Self::default())
    }

    /// The text `install` writes.
    pub fn render(&self) -> String {
        let mut s = format!(
            "# accel's emulator wrapper and libvirt hook (accelctl libvirt install)\n\
             run-dir = {:?}\nqemu = {:?}\niothread = {:?}\n",
            self.run_dir.display().to_string(),
            self.qemu.display().to_string(),
            self.iothread
        );
        if let Some(a) = &self.acceld {
            s += &format!("acceld = {:?}\n", a.display().to_string());
        }
        if self.lend {
            s += "lend = true\n";
        }
        s
    }

    /// acceld's control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join("acceld.sock")
    }

    /// The VM's own control socket: acceld serves it to QEMU's user while the hook's permit
    /// lasts (QEMU not running as root).
    pub fn vm_control_socket(&self, vm: &str) -> PathBuf {
        self.run_dir.join(vm).join("control.sock")
    }

    /// acceld's status of the VM, if acceld answers and has it.
    pub fn vm_status(&self, vm: &str, timeout: std::time::Duration) -> Option<VmStatus> {
        Self::vm_status_at(&self.control_socket(), vm, timeout)
    }

    /// The VM's status as the control socket `sock` answers it.
    pub fn vm_status_at(sock: &Path, vm: &str, timeout: std::time::Duration) -> Option<VmStatus> {
        let r =
            accel_api::control::call(sock, &accel_api::control::Request::Status, timeout).ok()?;
        let st: Status = serde_json::from_value(r.result?).ok()?;
        st.vms.into_iter().find(|v| v.vm == vm)
    }

    pub fn wrap_config(&self) -> argv::WrapConfig {
        argv::WrapConfig {
            run_dir: self.run_dir.clone(),
            iothread: self.iothread.clone(),
            lend: self.lend,
        }
    }
}
