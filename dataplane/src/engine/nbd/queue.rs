//! One queue's NBD connection, driven entirely by the queue's worker thread: requests pushed
//! by the worker are sent in one `sendmsg` per batch, write payloads gathered straight from
//! guest pages; replies are read by the same thread when the socket is readable (see
//! [`super::reader`]), read payloads scattered straight into guest pages. No thread hand-off
//! and no wake-up per request: the only other thread is the one that connects.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::warn;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::conn::{Conn, Flight, IoVecs, Link, Pending};
use super::handshake::{self, ExportInfo, SEND_TIMEOUT};
use super::proto::{
    CMD_FLAG_DF, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE,
    CMD_WRITE_ZEROES, REQUEST_MAGIC, TF_READ_ONLY, TF_SEND_DF, TF_SEND_FLUSH, TF_SEND_FUA,
    TF_SEND_TRIM, TF_SEND_WRITE_ZEROES,
};
use super::reader::Rx;
use crate::engine::{IoOp, QueueIo};
use crate::guest_mem::{consume_iov, sub_iovecs, MAX_IOV};
use crate::util::lock;

/// Most parts one request may be split into; larger requests get EINVAL (IOERR).
const MAX_PARTS: u64 = 1 << 12;
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
    pub(super) flight: Flight,
    pub(super) rx: Rx,
    /// The worker polls this: the connecting thread's eventfd, then the socket too.
    pub(super) ep: Epoll,
    /// The connection's outcome was taken in (the socket is watched, or it failed).
    pub(super) settled: bool,
}

// SAFETY: the raw pointers (the guest iovecs of requests in flight, the send scratch vector,
// the receive state's iovecs) name guest memory that the worker keeps valid until it reaps
// the request (the QueueIo::push contract), or this queue's own buffers; the queue is used by
// one thread at a time, the worker that owns it.
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

impl NbdQueue {
    pub(super) fn new(conn: Arc<Conn>, info: ExportInfo) -> io::Result<Self> {
        let ep = Epoll::new()?;
        ep.ctl(
            ControlOperation::Add,
            conn.done.as_raw_fd(),
            EpollEvent::new(EventSet::IN, 0),
        )?;
        Ok(NbdQueue {
            conn,
            info,
            out: Vec::new(),
            hdrs: Vec::new(),
            iov: Vec::new(),
            next_slot: 0,
            flight: Flight::default(),
            rx: Rx::new(),
            ep,
            settled: false,
        })
    }

    fn complete_now(&mut self, token: u64, res: i32) {
        self.flight.completions.push((token, res));
    }

    fn iov_len(iov: IoVecs) -> u64 {
        // SAFETY: push's contract: the iovec array is valid while the request is in flight.
        let all = unsafe { iov.as_slice() };
        all.iter().map(|v| v.iov_len as u64).sum()
    }

    fn link(&self) -> Option<&Link> {
        if self.settled {
            self.conn.link.get()
        } else {
            None
        }
    }

    /// Takes in the connecting thread's outcome once it is there: the socket joins the
    /// worker's poll set, or everything fails.
    fn settle(&mut self) {
        if self.settled {
            return;
        }
        let failed = {
            let st = lock(&self.conn.st);
            if !st.up && !st.dead {
                return;
            }
            st.dead.then(|| st.why.clone().unwrap_or_default())
        };
        self.settled = true;
        let _ = self.conn.done.read();
        let _ = self.ep.ctl(
            ControlOperation::Delete,
            self.conn.done.as_raw_fd(),
            EpollEvent::default(),
        );
        match (failed, self.conn.link.get()) {
            (None, Some(l)) => {
                if let Err(e) = self.ep.ctl(
                    ControlOperation::Add,
                    l.sock.as_raw_fd(),
                    EpollEvent::new(EventSet::IN, 1),
                ) {
                    self.fail(&format!("cannot watch the socket: {e}"));
                }
            }
            (why, _) => {
                self.fail(&why.unwrap_or_else(|| "no connection".into()));
            }
        }
    }

    /// Fails the connection: everything in flight and everything later gets EIO.
    fn fail(&mut self, why: &str) {
        if !self.flight.dead && !self.conn.closing.load(Ordering::Relaxed) {
            warn!(queue = self.conn.queue, "NBD connection lost: {why}");
            self.conn
                .stats
                .record(format!("queue {}: {why}", self.conn.queue));
        }
        self.flight.fail_all();
        self.out.clear();
        self.hdrs.clear();
        lock(&self.conn.st).dead = true;
        self.conn.settled.notify_all();
        self.conn.shut();
        if let Some(l) = self.conn.link.get() {
            let _ = self.ep.ctl(
                ControlOperation::Delete,
                l.sock.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    /// Reads every reply that is there, without waiting.
    fn pump(&mut self) {
        if self.flight.dead {
            return;
        }
        let Some(l) = self.link() else { return };
        let fd = l.sock.as_raw_fd();
        let structured = l.info.structured;
        let maxp = u64::from(self.info.max_payload);
        if let Err(e) = self.rx.pump(fd, structured, maxp, &mut self.flight) {
            let why = crate::error_chain(&e);
            tracing::debug!(queue = self.conn.queue, "NBD reader ends: {why}");
            self.fail(&why);
        }
    }

    /// Sends the scratch iovecs, never blocking while the server waits for us to read: when
    /// the socket is full, replies are read meanwhile (they only complete requests whose
    /// bytes were all sent). Gives up after [`SEND_TIMEOUT`] without progress.
    fn send_all(&mut self, fd: RawFd) -> io::Result<()> {
        let mut iov = std::mem::take(&mut self.iov);
        let res = (|| {
            let mut start = consume_iov(&mut iov, 0, 0);
            let mut stalled_since: Option<Instant> = None;
            while start < iov.len() {
                let n = (iov.len() - start).min(MAX_IOV);
                // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov[start..].as_mut_ptr();
                msg.msg_iovlen = n;
                // SAFETY: the iovecs name live memory (the headers, and guest pages of
                // requests in flight: push's contract); sendmsg only reads them.
                let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
                if r >= 0 {
                    stalled_since = None;
                    start = consume_iov(&mut iov, start, r as usize);
                    continue;
                }
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => {}
                    _ => return Err(e),
                }
                let since = *stalled_since.get_or_insert_with(Instant::now);
                let left = SEND_TIMEOUT.saturating_sub(since.elapsed());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLIN | libc::POLLOUT,
                    revents: 0,
                };
                let ms = left.as_millis().min(1000) as libc::c_int;
                // SAFETY: one valid pollfd.
                let k = unsafe { libc::poll(&mut p, 1, ms) };
                if k > 0 && p.revents & libc::POLLIN != 0 {
                    self.pump();
                    if self.flight.dead {
                        return Err(io::ErrorKind::BrokenPipe.into());
                    }
                }
            }
            Ok(())
        })();
        iov.clear();
        self.iov = iov;
        res
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
                let df = if self.info.structured && tf & TF_SEND_DF != 0 {
                    CMD_FLAG_DF
                } else {
                    0
                };
                (CMD_READ, df, offset, Self::iov_len(v), Some(v))
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
        self.settle();
        if self.flight.dead {
            self.complete_now(token, -libc::EIO);
            return true;
        }
        // A free slot: in-flight requests are few (the queue depth), so this ends fast.
        let mut slot = self.next_slot;
        while self.flight.inflight.contains_key(&slot) {
            slot = slot.wrapping_add(1);
        }
        self.next_slot = slot.wrapping_add(1);
        let read = typ == CMD_READ;
        self.flight.inflight.insert(
            slot,
            Pending {
                token,
                offset,
                len,
                iov,
                read,
                parts_left: parts,
                result: 0,
            },
        );
        if read {
            self.flight.reads += 1;
        }
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
        self.settle();
        if self.flight.dead {
            // Everything registered was failed with EIO already.
            self.out.clear();
            self.hdrs.clear();
            return Ok(());
        }
        let Some(l) = self.link() else {
            // Not connected yet: sent when the connecting thread signals.
            return Ok(());
        };
        let fd = l.sock.as_raw_fd();
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
        let res = self.send_all(fd);
        self.out.clear();
        self.hdrs.clear();
        if let Err(e) = res {
            self.fail(&format!("sending requests: {e}"));
        }
        Ok(())
    }

    fn completion_fd(&self) -> RawFd {
        self.ep.as_raw_fd()
    }

    fn has_completions(&mut self) -> bool {
        if self.flight.completions.is_empty() && !self.flight.inflight.is_empty() {
            self.settle();
            self.pump();
        }
        !self.flight.completions.is_empty()
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        self.settle();
        if !self.out.is_empty() {
            // Requests pushed before the connection was up.
            let _ = self.submit();
        }
        self.pump();
        out.append(&mut self.flight.completions);
    }
}

impl Drop for NbdQueue {
    fn drop(&mut self) {
        self.conn.closing.store(true, Ordering::Relaxed);
        if let Some(l) = self.conn.link.get() {
            handshake::disconnect(&l.sock);
        }
    }
}
