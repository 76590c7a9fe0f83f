//! The queue worker: one thread per virtqueue.
//!
//! ```text
//! kick eventfd ──► pop every available chain ──► split/validate ──► engine.push (no syscall)
//!                                                                  └─► one submit per batch
//! engine completion fd ──► reap every completion ──► status byte, used ring ──► one call per batch
//! control eventfd ──► pause (drain) / resume on another engine / stop (drain, hand the ring back)
//! ```
//!
//! Guest input is hostile: chains are split by `virtio_blk::split_chain` into bounded vectors,
//! every guest range is mapped through `vm-memory` (out-of-range -> IOERR), and nothing is
//! allocated with a size the guest chose. Buffers that O_DIRECT cannot use (misaligned) go
//! through a fixed per-queue bounce pool, chunk by chunk.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, warn};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::drive::{Drive, NextEngine, QueueCtl};
use crate::engine::{Engine, QueueIo};
use crate::guest_mem::dirty_log::DirtyLog;
use crate::guest_mem::{Mem, MemHandle};
use crate::queue::inflight::InflightQueue;
use crate::util::lock;

mod bounce;
mod request;

use crate::virtio_blk::{self, Layout};
use bounce::BouncePool;
use request::InFlight;

/// The call eventfd, which the frontend may replace while the queue runs.
pub type CallHandle = Arc<Mutex<Option<EventFd>>>;

/// Most data segments (descriptor pieces) one request may have. seg_max is 126; indirect
/// tables may hold more, up to this bound; longer requests get IOERR.
pub const MAX_SEGS: usize = 1024;

/// Most requests one `process_avail` pops before the worker notifies the driver and checks
/// its other events.
const BATCH_BUDGET: usize = 64;
/// A queue that ran this long without sleeping yields the CPU once (see `Worker::share_cpu`).
const YIELD_AFTER: Duration = Duration::from_micros(50);
/// A polling queue that found nothing for this long yields the CPU (cheap when nobody else
/// wants it).
const IDLE_YIELD_AFTER: Duration = Duration::from_micros(4);
/// An epoll wait at least this long is taken as a sleep (the CPU was given up).
const SLEPT: Duration = Duration::from_micros(5);

const TOKEN_KICK: u64 = 0;
const TOKEN_IO: u64 = 1;
const TOKEN_CTL: u64 = 2;
/// The completion fd of the engine an overlapped switch left (its requests finish there).
const TOKEN_IO_OLD: u64 = 3;

/// What the worker does with its ring: the drive's pause, lend and stop requests
/// (`QueueCtl`) move it from one to the next.
///
/// ```text
/// Running ──pause──► Pausing ──nothing in flight: ack──► Paused ──lend──► Lent
///    ▲                  ▲                                  │  ▲            │
///    └──────resume──────┴──────────────────────────────────┘  └──reclaim───┘
/// any ──stop──► Stopping ──nothing in flight: ack──► the thread ends
/// ```
///
/// A ring the driver corrupted is not a mode: a broken queue still pauses, drains, is lent
/// (never: nothing of it is popped) and stops as any other; it only pops nothing more
/// (`Worker::broken`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Pops and serves.
    Running,
    /// A pause was asked: nothing more is popped; acknowledged once nothing is in flight.
    Pausing,
    /// Paused and acknowledged: nothing in flight.
    Paused,
    /// Paused with the ring lent to QEMU's export: the kick eventfd is not watched and the
    /// ring is not touched until it comes back (see `drive::lend`); a resume waits for the
    /// take-back.
    Lent,
    /// A stop was asked: the worker ends once nothing is in flight.
    Stopping,
}

/// The engine before an overlapped switch, while requests popped before it finish there.
struct OldIo {
    io: Box<dyn QueueIo>,
    engine: Arc<dyn Engine>,
    /// Requests still on it (slots marked `on_old`).
    in_flight: usize,
}

/// A running worker. [`WorkerHandle::stop`] drains it and gives the ring back.
pub struct WorkerHandle {
    ctl: Arc<QueueCtl>,
    thread: JoinHandle<Queue>,
}

impl WorkerHandle {
    /// Stops popping, waits until every popped request has completed and is in the used
    /// ring, and returns the queue (its `next_avail` is then exact: nothing to replay). None
    /// when the worker panicked, or when acceld is shutting down and the bound passed with
    /// requests still in flight (the thread is left to the process exit).
    pub fn stop(self) -> Option<Queue> {
        self.ctl.request_stop();
        if !self.ctl.wait_exited() {
            error!(
                queue = self.ctl.index(),
                "queue did not drain within the shutdown bound; its requests in flight are left to the frontend"
            );
            return None;
        }
        match self.thread.join() {
            Ok(q) => Some(q),
            Err(_) => {
                error!(queue = self.ctl.index(), "queue worker panicked");
                None
            }
        }
    }

    pub fn ctl(&self) -> &Arc<QueueCtl> {
        &self.ctl
    }
}

pub struct WorkerParams {
    pub drive: Arc<Drive>,
    pub index: usize,
    pub queue: Queue,
    pub mem: MemHandle,
    pub kick: EventFd,
    pub call: CallHandle,
    /// The vring's error eventfd (SET_VRING_ERR), signalled when the ring is found broken.
    pub err: CallHandle,
    /// This queue's part of the inflight region (INFLIGHT_SHMFD), when the frontend set one.
    pub inflight: Option<InflightQueue>,
    /// Heads the previous backend left in flight, oldest first: started before anything else.
    pub resubmit: Vec<u16>,
    /// The connection's dirty log (live migration).
    pub log: Arc<DirtyLog>,
    /// Where the used ring is logged (`log_guest_addr` of SET_VRING_ADDR with F_LOG), or
    /// [`NO_USED_LOG`]. Changed while the worker runs.
    pub used_log: Arc<AtomicU64>,
}

/// `used_log` when the ring's used ring is not logged (no VHOST_VRING_F_LOG).
pub const NO_USED_LOG: u64 = u64::MAX;

/// A ring the driver corrupted: the queue stops (QEMU's `virtio_error` marks the device
/// broken for the same cases in `virtqueue_pop`).
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("the avail index moved from {next} to {avail}, more than the queue size {size}")]
    AvailIndex { next: u16, avail: u16, size: u16 },
    #[error("the driver says descriptor {head} is available; the queue has {size}")]
    Head { head: u16, size: u16 },
    #[error("cannot access the ring in guest memory ({0})")]
    Access(String),
    /// The avail index moves with the device's own writes (rings that overlap): re-checking
    /// it after re-enabling notifications would never end.
    #[error(
        "the avail index changes under the device's own notification writes (overlapping rings)"
    )]
    Unstable,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot create the worker's eventfd or epoll set")]
    Setup(#[source] std::io::Error),
    #[error("the engine could not open queue {0}")]
    Engine(usize, #[source] crate::engine::EngineError),
    #[error("cannot spawn the thread of queue {0}")]
    Spawn(usize, #[source] std::io::Error),
}

/// Starts the worker thread of one queue.
pub fn spawn(p: WorkerParams) -> Result<WorkerHandle, WorkerError> {
    let depth = u32::from(p.queue.size());
    let ctl = Arc::new(QueueCtl::new(p.index, depth, p.mem.clone()).map_err(WorkerError::Setup)?);
    let (io, engine) = p
        .drive
        .attach_worker(&ctl, depth)
        .map_err(|e| WorkerError::Engine(p.index, e))?;
    let epoll = Epoll::new().map_err(WorkerError::Setup)?;
    let add = |fd, token| {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    };
    let setup = add(p.kick.as_raw_fd(), TOKEN_KICK)
        .and_then(|_| add(io.completion_fd(), TOKEN_IO))
        .and_then(|_| add(ctl.wake.as_raw_fd(), TOKEN_CTL));
    if let Err(e) = setup {
        p.drive.detach_worker(&ctl);
        return Err(WorkerError::Setup(e));
    }
    let ctl2 = ctl.clone();
    let name = format!("{}-q{}", p.drive.config().name, p.index);
    let drive = p.drive.clone();
    let thread = std::thread::Builder::new()
        .name(name.chars().take(15).collect())
        .spawn(move || {
            let mut w = Worker::new(p, ctl2, io, engine, epoll);
            w.run();
            w.finish()
        });
    match thread {
        Ok(thread) => Ok(WorkerHandle { ctl, thread }),
        Err(e) => {
            drive.detach_worker(&ctl);
            Err(WorkerError::Spawn(ctl.index(), e))
        }
    }
}

/// How long a worker busy-polls before sleeping, adapted like QEMU's event loop
/// (`poll-max-ns`, `poll-grow`, `poll-shrink`): a wait that polling would have caught (shorter
/// than the maximum) doubles the window, starting at 4 µs; a longer wait means the queue went
/// idle and turns polling off until waits are short again. An idle drive costs nothing, a
/// steady low-depth stream never sleeps between requests.
#[derive(Debug)]
struct AdaptivePoll {
    max: Duration,
    window: Duration,
}

impl AdaptivePoll {
    const START: Duration = Duration::from_micros(4);

    fn new(max_us: u32) -> Self {
        AdaptivePoll {
            max: Duration::from_micros(u64::from(max_us)),
            window: Duration::ZERO,
        }
    }

    /// After a sleep: `waited` is the time from when polling started to the wake-up.
    fn adapt(&mut self, waited: Duration) {
        if self.max.is_zero() || waited <= self.window {
            return;
        }
        if waited > self.max {
            self.window = Duration::ZERO;
        } else if self.window < self.max {
            self.window = (self.window * 2).max(Self::START).min(self.max);
        }
    }
}

struct Worker {
    drive: Arc<Drive>,
    index: usize,
    queue: Queue,
    mem: MemHandle,
    kick: EventFd,
    call: CallHandle,
    err: CallHandle,
    inflight: Option<InflightQueue>,
    /// The order of the next popped request (inflight tracking).
    inflight_counter: u64,
    resubmit: Vec<u16>,
    log: Arc<DirtyLog>,
    used_log: Arc<AtomicU64>,
    /// The driver corrupted the ring: nothing more is popped until the frontend resets the
    /// queue (a new worker). Requests already popped complete.
    broken: bool,
    /// Requests held after an error their policy holds (werror=enospc, stop): still in
    /// flight, retried every HOLD_RETRY or on request, in their order.
    held: VecDeque<usize>,
    /// Held requests resubmitted by a retry and not finished yet.
    retrying: usize,
    next_retry: Option<Instant>,
    /// Requests were held: once the last one went through, take new ones again.
    was_holding: bool,
    ctl: Arc<QueueCtl>,
    io: Box<dyn QueueIo>,
    engine: Arc<dyn Engine>,
    /// The engine an overlapped switch left, until its last request completed.
    old: Option<OldIo>,
    /// A swap that came while `old` still had requests (the drive never sends one): taken
    /// when `old` retires, so no old engine is dropped with requests on it.
    pending_swap: Option<NextEngine>,
    epoll: Epoll,
    slots: Vec<InFlight>,
    free: Vec<usize>,
    in_flight: usize,
    layout: Layout,
    /// The type in the last decoded request header (for accounting a rejected request).
    req_type: Option<u32>,
    completions: Vec<(u64, i32)>,
    bounce: BouncePool,
    bounce_wait: VecDeque<usize>,
    id: [u8; virtio_blk::ID_BYTES],
    mode: Mode,
    /// The next batch interrupts the driver whatever EVENT_IDX says (after a lend, the
    /// notification state the queue kept is stale).
    force_call: bool,
    /// Stopped popping because no slot was free.
    starved: bool,
    used_added: bool,
    poll: AdaptivePoll,
    /// Inside `poll`: guest notifications stay off.
    polling: bool,
    /// Since when this worker has run without sleeping or yielding.
    on_cpu_since: Instant,
    /// `process_avail` stopped at its budget with requests left in the ring.
    backlog: bool,
}

impl Worker {
    fn new(
        p: WorkerParams,
        ctl: Arc<QueueCtl>,
        io: Box<dyn QueueIo>,
        engine: Arc<dyn Engine>,
        epoll: Epoll,
    ) -> Self {
        let n = usize::from(p.queue.size()).max(1);
        let id = virtio_blk::id_bytes(&p.drive.config().serial);
        let poll = AdaptivePoll::new(p.drive.config().poll_us);
        let mode = if lock(&ctl.st).pause {
            Mode::Pausing
        } else {
            Mode::Running
        };
        Worker {
            index: p.index,
            drive: p.drive,
            queue: p.queue,
            mem: p.mem,
            kick: p.kick,
            call: p.call,
            err: p.err,
            inflight_counter: p.inflight.as_ref().map_or(0, InflightQueue::next_counter),
            inflight: p.inflight,
            resubmit: p.resubmit,
            log: p.log,
            used_log: p.used_log,
            broken: false,
            held: VecDeque::new(),
            retrying: 0,
            next_retry: None,
            was_holding: false,
            ctl,
            io,
            engine,
            old: None,
            pending_swap: None,
            epoll,
            slots: (0..n).map(|_| InFlight::new()).collect(),
            free: (0..n).rev().collect(),
            in_flight: 0,
            layout: Layout::with_capacity(MAX_SEGS),
            req_type: None,
            completions: Vec::with_capacity(n),
            bounce: BouncePool {
                bufs: Vec::new(),
                free: Vec::new(),
            },
            bounce_wait: VecDeque::new(),
            id,
            mode,
            force_call: false,
            starved: false,
            used_added: false,
            poll,
            polling: false,
            on_cpu_since: Instant::now(),
            backlog: false,
        }
    }

    fn run(&mut self) {
        self.resubmit_inflight();
        // The frontend may have queued requests (and kicked) before this worker existed.
        self.process_avail();
        self.notify();
        // A previous server may have put completions in the used ring and died before its
        // interrupt (a SIGKILL between the used index and the call): the driver reads the
        // used ring only when interrupted, so without one it would wait forever (seen: a
        // guest stuck after one of twenty kills). One interrupt at every start; a spurious
        // one only makes the driver look at the ring.
        self.call_unconditionally();
        let mut events = vec![EpollEvent::default(); 8];
        loop {
            if matches!(self.mode, Mode::Pausing | Mode::Stopping) && self.in_flight == 0 {
                if self.mode == Mode::Pausing {
                    self.mode = Mode::Paused;
                    // A lend asked with the pause parks before the acknowledgement.
                    self.maybe_park();
                }
                self.ack_drained();
                if self.mode == Mode::Stopping {
                    return;
                }
            }
            let waiting_since = Instant::now();
            self.share_cpu(waiting_since, YIELD_AFTER);
            if self.backlog && self.mode == Mode::Running {
                self.process_avail();
                self.notify();
                continue;
            }
            if !self.poll.window.is_zero() && self.mode == Mode::Running && self.poll() {
                // Work came within the window: go on polling.
                continue;
            }
            let before_wait = Instant::now();
            // Held requests are retried on a timer: sleep no longer than the next retry.
            let timeout = self.next_retry.map_or(-1, |t| {
                t.saturating_duration_since(before_wait)
                    .as_millis()
                    .min(1000) as i32
            });
            let n = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    error!(queue = self.index, "epoll failed: {e}");
                    return;
                }
            };
            let woke = Instant::now();
            self.poll.adapt(woke - waiting_since);
            if woke - before_wait >= SLEPT {
                self.on_cpu_since = woke;
            }
            for ev in &events[..n] {
                match ev.data() {
                    // A kick event from the same wait as the control event that parked
                    // the queue: the kick eventfd is the export's now (reading it would
                    // take a kick from it; QEMU's export panics on an empty read).
                    TOKEN_KICK if self.mode == Mode::Lent => {}
                    TOKEN_KICK => {
                        let _ = self.kick.read();
                        self.process_avail();
                    }
                    TOKEN_IO | TOKEN_IO_OLD => self.reap(),
                    TOKEN_CTL => {
                        let _ = self.ctl.wake.read();
                        self.control();
                    }
                    _ => {}
                }
            }
            if self.next_retry.is_some_and(|t| Instant::now() >= t) {
                self.retry_held();
            }
            if self.was_holding && !self.holding() {
                // Every held request went through: take the ones that waited behind them.
                self.was_holding = false;
                self.process_avail();
            }
            self.notify();
        }
    }

    /// Busy-polls the avail ring and the engine's completions for up to the current window,
    /// with guest notifications (kicks) off, handling whatever it finds in batches: every
    /// request available at once, then one submission, one reap of every completion, one
    /// call. Returns whether it found work (the caller polls again) or not (the caller
    /// sleeps; notifications are on again and the ring was checked once more).
    fn poll(&mut self) -> bool {
        let mem = self.memory();
        let t0 = Instant::now();
        let mut spins = 0u32;
        self.polling = true;
        let found = loop {
            let mut busy = false;
            if self.io.has_completions()
                || self.old.as_mut().is_some_and(|o| o.io.has_completions())
            {
                self.reap();
                busy = true;
            }
            if !self.free.is_empty() && self.avail_pending(&mem) {
                self.process_avail();
                busy = true;
            }
            if busy {
                self.notify();
                break true;
            }
            spins = spins.wrapping_add(1);
            if spins % 32 == 0 {
                let now = Instant::now();
                if self.ctl.pending() || now - t0 >= self.poll.window {
                    break false;
                }
                // Idle: another queue's worker on this core may have work; let it in soon.
                self.share_cpu(now, IDLE_YIELD_AFTER);
            }
            std::hint::spin_loop();
        };
        self.polling = false;
        if !found {
            // Back to sleeping: notifications on, and whatever came in meanwhile is handled.
            self.process_avail();
            self.notify();
        }
        found
    }

    /// Lets the other threads of this core run once this worker has been `after` on the CPU
    /// without a sleep ([`YIELD_AFTER`] when working, [`IDLE_YIELD_AFTER`] when only
    /// spinning). A busy queue (polling, or always finding more work) never sleeps; without
    /// this, two such queues on one core would take turns of a whole scheduler slice (4 ms of
    /// latency for the waiting one), and a polling queue would delay any other thread there.
    fn share_cpu(&mut self, now: Instant, after: Duration) {
        if now - self.on_cpu_since >= after {
            std::thread::yield_now();
            self.on_cpu_since = Instant::now();
        }
    }

    /// Whether the driver has made requests available that were not popped yet (never for a
    /// broken ring: nothing more is popped from it).
    fn avail_pending(&self, mem: &Mem) -> bool {
        !self.broken
            && !self.holding()
            && self
                .queue
                .avail_idx(mem, Ordering::Acquire)
                .is_ok_and(|a| a.0 != self.queue.next_avail())
    }

    /// The next available chain, checked as QEMU's `virtqueue_pop` checks it: the avail index
    /// may run ahead of what was popped by at most the queue size, and the head must name a
    /// descriptor of the table. Either violation is a broken ring, not a bad request.
    fn pop<'m>(&mut self, mem: &'m Mem) -> Result<Option<DescriptorChain<&'m Mem>>, RingError> {
        let size = self.queue.size();
        let next = self.queue.next_avail();
        let avail = self
            .queue
            .avail_idx(mem, Ordering::Acquire)
            .map_err(|e| RingError::Access(e.to_string()))?
            .0;
        let pending = avail.wrapping_sub(next);
        if pending == 0 {
            return Ok(None);
        }
        if pending > size {
            return Err(RingError::AvailIndex { next, avail, size });
        }
        let chain = self
            .queue
            .iter(mem)
            .map_err(|e| RingError::Access(e.to_string()))?
            .next()
            .ok_or_else(|| RingError::Access("the avail ring entry is unreadable".into()))?;
        if chain.head_index() >= size {
            return Err(RingError::Head {
                head: chain.head_index(),
                size,
            });
        }
        Ok(Some(chain))
    }

    /// Starts the requests a previous backend left in flight, in their order, before popping
    /// anything new (they precede every request still in the avail ring).
    fn resubmit_inflight(&mut self) {
        let heads = std::mem::take(&mut self.resubmit);
        if heads.is_empty() {
            return;
        }
        let mem = self.memory();
        let table = self.queue.desc_table();
        let size = self.queue.size();
        // At most one mark per descriptor of this ring (`InflightQueue::start`), and a worker
        // has a slot per descriptor: every resubmitted request gets one.
        for head in heads {
            let descs = crate::queue::inflight::chain_at(&mem, table, size, head);
            self.start_request(head, descs.into_iter(), &mem);
        }
        self.submit();
    }

    /// Whether the queue holds requests (held, or resubmitted by a retry): it takes no new
    /// ones meanwhile, so nothing queued behind a held write overtakes it.
    fn holding(&self) -> bool {
        !self.held.is_empty() || self.retrying > 0
    }

    /// Resubmits every held request, in order; one that fails again is held again.
    fn retry_held(&mut self) {
        self.next_retry = None;
        let held = std::mem::take(&mut self.held);
        self.drive
            .stats
            .held_requests
            .fetch_sub(held.len() as u64, Ordering::Relaxed);
        for idx in held {
            self.retrying += 1;
            self.redo(idx);
        }
        self.submit();
    }

    /// Stops taking requests from a corrupt ring: one log line, the vring's error eventfd
    /// (QEMU learns of it), status and metrics. Requests already popped still complete;
    /// a frontend reset or reconnect starts a fresh worker.
    pub(super) fn mark_broken(&mut self, why: &RingError) {
        if self.broken {
            return;
        }
        self.broken = true;
        let stats = &self.drive.stats;
        stats.broken_queues.fetch_add(1, Ordering::Relaxed);
        stats.ring_errors.fetch_add(1, Ordering::Relaxed);
        *lock(&stats.last_ring_error) = Some(format!("queue {}: {why}", self.index));
        if let Some(n) = stats.log.ring.admit() {
            error!(drive = %self.drive.config().name, queue = self.index,
                "ring broken: {why}; the queue stops until the driver resets it{}",
                crate::util::suppressed(n));
        }
        if let Some(e) = lock(&self.err).as_ref() {
            let _ = e.write(1);
        }
    }

    fn finish(self) -> Queue {
        self.drive.detach_worker(&self.ctl);
        if self.broken {
            self.drive
                .stats
                .broken_queues
                .fetch_sub(1, Ordering::Relaxed);
        }
        let mut st = lock(&self.ctl.st);
        st.exited = true;
        self.ctl.cv.notify_all();
        drop(st);
        self.queue
    }

    fn control(&mut self) {
        self.control_requests();
        self.maybe_park();
    }

    /// Tells the drive that nothing is in flight (a pause's or a stop's acknowledgement).
    fn ack_drained(&self) {
        let mut st = lock(&self.ctl.st);
        st.drained = true;
        self.ctl.cv.notify_all();
    }

    /// A lend asked (with the pause that precedes it) and the queue paused with nothing in
    /// flight: park now, in the same wake-up as the pause's acknowledgement.
    fn maybe_park(&mut self) {
        let ready = self.mode == Mode::Paused && self.in_flight == 0 && self.old.is_none();
        if !ready || !std::mem::take(&mut lock(&self.ctl.st).lend) {
            return;
        }
        let loan = self.park();
        let mut st = lock(&self.ctl.st);
        st.lent = loan.is_ok();
        st.loan = Some(loan);
        self.ctl.cv.notify_all();
    }

    fn control_requests(&mut self) {
        self.ctl.pending.store(false, Ordering::Relaxed);
        let mut st = lock(&self.ctl.st);
        if st.stop {
            self.mode = Mode::Stopping;
        }
        if let Some(base) = st.reclaim.take() {
            st.lend = false;
            drop(st);
            if self.mode == Mode::Lent {
                self.unpark(base);
            }
            st = lock(&self.ctl.st);
            st.lent = false;
            self.ctl.cv.notify_all();
        }
        if let Some((io, engine)) = st.swap.take() {
            drop(st);
            let t = Instant::now();
            let idle = self.swap_engine(io, engine);
            let took = t.elapsed();
            st = lock(&self.ctl.st);
            st.swap_took = took;
            st.swapped = true;
            st.old_drained = self.old.is_none();
            self.ctl.cv.notify_all();
            drop(st);
            // Requests that came meanwhile, on the new engine; then the old context goes.
            self.process_avail();
            drop(idle);
            st = lock(&self.ctl.st);
        }
        if std::mem::take(&mut st.retry) && !self.held.is_empty() {
            drop(st);
            self.retry_held();
            st = lock(&self.ctl.st);
        }
        if st.pause && !st.drained {
            // A new pause request (also while already paused, e.g. held): acknowledge it
            // again once nothing is in flight.
            match self.mode {
                Mode::Running | Mode::Pausing | Mode::Paused => self.mode = Mode::Pausing,
                // Nothing is in flight on a lent ring.
                Mode::Lent => {
                    st.drained = true;
                    self.ctl.cv.notify_all();
                }
                // Acknowledged with the stop.
                Mode::Stopping => {}
            }
        }
        if !st.pause && matches!(self.mode, Mode::Pausing | Mode::Paused) {
            self.mode = Mode::Running;
            let next = st.next.take();
            drop(st);
            if let Some((io, engine)) = next {
                drop(self.replace_engine(io, engine));
            }
            self.process_avail();
        }
    }

    /// Parks the (paused, drained) queue for a lend: `avail_event` is set to the next avail
    /// index (with EVENT_IDX, the export's progress is read from it), the kick eventfd leaves
    /// the epoll set, and the ring is described with copies of the guest's eventfds.
    fn park(&mut self) -> Result<crate::drive::lend::RingLoan, String> {
        let mem = self.memory();
        let kick = self
            .kick
            .try_clone()
            .map_err(|e| format!("kick eventfd: {e}"))?;
        let call = match lock(&self.call).as_ref() {
            Some(c) => Some(c.try_clone().map_err(|e| format!("call eventfd: {e}"))?),
            None => None,
        };
        if self.queue.event_idx_enabled() {
            self.queue
                .enable_notification(&*mem)
                .map_err(|e| format!("avail_event: {e}"))?;
        }
        self.epoll
            .ctl(
                ControlOperation::Delete,
                self.kick.as_raw_fd(),
                EpollEvent::default(),
            )
            .map_err(|e| format!("epoll: {e}"))?;
        self.mode = Mode::Lent;
        Ok(crate::drive::lend::RingLoan {
            index: self.index,
            size: self.queue.size(),
            desc: self.queue.desc_table(),
            avail: self.queue.avail_ring(),
            used: self.queue.used_ring(),
            next_avail: self.queue.next_avail(),
            event_idx: self.queue.event_idx_enabled(),
            kick,
            call,
            mem,
        })
    }

    /// Takes the ring back from a lend at `next_avail` (the export's base; None: the ring
    /// never reached the export, the queue's own positions stand): the used index is read
    /// from the ring, the kick eventfd is watched again, and the driver is interrupted once
    /// (the export may have completed requests without an interrupt the driver still waits
    /// for; a spurious one is harmless).
    fn unpark(&mut self, next_avail: Option<u16>) {
        if let Some(next_avail) = next_avail {
            let mem = self.memory();
            self.queue.set_next_avail(next_avail);
            match self.queue.used_idx(&*mem, Ordering::Acquire) {
                Ok(u) => {
                    self.queue.set_next_used(u.0);
                    if let Some(iq) = &self.inflight {
                        iq.resync(u.0);
                    }
                }
                Err(e) => self.mark_broken(&RingError::Access(e.to_string())),
            }
        }
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            self.kick.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_KICK),
        ) {
            error!(
                queue = self.index,
                "cannot watch the kick eventfd again: {e}"
            );
        }
        self.mode = Mode::Paused;
        self.force_call = true;
        self.call_unconditionally();
    }

    /// An overlapped switch: new requests go to `io` at once, the ones in flight finish on
    /// the engine they started on (virtio-blk orders nothing between requests in flight),
    /// which the worker drops after their last completion (`retire_old`).
    /// Returns the old context when nothing was in flight on it, to be dropped after the
    /// swap is acknowledged (its teardown is no part of the pause).
    fn swap_engine(&mut self, io: Box<dyn QueueIo>, engine: Arc<dyn Engine>) -> Option<NextEngine> {
        if self.old.is_some() {
            error!(
                queue = self.index,
                "engine swap while the last one still finishes; taken after it"
            );
            self.pending_swap = Some((io, engine));
            return None;
        }
        if self.in_flight == 0 {
            return Some(self.replace_engine(io, engine));
        }
        for s in self.slots.iter_mut().filter(|s| s.mem.is_some()) {
            s.on_old = true;
        }
        self.drive.stats.overlapped.fetch_add(1, Ordering::Relaxed);
        let _ = self.epoll.ctl(
            ControlOperation::Modify,
            self.io.completion_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_IO_OLD),
        );
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            io.completion_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_IO),
        ) {
            error!(queue = self.index, "cannot watch the new engine: {e}");
        }
        self.old = Some(OldIo {
            io: std::mem::replace(&mut self.io, io),
            engine: std::mem::replace(&mut self.engine, engine),
            in_flight: self.in_flight,
        });
        None
    }

    /// The old engine's last request completed: its context goes, the switch learns it.
    pub(super) fn retire_old(&mut self) {
        if let Some(o) = self.old.take() {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                o.io.completion_fd(),
                EpollEvent::default(),
            );
            drop(o);
            if let Some((io, engine)) = self.pending_swap.take() {
                drop(self.swap_engine(io, engine));
            }
            let mut st = lock(&self.ctl.st);
            st.old_drained = self.old.is_none();
            self.ctl.cv.notify_all();
        }
    }

    /// The engine a request runs on: the old one for requests started before an overlapped
    /// switch.
    pub(super) fn engine_of(&self, idx: usize) -> &Arc<dyn Engine> {
        match &self.old {
            Some(o) if self.slots[idx].on_old => &o.engine,
            _ => &self.engine,
        }
    }

    /// Puts `io` in place of the current context (nothing in flight); returns the old one,
    /// for the caller to drop when it suits (tearing an io_uring ring down takes time).
    fn replace_engine(
        &mut self,
        io: Box<dyn QueueIo>,
        engine: Arc<dyn Engine>,
    ) -> (Box<dyn QueueIo>, Arc<dyn Engine>) {
        debug_assert_eq!(self.in_flight, 0);
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            self.io.completion_fd(),
            EpollEvent::default(),
        );
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            io.completion_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_IO),
        ) {
            error!(queue = self.index, "cannot watch the new engine: {e}");
        }
        (
            std::mem::replace(&mut self.io, io),
            std::mem::replace(&mut self.engine, engine),
        )
    }

    fn memory(&self) -> Arc<Mem> {
        lock(&self.mem).clone()
    }

    /// Pops every available request (while slots are free), starts them, submits once per
    /// pass. Leaves guest notifications on (unless polling), after checking the ring again.
    fn process_avail(&mut self) {
        if self.mode != Mode::Running || self.broken || self.holding() {
            return;
        }
        let mem = self.memory();
        self.starved = false;
        self.backlog = false;
        let mut budget = BATCH_BUDGET;
        // Times the ring said "more" after notifications were re-enabled and then had
        // nothing to pop: a real driver races us a few times at most.
        let mut empty_rechecks = 0;
        loop {
            if let Err(e) = self.queue.disable_notification(&*mem) {
                return self.mark_broken(&RingError::Access(e.to_string()));
            }
            let mut emptied = false;
            while !self.free.is_empty() && budget > 0 {
                let chain = match self.pop(&mem) {
                    Ok(Some(c)) => {
                        empty_rechecks = 0;
                        c
                    }
                    Ok(None) => {
                        emptied = true;
                        break;
                    }
                    Err(e) => {
                        self.submit();
                        return self.mark_broken(&e);
                    }
                };
                budget -= 1;
                self.start_chain(chain, &mem);
            }
            self.submit();
            if !emptied {
                if self.free.is_empty() {
                    // Resumed from `reap` once a slot frees; the ring keeps the rest.
                    self.starved = true;
                    return;
                }
                if budget == 0 {
                    // A driver that refills as fast as requests complete (inline I/O) would
                    // keep this loop going forever: the run loop notifies, lets other
                    // threads run, and comes back (kicks stay off meanwhile).
                    self.backlog = true;
                    return;
                }
                // Inline completions freed slots: pop on.
                continue;
            }
            if self.polling {
                return;
            }
            match self.queue.enable_notification(&*mem) {
                Ok(true) => {
                    empty_rechecks += 1;
                    if empty_rechecks > 16 {
                        return self.mark_broken(&RingError::Unstable);
                    }
                    continue;
                }
                Ok(false) => return,
                Err(e) => return self.mark_broken(&RingError::Access(e.to_string())),
            }
        }
    }

    /// Sends what was pushed. Completions the engine already has (inline I/O, or io_uring
    /// operations that completed while being submitted) are handled at once, and whatever
    /// they push (a short transfer's rest, the next bounce chunk) is sent too.
    fn submit(&mut self) {
        loop {
            if let Err(e) = self.io.submit() {
                error!(queue = self.index, "engine submit failed: {e}");
            }
            if let Some(o) = self.old.as_mut() {
                if let Err(e) = o.io.submit() {
                    error!(queue = self.index, "engine submit failed: {e}");
                }
            }
            if !self.io.has_completions()
                && !self.old.as_mut().is_some_and(|o| o.io.has_completions())
            {
                return;
            }
            self.reap_ready();
        }
    }

    /// One call per batch, when the driver wants one (EVENT_IDX).
    fn call_unconditionally(&self) {
        if let Some(call) = lock(&self.call).as_ref() {
            if let Err(e) = call.write(1) {
                if let Some(n) = self.drive.stats.log.call.admit() {
                    warn!(
                        queue = self.index,
                        "call eventfd: {e}{}",
                        crate::util::suppressed(n)
                    );
                }
            }
        }
    }

    fn notify(&mut self) {
        if !self.used_added {
            return;
        }
        self.used_added = false;
        let mem = self.memory();
        match self.queue.needs_notification(&*mem) {
            Ok(n) if n || std::mem::take(&mut self.force_call) => self.call_unconditionally(),
            Ok(_) => {}
            Err(e) => self.mark_broken(&RingError::Access(e.to_string())),
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_window_grows_on_short_waits_and_stops_on_long_ones() {
        let us = Duration::from_micros;
        let mut p = AdaptivePoll::new(32);
        assert_eq!(p.window, Duration::ZERO, "no polling before any traffic");
        p.adapt(us(20));
        assert_eq!(p.window, us(4));
        for _ in 0..10 {
            p.adapt(us(31));
        }
        assert_eq!(p.window, us(32), "capped at the maximum");
        p.adapt(us(10));
        assert_eq!(p.window, us(32), "a wait polling covers changes nothing");
        p.adapt(us(500));
        assert_eq!(p.window, Duration::ZERO, "an idle queue sleeps");
        let mut off = AdaptivePoll::new(0);
        off.adapt(us(1));
        assert_eq!(off.window, Duration::ZERO, "0 turns polling off");
    }
}
