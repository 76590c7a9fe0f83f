//! Permits: a VM whose QEMU does not run as root (libvirt's `libvirt-qemu`) registers itself.
//!
//! acceld's control socket stays root's. libvirt's hook (root) asks for a permit when the
//! domain starts, naming QEMU's user and the domain's images; acceld then makes `RUN_DIR/VM/`
//! that user's (QEMU creates its QMP and NBD sockets there) and serves `RUN_DIR/VM/control.sock`
//! to it (the run layer), through which the emulator wrapper registers the VM. Such a
//! registration may name only the permitted images (acceld opens them as root) and only the
//! QMP socket in the VM's own directory; the VM's sockets are then the user's. A permit ends
//! when the VM is forgotten or unregistered through acceld's own socket.

use std::path::{Path, PathBuf};

use accel_api::control::{check_id, DriveSpec};
use serde::{Deserialize, Serialize};
use tracing::info;

use super::{SupError, Supervisor};
use crate::util::lock;

/// Who a VM's QEMU runs as: its sockets and its directory are theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    /// Gives `path` (not a link it may be) to the owner.
    pub(super) fn chown(self, path: &Path) -> Result<(), SupError> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid)).map_err(|source| {
            SupError::Io {
                what: format!(
                    "cannot give {} to uid {} gid {}",
                    path.display(),
                    self.uid,
                    self.gid
                ),
                source,
            }
        })
    }
}

/// One VM's permit.
#[derive(Clone, Debug)]
pub struct Permit {
    pub owner: Owner,
    /// The images a registration may name, resolved (`realpath`).
    pub images: Vec<PathBuf>,
    /// Tells one permit of the VM from the next (the socket's server ends with its permit).
    pub generation: u64,
}

/// What `permit` answers.
#[derive(Clone, Debug, Serialize)]
pub struct Permitted {
    pub vm: String,
    /// The VM's control socket (served once the reply is out).
    pub socket: PathBuf,
    #[serde(skip)]
    pub generation: u64,
}

impl Supervisor {
    /// The VM's own control socket, `RUN_DIR/VM/control.sock`.
    pub fn vm_control_socket(&self, vm: &str) -> PathBuf {
        self.cfg.run_dir.join(vm).join("control.sock")
    }

    /// Records a permit for `vm` (replacing one before it) and makes its directory the
    /// owner's.
    pub fn permit(
        &self,
        vm: &str,
        owner: Owner,
        images: &[PathBuf],
    ) -> Result<Permitted, SupError> {
        check_id("VM name", vm).map_err(|e| SupError::Invalid(e.0))?;
        if owner.uid == 0 {
            return Err(SupError::Invalid(
                "uid 0 needs no permit: root registers through acceld's own control socket".into(),
            ));
        }
        if images.is_empty() {
            return Err(SupError::Invalid(format!("VM {vm}: no image given")));
        }
        let images = images
            .iter()
            .map(|p| {
                std::fs::canonicalize(p).map_err(|source| SupError::Io {
                    what: format!("image {}", p.display()),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let socket = self.vm_control_socket(vm);
        if socket.as_os_str().len() >= 108 {
            return Err(SupError::Invalid(format!(
                "socket path {} is too long for a unix socket; use a shorter run dir",
                socket.display()
            )));
        }
        let dir = self.cfg.run_dir.join(vm);
        super::registry::create_owned_dir(&dir, Some(owner))?;
        let mut permits = lock(&self.permits);
        let generation = permits.values().map(|p| p.generation).max().unwrap_or(0) + 1;
        permits.insert(
            vm.to_string(),
            Permit {
                owner,
                images,
                generation,
            },
        );
        info!(
            vm,
            uid = owner.uid,
            gid = owner.gid,
            "permit: QEMU's user registers the VM"
        );
        Ok(Permitted {
            vm: vm.to_string(),
            socket,
            generation,
        })
    }

    /// Who the registered VM's sockets belong to, if not root.
    pub fn vm_owner(&self, vm: &str) -> Option<Owner> {
        self.vm(vm).ok()?.owner
    }

    /// The VM's permit, if any.
    pub fn permit_of(&self, vm: &str) -> Option<Permit> {
        lock(&self.permits).get(vm).cloned()
    }

    /// Ends the VM's permit (if any), for the run layer when its socket cannot be served.
    pub fn end_permit_of(&self, vm: &str) {
        self.end_permit(vm);
    }

    /// Ends the VM's permit (if any): its control socket goes (also one an acceld before a
    /// restart left), and its directory if empty.
    pub(super) fn end_permit(&self, vm: &str) {
        if lock(&self.permits).remove(vm).is_some() {
            info!(vm, "permit ended");
        }
        let _ = std::fs::remove_file(self.vm_control_socket(vm));
        let _ = std::fs::remove_dir(self.cfg.run_dir.join(vm));
    }

    /// Checks a registration that came through the VM's own control socket; answers whose
    /// it is.
    pub fn check_permitted(
        &self,
        vm: &str,
        qmp: &Path,
        drives: &[DriveSpec],
    ) -> Result<Owner, SupError> {
        let p = self
            .permit_of(vm)
            .ok_or_else(|| SupError::Denied(format!("VM {vm} has no permit")))?;
        let want = self.cfg.run_dir.join(vm).join("qemu-qmp.sock");
        if qmp != want {
            return Err(SupError::Denied(format!(
                "VM {vm}: QMP socket {} is not {}",
                qmp.display(),
                want.display()
            )));
        }
        for d in drives {
            let real = std::fs::canonicalize(&d.image).map_err(|source| SupError::Io {
                what: format!("drive {}: image {}", d.id, d.image.display()),
                source,
            })?;
            if !p.images.contains(&real) {
                return Err(SupError::Denied(format!(
                    "drive {}: image {} is not one of the domain's images",
                    d.id,
                    d.image.display()
                )));
            }
        }
        Ok(p.owner)
    }
}
