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

/// Gives the socket or directory at `path` mode `mode` and, with `owner`, to that user,
/// without following a link the user put there: the file is opened `O_PATH|O_NOFOLLOW`,
/// checked (a socket with one link, or a directory) and changed through its descriptor.
pub fn secure_own(path: &Path, mode: u32, owner: Option<Owner>, dir: bool) -> Result<(), SupError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    let io = |what: &str, source| SupError::Io {
        what: format!("{what} {}", path.display()),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| io("cannot open", e))?;
    let m = f.metadata().map_err(|e| io("cannot stat", e))?;
    let ok = if dir {
        m.file_type().is_dir()
    } else {
        m.file_type().is_socket() && m.nlink() == 1
    };
    if !ok {
        return Err(SupError::Denied(format!(
            "{} is not the {} acceld made",
            path.display(),
            if dir { "directory" } else { "socket" }
        )));
    }
    // The descriptor's own inode, whatever the path names by now.
    let fdp = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
    std::fs::set_permissions(&fdp, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io("cannot set the mode of", e))?;
    if let Some(o) = owner {
        std::os::unix::fs::chown(&fdp, Some(o.uid), Some(o.gid))
            .map_err(|e| io(&format!("cannot give uid {} gid {}", o.uid, o.gid), e))?;
    }
    Ok(())
}

/// For a VM whose QEMU is not root, the image the direct engine is about to open (as root)
/// must be the drive's registered image, which its permit allowed: QEMU (the user's process)
/// reports the node's file name, and it could name any file.
pub(super) fn check_owned_image(
    owner: Option<Owner>,
    registered: &Path,
    path: &Path,
) -> Result<(), SupError> {
    if owner.is_none() {
        return Ok(());
    }
    let real = |p: &Path| std::fs::canonicalize(p).ok();
    match (real(registered), real(path)) {
        (Some(a), Some(b)) if a == b => Ok(()),
        _ => Err(SupError::Denied(format!(
            "QEMU names {} for the direct engine; the drive's image is {} (QEMU does not run as root)",
            path.display(),
            registered.display()
        ))),
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
        static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let generation = GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut permits = lock(&self.permits);
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

    /// Ends the VM's permit (if any): its control socket goes (also one an acceld before a
    /// restart left), and its directory if empty. Also for the run layer, when the socket
    /// cannot be served.
    pub fn end_permit(&self, vm: &str) {
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
        drives: &mut [DriveSpec],
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
        if drives.len() > p.images.len() {
            return Err(SupError::Denied(format!(
                "VM {vm}: {} drives for {} permitted images",
                drives.len(),
                p.images.len()
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
            // The path checked is the one used (no link swapped in between).
            d.image = real;
        }
        Ok(p.owner)
    }
}
