//! One queue's context on the relay: requests become chains on the queue's shadow ring,
//! completions come back on its used ring. Driven by the queue's worker alone.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::warn;
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};

use super::ring::Desc;
use super::session::Session;
use super::shadow::{INDIRECT_MAX, RING_SIZE, SLOT_HDR, SLOT_SEG, SLOT_STATUS};
use super::state::{Busy, Dwz, Head, QueueState};
use crate::engine::{IoOp, QueueIo};
use crate::guest_mem::{Mem, MemHandle};
use crate::util::lock;
use crate::vu_frontend::{F_BLK_CONFIG_WCE, F_BLK_FLUSH};

// virtio-blk request types and statuses (VIRTIO 1.2 §5.2.6).
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
const S_OK: u8 = 0;
const S_UNSUPP: u8 = 2;
/// What the status byte holds until the export writes it.
const S_UNSET: u8 = 0xff;
const F_UNMAP: u32 = 1;
/// The most sectors QEMU's export takes in one discard or write-zeroes segment.
const MAX_DWZ_SECTORS: u64 = 32768;

pub(crate) struct RelayQueue {
    s: Arc<Session>,
    queue: usize,
    st: Option<QueueState>,
    mem: MemHandle,
    /// The map this context translates with, and its regions: (host address, length, gpa),
    /// sorted by host address.
    cur: Arc<Mem>,
    map: Vec<(usize, usize, u64)>,
    chain: Vec<Desc>,
    done: Vec<(u64, i32)>,
    /// The session's end was taken in: everything failed, later requests fail at once.
    failed: bool,
}

fn host_map(mem: &Mem) -> Vec<(usize, usize, u64)> {
    let mut v: Vec<(usize, usize, u64)> = mem
        .iter()
        .map(|r| {
            (
                r.as_ptr() as usize,
                r.len() as usize,
                r.start_addr().raw_value(),
            )
        })
        .collect();
    v.sort_unstable();
    v
}

impl RelayQueue {
    pub(crate) fn new(
        s: Arc<Session>,
        queue: usize,
        st: QueueState,
        mem: MemHandle,
        cur: Arc<Mem>,
    ) -> RelayQueue {
        let map = host_map(&cur);
        RelayQueue {
            s,
            queue,
            st: Some(st),
            mem,
            cur,
            map,
            chain: Vec::with_capacity(INDIRECT_MAX),
            done: Vec::new(),
            failed: false,
        }
    }

    fn st(&mut self) -> &mut QueueState {
        self.st
            .as_mut()
            .expect("state held while the context lives")
    }

    /// The export's address of host range [p, p+len), inside one region of the map.
    fn gpa_of(&self, p: usize, len: usize) -> Option<u64> {
        let i = self
            .map
            .partition_point(|&(h, _, _)| h <= p)
            .checked_sub(1)?;
        let (h, l, g) = self.map[i];
        let off = p - h;
        (off.checked_add(len)? <= l).then_some(g + off as u64)
    }

    /// Takes a new guest memory map in (the front-end changed its table) and gives the
    /// export the regions it lacks. False when there is no new map or it cannot be synced.
    fn refresh(&mut self) -> bool {
        let m = lock(&self.mem).clone();
        if Arc::ptr_eq(&m, &self.cur) {
            return false;
        }
        if let Err(why) = self.s.sync_memory(&m) {
            self.s.fail(&why);
            return false;
        }
        self.map = host_map(&m);
        self.cur = m;
        true
    }

    /// The data descriptors of `iov`, after the header: false if a piece is not guest memory
    /// the export has, or there are too many.
    fn data_chain(&mut self, iov: *const libc::iovec, cnt: u32, write: bool) -> bool {
        if cnt as usize > INDIRECT_MAX - 2 {
            return false;
        }
        // SAFETY: push's contract: the iovec array is valid while the request is in flight.
        let iov = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
        for attempt in 0..2 {
            self.chain.truncate(1);
            let mut ok = true;
            for v in iov {
                if v.iov_len == 0 {
                    // QEMU's export ends the session on a zero-length descriptor.
                    continue;
                }
                match self.gpa_of(v.iov_base as usize, v.iov_len) {
                    Some(addr) if v.iov_len <= u32::MAX as usize => self.chain.push(Desc {
                        addr,
                        len: v.iov_len as u32,
                        write,
                    }),
                    _ => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                return true;
            }
            if attempt == 0 && !self.refresh() {
                return false;
            }
        }
        false
    }

    /// An empty chain with a place for the header, which [`RelayQueue::post`] fills.
    fn start_chain(&mut self) {
        self.chain.clear();
        self.chain.push(Desc {
            addr: 0,
            len: 16,
            write: false,
        });
    }

    fn complete_now(&mut self, token: u64, res: i32) {
        self.done.push((token, res));
    }

    /// Writes head `head`'s header (and segment), resets its status, and posts its chain
    /// (`self.chain` after the header).
    fn post(&mut self, head: u16, typ: u32, sector: u64, seg: Option<(u64, u32, u32)>) {
        let st = self.st.as_mut().expect("state");
        let (hdr, hdr_gpa) = st.ring.slot(head, SLOT_HDR);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&typ.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        // SAFETY: the head's 64-byte slot in the shadow region; the export reads it only
        // once the head is published.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), hdr, 16) };
        self.chain[0] = Desc {
            addr: hdr_gpa,
            len: 16,
            write: false,
        };
        if let Some((sec, n, flags)) = seg {
            let (p, gpa) = st.ring.slot(head, SLOT_SEG);
            let mut b = [0u8; 16];
            b[0..8].copy_from_slice(&sec.to_le_bytes());
            b[8..12].copy_from_slice(&n.to_le_bytes());
            b[12..16].copy_from_slice(&flags.to_le_bytes());
            // SAFETY: as for the header.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p, 16) };
            self.chain.truncate(1);
            self.chain.push(Desc {
                addr: gpa,
                len: 16,
                write: false,
            });
        }
        let (status, status_gpa) = st.ring.slot(head, SLOT_STATUS);
        // SAFETY: the head's status byte in its slot.
        unsafe { status.write_volatile(S_UNSET) };
        self.chain.push(Desc {
            addr: status_gpa,
            len: 1,
            write: true,
        });
        let ok = st.ring.set_chain(head, &self.chain);
        debug_assert!(ok, "chains are checked before posting");
        st.ring.post(head);
        st.outstanding += 1;
        self.s.stats.posted.fetch_add(1, Ordering::Relaxed);
    }

    /// Posts the next part of a discard or write-zeroes.
    fn post_dwz(&mut self, head: u16, d: &mut Dwz) {
        let n = (d.end - d.next).min(MAX_DWZ_SECTORS);
        self.chain.truncate(1);
        self.post(head, d.typ, 0, Some((d.next, n as u32, d.flags)));
        d.next += n;
    }

    /// Fails everything in flight (the session ended): the heads stay orphans until the
    /// ring is set up again, which never happens on this session.
    fn fail_all(&mut self) {
        if self.failed {
            return;
        }
        self.failed = true;
        let lost = self.s.lost_errno();
        let st = self.st.as_mut().expect("state");
        for h in &mut st.heads {
            if let Head::Busy(b) = *h {
                self.done.push((b.token, lost));
                *h = Head::Orphan;
            }
        }
    }

    /// Ends the session over a used ring the export got wrong.
    fn broken(&mut self, what: &str) {
        self.s.fail(&format!("queue {}: {what}", self.queue));
        self.fail_all();
    }

    fn collect(&mut self) {
        if self.failed {
            return;
        }
        if self.s.is_dead() {
            return self.fail_all();
        }
        loop {
            let (idx, seen, outstanding) = {
                let st = self.st();
                (st.ring.used_idx(), st.ring.used_seen, st.outstanding)
            };
            let new = idx.wrapping_sub(seen);
            if new > outstanding {
                return self.broken(&format!(
                    "used index moved by {new} with {outstanding} posted"
                ));
            }
            for k in 0..new {
                let i = seen.wrapping_add(k);
                let (id, _len) = self.st().ring.used(i);
                self.st().ring.used_seen = i.wrapping_add(1);
                self.st().outstanding -= 1;
                if !self.used(id) {
                    return;
                }
            }
            if !self.st().ring.arm() {
                return;
            }
        }
    }

    /// One used head: its result, or its next part. False when the session broke.
    fn used(&mut self, id: u32) -> bool {
        let Some(head) = u16::try_from(id).ok().filter(|&h| h < RING_SIZE) else {
            self.broken(&format!("used id {id}"));
            return false;
        };
        let st = self.st.as_mut().expect("state");
        let mut b = match st.heads[usize::from(head)] {
            Head::Busy(b) => b,
            Head::Orphan => {
                st.heads[usize::from(head)] = Head::Free;
                st.free.push(head);
                return true;
            }
            Head::Free => {
                self.broken(&format!("used id {id}, which is not in flight"));
                return false;
            }
        };
        let (p, _) = st.ring.slot(head, SLOT_STATUS);
        // SAFETY: the head's status byte; the export wrote it before its used index, which
        // was read with Acquire.
        let status = unsafe { p.read_volatile() };
        if status == S_OK {
            if let Some(mut d) = b.dwz.filter(|d| d.next < d.end) {
                self.post_dwz(head, &mut d);
                b.dwz = Some(d);
                self.st().heads[usize::from(head)] = Head::Busy(b);
                return true;
            }
            if b.then_flush {
                b.then_flush = false;
                b.typ = T_FLUSH;
                self.chain.truncate(1);
                self.post(head, T_FLUSH, 0, None);
                self.st().heads[usize::from(head)] = Head::Busy(b);
                return true;
            }
        }
        let res = match status {
            S_OK => b.ok,
            S_UNSUPP if b.typ == T_DISCARD => -libc::EOPNOTSUPP,
            _ if b.typ != T_IN && b.typ != T_DISCARD && self.s.out_of_space(b.ok.max(0) as u64) => {
                -libc::ENOSPC
            }
            _ => -libc::EIO,
        };
        let st = self.st();
        st.heads[usize::from(head)] = Head::Free;
        st.free.push(head);
        self.done.push((b.token, res));
        true
    }
}

// SAFETY: the raw pointers (the shadow ring's memory, the guest iovecs of requests in flight)
// name the session's shadow region, which the Arc<Session> keeps mapped, and guest memory
// the worker keeps valid until it reaps; the context is used by one thread at a time.
unsafe impl Send for RelayQueue {}

impl QueueIo for RelayQueue {
    unsafe fn push(&mut self, op: &IoOp, token: u64) -> bool {
        if self.failed || self.s.is_dead() {
            self.fail_all();
            self.complete_now(token, self.s.lost_errno());
            return true;
        }
        let features = self.s.cfg.features;
        let mut then_flush = false;
        let (typ, sector, ok, dwz) = match *op {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            }
            | IoOp::Writev {
                offset,
                iov,
                iovcnt,
                ..
            } => {
                let write = matches!(op, IoOp::Writev { .. });
                if write && self.s.cfg.read_only {
                    self.complete_now(token, -libc::EROFS);
                    return true;
                }
                if let IoOp::Writev { dsync, .. } = *op {
                    if features & F_BLK_CONFIG_WCE != 0 {
                        if let Err(why) = self.s.set_write_cache(!dsync) {
                            self.s.fail(&why);
                            self.fail_all();
                            self.complete_now(token, self.s.lost_errno());
                            return true;
                        }
                    } else {
                        then_flush = dsync && features & F_BLK_FLUSH != 0;
                    }
                }
                // SAFETY: push's contract.
                let total: u64 = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) }
                    .iter()
                    .map(|v| v.iov_len as u64)
                    .sum();
                if total == 0 {
                    self.complete_now(token, 0);
                    return true;
                }
                let Ok(ok) = i32::try_from(total) else {
                    self.complete_now(token, -libc::EINVAL);
                    return true;
                };
                if offset % 512 != 0 || total % 512 != 0 {
                    self.complete_now(token, -libc::EINVAL);
                    return true;
                }
                self.start_chain();
                if !self.data_chain(iov, iovcnt, !write) {
                    if let Some(n) = RELAY_LOG.admit() {
                        warn!(
                            queue = self.queue,
                            "a request's buffers are not guest memory the export has{}",
                            crate::util::suppressed(n)
                        );
                    }
                    self.complete_now(token, -libc::EIO);
                    return true;
                }
                (if write { T_OUT } else { T_IN }, offset / 512, ok, None)
            }
            IoOp::Flush => {
                if features & F_BLK_FLUSH == 0 {
                    self.complete_now(token, 0);
                    return true;
                }
                self.start_chain();
                (T_FLUSH, 0, 0, None)
            }
            IoOp::Fallocate {
                offset,
                len,
                mode,
                zeroes,
            } => {
                if self.s.cfg.read_only {
                    self.complete_now(token, -libc::EROFS);
                    return true;
                }
                if offset % 512 != 0 || len % 512 != 0 {
                    self.complete_now(token, -libc::EINVAL);
                    return true;
                }
                let (typ, flags) = if zeroes {
                    let unmap = mode & libc::FALLOC_FL_PUNCH_HOLE != 0;
                    (T_WRITE_ZEROES, if unmap { F_UNMAP } else { 0 })
                } else {
                    (T_DISCARD, 0)
                };
                let first = offset / 512;
                let d = Dwz {
                    typ,
                    flags,
                    next: first,
                    end: first + len / 512,
                };
                self.start_chain();
                (typ, 0, 0, Some(d))
            }
        };
        let Some(head) = self.st().free.pop() else {
            return false;
        };
        let busy = Busy {
            token,
            ok,
            typ,
            dwz,
            then_flush,
        };
        if let Some(mut d) = dwz {
            self.post_dwz(head, &mut d);
            self.st().heads[usize::from(head)] = Head::Busy(Busy {
                dwz: Some(d),
                ..busy
            });
        } else {
            self.post(head, typ, sector, None);
            self.st().heads[usize::from(head)] = Head::Busy(busy);
        }
        true
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.failed {
            return Ok(());
        }
        if self.st().ring.publish() {
            self.s.stats.kicks.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.s.kicks[self.queue].write(1) {
                self.s
                    .fail(&format!("cannot kick queue {}: {e}", self.queue));
            }
        }
        Ok(())
    }

    fn completion_fd(&self) -> RawFd {
        self.s.calls[self.queue].as_raw_fd()
    }

    fn has_completions(&mut self) -> bool {
        if !self.done.is_empty() || self.failed {
            return !self.done.is_empty();
        }
        if self.s.is_dead() {
            return true;
        }
        let st = self.st();
        st.ring.used_idx() != st.ring.used_seen
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        let _ = self.s.calls[self.queue].read();
        self.collect();
        out.append(&mut self.done);
    }
}

static RELAY_LOG: crate::util::LogLimit =
    crate::util::LogLimit::new(5, std::time::Duration::from_secs(10));

impl Drop for RelayQueue {
    fn drop(&mut self) {
        if let Some(mut st) = self.st.take() {
            // What is still in flight (an abandoned drain) completes into nothing.
            for h in &mut st.heads {
                if matches!(h, Head::Busy(_)) {
                    *h = Head::Orphan;
                }
            }
            self.s.give_back(self.queue, st);
        }
    }
}
