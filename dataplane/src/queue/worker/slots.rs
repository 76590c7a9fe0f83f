//! The worker's request slots: one per descriptor of the ring, each either free or holding
//! the request popped into it. A free slot holds no request at all (no placeholder to be
//! mistaken for one), only the buffers its next request reuses, so popping allocates nothing.

use std::ops::{Index, IndexMut};
use std::sync::Arc;
use std::time::Instant;

use crate::drive::AcctClass;
use crate::guest_mem::Mem;
use crate::virtio_blk::{Op, Seg};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// readv/writev straight on guest memory.
    Direct,
    /// Through a bounce buffer, chunk by chunk.
    Bounce,
    Flush,
    Fallocate(i32),
}

/// A request between its pop and its completion.
pub(super) struct Request {
    pub(super) head: u16,
    /// Where its status byte goes in guest memory (`u64::MAX`: the chain has none).
    pub(super) status: u64,
    pub(super) used_len: u32,
    /// The request's accounting class, once dispatched (None: GET_ID, or not yet).
    pub(super) acct: Option<AcctClass>,
    /// Resubmitted by a retry of held requests.
    pub(super) retried: bool,
    /// What the request asks (None: it failed validation and completes at once).
    pub(super) op: Option<Op>,
    pub(super) stage: Stage,
    /// Bytes of the data already transferred (short transfers, bounce chunks).
    pub(super) done: u64,
    /// For bounce: write zeroes instead of guest data.
    pub(super) zero_fill: bool,
    pub(super) bounce: Option<usize>,
    pub(super) iov: Vec<libc::iovec>,
    pub(super) segs: Vec<Seg>,
    /// The guest memory map the request was popped with: its buffers stay mapped until it
    /// completes, and the used ring is written through it.
    pub(super) mem: Arc<Mem>,
    /// When the request was popped (for the latency histogram).
    pub(super) started: Instant,
    /// Started on the engine an overlapped switch left: it finishes there.
    pub(super) on_old: bool,
}

impl Request {
    /// Bytes of data the request moves (0 for flush, GET_ID and rejected requests).
    pub(super) fn total(&self) -> u64 {
        match self.op {
            Some(
                Op::Read { len, .. }
                | Op::Write { len, .. }
                | Op::WriteZeroes { len, .. }
                | Op::Discard { len, .. },
            ) => len,
            _ => 0,
        }
    }

    /// Where on the disk the request starts (0 when it has no range).
    pub(super) fn offset(&self) -> u64 {
        match self.op {
            Some(
                Op::Read { offset, .. }
                | Op::Write { offset, .. }
                | Op::WriteZeroes { offset, .. }
                | Op::Discard { offset, .. },
            ) => offset,
            _ => 0,
        }
    }

    pub(super) fn is_read(&self) -> bool {
        matches!(self.op, Some(Op::Read { .. }))
    }
}

/// What a free slot keeps for its next request: the capacity of its vectors.
#[derive(Default)]
pub(super) struct Buffers {
    iov: Vec<libc::iovec>,
    segs: Vec<Seg>,
}

pub(super) enum Slot {
    Free(Buffers),
    Busy(Request),
}

/// The slots of one queue. Indices are the engine's tokens: an index is handed out by
/// [`Slots::start`] and is valid until [`Slots::finish`].
pub(super) struct Slots {
    slots: Vec<Slot>,
    /// Free indices, the next one last.
    free: Vec<usize>,
}

impl Slots {
    pub(super) fn new(n: usize) -> Self {
        Slots {
            slots: (0..n).map(|_| Slot::Free(Buffers::default())).collect(),
            free: (0..n).rev().collect(),
        }
    }

    pub(super) fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// Requests in flight.
    pub(super) fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Puts a request popped at `head` into a free slot; None when every slot is busy.
    pub(super) fn start(&mut self, head: u16, status: u64, mem: &Arc<Mem>) -> Option<usize> {
        let idx = self.free.pop()?;
        let Slot::Free(b) = std::mem::replace(&mut self.slots[idx], Slot::Free(Buffers::default()))
        else {
            unreachable!("an index in the free list names a free slot");
        };
        self.slots[idx] = Slot::Busy(Request {
            head,
            status,
            used_len: 1,
            acct: None,
            retried: false,
            op: None,
            // Set by `dispatch` before anything is pushed; never read for a request that
            // completes at once (rejected, GET_ID, empty).
            stage: Stage::Flush,
            done: 0,
            zero_fill: false,
            bounce: None,
            iov: b.iov,
            segs: b.segs,
            mem: mem.clone(),
            started: Instant::now(),
            on_old: false,
        });
        Some(idx)
    }

    /// The request in slot `idx`, if one is there (for indices that come from outside, as
    /// an engine's completion token).
    pub(super) fn get(&self, idx: usize) -> Option<&Request> {
        match self.slots.get(idx) {
            Some(Slot::Busy(r)) => Some(r),
            _ => None,
        }
    }

    pub(super) fn get_mut(&mut self, idx: usize) -> Option<&mut Request> {
        match self.slots.get_mut(idx) {
            Some(Slot::Busy(r)) => Some(r),
            _ => None,
        }
    }

    /// Takes the request out of slot `idx` and frees the slot (keeping its buffers).
    pub(super) fn finish(&mut self, idx: usize) -> Option<Request> {
        let slot = self.slots.get_mut(idx)?;
        if !matches!(slot, Slot::Busy(_)) {
            return None;
        }
        let Slot::Busy(mut r) = std::mem::replace(slot, Slot::Free(Buffers::default())) else {
            unreachable!("checked busy above");
        };
        *slot = Slot::Free(Buffers {
            iov: std::mem::take(&mut r.iov),
            segs: std::mem::take(&mut r.segs),
        });
        self.free.push(idx);
        Some(r)
    }

    /// Every request in flight.
    pub(super) fn busy_mut(&mut self) -> impl Iterator<Item = &mut Request> {
        self.slots.iter_mut().filter_map(|s| match s {
            Slot::Busy(r) => Some(r),
            Slot::Free(_) => None,
        })
    }
}

/// The request in a slot the worker started and has not finished.
///
/// # Panics
/// When slot `idx` is free: a worker bug, as every index used this way came from
/// [`Slots::start`] and is used only until [`Slots::finish`] (indices from outside go
/// through [`Slots::get`]).
impl Index<usize> for Slots {
    type Output = Request;
    fn index(&self, idx: usize) -> &Request {
        match &self.slots[idx] {
            Slot::Busy(r) => r,
            Slot::Free(_) => panic!("slot {idx} is free"),
        }
    }
}

impl IndexMut<usize> for Slots {
    fn index_mut(&mut self, idx: usize) -> &mut Request {
        match &mut self.slots[idx] {
            Slot::Busy(r) => r,
            Slot::Free(_) => panic!("slot {idx} is free"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> Arc<Mem> {
        Arc::new(Mem::new())
    }

    #[test]
    fn a_slot_is_busy_from_start_to_finish_and_keeps_its_buffers() {
        let m = mem();
        let mut s = Slots::new(2);
        assert_eq!(s.in_flight(), 0);
        let a = s.start(7, 100, &m).expect("free slot");
        let b = s.start(8, 200, &m).expect("free slot");
        assert_ne!(a, b);
        assert!(!s.has_free());
        assert_eq!(s.start(9, 0, &m), None, "no third slot");
        assert_eq!(s.in_flight(), 2);
        assert_eq!(s[a].head, 7);
        assert!(s[a].op.is_none(), "nothing decoded yet");
        s[a].segs.reserve(64);
        let cap = s[a].segs.capacity();
        let r = s.finish(a).expect("busy");
        assert_eq!((r.head, r.status), (7, 100));
        assert!(s.get(a).is_none(), "free after finish");
        assert!(s.finish(a).is_none(), "finished once");
        assert!(s.finish(99).is_none(), "no such slot");
        assert_eq!(s.in_flight(), 1);
        let c = s.start(10, 0, &m).expect("the freed slot");
        assert_eq!(c, a);
        assert!(s[c].segs.capacity() >= cap, "buffers reused");
        assert_eq!(s.busy_mut().count(), 2);
    }
}
