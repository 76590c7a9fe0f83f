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
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::drive::{AcctClass, DiscardMode, Drive, QueueCtl};
use crate::engine::{Engine, IoOp, QueueIo};
use crate::guest_mem::{
    advance_iov, build_iovecs, copy_from_guest, copy_to_guest, iov_aligned, Mem, MemHandle,
};
use crate::util::lock;
use crate::virtio_blk::{
    self, split_chain, Desc, DwzSegment, Header, Layout, Op, Seg, DWZ_SEGMENT_LEN, HEADER_LEN,
    S_IOERR, S_OK, S_UNSUPP, T_DISCARD, T_WRITE_ZEROES,
};

/// The call eventfd, which the frontend may replace while the queue runs.
pub type CallHandle = Arc<Mutex<Option<EventFd>>>;

/// Most data segments (descriptor pieces) one request may have. seg_max is 126; indirect
/// tables may hold more, up to this bound; longer requests get IOERR.
pub const MAX_SEGS: usize = 1024;
/// Bounce pool: buffers per queue and bytes per buffer. A bounced request holds one buffer
/// and moves its data through it in chunks of this size.
const BOUNCE_BUFS: usize = 8;
const BOUNCE_SIZE: usize = 256 * 1024;
const BOUNCE_ALIGN: usize = 4096;

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

/// A running worker. [`WorkerHandle::stop`] drains it and gives the ring back.
pub struct WorkerHandle {
    ctl: Arc<QueueCtl>,
    thread: JoinHandle<Queue>,
}

impl WorkerHandle {
    /// Stops popping, waits until every popped request has completed and is in the used
    /// ring, and returns the queue (its `next_avail` is then exact: nothing to replay).
    pub fn stop(self) -> Queue {
        self.ctl.request_stop();
        match self.thread.join() {
            Ok(q) => q,
            Err(_) => {
                error!(queue = self.ctl.index(), "queue worker panicked");
                Queue::new(1).expect("a queue of size 1 is valid")
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
    let ctl = Arc::new(QueueCtl::new(p.index, depth).map_err(WorkerError::Setup)?);
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// readv/writev straight on guest memory.
    Direct,
    /// Through a bounce buffer, chunk by chunk.
    Bounce,
    Flush,
    Fallocate(i32),
}

struct Slot {
    head: u16,
    status: u64,
    used_len: u32,
    /// The request's accounting class, once dispatched (None: GET_ID, or not yet).
    acct: Option<AcctClass>,
    op: Op,
    stage: Stage,
    /// Bytes of the data already transferred (short transfers, bounce chunks).
    done: u64,
    /// For bounce: write zeroes instead of guest data.
    zero_fill: bool,
    bounce: Option<usize>,
    iov: Vec<libc::iovec>,
    segs: Vec<Seg>,
    mem: Option<Arc<Mem>>,
    /// When the request was popped (for the latency histogram).
    started: Instant,
}

impl Slot {
    fn new() -> Self {
        Slot {
            head: 0,
            status: 0,
            used_len: 0,
            acct: None,
            op: Op::Flush,
            stage: Stage::Flush,
            done: 0,
            zero_fill: false,
            bounce: None,
            iov: Vec::new(),
            segs: Vec::new(),
            mem: None,
            started: Instant::now(),
        }
    }

    fn total(&self) -> u64 {
        match self.op {
            Op::Read { len, .. }
            | Op::Write { len, .. }
            | Op::WriteZeroes { len, .. }
            | Op::Discard { len, .. } => len,
            _ => 0,
        }
    }

    fn offset(&self) -> u64 {
        match self.op {
            Op::Read { offset, .. }
            | Op::Write { offset, .. }
            | Op::WriteZeroes { offset, .. }
            | Op::Discard { offset, .. } => offset,
            _ => 0,
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

/// A fixed set of aligned buffers, allocated on first use.
struct BouncePool {
    bufs: Vec<Vec<u8>>,
    free: Vec<usize>,
}

impl BouncePool {
    fn take(&mut self) -> Option<usize> {
        if self.bufs.is_empty() {
            self.bufs = (0..BOUNCE_BUFS)
                .map(|_| vec![0u8; BOUNCE_SIZE + BOUNCE_ALIGN])
                .collect();
            self.free = (0..BOUNCE_BUFS).collect();
        }
        self.free.pop()
    }

    fn buf(&mut self, i: usize) -> &mut [u8] {
        let b = &mut self.bufs[i];
        let off = b.as_ptr().align_offset(BOUNCE_ALIGN);
        &mut b[off..off + BOUNCE_SIZE]
    }
}

struct Worker {
    drive: Arc<Drive>,
    index: usize,
    queue: Queue,
    mem: MemHandle,
    kick: EventFd,
    call: CallHandle,
    ctl: Arc<QueueCtl>,
    io: Box<dyn QueueIo>,
    engine: Arc<dyn Engine>,
    epoll: Epoll,
    slots: Vec<Slot>,
    free: Vec<usize>,
    in_flight: usize,
    layout: Layout,
    /// The type in the last decoded request header (for accounting a rejected request).
    req_type: Option<u32>,
    completions: Vec<(u64, i32)>,
    bounce: BouncePool,
    bounce_wait: VecDeque<usize>,
    id: [u8; virtio_blk::ID_BYTES],
    paused: bool,
    stopping: bool,
    acked: bool,
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
        let paused = lock(&ctl.st).pause;
        Worker {
            index: p.index,
            drive: p.drive,
            queue: p.queue,
            mem: p.mem,
            kick: p.kick,
            call: p.call,
            ctl,
            io,
            engine,
            epoll,
            slots: (0..n).map(|_| Slot::new()).collect(),
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
            paused,
            stopping: false,
            acked: false,
            starved: false,
            used_added: false,
            poll,
            polling: false,
            on_cpu_since: Instant::now(),
            backlog: false,
        }
    }

    fn run(&mut self) {
        // The frontend may have queued requests (and kicked) before this worker existed.
        self.process_avail();
        self.notify();
        let mut events = vec![EpollEvent::default(); 8];
        loop {
            if (self.paused || self.stopping) && self.in_flight == 0 && !self.acked {
                self.acked = true;
                let mut st = lock(&self.ctl.st);
                st.drained = true;
                self.ctl.cv.notify_all();
            }
            if self.stopping && self.in_flight == 0 {
                return;
            }
            let waiting_since = Instant::now();
            self.share_cpu(waiting_since, YIELD_AFTER);
            if self.backlog && !self.paused && !self.stopping {
                self.process_avail();
                self.notify();
                continue;
            }
            if !self.poll.window.is_zero() && !self.paused && !self.stopping && self.poll() {
                // Work came within the window: go on polling.
                continue;
            }
            let before_wait = Instant::now();
            let n = match self.epoll.wait(-1, &mut events) {
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
                    TOKEN_KICK => {
                        let _ = self.kick.read();
                        self.process_avail();
                    }
                    TOKEN_IO => self.reap(),
                    TOKEN_CTL => {
                        let _ = self.ctl.wake.read();
                        self.control();
                    }
                    _ => {}
                }
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
            if self.io.has_completions() {
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

    /// Whether the driver has made requests available that were not popped yet.
    fn avail_pending(&self, mem: &Mem) -> bool {
        self.queue
            .avail_idx(mem, Ordering::Acquire)
            .is_ok_and(|a| a.0 != self.queue.next_avail())
    }

    fn finish(self) -> Queue {
        self.drive.detach_worker(&self.ctl);
        let mut st = lock(&self.ctl.st);
        st.exited = true;
        self.ctl.cv.notify_all();
        drop(st);
        self.queue
    }

    fn control(&mut self) {
        self.ctl.pending.store(false, Ordering::Relaxed);
        let mut st = lock(&self.ctl.st);
        if st.stop {
            self.stopping = true;
        }
        if st.pause && !st.drained {
            // A new pause request (also while already paused, e.g. held): acknowledge it
            // again once nothing is in flight.
            self.paused = true;
            self.acked = false;
        }
        if !st.pause && self.paused {
            self.paused = false;
            self.acked = false;
            let next = st.next.take();
            drop(st);
            if let Some((io, engine)) = next {
                self.replace_engine(io, engine);
            }
            self.process_avail();
        }
    }

    fn replace_engine(&mut self, io: Box<dyn QueueIo>, engine: Arc<dyn Engine>) {
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
        self.io = io;
        self.engine = engine;
    }

    fn memory(&self) -> Arc<Mem> {
        lock(&self.mem).clone()
    }

    /// Pops every available request (while slots are free), starts them, submits once per
    /// pass. Leaves guest notifications on (unless polling), after checking the ring again.
    fn process_avail(&mut self) {
        if self.paused || self.stopping {
            return;
        }
        let mem = self.memory();
        self.starved = false;
        self.backlog = false;
        let mut budget = BATCH_BUDGET;
        loop {
            if let Err(e) = self.queue.disable_notification(&*mem) {
                warn!(queue = self.index, "disable_notification: {e}");
            }
            let mut emptied = false;
            while !self.free.is_empty() && budget > 0 {
                let Some(chain) = self.queue.pop_descriptor_chain(&*mem) else {
                    emptied = true;
                    break;
                };
                budget -= 1;
                self.start_request(chain, &mem);
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
                Ok(true) => continue,
                Ok(false) => return,
                Err(e) => {
                    warn!(queue = self.index, "enable_notification: {e}");
                    return;
                }
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
            if !self.io.has_completions() {
                return;
            }
            self.reap_ready();
        }
    }

    fn start_request(&mut self, chain: DescriptorChain<&Mem>, mem: &Arc<Mem>) {
        let head = chain.head_index();
        let descs = chain.map(|d| Desc {
            addr: d.addr().0,
            len: d.len(),
            writable: d.is_write_only(),
        });
        let split = split_chain(descs, MAX_SEGS, &mut self.layout);
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
    fn decode(&mut self, mem: &Mem) -> Result<Op, u8> {
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
        virtio_blk::validate(&self.drive.config().geometry(), h, &self.layout, dwz)
    }

    fn dispatch(&mut self, idx: usize) {
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
    fn push_rw(&mut self, idx: usize) {
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

    fn push(&mut self, idx: usize, op: IoOp) {
        // SAFETY: the iovecs live in `self.slots[idx].iov` and point into guest memory kept
        // mapped by `self.slots[idx].mem`, or into this worker's bounce buffers; neither is
        // touched or freed until the completion for `idx` is reaped.
        let ok = unsafe { self.io.push(&op, idx as u64) };
        if !ok {
            // Cannot happen while in-flight <= depth; answer rather than lose the request.
            error!(queue = self.index, "engine queue full");
            self.complete(idx, S_IOERR);
        }
    }

    /// Submits a slot's fallocate with `mode` (its completion comes back to `on_fallocate`);
    /// `zeroes`: the range must read as zeroes afterwards.
    fn push_fallocate(&mut self, idx: usize, offset: u64, len: u64, mode: i32, zeroes: bool) {
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

    fn start_bounce(&mut self, idx: usize) {
        match self.bounce.take() {
            Some(b) => {
                self.slots[idx].bounce = Some(b);
                self.bounce_chunk(idx);
            }
            None => self.bounce_wait.push_back(idx),
        }
    }

    /// Submits the next chunk of a bounced request.
    fn bounce_chunk(&mut self, idx: usize) {
        let slot = &mut self.slots[idx];
        let b = slot.bounce.expect("bounce buffer held");
        let n = ((slot.total() - slot.done) as usize).min(BOUNCE_SIZE);
        let offset = slot.offset() + slot.done;
        let read = matches!(slot.op, Op::Read { .. });
        let buf = self.bounce.buf(b);
        if !read {
            if slot.zero_fill {
                buf[..n].fill(0);
            } else if copy_from_guest(
                slot.mem.as_deref().expect("set"),
                &slot.segs,
                slot.done,
                &mut buf[..n],
            )
            .is_err()
            {
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

    /// Handles every completion (the engine's fd was readable, or polling saw some), then
    /// submits and pops what was waiting for a free slot.
    fn reap(&mut self) {
        self.reap_ready();
        self.submit();
        if self.starved {
            self.process_avail();
        }
    }

    /// Handles the completions the engine has now, without submitting.
    fn reap_ready(&mut self) {
        let mut done = std::mem::take(&mut self.completions);
        done.clear();
        self.io.reap(&mut done);
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

    fn on_completion(&mut self, idx: usize, res: i32) {
        let stage = self.slots[idx].stage;
        match stage {
            Stage::Flush => self.complete(idx, if res < 0 { S_IOERR } else { S_OK }),
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

    fn on_fallocate(&mut self, idx: usize, mode: i32, res: i32) {
        if res >= 0 {
            return self.complete(idx, S_OK);
        }
        let unsupported = res == -libc::EOPNOTSUPP || res == -libc::EINVAL;
        match self.slots[idx].op {
            // Discard is a hint: a file system that cannot punch holes did nothing wrong.
            Op::Discard { .. } if unsupported => self.complete(idx, S_OK),
            Op::WriteZeroes { offset, len, .. } if unsupported => {
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                if mode != punch && !self.engine.is_block_device() {
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

    fn io_error(&mut self, idx: usize, res: i32) {
        let e = std::io::Error::from_raw_os_error(-res);
        warn!(drive = %self.drive.config().name, queue = self.index, op = ?self.slots[idx].op, "I/O failed: {}", if res == 0 { "unexpected end of file".to_string() } else { e.to_string() });
        self.complete(idx, S_IOERR);
    }

    /// Writes the status byte (last), puts the head in the used ring, frees the slot.
    fn complete(&mut self, idx: usize, status: u8) {
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
        if let Err(e) = self.queue.add_used(&*mem, slot.head, slot.used_len) {
            warn!(queue = self.index, "add_used: {e}");
        }
        slot.op = Op::Flush;
        let freed_bounce = slot.bounce.take();
        self.used_added = true;
        self.free.push(idx);
        self.in_flight -= 1;
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
    }

    /// One call per batch, when the driver wants one (EVENT_IDX).
    fn notify(&mut self) {
        if !self.used_added {
            return;
        }
        self.used_added = false;
        let mem = self.memory();
        match self.queue.needs_notification(&*mem) {
            Ok(true) => {
                if let Some(call) = lock(&self.call).as_ref() {
                    if let Err(e) = call.write(1) {
                        warn!(queue = self.index, "call eventfd: {e}");
                    }
                }
            }
            Ok(false) => {}
            Err(e) => warn!(queue = self.index, "needs_notification: {e}"),
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
