//! One request from pop to completion: the one place a request is popped (`start_request`,
//! split and validate, then dispatch to the engine) and the one place it completes
//! (`complete`: status byte, used ring, accounting). Dirty logging and inflight tracking hook
//! at those two points.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::{debug, error, warn};
use virtio_queue::{DescriptorChain, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::bounce::BOUNCE_SIZE;
use super::slots::Stage;
use super::{Worker, MAX_SEGS, NO_USED_LOG};
use crate::drive::{AcctClass, DiscardMode, ErrorPolicy};
use crate::engine::IoOp;
use crate::guest_mem::dirty_log::used_ring_len;
use crate::guest_mem::{
    advance_iov, build_iovecs, copy_from_guest, copy_to_guest, iov_aligned, Mem,
};
use crate::virtio_blk::{
    self, split_chain, Desc, DwzSegment, Header, Op, DWZ_SEGMENT_LEN, HEADER_LEN, S_IOERR, S_OK,
    S_UNSUPP, T_DISCARD, T_WRITE_ZEROES,
};

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
        if let Some(iq) = &self.ring.inflight {
            iq.get(head, self.ring.inflight_counter);
            self.ring.inflight_counter += 1;
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
        let Some(idx) = self.slots.start(head, status.unwrap_or(u64::MAX), mem) else {
            // process_avail pops only while a slot is free.
            return;
        };
        self.drive.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        match decoded {
            Err(st) => {
                if let Some(class) = self.req_type.take().and_then(acct_class) {
                    self.drive.stats.acct.invalid(class);
                }
                self.complete(idx, st)
            }
            Ok(op) => {
                self.slots[idx].op = Some(op);
                self.dispatch(idx, op);
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

    pub(super) fn dispatch(&mut self, idx: usize, op: Op) {
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
                let n = (self.layout.writable_data_len as usize).min(self.id.len());
                let req = &mut self.slots[idx];
                // What the device writes is logged at completion (dirty logging).
                req.segs.clear();
                req.segs.extend_from_slice(&self.layout.writable_data);
                let st = match copy_to_guest(&req.mem, &self.layout.writable_data, 0, &self.id[..n])
                {
                    Ok(()) => {
                        req.used_len = n as u32 + 1;
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
                    self.slots[idx].used_len = (len as u32).wrapping_add(1);
                }
                if len == 0 {
                    return self.complete(idx, S_OK);
                }
                let segs = if read {
                    &self.layout.writable_data
                } else {
                    &self.layout.readable_data
                };
                let align = self.engines.current().buffer_alignment() as usize;
                let slot = &mut self.slots[idx];
                slot.segs.clear();
                slot.segs.extend_from_slice(segs);
                match build_iovecs(&slot.mem, segs, &mut slot.iov) {
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
        let op = if slot.is_read() {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            }
        } else {
            IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync,
            }
        };
        self.push(idx, op);
    }

    pub(super) fn push(&mut self, idx: usize, op: IoOp) {
        // A request started before an overlapped switch goes on where it started.
        let io = self.engines.io_for(self.slots[idx].on_old);
        // SAFETY: the iovecs live in `self.slots[idx].iov` and point into guest memory kept
        // mapped by `self.slots[idx].mem`, or into this worker's bounce buffers; neither is
        // touched or freed until the completion for `idx` is reaped (the slot stays busy
        // until then).
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
        self.engines.reap(&mut done);
        for &(token, res) in &done {
            let idx = token as usize;
            if self.slots.get(idx).is_none() {
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
                if slot.is_read() {
                    let buf = self.bounce.buf(b);
                    if copy_to_guest(&slot.mem, &slot.segs, slot.done, &buf[..n]).is_err() {
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
            Some(Op::Discard { .. }) if unsupported => self.complete(idx, S_OK),
            Some(Op::WriteZeroes { offset, len, .. }) if unsupported => {
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                if mode != punch
                    && !self
                        .engines
                        .engine_for(self.slots[idx].on_old)
                        .is_block_device()
                {
                    // tmpfs has no ZERO_RANGE; a punched hole of a regular file reads as zeroes.
                    self.push_fallocate(idx, offset, len, punch, true);
                } else {
                    // Last resort: write zeroes through the bounce pool.
                    let slot = &mut self.slots[idx];
                    slot.stage = Stage::Bounce;
                    slot.zero_fill = true;
                    slot.op = Some(Op::Write { offset, len });
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
        let read = self.slots[idx].is_read();
        let cfg = self.drive.config();
        let policy = if read { cfg.rerror } else { cfg.werror };
        if res == crate::engine::PATH_LOST {
            // Not the storage's failure: the supervisor moves the drive to another path,
            // where the retry goes.
            return self.hold(idx, res);
        }
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

    /// Writes the status byte (last), puts the head in the used ring, frees the slot.
    pub(super) fn complete(&mut self, idx: usize, status: u8) {
        let Some(req) = self.slots.get_mut(idx) else {
            error!(queue = self.index, idx, "completion of a free slot");
            return;
        };
        if std::mem::take(&mut req.retried) {
            self.holds.retrying -= 1;
        }
        if status != S_OK {
            req.used_len = 1;
        }
        let req = &self.slots[idx];
        let stats = &self.drive.stats;
        match status {
            S_OK => {}
            S_UNSUPP => {
                stats.unsupported.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                stats.io_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        let took = req.started.elapsed();
        stats.latency.record(took);
        if let Some(class) = req.acct {
            stats.acct.done(class, status == S_OK, req.total(), took);
        }
        // The request's own memory map holds the ring too: no lock per completion.
        let mem = &*req.mem;
        if req.status != u64::MAX && mem.write_obj(status, GuestAddress(req.status)).is_err() {
            debug!(queue = self.index, "status byte outside guest memory");
        }
        let head = req.head;
        // Dirty logging: every page the device wrote for this request, after the writes and
        // before the used element says it completed; then the used ring, after add_used. One
        // look at the log per completion (a log swap waits for the guard).
        let guard = self.ring.log.active();
        let log = guard.as_deref().and_then(Option::as_ref);
        if let Some(log) = log {
            if matches!(req.op, Some(Op::Read { .. } | Op::GetId)) {
                for s in &req.segs {
                    log.mark(s.addr, u64::from(s.len));
                }
            }
            if req.status != u64::MAX {
                log.mark(req.status, 1);
            }
        }
        if let Some(iq) = &self.ring.inflight {
            iq.pre_put(head);
        }
        let used = self.ring.queue.add_used(mem, head, req.used_len);
        if let (Some(iq), Ok(())) = (&self.ring.inflight, &used) {
            // Cleared only once the head is in the used ring: a completion that did not get
            // there stays marked, for the next backend.
            iq.post_put(head, self.ring.queue.next_used());
        }
        if let (Some(log), Ok(())) = (log, &used) {
            // QEMU syncs the whole used ring too: one or two pages.
            let at = self.ring.used_log.load(Ordering::Acquire);
            if at != NO_USED_LOG {
                log.mark(at, used_ring_len(self.ring.queue.size()));
            }
        }
        drop(guard);
        let Some(req) = self.slots.finish(idx) else {
            return;
        };
        self.ring.used_added = true;
        if req.on_old && self.engines.old_finished() {
            self.retire_old();
        }
        if let Some(b) = req.bounce {
            // Hand the buffer to the oldest request waiting for one.
            match self.bounce.waiting.pop_front() {
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

impl Worker {
    /// Keeps a failed request in flight for a retry (werror=enospc, stop): the guest sees
    /// nothing, the queue takes no new request until it went through.
    pub(super) fn hold(&mut self, idx: usize, res: i32) {
        let stats = &self.drive.stats;
        if std::mem::take(&mut self.slots[idx].retried) {
            self.holds.retrying -= 1;
        }
        if res == -libc::ENOSPC {
            stats.nospace_events.fetch_add(1, Ordering::Relaxed);
        }
        stats.hold_errno.store(-res, Ordering::Relaxed);
        stats.held_requests.fetch_add(1, Ordering::Relaxed);
        if !self.holds.holding() {
            if let Some(n) = stats.log.hold.admit() {
                let e = std::io::Error::from_raw_os_error(-res);
                warn!(drive = %self.drive.config().name, queue = self.index,
                    "I/O failed ({e}): requests held and retried every {:?} until it succeeds or `accelctl resume`{}",
                    crate::drive::HOLD_RETRY, crate::util::suppressed(n));
            }
        }
        self.holds.push(idx);
    }

    /// Resubmits every held request, in order; one that fails again is held again.
    pub(super) fn retry_held(&mut self) {
        let held = self.holds.take();
        self.drive
            .stats
            .held_requests
            .fetch_sub(held.len() as u64, Ordering::Relaxed);
        for idx in held {
            self.holds.retrying += 1;
            self.redo(idx);
        }
        self.submit();
    }

    /// Submits a held request again from where it stopped.
    fn redo(&mut self, idx: usize) {
        // A held request is in flight on no engine: after an overlapped switch its retry
        // goes to the current one (the old one may be a path that is gone).
        if std::mem::take(&mut self.slots[idx].on_old) && self.engines.old_finished() {
            self.retire_old();
        }
        let req = &mut self.slots[idx];
        req.retried = true;
        match (req.stage, req.op) {
            (Stage::Direct, _) => self.push_rw(idx),
            (Stage::Bounce, _) => self.bounce_chunk(idx),
            (Stage::Flush, _) => self.push(idx, IoOp::Flush),
            (Stage::Fallocate(mode), Some(Op::Discard { offset, len })) => {
                self.push_fallocate(idx, offset, len, mode, false)
            }
            (Stage::Fallocate(mode), Some(Op::WriteZeroes { offset, len, .. })) => {
                self.push_fallocate(idx, offset, len, mode, true)
            }
            (Stage::Fallocate(_), _) => self.complete(idx, S_IOERR),
        }
    }
}

impl Worker {
    pub(super) fn start_bounce(&mut self, idx: usize) {
        match self.bounce.take() {
            Some(b) => {
                self.slots[idx].bounce = Some(b);
                self.bounce_chunk(idx);
            }
            None => self.bounce.waiting.push_back(idx),
        }
    }

    /// Submits the next chunk of a bounced request.
    pub(super) fn bounce_chunk(&mut self, idx: usize) {
        let slot = &mut self.slots[idx];
        let b = slot.bounce.expect("bounce buffer held");
        let n = ((slot.total() - slot.done) as usize).min(BOUNCE_SIZE);
        let offset = slot.offset() + slot.done;
        let read = slot.is_read();
        let buf = self.bounce.buf(b);
        if !read {
            if slot.zero_fill {
                buf[..n].fill(0);
            } else if copy_from_guest(&slot.mem, &slot.segs, slot.done, &mut buf[..n]).is_err() {
                return self.complete(idx, S_IOERR);
            }
        }
        slot.iov.clear();
        slot.iov.push(libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: n,
        });
        let (iov, iovcnt) = (slot.iov.as_ptr(), 1);
        let op = if read {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            }
        } else {
            IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync: !self.drive.writeback(),
            }
        };
        self.push(idx, op);
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
