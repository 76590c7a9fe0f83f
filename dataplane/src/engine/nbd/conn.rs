//! One NBD connection's state, shared by the engine (which makes it), the connecting thread
//! ([`super::reader::connect_thread`]), the sending side ([`super::queue`]) and the reply
//! reader ([`super::reader`]): the socket once connected, how the connection settled, the
//! requests in flight and their results, and the engine's counters.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use super::handshake::{connect, disconnect, ExportInfo, NbdError};
use super::reply;
use crate::util::lock;

/// The guest's iovec array of one request (it lives in the worker's slot until completion).
#[derive(Clone, Copy)]
pub(super) struct IoVecs {
    pub(super) ptr: *const libc::iovec,
    pub(super) cnt: u32,
}

pub(super) struct Pending {
    pub(super) token: u64,
    /// Byte offset of the request on the disk, and its length.
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) iov: Option<IoVecs>,
    pub(super) read: bool,
    pub(super) parts_left: u64,
    pub(super) result: i32,
}

/// What the connecting thread and the engine share with the worker.
#[derive(Default)]
pub(super) struct ConnState {
    pub(super) dead: bool,
    /// The handshake is over: the export has this connection as a client.
    pub(super) up: bool,
    /// Why the connection could not be made.
    pub(super) why: Option<String>,
}

/// A connected socket and what its handshake negotiated.
pub(super) struct Link {
    pub(super) sock: UnixStream,
    pub(super) info: ExportInfo,
}

pub(super) struct Conn {
    /// Set once the connecting thread has connected.
    pub(super) link: OnceLock<Link>,
    /// Signalled once by the connecting thread: connected, or failed.
    pub(super) done: EventFd,
    pub(super) st: Mutex<ConnState>,
    /// Notified when `up` or `dead` is set.
    pub(super) settled: Condvar,
    /// Set by a deliberate close: EOF is then not an error.
    pub(super) closing: AtomicBool,
    pub(super) stats: Arc<NbdStats>,
    pub(super) queue: usize,
}

impl Conn {
    /// Marks the handshake done (the connecting thread, right after it).
    pub(super) fn set_up(&self) {
        lock(&self.st).up = true;
        self.settled.notify_all();
        let _ = self.done.write(1);
    }

    /// The connection could not be made (the connecting thread).
    pub(super) fn set_failed(&self, why: String) {
        {
            let mut st = lock(&self.st);
            st.dead = true;
            st.why = Some(why);
        }
        self.settled.notify_all();
        let _ = self.done.write(1);
    }

    /// Waits until the connection is up or dead; false when `deadline` passes first.
    pub(super) fn wait_settled(&self, deadline: Instant) -> bool {
        let mut st = lock(&self.st);
        while !st.up && !st.dead {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = match self.settled.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Shuts the socket down: the worker sees end of file and fails what is in flight.
    pub(super) fn shut(&self) {
        if let Some(l) = self.link.get() {
            let _ = l.sock.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The requests in flight on one connection and their finished results, owned by the worker.
#[derive(Default)]
pub(super) struct Flight {
    /// By slot (the NBD cookie's high 32 bits).
    pub(super) inflight: HashMap<u32, Pending>,
    /// Requests in flight that are reads: while there are none, no reply can carry guest
    /// data, and replies are read in bulk.
    pub(super) reads: usize,
    pub(super) completions: Vec<(u64, i32)>,
    pub(super) dead: bool,
}

impl Flight {
    /// Request `slot`, which a reply names.
    pub(super) fn get(&self, slot: u32) -> Result<&Pending, reply::ReplyError> {
        self.inflight
            .get(&slot)
            .ok_or(reply::ReplyError::UnknownSlot(slot))
    }

    /// One part of request `slot` finished with `err` (0: success).
    pub(super) fn part_done(&mut self, slot: u32, err: i32) -> Result<(), reply::ReplyError> {
        let p = self
            .inflight
            .get_mut(&slot)
            .ok_or(reply::ReplyError::UnknownSlot(slot))?;
        if err != 0 && p.result == 0 {
            p.result = err;
        }
        p.parts_left -= 1;
        if p.parts_left == 0 {
            let p = self.inflight.remove(&slot).expect("present");
            if p.read {
                self.reads -= 1;
            }
            let res = if p.result != 0 {
                p.result
            } else {
                p.len.min(i32::MAX as u64) as i32
            };
            self.completions.push((p.token, res));
        }
        Ok(())
    }

    /// Fails everything in flight with EIO; later requests fail at once.
    pub(super) fn fail_all(&mut self) {
        self.dead = true;
        self.reads = 0;
        let failed = self.inflight.drain().map(|(_, p)| (p.token, -libc::EIO));
        self.completions.extend(failed);
    }
}

impl IoVecs {
    /// The iovec array.
    ///
    /// # Safety
    /// The request must be in flight: the `QueueIo::push` contract keeps its array valid
    /// until its completion is reaped.
    pub(super) unsafe fn as_slice<'a>(&self) -> &'a [libc::iovec] {
        // SAFETY: the caller guarantees the array is valid (see above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.cnt as usize) }
    }
}

/// Counters and the last error of an NBD engine, for status.
#[derive(Debug, Default)]
pub struct NbdStats {
    pub connections: AtomicU64,
    pub errors: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

impl NbdStats {
    pub(super) fn record(&self, e: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_error) = Some(e);
    }
}

/// One more connection to `export`, which must still hold `size` bytes.
pub(super) fn connect_link(path: &Path, export: &str, size: u64) -> Result<Link, NbdError> {
    let (sock, info) = connect(path, export)?;
    if info.size != size {
        disconnect(&sock);
        return Err(NbdError::SizeChanged {
            export: export.to_string(),
            was: size,
            now: info.size,
        });
    }
    Ok(Link { sock, info })
}
