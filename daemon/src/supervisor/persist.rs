//! The state file: the registry as it must survive an acceld restart (atomic save, load).

use std::path::Path;

use accel_api::control::{DriveSpec, ThrottleLimits};
use accel_api::status::EngineKind;
use policy::Pin;
use serde::{Deserialize, Serialize};

use super::drive_state::Recorded;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedDrive {
    pub spec: DriveSpec,
    pub engine: EngineKind,
    pub nodes_removed: bool,
    pub recorded: Option<Recorded>,
    #[serde(default)]
    pub pin: Option<Pin>,
    #[serde(default)]
    pub throttle: Option<ThrottleLimits>,
    /// The image as registered (older state files lack it: resolved at restore).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<super::permit::ImageRef>,
    /// The CHS geometry the guest was shown (guessed once, from the disk's first sector at
    /// registration, as QEMU does at its device's start; kept across acceld restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chs: Option<accel_dataplane::virtio_blk::Chs>,
}

impl SavedDrive {
    /// A drive just registered: held until the supervisor attaches.
    pub fn new(mut spec: DriveSpec) -> Self {
        let throttle = spec.throttle.take().filter(|l| !l.is_empty());
        SavedDrive {
            spec,
            engine: EngineKind::Held,
            nodes_removed: false,
            recorded: None,
            pin: None,
            throttle,
            image: None,
            chs: None,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedVm {
    pub name: String,
    pub qmp: std::path::PathBuf,
    pub cont: bool,
    #[serde(default)]
    pub incoming: bool,
    /// acceld turned QEMU's pause-before-switchover on (so it is acceld's to continue).
    #[serde(default)]
    pub pause_owned: bool,
    /// QEMU's user, when it registered the VM through a permit (its sockets are theirs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<super::permit::Owner>,
    pub drives: Vec<SavedDrive>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SavedState {
    pub vms: Vec<SavedVm>,
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("cannot read state file {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state file {path} is damaged")]
    Damaged {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot save state to {path}")]
    Write {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Writes the state next to `path` and renames it over, so a crash leaves the old or the new.
pub fn save(path: &Path, st: &SavedState) -> Result<(), PersistError> {
    let tmp = path.with_extension("tmp");
    let data = serde_json::to_vec_pretty(st).expect("state serializes");
    // Only root reads it: the run dir may be traversable by QEMU's user (permits).
    write_private(&tmp, &data)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|source| PersistError::Write {
            path: path.to_path_buf(),
            source,
        })
}

fn write_private(p: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(p)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(data)
}

/// The saved state; empty when there is no file yet.
pub fn load(path: &Path) -> Result<SavedState, PersistError> {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SavedState::default()),
        Err(source) => {
            return Err(PersistError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_slice(&data).map_err(|source| PersistError::Damaged {
        path: path.to_path_buf(),
        source,
    })
}
