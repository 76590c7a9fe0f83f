//! One queue's NBD connection: requests pushed by the worker, sent in one `writev` per batch
//! with write payloads gathered straight from guest pages.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tracing::warn;
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::engine::{IoOp, QueueIo};
use crate::guest_mem::{consume_iov, sub_iovecs, MAX_IOV};
use crate::util::lock;

/// The guest's iovec array of one request (it lives in the worker's slot until completion).
#[derive(Clone, Copy)]
pub(super) struct IoVecs {
    pub(super) ptr: *const libc::iovec,
    pub(super) cnt: u32,
}

// SAFETY: the pointers name guest memory (or a bounce buffer) that the worker keeps valid and
// untouched until it reaps this request's completion (the QueueIo::push contract); the reader
// thread only touches them for a request that is still in flight.
unsafe impl Send for IoVecs {}

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

#[derive(Default)]
pub(super) struct ConnState {
    /// In flight, by slot (the NBD cookie's high 32 bits).
    pub(super) inflight: HashMap<u32, Pending>,
    pub(super) completions: Vec<(u64, i32)>,
    pub(super) dead: bool,
    /// The handshake is over: the export has this connection as a client.
    pub(super) up: bool,
}

pub(super) struct Conn {
    /// Set once the reader thread has connected.
    pub(super) sock: std::sync::OnceLock<UnixStream>,
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
    /// Marks the handshake done (the reader thread, right after it).
    pub(super) fn set_up(&self) {
        lock(&self.st).up = true;
        self.settled.notify_all();
    }

    /// Waits until the connection is up or dead; false when `deadline` passes first.
    pub(super) fn wait_settled(&self, deadline: std::time::Instant) -> bool {
        let mut st = lock(&self.st);
        while !st.up && !st.dead {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
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

    pub(super) fn signal(&self) {
        let _ = self.done.write(1);
    }

    /// Marks the connection dead and fails everything in flight with EIO.
    pub(super) fn fail_all(&self, why: &str) {
        let mut st = lock(&self.st);
        if !st.dead && !self.closing.load(Ordering::Relaxed) {
            warn!(queue = self.queue, "NBD connection lost: {why}");
            self.stats.record(format!("queue {}: {why}", self.queue));
        }
        st.dead = true;
        let failed: Vec<(u64, i32)> = st
            .inflight
            .drain()
            .map(|(_, p)| (p.token, -libc::EIO))
            .collect();
        st.completions.extend(failed);
        drop(st);
        self.settled.notify_all();
        if let Some(s) = self.sock.get() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.signal();
    }
}

/// A write's payload: the request's iovecs, and the byte range of them this part sends.
pub(super) type Payload = (IoVecs, u64, u64);

pub(super) struct NbdQueue {
    pub(super) conn: Arc<Conn>,
    pub(super) info: ExportInfo,
    /// Request headers and payload references pushed since the last submit.
    pub(super) out: Vec<(usize, Option<Payload>)>,
    pub(super) hdrs: Vec<[u8; 28]>,
    pub(super) iov: Vec<libc::iovec>,
    pub(super) next_slot: u32,
}

// SAFETY: the only raw pointers are in the iovec scratch vector, filled and used within one
// `submit` call on the owning thread; between calls they are never dereferenced.
unsafe impl Send for NbdQueue {}

fn header(flags: u16, typ: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&typ.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
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

impl NbdQueue {
    fn complete_now(&mut self, token: u64, res: i32) {
        lock(&self.conn.st).completions.push((token, res));
        self.conn.signal();
    }

    fn iov_len(iov: IoVecs) -> u64 {
        // SAFETY: push's contract: the iovec array is valid while the request is in flight.
        let all = unsafe { iov.as_slice() };
        all.iter().map(|v| v.iov_len as u64).sum()
    }
}

impl QueueIo for NbdQueue {
    unsafe fn push(&mut self, op: &IoOp, token: u64) -> bool {
        let tf = self.info.flags;
        let (typ, flags, offset, len, iov) = match *op {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            } => {
                let v = IoVecs {
                    ptr: iov,
                    cnt: iovcnt,
                };
                (CMD_READ, 0, offset, Self::iov_len(v), Some(v))
            }
            IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync,
            } => {
                if tf & TF_READ_ONLY != 0 {
                    self.complete_now(token, -libc::EROFS);
                    return true;
                }
                let v = IoVecs {
                    ptr: iov,
                    cnt: iovcnt,
                };
                let fua = if dsync && tf & TF_SEND_FUA != 0 {
                    CMD_FLAG_FUA
                } else {
                    0
                };
                (CMD_WRITE, fua, offset, Self::iov_len(v), Some(v))
            }
            IoOp::Flush => {
                if tf & TF_SEND_FLUSH == 0 {
                    // The server has no volatile cache to flush.
                    self.complete_now(token, 0);
                    return true;
                }
                (CMD_FLUSH, 0, 0, 0, None)
            }
            IoOp::Fallocate {
                offset,
                len,
                mode,
                zeroes,
            } => {
                if !zeroes {
                    if tf & TF_SEND_TRIM == 0 {
                        self.complete_now(token, -libc::EOPNOTSUPP);
                        return true;
                    }
                    (CMD_TRIM, 0, offset, len, None)
                } else {
                    if tf & TF_SEND_WRITE_ZEROES == 0 {
                        self.complete_now(token, -libc::EOPNOTSUPP);
                        return true;
                    }
                    let punch = mode & libc::FALLOC_FL_PUNCH_HOLE != 0;
                    (
                        CMD_WRITE_ZEROES,
                        if punch { 0 } else { CMD_FLAG_NO_HOLE },
                        offset,
                        len,
                        None,
                    )
                }
            }
        };
        let maxp = u64::from(self.info.max_payload);
        let parts = if typ == CMD_FLUSH {
            1
        } else {
            len.div_ceil(maxp).max(1)
        };
        if parts > MAX_PARTS || offset.checked_add(len).is_none_or(|e| e > self.info.size) {
            self.complete_now(token, -libc::EINVAL);
            return true;
        }
        let slot = {
            let mut st = lock(&self.conn.st);
            if st.dead {
                st.completions.push((token, -libc::EIO));
                drop(st);
                self.conn.signal();
                return true;
            }
            // A free slot: in-flight requests are few (the queue depth), so this ends fast.
            let mut slot = self.next_slot;
            while st.inflight.contains_key(&slot) {
                slot = slot.wrapping_add(1);
            }
            self.next_slot = slot.wrapping_add(1);
            st.inflight.insert(
                slot,
                Pending {
                    token,
                    offset,
                    len,
                    iov,
                    read: typ == CMD_READ,
                    parts_left: parts,
                    result: 0,
                },
            );
            slot
        };
        for part in 0..parts {
            let poff = part * maxp;
            let plen = (len - poff.min(len)).min(maxp);
            let cookie = (u64::from(slot) << 32) | part;
            let h = header(flags, typ, cookie, offset + poff, plen as u32);
            self.hdrs.push(h);
            let payload = if typ == CMD_WRITE {
                iov.map(|v| (v, poff, plen))
            } else {
                None
            };
            self.out.push((self.hdrs.len() - 1, payload));
        }
        true
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        if lock(&self.conn.st).dead {
            // Everything registered was failed with EIO already.
            self.out.clear();
            self.hdrs.clear();
            return Ok(());
        }
        let Some(sock) = self.conn.sock.get() else {
            // Not connected yet: sent when the reader thread signals the connection.
            return Ok(());
        };
        let fd = sock.as_raw_fd();
        self.iov.clear();
        for (h, payload) in &self.out {
            self.iov.push(libc::iovec {
                iov_base: self.hdrs[*h].as_ptr() as *mut libc::c_void,
                iov_len: 28,
            });
            if let Some((v, from, len)) = payload {
                // SAFETY: push's contract keeps the request's iovecs valid until completion,
                // and a request cannot complete before its payload has been sent.
                sub_iovecs(unsafe { v.as_slice() }, *from, *len, &mut self.iov);
            }
        }
        let res = write_all_vectored(fd, &mut self.iov);
        self.out.clear();
        self.hdrs.clear();
        if let Err(e) = res {
            // The reader fails every request in flight (including these) when it sees the
            // socket shut down.
            self.conn.fail_all(&format!("sending requests: {e}"));
        }
        Ok(())
    }

    fn completion_fd(&self) -> RawFd {
        self.conn.done.as_raw_fd()
    }

    fn has_completions(&mut self) -> bool {
        !lock(&self.conn.st).completions.is_empty()
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        let _ = self.conn.done.read();
        if !self.out.is_empty() {
            // Requests pushed before the connection was up.
            let _ = self.submit();
        }
        out.append(&mut lock(&self.conn.st).completions);
    }
}

impl Drop for NbdQueue {
    fn drop(&mut self) {
        self.conn.closing.store(true, Ordering::Relaxed);
        if let Some(s) = self.conn.sock.get() {
            disconnect(s);
        }
    }
}

/// Writes every byte of `iov` (in IOV_MAX batches), adjusting it after short writes.
fn write_all_vectored(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<()> {
    // SAFETY: the iovecs are valid over live memory (see submit); writev only reads them.
    transfer_all(iov, |v, n| unsafe { libc::writev(fd, v, n) })
}

/// Runs `op` (readv or writev) until every byte of `iov` moved, in IOV_MAX batches, advancing
/// past short transfers; EINTR is retried and a zero-byte transfer is end of file.
pub(super) fn transfer_all(
    iov: &mut [libc::iovec],
    mut op: impl FnMut(*const libc::iovec, libc::c_int) -> isize,
) -> io::Result<()> {
    let mut start = consume_iov(iov, 0, 0);
    while start < iov.len() {
        let n = (iov.len() - start).min(MAX_IOV);
        let r = op(iov[start..].as_ptr(), n as libc::c_int);
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        start = consume_iov(iov, start, r as usize);
    }
    Ok(())
}
