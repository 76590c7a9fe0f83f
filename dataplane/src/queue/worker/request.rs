//! One request from pop to completion: the one place a request is popped (`start_request`,
//! split and validate, then dispatch to the engine) and the one place it completes
//! (`complete`: status byte, used ring, accounting). Dirty logging and inflight tracking hook
//! at those two points.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, error, warn};
use virtio_queue::{DescriptorChain, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::{Worker, MAX_SEGS, NO_USED_LOG};
use crate::drive::{AcctClass, DiscardMode, ErrorPolicy};
use crate::engine::IoOp;
use crate::guest_mem::dirty_log::used_ring_len;
use crate::guest_mem::{
    advance_iov, build_iovecs, copy_from_guest, copy_to_guest, iov_aligned, Mem,
};
use crate::virtio_blk::{
    self, split_chain, Desc, DwzSegment, Header, Op, Seg, DWZ_SEGMENT_LEN, HEADER_LEN, S_IOERR,
    S_OK, S_UNSUPP, T_DISCARD, T_WRITE_ZEROES,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// readv/writev straight on guest memory.
    Direct,
    /// Through a bounce buffer, chunk by chunk.
    Bounce,
    Flush,
    Fallocate(i32),
}

pub(super) struct InFlight {
    pub(super) head: u16,
    pub(super) status: u64,
    pub(super) used_len: u32,
    /// The request's accounting class, once dispatched (None: GET_ID, or not yet).
    pub(super) acct: Option<AcctClass>,
    /// Resubmitted by a retry of held requests.
    pub(super) retried: bool,
    pub(super) op: Op,
    pub(super) stage: Stage,
    /// Bytes of the data already transferred (short transfers, bounce chunks).
    pub(super) done: u64,
    /// For bounce: write zeroes instead of guest data.
    pub(super) zero_fill: bool,
    pub(super) bounce: Option<usize>,
    pub(super) iov: Vec<libc::iovec>,
    pub(super) segs: Vec<Seg>,
    pub(super) mem: Option<Arc<Mem>>,
    /// When the request was popped (for the latency histogram).
    pub(super) started: Instant,
    /// Started on the engine an overlapped switch left: it finishes there.
    pub(super) on_old: bool,
}

impl InFlight {
    pub(super) fn new() -> Self {
        InFlight {
            head: 0,
            status: 0,
            used_len: 0,
            acct: None,
            retried: false,
            op: Op::Flush,
            stage: Stage::Flush,
            done: 0,
            zero_fill: false,
            bounce: None,
            iov: Vec::new(),
            segs: Vec::new(),
            mem: None,
            started: Instant::now(),
            on_old: false,
        }
    }

    pub(super) fn total(&self) -> u64 {
        match self.op {
            Op::Read { len, .. }
            | Op::Write { len, .. }
            | Op::WriteZeroes { len, .. }
            | Op::Discard { len, .. } => len,
            _ => 0,
        }
    }

    pub(super) fn offset(&self) -> u64 {
        match self.op {
            Op::Read { offset, .. }
            | Op::Write { offset, .. }
            | Op::WriteZeroes { offset, .. }
            | Op::Discard { offset, .. } => offset,
            _ => 0,
        }
    }
}
impl Worker {
    /// A chain popped from the avail ring.
    pub(super) fn start_chain(&mut self, chain: DescriptorChain<&Mem>, mem: &Arc<Mem>) {
        let head = chain.head_index();
        let descs = chain.map(|d| {
            let desc = Desc {
                addr: d.addr().0,
                len: d.len(),
                writable: d.is_write_only(),
            };
            (desc, d.has_next())
        });
        self.start_request(head, descs, mem);
    }

    /// The one place a request starts: marked in flight (inflight tracking), split,
    /// validated, dispatched. `descs` are the chain's descriptors with their NEXT flag.
    pub(super) fn start_request(
        &mut self,
        head: u16,
        descs: impl Iterator<Item = (Desc, bool)>,
        mem: &Arc<Mem>,
    ) {
        if let Some(iq) = &self.inflight {
            iq.get(head, self.inflight_counter);
            self.inflight_counter += 1;
        }
        // A chain can end quietly wherever it cannot go on (a loop cut by its length bound,
        // a next index past the table, an unreadable descriptor, a bad indirect table): a
        // chain whose last descriptor still says NEXT was cut, and is malformed.
        let mut cut = false;
        let descs = descs.map(|(d, next)| {
            cut = next;
            d
        });
        let mut split = split_chain(descs, MAX_SEGS, &mut self.layout);
        if cut && split.is_ok() {
            split = Err(virtio_blk::LayoutError::Cut);
        }
        let status = self.layout.status;
        let decoded = match split {
            Ok(()) => self.decode(mem),
            Err(e) => {
                debug!(queue = self.index, head, "malformed chain: {e}");
                Err(S_IOERR)
            }
        };
        let Some(idx) = self.free.pop() else {
            // process_avail pops only while a slot is free.
            return;
        };
        self.in_flight += 1;
        self.drive.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        let slot = &mut self.slots[idx];
        slot.head = head;
        slot.started = Instant::now();
        slot.status = status.unwrap_or(u64::MAX);
        slot.used_len = 1;
        slot.done = 0;
        slot.zero_fill = false;
        slot.bounce = None;
        slot.mem = Some(mem.clone());
        slot.acct = None;
        slot.on_old = false;
        match decoded {
            Err(st) => {
                if let Some(class) = self.req_type.take().and_then(acct_class) {
                    self.drive.stats.acct.invalid(class);
                }
                self.complete(idx, st)
            }
            Ok(op) => {
                self.slots[idx].op = op;
                self.dispatch(idx);
            }
        }
    }

    /// Reads the header (and the discard/write-zeroes segment) and validates the request.
    pub(super) fn decode(&mut self, mem: &Mem) -> Result<Op, u8> {
        self.req_type = None;
        let mut hb = [0u8; HEADER_LEN as usize];
        copy_from_guest(mem, &self.layout.header, 0, &mut hb).map_err(|_| S_IOERR)?;
        let h = Header::from_bytes(&hb);
        self.req_type = Some(h.req_type);
        let dwz = if matches!(h.req_type, T_DISCARD | T_WRITE_ZEROES)
            && self.layout.readable_data_len == u64::from(DWZ_SEGMENT_LEN)
        {
            let mut sb = [0u8; DWZ_SEGMENT_LEN as usize];
            copy_from_guest(mem, &self.layout.readable_data, 0, &mut sb).map_err(|_| S_IOERR)?;
            Some(DwzSegment::from_bytes(&sb))
        } else {
            None
        };
        virtio_blk::validate(&self.drive.geometry(), h, &self.layout, dwz)
    }

    pub(super) fn dispatch(&mut self, idx: usize) {
        let op = self.slots[idx].op;
        self.slots[idx].acct = match op {
            Op::Read { .. } => Some(AcctClass::Read),
            Op::Write { .. } | Op::WriteZeroes { .. } => Some(AcctClass::Write),
            Op::Flush => Some(AcctClass::Flush),
            Op::Discard { .. } => Some(AcctClass::Unmap),
            Op::GetId => None,
        };
        let stats = &self.drive.stats;
        match op {
            Op::GetId => {
                stats.get_ids.fetch_add(1, Ordering::Relaxed);
                let mem = self.slots[idx].mem.clone().expect("set at start");
                let n = (self.layout.writable_data_len as usize).min(self.id.len());
                // What the device writes is logged at completion (dirty logging).
                self.slots[idx].segs.clear();
                self.slots[idx]
                    .segs
                    .extend_from_slice(&self.layout.writable_data);
                let st = match copy_to_guest(&mem, &self.layout.writable_data, 0, &self.id[..n]) {
                    Ok(()) => {
                        self.slots[idx].used_len = n as u32 + 1;
                        S_OK
                    }
                    Err(_) => S_IOERR,
                };
                self.complete(idx, st);
            }
            Op::Flush => {
                stats.flushes.fetch_add(1, Ordering::Relaxed);
                self.slots[idx].stage = Stage::Flush;
                // Right after an overlapped switch from the direct engine, writes that
                // completed there are made durable first: QEMU's flush covers only what was
                // written through QEMU.
                if let Some(old) = self.drive.unsynced_old() {
                    if let Err(e) = old.sync_data() {
                        return self.io_error(idx, -e.raw_os_error().unwrap_or(libc::EIO));
                    }
                }
                self.push(idx, IoOp::Flush);
            }
            Op::Discard { offset, len } => {
                stats.discards.fetch_add(1, Ordering::Relaxed);
                if self.drive.config().discard == DiscardMode::Ignore || len == 0 {
                    return self.complete(idx, S_OK);
                }
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                self.push_fallocate(idx, offset, len, mode, false);
            }
            Op::WriteZeroes { offset, len, unmap } => {
                stats.write_zeroes.fetch_add(1, Ordering::Relaxed);
                if len == 0 {
                    return self.complete(idx, S_OK);
                }
                let mode = if unmap && self.drive.config().discard == DiscardMode::Unmap {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                };
                self.push_fallocate(idx, offset, len, mode, true);
            }
            Op::Read { len, .. } | Op::Write { len, .. } => {
                let read = matches!(op, Op::Read { .. });
                if read {
                    stats.reads.fetch_add(1, Ordering::Relaxed);
                    self.slots[idx].used_len = (len as u32).wrapping_add(1);
                } else {
                    stats.writes.fetch_add(1, Ordering::Relaxed);
                }
                if len == 0 {
                    return self.complete(idx, S_OK);
                }
                let segs = if read {
                    &self.layout.writable_data
                } else {
                    &self.layout.readable_data
                };
                let align = self.engine.buffer_alignment() as usize;
                let slot = &mut self.slots[idx];
                slot.segs.clear();
                slot.segs.extend_from_slice(segs);
                match build_iovecs(slot.mem.as_deref().expect("set"), segs, &mut slot.iov) {
                    Err(_) => return self.complete(idx, S_IOERR),
                    Ok(aligned) if aligned || align <= 1 => {}
                    Ok(_) if iov_aligned(&slot.iov, align) => {}
                    Ok(_) => {
                        slot.stage = Stage::Bounce;
                        stats.bounced.fetch_add(1, Ordering::Relaxed);
                        return self.start_bounce(idx);
                    }
                }
                slot.stage = Stage::Direct;
                self.push_rw(idx);
            }
        }
    }

    /// (Re)submits the direct readv/writev of a slot from its current progress.
    pub(super) fn push_rw(&mut self, idx: usize) {
        let dsync = !self.drive.writeback();
        let slot = &self.slots[idx];
        let offset = slot.offset() + slot.done;
        let (iov, iovcnt) = (slot.iov.as_ptr(), slot.iov.len() as u32);
        let op = match slot.op {
            Op::Read { .. } => IoOp::Readv {
                offset,
                iov,
                iovcnt,
            },
            _ => IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync,
            },
        };
        self.push(idx, op);
    }

    pub(super) fn push(&mut self, idx: usize, op: IoOp) {
        // A request started before an overlapped switch goes on where it started.
        let io = match self.old.as_mut() {
            Some(o) if self.slots[idx].on_old => &mut o.io,
            _ => &mut self.io,
        };
        // SAFETY: the iovecs live in `self.slots[idx].iov` and point into guest memory kept
        // mapped by `self.slots[idx].mem`, or into this worker's bounce buffers; neither is
        // touched or freed until the completion for `idx` is reaped.
        let ok = unsafe { io.push(&op, idx as u64) };
        if !ok {
            // Cannot happen while in-flight <= depth; answer rather than lose the request.
            error!(queue = self.index, "engine queue full");
            self.complete(idx, S_IOERR);
        }
    }

    /// Submits a slot's fallocate with `mode` (its completion comes back to `on_fallocate`);
    /// `zeroes`: the range must read as zeroes afterwards.
    pub(super) fn push_fallocate(
        &mut self,
        idx: usize,
        offset: u64,
        len: u64,
        mode: i32,
        zeroes: bool,
    ) {
        self.slots[idx].stage = Stage::Fallocate(mode);
        self.push(
            idx,
            IoOp::Fallocate {
                offset,
                len,
                mode,
                zeroes,
            },
        );
    }

    /// Handles every completion (the engine's fd was readable, or polling saw some), then
    /// submits and pops what was waiting for a free slot.
    pub(super) fn reap(&mut self) {
        self.reap_ready();
        self.submit();
        if self.starved {
            self.process_avail();
        }
    }

    /// Handles the completions the engine has now, without submitting.
    pub(super) fn reap_ready(&mut self) {
        let mut done = std::mem::take(&mut self.completions);
        done.clear();
        self.io.reap(&mut done);
        if let Some(o) = self.old.as_mut() {
            o.io.reap(&mut done);
        }
        for &(token, res) in &done {
            let idx = token as usize;
            if idx >= self.slots.len() || self.slots[idx].mem.is_none() {
                error!(queue = self.index, token, "completion for no request");
                continue;
            }
            self.on_completion(idx, res);
        }
        self.completions = done;
    }

    pub(super) fn on_completion(&mut self, idx: usize, res: i32) {
        let stage = self.slots[idx].stage;
        match stage {
            Stage::Flush if res < 0 => self.io_error(idx, res),
            Stage::Flush => self.complete(idx, S_OK),
            Stage::Fallocate(mode) => self.on_fallocate(idx, mode, res),
            Stage::Direct => {
                if res <= 0 {
                    self.io_error(idx, res);
                    return;
                }
                let slot = &mut self.slots[idx];
                slot.done += res as u64;
                if slot.done >= slot.total() {
                    return self.complete(idx, S_OK);
                }
                // Short transfer: go on from where it stopped.
                advance_iov(&mut slot.iov, res as usize);
                self.push_rw(idx);
            }
            Stage::Bounce => {
                if res <= 0 {
                    self.io_error(idx, res);
                    return;
                }
                let n = res as usize;
                let slot = &mut self.slots[idx];
                let b = slot.bounce.expect("bounce buffer held");
                if matches!(slot.op, Op::Read { .. }) {
                    let buf = self.bounce.buf(b);
                    if copy_to_guest(
                        slot.mem.as_deref().expect("set"),
                        &slot.segs,
                        slot.done,
                        &buf[..n],
                    )
                    .is_err()
                    {
                        return self.complete(idx, S_IOERR);
                    }
                }
                slot.done += n as u64;
                if slot.done >= slot.total() {
                    self.complete(idx, S_OK);
                } else {
                    self.bounce_chunk(idx);
                }
            }
        }
    }

    pub(super) fn on_fallocate(&mut self, idx: usize, mode: i32, res: i32) {
        if res >= 0 {
            return self.complete(idx, S_OK);
        }
        let unsupported = res == -libc::EOPNOTSUPP || res == -libc::EINVAL;
        match self.slots[idx].op {
            // Discard is a hint: a file system that cannot punch holes did nothing wrong.
            Op::Discard { .. } if unsupported => self.complete(idx, S_OK),
            Op::WriteZeroes { offset, len, .. } if unsupported => {
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                if mode != punch && !self.engine_of(idx).is_block_device() {
                    // tmpfs has no ZERO_RANGE; a punched hole of a regular file reads as zeroes.
                    self.push_fallocate(idx, offset, len, punch, true);
                } else {
                    // Last resort: write zeroes through the bounce pool.
                    let slot = &mut self.slots[idx];
                    slot.stage = Stage::Bounce;
                    slot.zero_fill = true;
                    slot.op = Op::Write { offset, len };
                    self.start_bounce(idx);
                }
            }
            _ => self.io_error(idx, res),
        }
    }

    /// A request failed with `res` (-errno, or 0 for an unexpected end of file): its policy
    /// (QEMU's rerror for reads, werror for everything else) reports it, ignores it, or holds
    /// it for a retry.
    pub(super) fn io_error(&mut self, idx: usize, res: i32) {
        let read = matches!(self.slots[idx].op, Op::Read { .. });
        let cfg = self.drive.config();
        let policy = if read { cfg.rerror } else { cfg.werror };
        match policy {
            ErrorPolicy::Stop => return self.hold(idx, res),
            ErrorPolicy::Enospc if res == -libc::ENOSPC => return self.hold(idx, res),
            ErrorPolicy::Ignore => return self.complete(idx, S_OK),
            ErrorPolicy::Enospc | ErrorPolicy::Report => {}
        }
        if let Some(n) = self.drive.stats.log.io.admit() {
            let e = std::io::Error::from_raw_os_error(-res);
            warn!(drive = %self.drive.config().name, queue = self.index, op = ?self.slots[idx].op,
                "I/O failed: {}{}",
                if res == 0 { "unexpected end of file".to_string() } else { e.to_string() },
                crate::util::suppressed(n));
        }
        self.complete(idx, S_IOERR);
    }

    /// Keeps a failed request in flight for a retry (werror=enospc, stop): the guest sees
    /// nothing, the queue takes no new request until it went through.
    fn hold(&mut self, idx: usize, res: i32) {
        let stats = &self.drive.stats;
        if std::mem::take(&mut self.slots[idx].retried) {
            self.retrying -= 1;
        }
        if res == -libc::ENOSPC {
            stats.nospace_events.fetch_add(1, Ordering::Relaxed);
        }
        stats.hold_errno.store(-res, Ordering::Relaxed);
        stats.held_requests.fetch_add(1, Ordering::Relaxed);
        if self.held.is_empty() && self.retrying == 0 {
            if let Some(n) = stats.log.hold.admit() {
                let e = std::io::Error::from_raw_os_error(-res);
                warn!(drive = %self.drive.config().name, queue = self.index,
                    "I/O failed ({e}): requests held and retried every {:?} until it succeeds or `accelctl resume`{}",
                    crate::drive::HOLD_RETRY, crate::util::suppressed(n));
            }
        }
        self.held.push_back(idx);
        self.was_holding = true;
        self.next_retry
            .get_or_insert_with(|| Instant::now() + crate::drive::HOLD_RETRY);
    }

    /// Submits a held request again from where it stopped.
    pub(super) fn redo(&mut self, idx: usize) {
        self.slots[idx].retried = true;
        match self.slots[idx].stage {
            Stage::Direct => self.push_rw(idx),
            Stage::Bounce => self.bounce_chunk(idx),
            Stage::Flush => self.push(idx, IoOp::Flush),
            Stage::Fallocate(mode) => match self.slots[idx].op {
                Op::Discard { offset, len } => self.push_fallocate(idx, offset, len, mode, false),
                Op::WriteZeroes { offset, len, .. } => {
                    self.push_fallocate(idx, offset, len, mode, true)
                }
                _ => self.complete(idx, S_IOERR),
            },
        }
    }

    /// Writes the status byte (last), puts the head in the used ring, frees the slot.
    pub(super) fn complete(&mut self, idx: usize, status: u8) {
        if std::mem::take(&mut self.slots[idx].retried) {
            self.retrying -= 1;
        }
        let stats = &self.drive.stats;
        match status {
            S_OK => match self.slots[idx].op {
                Op::Read { len, .. } => {
                    stats.bytes_read.fetch_add(len, Ordering::Relaxed);
                }
                Op::Write { len, .. } => {
                    stats.bytes_written.fetch_add(len, Ordering::Relaxed);
                }
                _ => {}
            },
            S_UNSUPP => {
                stats.unsupported.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                stats.io_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        let slot = &mut self.slots[idx];
        let took = slot.started.elapsed();
        stats.latency.record(took);
        if let Some(class) = slot.acct.take() {
            let bytes = match slot.op {
                Op::Read { len, .. }
                | Op::Write { len, .. }
                | Op::WriteZeroes { len, .. }
                | Op::Discard { len, .. } => len,
                Op::Flush | Op::GetId => 0,
            };
            stats.acct.done(class, status == S_OK, bytes, took);
        }
        // The request's own memory map holds the ring too: no lock per completion.
        let mem = slot.mem.take().expect("request in flight");
        if status != S_OK {
            slot.used_len = 1;
        }
        if slot.status != u64::MAX && mem.write_obj(status, GuestAddress(slot.status)).is_err() {
            debug!(queue = self.index, "status byte outside guest memory");
        }
        let head = slot.head;
        // Dirty logging: every page the device wrote for this request, after the writes and
        // before the used element says it completed; then the used ring, after add_used. One
        // look at the log per completion (a log swap waits for the guard).
        let guard = self.log.active();
        let log = guard.as_deref().and_then(Option::as_ref);
        if let Some(log) = log {
            if matches!(slot.op, Op::Read { .. } | Op::GetId) {
                for s in &slot.segs {
                    log.mark(s.addr, u64::from(s.len));
                }
            }
            if slot.status != u64::MAX {
                log.mark(slot.status, 1);
            }
        }
        if let Some(iq) = &self.inflight {
            iq.pre_put(head);
        }
        let used = self.queue.add_used(&*mem, head, slot.used_len);
        if let (Some(iq), Ok(())) = (&self.inflight, &used) {
            // Cleared only once the head is in the used ring: a completion that did not get
            // there stays marked, for the next backend.
            iq.post_put(head, self.queue.next_used());
        }
        if let (Some(log), Ok(())) = (log, &used) {
            // QEMU syncs the whole used ring too: one or two pages.
            let at = self.used_log.load(Ordering::Acquire);
            if at != NO_USED_LOG {
                log.mark(at, used_ring_len(self.queue.size()));
            }
        }
        drop(guard);
        slot.op = Op::Flush;
        let freed_bounce = slot.bounce.take();
        let was_old = std::mem::take(&mut slot.on_old);
        self.used_added = true;
        self.free.push(idx);
        self.in_flight -= 1;
        if was_old {
            if let Some(o) = self.old.as_mut() {
                o.in_flight -= 1;
                if o.in_flight == 0 {
                    self.retire_old();
                }
            }
        }
        if let Some(b) = freed_bounce {
            // Hand the buffer to the oldest request waiting for one.
            match self.bounce_wait.pop_front() {
                Some(next) => {
                    self.slots[next].bounce = Some(b);
                    self.bounce_chunk(next);
                }
                None => self.bounce.free.push(b),
            }
        }
        if let Err(e) = used {
            // The used ring is not guest memory (any more): nothing can complete there.
            self.mark_broken(&super::RingError::Access(e.to_string()));
        }
    }
}

/// The accounting class of a request type (None: GET_ID and unknown types).
fn acct_class(req_type: u32) -> Option<AcctClass> {
    match req_type {
        virtio_blk::T_IN => Some(AcctClass::Read),
        virtio_blk::T_OUT | T_WRITE_ZEROES => Some(AcctClass::Write),
        virtio_blk::T_FLUSH => Some(AcctClass::Flush),
        T_DISCARD => Some(AcctClass::Unmap),
        _ => None,
    }
}
