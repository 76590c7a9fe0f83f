//! The state file: the registry as it must survive an acceld restart (atomic save, load).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use accel_api::control::{DriveSpec, ThrottleLimits};
use accel_api::status::EngineKind;
use accel_dataplane::util::lock;
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

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
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

/// The state file and the bytes acceld last wrote to it. acceld is the file's one writer, so
/// a save that would write those bytes again writes nothing: the once-a-second reconcile of
/// every VM saves, and the file changes only when the registry did.
pub struct StateFile {
    path: PathBuf,
    last: Mutex<Option<Vec<u8>>>,
}

impl StateFile {
    pub fn new(path: PathBuf) -> Self {
        StateFile {
            path,
            last: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the state `st` builds unless the file holds it already; true when it wrote.
    /// Saves are serialized and each builds its state under the lock, so the last written is
    /// the newest. A failed write leaves the old file and is tried again by the next save.
    pub fn save(&self, st: impl FnOnce() -> SavedState) -> Result<bool, PersistError> {
        let mut last = lock(&self.last);
        let data = serde_json::to_vec_pretty(&st()).expect("state serializes");
        if last.as_deref() == Some(data.as_slice()) {
            return Ok(false);
        }
        save_bytes(&self.path, &data)?;
        *last = Some(data);
        Ok(true)
    }
}

/// Writes the state next to `path` and renames it over, so an acceld crash leaves the old or
/// the new. Not synced: the file describes running QEMUs, which a host crash ends too, and a
/// sync would block the async runtime's thread for a disk's flush.
fn save_bytes(path: &Path, data: &[u8]) -> Result<(), PersistError> {
    let tmp = path.with_extension("tmp");
    // Only root reads it: the run dir may be traversable by QEMU's user (permits).
    write_private(&tmp, data)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn vm(name: &str, cont: bool) -> SavedVm {
        SavedVm {
            name: name.into(),
            qmp: format!("/run/{name}.qmp").into(),
            cont,
            incoming: false,
            pause_owned: false,
            owner: None,
            drives: Vec::new(),
        }
    }

    fn state(vms: Vec<SavedVm>) -> SavedState {
        SavedState { vms }
    }

    #[test]
    fn a_save_writes_only_what_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let f = StateFile::new(path.clone());
        // (state, written?) in order: the first save writes, the same state again does not,
        // a change does, going back does.
        let steps = [
            (state(vec![]), true),
            (state(vec![]), false),
            (state(vec![vm("a", true)]), true),
            (state(vec![vm("a", true)]), false),
            (state(vec![vm("a", false)]), true),
            (state(vec![vm("a", false), vm("b", true)]), true),
            (state(vec![vm("a", false), vm("b", true)]), false),
            (state(vec![]), true),
        ];
        // A second name for the file before each save: a write renames a new file over the
        // name, so the name leaves the link (which keeps the old inode's number from reuse).
        let keep = dir.path().join("keep");
        for (i, (st, written)) in steps.iter().enumerate() {
            let _ = std::fs::remove_file(&keep);
            let before = std::fs::hard_link(&path, &keep)
                .ok()
                .map(|_| std::fs::metadata(&keep).unwrap().ino());
            assert_eq!(f.save(|| st.clone()).unwrap(), *written, "step {i}");
            let now = std::fs::metadata(&path).unwrap();
            assert_eq!(before == Some(now.ino()), !written, "step {i}");
            assert_eq!(now.permissions().mode() & 0o777, 0o600);
            let back = load(&path).unwrap();
            assert_eq!(
                back.vms
                    .iter()
                    .map(|v| (&v.name, v.cont))
                    .collect::<Vec<_>>(),
                st.vms.iter().map(|v| (&v.name, v.cont)).collect::<Vec<_>>(),
                "step {i}"
            );
        }
        assert!(!path.with_extension("tmp").exists());
    }

    #[test]
    fn a_failed_save_is_tried_again_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("run");
        let f = StateFile::new(sub.join("state.json"));
        let st = state(vec![vm("a", true)]);
        let e = f.save(|| st.clone()).unwrap_err();
        assert!(matches!(e, PersistError::Write { .. }), "{e:?}");
        std::fs::create_dir(&sub).unwrap();
        assert!(
            f.save(|| st.clone()).unwrap(),
            "the same state, once the write can succeed"
        );
        assert_eq!(load(f.path()).unwrap().vms.len(), 1);
    }

    #[test]
    fn no_file_loads_empty_and_a_damaged_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert!(load(&path).unwrap().vms.is_empty());
        std::fs::write(&path, b"{\"vms\": [").unwrap();
        assert!(matches!(load(&path), Err(PersistError::Damaged { .. })));
    }
}
