//! One queue's ring and heads: what survives its context (a queue that opens again goes on
//! where it stood, and what an abandoned context left in flight completes into nothing).

use super::ring::DriverRing;
use super::shadow::RING_SIZE;

/// A discard or write-zeroes request sent in parts of at most [`MAX_DWZ_SECTORS`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dwz {
    pub(crate) typ: u32,
    pub(crate) flags: u32,
    /// The next part's first sector, and the end.
    pub(crate) next: u64,
    pub(crate) end: u64,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Busy {
    pub(crate) token: u64,
    /// The result on success (bytes for reads and writes).
    pub(crate) ok: i32,
    pub(crate) typ: u32,
    pub(crate) dwz: Option<Dwz>,
    /// A write-through write on an export whose write cache acceld cannot turn off: a
    /// FLUSH follows it on the same head.
    pub(crate) then_flush: bool,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Head {
    Free,
    Busy(Busy),
    /// Posted by a context that was dropped before it completed: freed when it does.
    Orphan,
}

/// A queue's ring and heads; moves between the session and the queue's context.
pub(crate) struct QueueState {
    pub(crate) ring: DriverRing,
    /// The export has this ring (its addresses, call and kick).
    pub(crate) started: bool,
    pub(crate) heads: Vec<Head>,
    pub(crate) free: Vec<u16>,
    /// Heads posted and not yet used.
    pub(crate) outstanding: u16,
}

impl QueueState {
    /// # Safety
    /// As [`DriverRing::new`].
    pub(crate) unsafe fn new(host: *mut u8, gpa: u64) -> QueueState {
        QueueState {
            // SAFETY: the caller's contract.
            ring: unsafe { DriverRing::new(host, gpa) },
            started: false,
            heads: vec![Head::Free; usize::from(RING_SIZE)],
            free: (0..RING_SIZE).rev().collect(),
            outstanding: 0,
        }
    }
}
