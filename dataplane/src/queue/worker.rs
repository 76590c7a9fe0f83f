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

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, warn};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::drive::{Drive, NextEngine, QueueCtl};
use crate::engine::{Engine, QueueIo};
use crate::guest_mem::dirty_log::DirtyLog;
use crate::guest_mem::{Mem, MemHandle};
use crate::queue::inflight::InflightQueue;
use crate::util::lock;

mod bounce;
mod engines;
mod holds;
mod poller;
mod request;
mod ring;
mod slots;

use crate::virtio_blk::{self, Layout};
use bounce::BouncePool;
use engines::{Engines, Swapped, TOKEN_IO, TOKEN_IO_OLD};
use holds::Holds;
use poller::Poller;
use ring::Ring;
pub use ring::{CallHandle, RingError};
use slots::Slots;

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
const TOKEN_CTL: u64 = 2;

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
/// (`Ring::broken`).
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
    let ((io, engine), start_paused) = p
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
            let mut w = Worker::new(p, ctl2, io, engine, start_paused, epoll);
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

struct Worker {
    drive: Arc<Drive>,
    index: usize,
    /// What the worker does with its ring (the drive's pause, lend and stop requests).
    mode: Mode,
    ctl: Arc<QueueCtl>,
    epoll: Epoll,
    /// The guest's ring and what goes with it.
    ring: Ring,
    /// A slot per descriptor: the requests in flight.
    slots: Slots,
    /// Requests held after an error their policy holds.
    holds: Holds,
    /// The engine requests go to (and the one an overlapped switch left).
    engines: Engines,
    poller: Poller,
    layout: Layout,
    /// The type in the last decoded request header (for accounting a rejected request).
    req_type: Option<u32>,
    completions: Vec<(u64, i32)>,
    bounce: BouncePool,
    id: [u8; virtio_blk::ID_BYTES],
    /// Stopped popping because no slot was free.
    starved: bool,
    /// `process_avail` stopped at its budget with requests left in the ring.
    backlog: bool,
    /// The context is the null one of a paused start: a resume that brings none
    /// (`QueueCtl::resume(None)`) opens one on the drive's engine before serving.
    null_io: bool,
}

impl Worker {
    fn new(
        p: WorkerParams,
        ctl: Arc<QueueCtl>,
        io: Box<dyn QueueIo>,
        engine: Arc<dyn Engine>,
        start_paused: bool,
        epoll: Epoll,
    ) -> Self {
        let n = usize::from(p.queue.size()).max(1);
        let id = virtio_blk::id_bytes(&p.drive.config().serial);
        let poller = Poller::new(p.drive.config().poll_us);
        // A worker attached paused holds a null context: it must not serve a request before
        // the resume hands it a real one (which, if the resume came before this thread ran,
        // waits in the control state: the first control wake-up takes it).
        let mode = if start_paused || lock(&ctl.st).pause {
            Mode::Pausing
        } else {
            Mode::Running
        };
        Worker {
            index: p.index,
            drive: p.drive,
            ring: Ring {
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
                force_call: false,
                used_added: false,
            },
            holds: Holds::default(),
            engines: Engines::new(io, engine, p.index),
            ctl,
            epoll,
            slots: Slots::new(n),
            layout: Layout::with_capacity(MAX_SEGS),
            req_type: None,
            completions: Vec::with_capacity(n),
            bounce: BouncePool::default(),
            id,
            mode,
            starved: false,
            poller,
            backlog: false,
            null_io: start_paused,
        }
    }

    fn run(&mut self) {
        // Not while paused: a worker that starts paused (the drive held, a switch going on)
        // has no engine yet; its resubmissions wait for the resume (`control_requests`).
        if self.mode == Mode::Running {
            self.resubmit_inflight();
        }
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
            if matches!(self.mode, Mode::Pausing | Mode::Stopping) && self.slots.in_flight() == 0 {
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
            self.poller.share_cpu(waiting_since, YIELD_AFTER);
            if self.backlog && self.mode == Mode::Running {
                self.process_avail();
                self.notify();
                continue;
            }
            if !self.poller.window().is_zero() && self.mode == Mode::Running && self.poll() {
                // Work came within the window: go on polling.
                continue;
            }
            let before_wait = Instant::now();
            // Held requests are retried on a timer: sleep no longer than the next retry.
            let timeout = self.holds.timeout_ms(before_wait);
            let n = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    error!(queue = self.index, "epoll failed: {e}");
                    return;
                }
            };
            let woke = Instant::now();
            self.poller.adaptive.adapt(woke - waiting_since);
            if woke - before_wait >= SLEPT {
                self.poller.slept(woke);
            }
            for ev in &events[..n] {
                match ev.data() {
                    // A kick event from the same wait as the control event that parked
                    // the queue: the kick eventfd is the export's now (reading it would
                    // take a kick from it; QEMU's export panics on an empty read).
                    TOKEN_KICK if self.mode == Mode::Lent => {}
                    TOKEN_KICK => {
                        let _ = self.ring.kick.read();
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
            if self.holds.retry_due(Instant::now()) {
                self.retry_held();
            }
            if self.holds.released() {
                // Every held request went through: take the ones that waited behind them.
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
        self.poller.polling = true;
        let found = loop {
            let mut busy = false;
            if self.engines.has_completions() {
                self.reap();
                busy = true;
            }
            if self.slots.has_free() && self.avail_pending(&mem) {
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
                if self.ctl.pending() || now - t0 >= self.poller.window() {
                    break false;
                }
                // Idle: another queue's worker on this core may have work; let it in soon.
                self.poller.share_cpu(now, IDLE_YIELD_AFTER);
            }
            std::hint::spin_loop();
        };
        self.poller.polling = false;
        if !found {
            // Back to sleeping: notifications on, and whatever came in meanwhile is handled.
            self.process_avail();
            self.notify();
        }
        found
    }

    /// Whether the driver has made requests available that were not popped yet (never for a
    /// broken ring: nothing more is popped from it).
    fn avail_pending(&self, mem: &Mem) -> bool {
        !self.ring.broken
            && !self.holds.holding()
            && self
                .ring
                .queue
                .avail_idx(mem, Ordering::Acquire)
                .is_ok_and(|a| a.0 != self.ring.queue.next_avail())
    }

    /// Starts the requests a previous backend left in flight, in their order, before popping
    /// anything new (they precede every request still in the avail ring).
    fn resubmit_inflight(&mut self) {
        let heads = std::mem::take(&mut self.ring.resubmit);
        if heads.is_empty() {
            return;
        }
        let mem = self.memory();
        let table = self.ring.queue.desc_table();
        let size = self.ring.queue.size();
        // At most one mark per descriptor of this ring (`InflightQueue::start`), and a worker
        // has a slot per descriptor: every resubmitted request gets one.
        for head in heads {
            let descs = crate::queue::inflight::chain_at(&mem, table, size, head);
            self.start_request(head, descs.into_iter(), &mem);
        }
        self.submit();
    }

    /// Stops taking requests from a corrupt ring: one log line, the vring's error eventfd
    /// (QEMU learns of it), status and metrics. Requests already popped still complete;
    /// a frontend reset or reconnect starts a fresh worker.
    pub(super) fn mark_broken(&mut self, why: &RingError) {
        if self.ring.broken {
            return;
        }
        self.ring.broken = true;
        let stats = &self.drive.stats;
        stats.broken_queues.fetch_add(1, Ordering::Relaxed);
        stats.ring_errors.fetch_add(1, Ordering::Relaxed);
        *lock(&stats.last_ring_error) = Some(format!("queue {}: {why}", self.index));
        if let Some(n) = stats.log.ring.admit() {
            error!(drive = %self.drive.config().name, queue = self.index,
                "ring broken: {why}; the queue stops until the driver resets it{}",
                crate::util::suppressed(n));
        }
        if let Some(e) = lock(&self.ring.err).as_ref() {
            let _ = e.write(1);
        }
    }

    fn finish(self) -> Queue {
        self.drive.detach_worker(&self.ctl);
        if self.ring.broken {
            self.drive
                .stats
                .broken_queues
                .fetch_sub(1, Ordering::Relaxed);
        }
        let mut st = lock(&self.ctl.st);
        st.exited = true;
        self.ctl.cv.notify_all();
        drop(st);
        self.ring.queue
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
        let ready =
            self.mode == Mode::Paused && self.slots.in_flight() == 0 && !self.engines.overlapping();
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
            st.old_drained = !self.engines.overlapping();
            self.ctl.cv.notify_all();
            drop(st);
            // Requests that came meanwhile, on the new engine; then the old context goes.
            self.process_avail();
            drop(idle);
            st = lock(&self.ctl.st);
        }
        if std::mem::take(&mut st.retry) && self.holds.any_held() {
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
            let next = match next {
                Some(n) => Some(n),
                None if self.null_io => self.open_current(),
                None => None,
            };
            if let Some((io, engine)) = next {
                drop(self.engines.replace(&self.epoll, io, engine));
                self.null_io = false;
            } else if self.null_io {
                // Nothing to serve with (the drive holds): the requests wait in the vring.
                self.mode = Mode::Paused;
                return;
            }
            // The previous back-end's unfinished requests first (a no-op once done).
            self.resubmit_inflight();
            self.process_avail();
        }
    }

    /// A context on the drive's current engine, for a worker resumed without one while it
    /// holds the null context of a paused start; None while the drive holds or the engine
    /// cannot open one (logged).
    fn open_current(&self) -> Option<NextEngine> {
        let engine = self.drive.engine();
        if engine.holds() {
            return None;
        }
        match engine.open_queue(self.index, self.ctl.depth(), self.ctl.mem()) {
            Ok(io) => Some((io, engine)),
            Err(e) => {
                if let Some(n) = self.drive.stats.log.io.admit() {
                    warn!(drive = %self.drive.config().name, queue = self.index, "cannot open the engine: {e}{}", crate::util::suppressed(n));
                }
                None
            }
        }
    }

    /// Parks the (paused, drained) queue for a lend: `avail_event` is set to the next avail
    /// index (with EVENT_IDX, the export's progress is read from it), the kick eventfd leaves
    /// the epoll set, and the ring is described with copies of the guest's eventfds.
    fn park(&mut self) -> Result<crate::drive::lend::RingLoan, String> {
        let mem = self.memory();
        let kick = self
            .ring
            .kick
            .try_clone()
            .map_err(|e| format!("kick eventfd: {e}"))?;
        let call = match lock(&self.ring.call).as_ref() {
            Some(c) => Some(c.try_clone().map_err(|e| format!("call eventfd: {e}"))?),
            None => None,
        };
        if self.ring.queue.event_idx_enabled() {
            self.ring
                .queue
                .enable_notification(&*mem)
                .map_err(|e| format!("avail_event: {e}"))?;
        }
        self.epoll
            .ctl(
                ControlOperation::Delete,
                self.ring.kick.as_raw_fd(),
                EpollEvent::default(),
            )
            .map_err(|e| format!("epoll: {e}"))?;
        self.mode = Mode::Lent;
        Ok(crate::drive::lend::RingLoan {
            index: self.index,
            size: self.ring.queue.size(),
            desc: self.ring.queue.desc_table(),
            avail: self.ring.queue.avail_ring(),
            used: self.ring.queue.used_ring(),
            next_avail: self.ring.queue.next_avail(),
            event_idx: self.ring.queue.event_idx_enabled(),
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
            self.ring.queue.set_next_avail(next_avail);
            match self.ring.queue.used_idx(&*mem, Ordering::Acquire) {
                Ok(u) => {
                    self.ring.queue.set_next_used(u.0);
                    if let Some(iq) = &self.ring.inflight {
                        iq.resync(u.0);
                    }
                }
                Err(e) => self.mark_broken(&RingError::Access(e.to_string())),
            }
        }
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            self.ring.kick.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_KICK),
        ) {
            error!(
                queue = self.index,
                "cannot watch the kick eventfd again: {e}"
            );
        }
        self.mode = Mode::Paused;
        self.ring.force_call = true;
        self.call_unconditionally();
    }

    /// An overlapped switch: new requests go to `io` at once, the ones in flight finish on
    /// the engine they started on (virtio-blk orders nothing between requests in flight),
    /// which the worker drops after their last completion (`retire_old`).
    /// Returns the old context when nothing was in flight on it, to be dropped after the
    /// swap is acknowledged (its teardown is no part of the pause).
    fn swap_engine(&mut self, io: Box<dyn QueueIo>, engine: Arc<dyn Engine>) -> Option<NextEngine> {
        let swapped = self
            .engines
            .swap(&self.epoll, io, engine, self.slots.in_flight());
        self.after_swap(swapped)
    }

    fn after_swap(&mut self, swapped: Swapped) -> Option<NextEngine> {
        match swapped {
            Swapped::Idle(old) => Some(old),
            Swapped::Overlapped => {
                for r in self.slots.busy_mut() {
                    r.on_old = true;
                }
                self.drive.stats.overlapped.fetch_add(1, Ordering::Relaxed);
                None
            }
            Swapped::Deferred => None,
        }
    }

    /// The old engine's last request completed: its context goes, the switch learns it.
    pub(super) fn retire_old(&mut self) {
        if !self.engines.overlapping() {
            return;
        }
        if let Some(swapped) = self.engines.retire_old(&self.epoll, self.slots.in_flight()) {
            drop(self.after_swap(swapped));
        }
        let mut st = lock(&self.ctl.st);
        st.old_drained = !self.engines.overlapping();
        self.ctl.cv.notify_all();
    }

    fn memory(&self) -> Arc<Mem> {
        self.ring.memory()
    }

    /// Pops every available request (while slots are free), starts them, submits once per
    /// pass. Leaves guest notifications on (unless polling), after checking the ring again.
    fn process_avail(&mut self) {
        if self.mode != Mode::Running || self.ring.broken || self.holds.holding() {
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
            if let Err(e) = self.ring.queue.disable_notification(&*mem) {
                return self.mark_broken(&RingError::Access(e.to_string()));
            }
            let mut emptied = false;
            while self.slots.has_free() && budget > 0 {
                let chain = match self.ring.pop(&mem) {
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
                if !self.slots.has_free() {
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
            if self.poller.polling {
                return;
            }
            match self.ring.queue.enable_notification(&*mem) {
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
            self.engines.submit();
            if !self.engines.has_completions() {
                return;
            }
            self.reap_ready();
        }
    }

    /// One call per batch, when the driver wants one (EVENT_IDX).
    fn call_unconditionally(&self) {
        if let Some(call) = lock(&self.ring.call).as_ref() {
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
        if !self.ring.used_added {
            return;
        }
        self.ring.used_added = false;
        let mem = self.memory();
        match self.ring.queue.needs_notification(&*mem) {
            Ok(n) if n || std::mem::take(&mut self.ring.force_call) => self.call_unconditionally(),
            Ok(_) => {}
            Err(e) => self.mark_broken(&RingError::Access(e.to_string())),
        }
    }
}
