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

use accel_api::control::{check_id, DriveSpec, PermitImage};

use accel_dataplane::engine::file::ImageId;
use serde::{Deserialize, Serialize};
use tracing::info;

use super::{SupError, Supervisor};
use accel_dataplane::util::lock;

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

/// A drive's image as registered: its canonical path (no symbolic link on the way when it was
/// resolved, by root) and the identity of the file it named then. Every open of the image
/// (a switch to the direct engine, the take-back after a migration's hand-off, the restore
/// after a restart) opens that path without following links and checks that identity, so no
/// link or rename QEMU's user makes can turn acceld's open (as root) onto another file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    pub path: PathBuf,
    pub id: ImageId,
    /// The permit allows this image read-only (a backing file, a disk's `<readonly/>`).
    #[serde(default)]
    pub read_only: bool,
    /// The format the permit names for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
}

impl ImageRef {
    /// Resolves `path` now (as root, trusted: a registration through acceld's own socket, or
    /// root's permit).
    pub fn resolve(path: &Path) -> Result<ImageRef, SupError> {
        let io = |source| SupError::Io {
            what: format!("image {}", path.display()),
            source,
        };
        let real = std::fs::canonicalize(path).map_err(io)?;
        let id = ImageId::of_path(&real).map_err(io)?;
        Ok(ImageRef {
            path: real,
            id,
            read_only: false,
            format: None,
        })
    }
}

/// The file QEMU names for a drive going direct must be the drive's registered image (the
/// same device and inode, as QEMU opened it: links followed): QEMU, or its user, could name
/// any file. acceld then opens the registered path itself, never QEMU's.
pub(super) fn check_qemu_image(image: &ImageRef, qemu_path: &Path) -> Result<(), SupError> {
    match ImageId::of_path(qemu_path) {
        Ok(id) if id == image.id => Ok(()),
        _ => Err(SupError::Denied(format!(
            "QEMU names {} for the direct engine; the drive's image is {}",
            qemu_path.display(),
            image.path.display()
        ))),
    }
}

/// Most images one permit names (each a file acceld stats as root).
const MAX_PERMIT_IMAGES: usize = 256;

/// One VM's permit.
#[derive(Clone, Debug)]
pub struct Permit {
    pub owner: Owner,
    /// The images a registration may name, resolved (`realpath`) with their identity.
    pub images: Vec<ImageRef>,
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
        images: &[PermitImage],
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
        if let Ok(v) = self.vm(vm) {
            if v.owner != Some(owner) {
                return Err(SupError::Exists(format!(
                    "VM {vm} is registered as another user's"
                )));
            }
        }
        if images.len() > MAX_PERMIT_IMAGES {
            return Err(SupError::Invalid(format!(
                "VM {vm}: {} images (at most {MAX_PERMIT_IMAGES})",
                images.len()
            )));
        }
        let mut refs: Vec<ImageRef> = Vec::new();
        for i in images {
            let mut r = ImageRef::resolve(i.path())?;
            r.read_only = i.read_only();
            r.format = i.format().map(str::to_string);
            if let Some(f) = &r.format {
                check_id("image format", f).map_err(|e| SupError::Invalid(e.0))?;
            }
            // One file named twice (two paths, or a disk and a backing file): writable
            // only if every mention is.
            match refs.iter_mut().find(|o| o.id == r.id) {
                Some(o) => {
                    o.read_only |= r.read_only;
                    if o.format.is_none() {
                        o.format = r.format;
                    }
                }
                None => refs.push(r),
            }
        }
        let images = refs;
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
        // QEMU's QMP socket of a permitted VM is in the VM's directory too. QEMU removes it
        // when it exits cleanly; one it left (SIGKILLed by libvirt after a `virsh save`, say)
        // would keep the directory. Nobody listening: stale, removed (unlink never follows a
        // link the user planted there).
        let qmp = self.qemu_qmp_socket(vm);
        if !accel_dataplane::util::socket_listening(&qmp) {
            let _ = std::fs::remove_file(&qmp);
        }
        let _ = std::fs::remove_dir(self.cfg.run_dir.join(vm));
    }

    /// Where a permitted VM's QEMU serves its QMP (the wrapper puts it there).
    fn qemu_qmp_socket(&self, vm: &str) -> PathBuf {
        self.cfg.run_dir.join(vm).join("qemu-qmp.sock")
    }

    /// Checks a registration that came through the VM's own control socket; answers whose
    /// it is.
    pub fn check_permitted(
        &self,
        vm: &str,
        qmp: &Path,
        drives: &mut [DriveSpec],
    ) -> Result<Owner, SupError> {
        let mut used: Vec<ImageId> = Vec::new();
        let p = self
            .permit_of(vm)
            .ok_or_else(|| SupError::Denied(format!("VM {vm} has no permit")))?;
        let want = self.qemu_qmp_socket(vm);
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
            let Some(img) = p.images.iter().find(|i| i.path == real) else {
                return Err(SupError::Denied(format!(
                    "drive {}: image {} is not one of the domain's images",
                    d.id,
                    d.image.display()
                )));
            };
            if used.contains(&img.id) {
                return Err(SupError::Denied(format!(
                    "drive {}: image {} is another drive's too",
                    d.id,
                    d.image.display()
                )));
            }
            used.push(img.id);
            if img.read_only && !d.read_only {
                return Err(SupError::Denied(format!(
                    "drive {}: image {} is permitted read-only (register it with read-only=on)",
                    d.id,
                    d.image.display()
                )));
            }
            if let Some(f) = &img.format {
                if *f != d.format {
                    return Err(SupError::Denied(format!(
                        "drive {}: image {} is {f} in the domain, not {}",
                        d.id,
                        d.image.display(),
                        d.format
                    )));
                }
            }
            // The path checked is the one used (no link swapped in between).
            d.image = real;
        }
        Ok(p.owner)
    }
}
