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

/// What a process may open, as far as acceld mirrors it: its filesystem ids, its
/// supplementary groups and its effective capabilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub cap_eff: u64,
}

impl Creds {
    /// A permit's owner: its ids, no groups, no capabilities.
    pub fn of_owner(o: Owner) -> Creds {
        Creds {
            uid: o.uid,
            gid: o.gid,
            groups: Vec::new(),
            cap_eff: 0,
        }
    }

    /// QEMU's: the permit's owner; else QEMU's process as it is now (the QMP socket's
    /// creator, alive while acceld's connection is: its pid is not reused). QEMU may have
    /// dropped its ids or capabilities after making the socket. The error says why they are
    /// unknown.
    pub fn of_qemu(owner: Option<Owner>, peer_pid: Option<i32>) -> Result<Creds, String> {
        match (owner, peer_pid) {
            (Some(o), _) => Ok(Creds::of_owner(o)),
            (None, Some(pid)) => {
                Creds::of_process(pid).map_err(|e| format!("its credentials are unknown: {e}"))
            }
            (None, None) => Err("its process is unknown".into()),
        }
    }

    /// A process's, from `/proc/PID/status` (the filesystem uid and gid, `Groups:`,
    /// `CapEff:`).
    pub fn of_process(pid: i32) -> std::io::Result<Creds> {
        Creds::parse(&std::fs::read_to_string(format!("/proc/{pid}/status"))?).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("/proc/{pid}/status has no Uid, Gid, Groups or CapEff line"),
            )
        })
    }

    /// Parses a `/proc/PID/status` text.
    pub fn parse(status: &str) -> Option<Creds> {
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k).map(str::trim))
        };
        // Uid: real effective saved filesystem.
        let fs_id = |k: &str| field(k)?.split_whitespace().nth(3)?.parse().ok();
        let groups = field("Groups:")?
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<Vec<u32>, _>>()
            .ok()?;
        Some(Creds {
            uid: fs_id("Uid:")?,
            gid: fs_id("Gid:")?,
            groups,
            cap_eff: u64::from_str_radix(field("CapEff:")?, 16).ok()?,
        })
    }
}

impl ImageRef {
    /// Resolves `path` as a process with `who`'s credentials could open it (read-write unless
    /// `read_only`): on a thread of its own whose filesystem ids, supplementary groups and
    /// effective capabilities are `who`'s (Linux keeps all three per thread). The file must
    /// be a regular file or a block device; its identity and canonical path are those of the
    /// descriptor that open gave, so acceld's later open (as root, by that path, identity
    /// checked) reaches that file or none.
    ///
    /// This is how a drive takes a new image that QEMU names after a pivot (blockcopy,
    /// `blockdev-mirror`): QEMU, or its user, can only name a file QEMU could open itself.
    pub fn resolve_as(path: &Path, who: Creds, read_only: bool) -> Result<ImageRef, SupError> {
        let path = path.to_path_buf();
        std::thread::Builder::new()
            .name("acceld-open-as".into())
            .spawn(move || open_as(&path, &who, read_only))
            .map_err(|source| SupError::Io {
                what: "cannot start a thread to open an image".into(),
                source,
            })?
            .join()
            .unwrap_or_else(|_| Err(SupError::Invalid("the image open panicked".into())))
    }
}

impl ImageRef {
    /// [`ImageRef::resolve_as`] off the async runtime, waiting at most `deadline` (a file
    /// system that does not answer holds a blocking thread, not the caller).
    pub async fn resolve_as_within(
        path: PathBuf,
        who: Creds,
        read_only: bool,
        deadline: std::time::Duration,
    ) -> Result<ImageRef, SupError> {
        super::offload::blocking_within(deadline, move || {
            ImageRef::resolve_as(&path, who, read_only)
        })
        .await
        .unwrap_or_else(|| {
            Err(SupError::Invalid(format!(
                "the open did not return within {deadline:?}"
            )))
        })
    }
}

/// `struct __user_cap_header_struct` (capget(2), version 3).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// Takes `who`'s credentials on this thread (for good: the caller's thread ends after).
fn become_thread(who: &Creds) -> std::io::Result<()> {
    let err = std::io::Error::last_os_error;
    // SAFETY: setgroups as a raw syscall changes this thread's supplementary groups only
    // (glibc's wrapper would change every thread's); it reads `len` gids from a live slice.
    let r = unsafe { libc::syscall(libc::SYS_setgroups, who.groups.len(), who.groups.as_ptr()) };
    if r != 0 {
        return Err(err());
    }
    // SAFETY: setfsgid and setfsuid change this thread's filesystem ids; they take an id and
    // return the previous one, touching no memory.
    unsafe { libc::setfsgid(who.gid) };
    // SAFETY: as above.
    unsafe { libc::setfsuid(who.uid) };
    // Both answer the id in force to an invalid one (which changes nothing): check they took.
    // SAFETY: as above.
    let uid = unsafe { libc::setfsuid(u32::MAX) } as u32;
    // SAFETY: as above.
    let gid = unsafe { libc::setfsgid(u32::MAX) } as u32;
    if (uid, gid) != (who.uid, who.gid) {
        return Err(std::io::Error::other(format!(
            "the filesystem ids stayed {uid}:{gid}"
        )));
    }
    // The effective capabilities: `who`'s, within what this thread may have.
    let mut h = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: capget writes two cap data structs (version 3) into `d` and reads `h`.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut CapHeader, d.as_mut_ptr()) };
    if r != 0 {
        return Err(err());
    }
    for (i, c) in d.iter_mut().enumerate() {
        c.effective = (who.cap_eff >> (32 * i)) as u32 & c.permitted;
    }
    // SAFETY: capset reads the header and two cap data structs; it changes this thread's
    // capabilities only.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut CapHeader, d.as_ptr()) };
    if r != 0 {
        return Err(err());
    }
    Ok(())
}

/// [`ImageRef::resolve_as`], on its own thread (its credentials change for good).
fn open_as(path: &Path, who: &Creds, read_only: bool) -> Result<ImageRef, SupError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let io = |what: &str, source| SupError::Io {
        what: format!("{what} {}", path.display()),
        source,
    };
    become_thread(who).map_err(|e| {
        io(
            &format!("cannot take uid {} gid {} to open", who.uid, who.gid),
            e,
        )
    })?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        // No FIFO blocks the open, no tty becomes acceld's.
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| io(&format!("uid {} gid {} cannot open", who.uid, who.gid), e))?;
    let m = f.metadata().map_err(|e| io("cannot stat", e))?;
    if !(m.file_type().is_file() || m.file_type().is_block_device()) {
        return Err(SupError::Denied(format!(
            "{} is neither a regular file nor a block device",
            path.display()
        )));
    }
    let real = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .map_err(|e| io("cannot resolve", e))?;
    Ok(ImageRef {
        path: real,
        id: ImageId::of(&m),
        read_only,
        format: None,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const NOBODY: u32 = 65534;

    #[test]
    fn creds_come_from_the_status_file_of_a_process() {
        let st = "Name:\tqemu\nUid:\t64055\t64055\t64055\t64056\nGid:\t994\t994\t994\t995\n\
                  Groups:\t108 994 \nCapEff:\t0000000000000002\n";
        assert_eq!(
            Creds::parse(st),
            Some(Creds {
                uid: 64056,
                gid: 995,
                groups: vec![108, 994],
                cap_eff: 2,
            })
        );
        assert_eq!(Creds::parse("Uid:\t1\t1\t1\t1\n"), None);
        let me = Creds::of_process(std::process::id() as i32).unwrap();
        // SAFETY: getuid reads this process's uid.
        assert_eq!(me.uid, unsafe { libc::geteuid() });
    }

    fn file(dir: &Path, name: &str, owner: u32, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, b"x").unwrap();
        std::os::unix::fs::chown(&p, Some(owner), Some(owner)).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    /// What QEMU names after a pivot is opened with QEMU's credentials: its user's files
    /// only; root without capabilities (libvirt's default for a root QEMU) not another user's
    /// private file; no FIFO holds the open; a link to a file QEMU may not open gets nothing.
    #[test]
    fn a_pivot_target_is_opened_with_qemus_credentials_only() {
        // SAFETY: geteuid reads this process's uid.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("needs root (CI runs as root)");
            return;
        }
        let dir = tempfile::Builder::new()
            .prefix("accel-pivot")
            .tempdir_in("/var/tmp")
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let nobody = Creds::of_owner(Owner {
            uid: NOBODY,
            gid: NOBODY,
        });
        let theirs = file(dir.path(), "theirs.raw", NOBODY, 0o600);
        let roots = file(dir.path(), "roots.raw", 0, 0o600);
        let r = ImageRef::resolve_as(&theirs, nobody.clone(), false).unwrap();
        assert_eq!(r.path, theirs);
        assert_eq!(r.id, ImageId::of_path(&theirs).unwrap());
        let e = ImageRef::resolve_as(&roots, nobody.clone(), false).unwrap_err();
        assert!(e.to_string().contains("cannot open"), "{e}");
        let link = dir.path().join("link.raw");
        std::os::unix::fs::symlink(&roots, &link).unwrap();
        assert!(ImageRef::resolve_as(&link, nobody.clone(), true).is_err());
        // Read-only is asked for as such: a file they may only read.
        let ro = file(dir.path(), "ro.raw", NOBODY, 0o400);
        assert!(ImageRef::resolve_as(&ro, nobody.clone(), false).is_err());
        assert!(ImageRef::resolve_as(&ro, nobody, true).unwrap().read_only);
        // Root without capabilities may not open another user's private file; with them, it
        // may (what a root QEMU with its capabilities could do itself).
        let bare_root = Creds {
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            cap_eff: 0,
        };
        assert!(ImageRef::resolve_as(&theirs, bare_root, false).is_err());
        let root = Creds::of_process(std::process::id() as i32).unwrap();
        assert!(ImageRef::resolve_as(&theirs, root.clone(), false).is_ok());
        // A FIFO: refused at once (no writer needed), not waited on.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        let t0 = std::time::Instant::now();
        let e = ImageRef::resolve_as(&fifo, root, true).unwrap_err();
        assert!(e.to_string().contains("neither a regular file"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        // The calling thread kept its own credentials.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&roots)
            .unwrap();
    }
}
