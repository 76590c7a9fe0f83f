//! The pause/drain/resume handshake between a drive (switches, the vhost-user handler) and
//! each of its queue workers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use tracing::error;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{Engine, QueueIo};
use crate::guest_mem::{Mem, MemHandle};
use crate::util::lock;

/// What a parked worker hands over: its ring, where it stopped, and the guest's eventfds.
pub struct RingLoan {
    pub index: usize,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub next_avail: u16,
    pub event_idx: bool,
    pub kick: EventFd,
    pub call: Option<EventFd>,
    pub mem: Arc<Mem>,
}

/// When the process stops waiting for drains (the shutdown bound); None while running.
static ABANDON_AT: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
/// How often a wait looks at the shutdown bound.
const ABANDON_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Bounds shutdown: after `deadline`, every wait for a queue to drain or a worker to finish
/// gives up (the process is about to exit; requests still in flight then are neither
/// completed nor failed, so the frontend resubmits them after it reconnects). Used only when
/// acceld stops.
pub fn abandon_drains_at(deadline: Instant) {
    *lock(&ABANDON_AT) = Some(deadline);
}

fn abandon_deadline() -> Option<Instant> {
    *lock(&ABANDON_AT)
}

/// The control side of a worker, shared with the vhost-user handler and with engine switches.
pub struct QueueCtl {
    index: usize,
    depth: u32,
    /// Readable when the control state changed (the worker watches it in its epoll set).
    pub(crate) wake: EventFd,
    /// Set with every poke, so that a polling worker sees it without a system call.
    pub(crate) pending: AtomicBool,
    pub(crate) st: Mutex<CtlState>,
    /// Signalled by the worker when it drained or exited.
    pub(crate) cv: Condvar,
    /// The guest memory map the worker uses (for a lend's memory table).
    pub(crate) mem: MemHandle,
}

/// A queue's context on an engine, and the engine.
pub type NextEngine = (Box<dyn QueueIo>, Arc<dyn Engine>);

#[derive(Default)]
pub(crate) struct CtlState {
    pub(crate) pause: bool,
    pub(crate) stop: bool,
    /// The worker saw the pause or stop and has nothing in flight.
    pub(crate) drained: bool,
    pub(crate) exited: bool,
    pub(crate) next: Option<NextEngine>,
    /// Retry the held requests now (an operator's resume).
    pub(crate) retry: bool,
    /// Take new requests on this engine at once; the ones in flight finish on the old one
    /// (an overlapped switch, see `Drive::swap_engine`).
    pub(crate) swap: Option<NextEngine>,
    /// The worker took the swap: nothing new goes to the old engine.
    pub(crate) swapped: bool,
    /// Nothing is in flight on the old engine any more (the worker dropped its context).
    pub(crate) old_drained: bool,
    /// How long the worker took no requests while it took the swap.
    pub(crate) swap_took: std::time::Duration,
    /// Park and describe the ring for a lend (the worker is paused and drained).
    pub(crate) lend: bool,
    /// The worker's answer to `lend`: its ring, or why it cannot park.
    pub(crate) loan: Option<Result<RingLoan, String>>,
    /// The worker is parked: its ring is lent.
    pub(crate) lent: bool,
    /// Take the ring back: at this next avail index (the export's), or (None) where the
    /// queue stood, for a ring that never reached the export.
    pub(crate) reclaim: Option<Option<u16>>,
}

impl QueueCtl {
    pub(crate) fn new(index: usize, depth: u32, mem: MemHandle) -> std::io::Result<Self> {
        Ok(QueueCtl {
            index,
            depth,
            mem,
            wake: EventFd::new(EFD_NONBLOCK)?,
            pending: AtomicBool::new(false),
            st: Mutex::new(CtlState::default()),
            cv: Condvar::new(),
        })
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// The guest memory of the queue's session.
    pub fn mem(&self) -> &MemHandle {
        &self.mem
    }

    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Relaxed)
    }

    pub(crate) fn poke(&self) {
        self.pending.store(true, Ordering::Relaxed);
        if let Err(e) = self.wake.write(1) {
            error!(queue = self.index, "cannot wake worker: {e}");
        }
    }

    /// Stop popping new requests; in-flight ones go on to completion.
    pub fn request_pause(&self) {
        let mut st = lock(&self.st);
        st.pause = true;
        st.drained = false;
        drop(st);
        self.poke();
    }

    /// Waits until the worker is paused with nothing in flight (or has exited).
    pub fn wait_drained(&self, deadline: Instant) -> bool {
        self.wait_for(Some(deadline), |st| st.drained || st.exited)
    }

    /// Waits until the worker thread has finished (after [`QueueCtl::request_stop`]); false
    /// when the process gave up on drains first ([`abandon_drains_at`]).
    pub fn wait_exited(&self) -> bool {
        self.wait_for(None, |st| st.exited)
    }

    /// Waits for `done` until `deadline` (None: no deadline of its own) or the process-wide
    /// shutdown bound, whichever comes first.
    fn wait_for(&self, deadline: Option<Instant>, done: impl Fn(&CtlState) -> bool) -> bool {
        let mut st = lock(&self.st);
        while !done(&st) {
            let now = Instant::now();
            let end = match (deadline, abandon_deadline()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if end.is_some_and(|e| now >= e) {
                return false;
            }
            // Wake up now and then: the shutdown bound may be set while we wait.
            let slice = end.map_or(ABANDON_POLL, |e| (e - now).min(ABANDON_POLL));
            st = self
                .cv
                .wait_timeout(st, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Ends a pause, on a new engine context when `next` is given.
    pub fn resume(&self, next: Option<NextEngine>) {
        let mut st = lock(&self.st);
        st.pause = false;
        st.drained = false;
        st.next = next;
        drop(st);
        self.poke();
    }

    /// New requests go to `next` from now on; those in flight finish where they are.
    pub fn request_swap(&self, next: NextEngine) {
        let mut st = lock(&self.st);
        st.swap = Some(next);
        st.swapped = false;
        st.old_drained = false;
        drop(st);
        self.poke();
    }

    /// Waits until the worker took the swap (or has exited).
    pub fn wait_swapped(&self, deadline: Instant) -> bool {
        self.wait_for(Some(deadline), |st| st.swapped || st.exited)
    }

    /// How long the worker stopped taking requests for the last swap (zero if it has not
    /// taken one).
    pub fn swap_took(&self) -> std::time::Duration {
        lock(&self.st).swap_took
    }

    /// Waits until the worker's requests on the old engine have all completed (or it exited).
    pub fn wait_old_drained(&self, deadline: Instant) -> bool {
        self.wait_for(Some(deadline), |st| st.old_drained || st.exited)
    }

    /// Asks the worker to park for a lend and describe its ring once it is paused with
    /// nothing in flight: set before the pause, so that one wake-up does both.
    pub(crate) fn ask_lend(&self) {
        let mut st = lock(&self.st);
        st.lend = true;
        st.loan = None;
    }

    /// The parked worker's ring, or None when it could not park by `deadline` (it is then
    /// parked or not; [`QueueCtl::request_reclaim`] undoes either).
    pub(crate) fn wait_loan(&self, deadline: Instant) -> Option<RingLoan> {
        if !self.wait_for(Some(deadline), |st| st.loan.is_some() || st.exited) {
            return None;
        }
        match lock(&self.st).loan.take() {
            Some(Ok(l)) => Some(l),
            Some(Err(why)) => {
                error!(queue = self.index, "cannot park for a lend: {why}");
                None
            }
            None => None,
        }
    }

    /// Gives a parked worker its ring back at `next_avail` (None: where it stood), and
    /// withdraws a lend it was asked for; it stays paused.
    pub(crate) fn request_reclaim(&self, next_avail: Option<u16>) {
        let mut st = lock(&self.st);
        st.lend = false;
        st.reclaim = Some(next_avail);
        drop(st);
        self.poke();
    }

    /// Waits until the worker took its ring back (or exited).
    pub(crate) fn wait_reclaimed(&self, deadline: Instant) -> bool {
        self.wait_for(Some(deadline), |st| {
            (!st.lent && st.reclaim.is_none()) || st.exited
        })
    }

    /// Marks a worker that has not started yet as paused from its first moment.
    pub(crate) fn start_paused(&self) {
        let mut st = lock(&self.st);
        st.pause = true;
        st.drained = false;
    }

    /// Retries the worker's held requests now.
    pub fn request_retry(&self) {
        lock(&self.st).retry = true;
        self.poke();
    }

    pub(crate) fn request_stop(&self) {
        lock(&self.st).stop = true;
        self.poke();
    }
}
