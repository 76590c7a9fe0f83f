//! The relay's session with the export: the client (behind a lock, for the rare messages
//! after set-up: memory changes, the write cache), the shadow region, each queue's ring while
//! no context holds it, and the thread that watches the session and answers the export's
//! back-end channel.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tracing::{info, warn};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use super::shadow::{Shadow, SHADOW_GPA};
use super::state::QueueState;
use crate::guest_mem::Mem;
use crate::util::lock;
use crate::vu_frontend::{Client, ClientError, ExportConfig, Region};

/// Where a queue's ring is.
pub(crate) enum QueueSlot {
    /// No context opened it yet: a fresh ring.
    Unused,
    /// Between contexts.
    Here(QueueState),
    /// A context holds it (two contexts on one ring would share its memory).
    Taken,
}

/// What the relay counts.
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Requests posted on the shadow rings (a discard split in parts counts once per part).
    pub posted: AtomicU64,
    /// Kicks sent to the export (EVENT_IDX skips the rest).
    pub kicks: AtomicU64,
    /// Config changes the export sent on the back-end channel (a resize of its node).
    pub config_changes: AtomicU64,
    /// Guest memory regions added to the export's table.
    pub regions_added: AtomicU64,
}

/// The guest memory the export's table has, and acceld's map of it.
#[derive(Default)]
pub(crate) struct Exported {
    /// The map last synced (compared by address: a new map is a new Arc).
    mem: Option<Arc<Mem>>,
    /// The guest regions in the export's table: (gpa, size).
    regions: Vec<(u64, u64)>,
}

pub(crate) struct Session {
    pub(crate) path: PathBuf,
    pub(crate) client: Mutex<Client>,
    pub(crate) cfg: ExportConfig,
    pub(crate) shadow: Shadow,
    pub(crate) exported: Mutex<Exported>,
    /// Each queue's ring while no queue context holds it (a context takes it and gives it
    /// back when dropped, so a queue that opens again goes on where it stood).
    pub(crate) queues: Vec<Mutex<QueueSlot>>,
    pub(crate) calls: Vec<EventFd>,
    pub(crate) kicks: Vec<EventFd>,
    /// The export's write cache as last set (None: the export's default, on).
    pub(crate) write_cache: Mutex<Option<bool>>,
    /// Whether the export's write cache is off now (read per write, without the lock).
    pub(crate) write_through: AtomicBool,
    pub(crate) dead: AtomicBool,
    /// Requests fail with [`crate::engine::PATH_LOST`] rather than EIO once the session
    /// ended: a supervisor moves the drive to another path (`RelayEngine::hold_when_lost`).
    pub(crate) hold_when_lost: AtomicBool,
    pub(crate) why: Mutex<Option<String>>,
    /// Signalled when `why` is set.
    pub(crate) ended: std::sync::Condvar,
    pub(crate) stats: RelayStats,
    /// Stops the session thread.
    pub(crate) stop: EventFd,
    /// The image whose file system tells an out-of-space failure apart (see
    /// [`Session::out_of_space`]).
    pub(crate) image: std::sync::OnceLock<PathBuf>,
}

impl Session {
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// What a request gets once the session ended.
    pub(crate) fn lost_errno(&self) -> i32 {
        if self.hold_when_lost.load(Ordering::Acquire) {
            crate::engine::PATH_LOST
        } else {
            -libc::EIO
        }
    }

    /// Ends the session: every queue fails what it has in flight at its next reap.
    pub(crate) fn fail(&self, why: &str) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        warn!(export = %self.path.display(), "relay session lost: {why}");
        *lock(&self.why) = Some(why.to_string());
        self.ended.notify_all();
        let _ = shutdown(&lock(&self.client));
        for c in &self.calls {
            let _ = c.write(1);
        }
    }

    /// Gives the export every region of `mem` it lacks (adding never unmaps anything a
    /// request in flight uses). A region that went is left in the export's table unless a
    /// new one overlaps it; only then is it removed first.
    pub(crate) fn sync_memory(&self, mem: &Arc<Mem>) -> Result<(), String> {
        let mut ex = lock(&self.exported);
        if ex.mem.as_ref().is_some_and(|m| Arc::ptr_eq(m, mem)) {
            return Ok(());
        }
        let mut want = Vec::new();
        for r in mem.iter() {
            let Some(fo) = r.file_offset() else {
                return Err("guest memory that is not a shared file".into());
            };
            want.push(Region {
                gpa: r.start_addr().raw_value(),
                size: r.len(),
                fd: fo.file().as_fd(),
                offset: fo.start(),
            });
        }
        let overlaps = |a: (u64, u64), b: (u64, u64)| {
            a.0 < b.0.saturating_add(b.1) && b.0 < a.0.saturating_add(a.1)
        };
        let mut c = lock(&self.client);
        let fail = |e: ClientError| crate::util::error_chain(&e);
        let mut kept = Vec::new();
        for &old in &ex.regions {
            let same = want.iter().any(|w| (w.gpa, w.size) == old);
            let clash = !same && want.iter().any(|w| overlaps((w.gpa, w.size), old));
            if clash {
                c.remove_mem_region(old.0, old.1).map_err(fail)?;
            } else {
                kept.push(old);
            }
        }
        ex.regions = kept;
        for w in &want {
            if ex.regions.contains(&(w.gpa, w.size)) {
                continue;
            }
            if w.gpa.saturating_add(w.size) > SHADOW_GPA {
                return Err(format!(
                    "guest memory at {:#x} reaches the relay's region",
                    w.gpa
                ));
            }
            if ex.regions.len() as u64 + 2 > self.cfg.max_mem_slots {
                return Err(format!(
                    "the export takes {} memory regions",
                    self.cfg.max_mem_slots
                ));
            }
            c.add_mem_region(w).map_err(fail)?;
            ex.regions.push((w.gpa, w.size));
            self.stats.regions_added.fetch_add(1, Ordering::Relaxed);
        }
        c.ping().map_err(fail)?;
        ex.mem = Some(mem.clone());
        Ok(())
    }

    /// Whether a write the export failed failed for lack of space. QEMU's export answers
    /// IOERR for every error (no errno reaches a vhost-user front-end), so the image's file
    /// system is asked: less free space than twice the request and 2 MiB (a qcow2 cluster
    /// and its tables) is taken as ENOSPC. False without an image.
    pub(crate) fn out_of_space(&self, len: u64) -> bool {
        let Some(path) = self.image.get() else {
            return false;
        };
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: statvfs is plain old data; all-zero is a valid value to be overwritten.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a valid out pointer; the result is checked.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return false;
        }
        let free = st.f_bavail.saturating_mul(st.f_frsize);
        free < (2 * len).max(2 << 20)
    }

    /// Sets the export's write cache (write-through when off) if it differs.
    pub(crate) fn set_write_cache(&self, on: bool) -> Result<(), String> {
        if self.write_through.load(Ordering::Acquire) != on {
            return Ok(());
        }
        let mut wc = lock(&self.write_cache);
        if *wc == Some(on) || (wc.is_none() && on) {
            return Ok(());
        }
        let mut c = lock(&self.client);
        c.set_write_cache(on)
            .and_then(|()| c.ping())
            .map_err(|e| crate::util::error_chain(&e))?;
        *wc = Some(on);
        self.write_through.store(!on, Ordering::Release);
        Ok(())
    }
}

pub(crate) fn shutdown(c: &Client) -> std::io::Result<()> {
    // SAFETY: shutdown on the session's own socket; the descriptor stays owned by `c`.
    let r = unsafe { libc::shutdown(c.socket().as_raw_fd(), libc::SHUT_RDWR) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The session thread: answers the export's back-end channel (a config change needs a
/// reader, or the export spins on a full socket) and sees the session's end.
pub(crate) fn watch(s: &Session, sock: &OwnedFd, backend: &UnixStream) {
    let _ = backend.set_nonblocking(true);
    let mut fds = [
        libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        },
        libc::pollfd {
            fd: backend.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: s.stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        for f in &mut fds {
            f.revents = 0;
        }
        // SAFETY: a valid array of pollfds for the duration of the call (a negative fd, the
        // back-end channel once closed, is skipped by poll).
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if r < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            s.fail("cannot poll the session");
            return;
        }
        if fds[2].revents != 0 {
            return;
        }
        if fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            s.fail("the export closed the session");
            return;
        }
        if fds[1].revents != 0 {
            match backend_message(backend) {
                Ok(Some(2)) => {
                    s.stats.config_changes.fetch_add(1, Ordering::Relaxed);
                    info!(export = %s.path.display(), "the export's config changed (a resize)");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!("relay back-end channel ends: {e}");
                    fds[1].fd = -1;
                }
            }
        }
    }
}

/// Reads one message from the back-end channel and acknowledges it if asked. Returns its
/// request number (None when nothing was there).
fn backend_message(b: &UnixStream) -> std::io::Result<Option<u32>> {
    use std::io::{Read, Write};
    let mut h = [0u8; 12];
    let mut r = b;
    match r.read(&mut h) {
        Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
        Ok(12) => {}
        Ok(_) => return Err(std::io::ErrorKind::InvalidData.into()),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    }
    let req = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    let flags = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
    let size = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
    if size > 4096 {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    let mut p = vec![0u8; size];
    b.set_nonblocking(false)?;
    b.set_read_timeout(Some(std::time::Duration::from_secs(1)))?;
    let got = r.read_exact(&mut p);
    b.set_nonblocking(true)?;
    got?;
    if flags & 0x8 != 0 {
        let mut m = Vec::with_capacity(20);
        m.extend_from_slice(&req.to_le_bytes());
        m.extend_from_slice(&(0x1u32 | 0x4).to_le_bytes());
        m.extend_from_slice(&8u32.to_le_bytes());
        m.extend_from_slice(&0u64.to_le_bytes());
        let mut w = b;
        w.write_all(&m)?;
    }
    Ok(Some(req))
}

impl Session {
    pub(crate) fn give_back(&self, queue: usize, st: QueueState) {
        *lock(&self.queues[queue]) = QueueSlot::Here(st);
    }
}
