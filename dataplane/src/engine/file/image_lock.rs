//! QEMU-compatible image locks (block/file-posix.c), so that QEMU and acceld never both write
//! an image.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

use crate::engine::EngineError;

// QEMU's image locking (block/file-posix.c): one byte per permission, shared (read) OFD
// locks only. A holder of permission P locks byte 100+P; a holder that does not share P with
// others locks byte 200+P. An opener checks both directions and fails on a conflict, which is
// how QEMU reports "Failed to get "write" lock".
const LOCK_PERM_BASE: i64 = 100;
const LOCK_SHARED_BASE: i64 = 200;
const PERM_CONSISTENT_READ: i64 = 0;
const PERM_WRITE: i64 = 1;
const PERM_RESIZE: i64 = 3;
const PERM_NAMES: [&str; 5] = [
    "consistent read",
    "write",
    "write unchanged",
    "resize",
    "graph modification",
];

fn ofd_lock(fd: RawFd, cmd: libc::c_int, typ: libc::c_int, byte: i64) -> io::Result<libc::flock> {
    // SAFETY: flock is plain old data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    // SAFETY: fd is open; fl is a valid flock that outlives the call.
    let r = unsafe { libc::fcntl(fd, cmd, &mut fl) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl)
}

/// Whether another open file description holds a lock on `byte`.
fn lock_held_elsewhere(fd: RawFd, byte: i64) -> io::Result<bool> {
    let fl = ofd_lock(fd, libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_int, byte)?;
    Ok(i32::from(fl.l_type) != libc::F_UNLCK)
}

/// Takes the locks QEMU itself takes for a guest disk that is not shared (share-rw=off):
/// consistent read and, when writable, write; nobody else may write or resize. Fails, like
/// QEMU, when another process holds a conflicting lock; afterwards QEMU (and qemu-img without
/// -U) fails to open the image for writing while acceld serves it.
pub fn qemu_lock(f: &File, path: &Path, read_only: bool) -> Result<(), EngineError> {
    lock_perms(f, path, read_only, &[PERM_WRITE, PERM_RESIZE])
}

/// [`qemu_lock`], but sharing write for now: the image's current writer (QEMU's export,
/// idle once acceld closed its connections) keeps its lock until the switch has happened;
/// [`set_write_shared`] `false` then takes the rest.
pub fn qemu_lock_sharing_write(f: &File, path: &Path, read_only: bool) -> Result<(), EngineError> {
    lock_perms(f, path, read_only, &[PERM_RESIZE])
}

fn lock_perms(f: &File, path: &Path, read_only: bool, unshared: &[i64]) -> Result<(), EngineError> {
    let fd = f.as_raw_fd();
    let mut perms = vec![PERM_CONSISTENT_READ];
    if !read_only {
        perms.push(PERM_WRITE);
    }
    let err = |source| EngineError::Lock {
        path: path.to_path_buf(),
        source,
    };
    for &p in &perms {
        if lock_held_elsewhere(fd, LOCK_SHARED_BASE + p).map_err(err)? {
            return Err(EngineError::Locked {
                path: path.to_path_buf(),
                what: PERM_NAMES[p as usize],
            });
        }
    }
    for &p in unshared {
        if lock_held_elsewhere(fd, LOCK_PERM_BASE + p).map_err(err)? {
            return Err(EngineError::Locked {
                path: path.to_path_buf(),
                what: PERM_NAMES[p as usize],
            });
        }
    }
    let bytes = perms
        .iter()
        .map(|p| LOCK_PERM_BASE + p)
        .chain(unshared.iter().map(|p| LOCK_SHARED_BASE + p));
    for b in bytes {
        ofd_lock(fd, libc::F_OFD_SETLK, libc::F_RDLCK as libc::c_int, b).map_err(err)?;
    }
    Ok(())
}

/// Shares or stops sharing the write permission on an image acceld has locked with
/// [`qemu_lock`] (writable): shared, QEMU can attach a writer of its own (the export that
/// takes over at the next switch, idle until acceld connects); unshared again, it fails like
/// QEMU if another process writes now.
pub fn set_write_shared(f: &File, path: &Path, shared: bool) -> Result<(), EngineError> {
    let fd = f.as_raw_fd();
    let byte = LOCK_SHARED_BASE + PERM_WRITE;
    let err = |source| EngineError::Lock {
        path: path.to_path_buf(),
        source,
    };
    if shared {
        ofd_lock(fd, libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_int, byte).map_err(err)?;
        return Ok(());
    }
    if lock_held_elsewhere(fd, LOCK_PERM_BASE + PERM_WRITE).map_err(err)? {
        return Err(EngineError::Locked {
            path: path.to_path_buf(),
            what: PERM_NAMES[PERM_WRITE as usize],
        });
    }
    ofd_lock(fd, libc::F_OFD_SETLK, libc::F_RDLCK as libc::c_int, byte).map_err(err)?;
    Ok(())
}

/// Drops every lock [`qemu_lock`] took on this open file.
pub fn qemu_unlock(f: &File) {
    let fd = f.as_raw_fd();
    for b in (LOCK_PERM_BASE..LOCK_PERM_BASE + 5).chain(LOCK_SHARED_BASE..LOCK_SHARED_BASE + 5) {
        let _ = ofd_lock(fd, libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_int, b);
    }
}
