//! A drive: what the guest sees (config, serial, geometry), which engine serves it, and the
//! live engine switch.
//!
//! A switch never cancels a request and never loses one: it stops every queue worker from
//! popping new requests (they stay in the vring), waits until each queue's in-flight requests
//! have completed on the old engine, hands each worker a context on the new engine, and lets
//! them resume. The time between the first pause and the last resume is the pause the guest
//! can observe, and it is recorded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use crate::engine::{Engine, EngineError};
use crate::virtio_blk::{BlkConfig, DiskGeometry, SECTOR_SHIFT};
use crate::worker::QueueCtl;

/// What a DISCARD request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiscardMode {
    /// Punch a hole in the image (the space is freed; reads return zeroes).
    Unmap,
    /// Answer OK and do nothing (discard is a hint).
    Ignore,
}

/// Default most microseconds a queue busy-polls before sleeping: QEMU's `poll-max-ns`.
pub const DEFAULT_POLL_US: u32 = 32;

#[derive(Clone, Debug)]
pub struct DriveConfig {
    /// For logs and status.
    pub name: String,
    /// GET_ID answer (20 bytes at most, NUL-padded).
    pub serial: String,
    pub capacity_bytes: u64,
    pub logical_block_size: u32,
    pub read_only: bool,
    pub num_queues: u16,
    /// Largest queue size the frontend may choose.
    pub queue_size: u16,
    pub discard: DiscardMode,
    /// Most microseconds a queue busy-polls the vring and the engine before sleeping (the
    /// window adapts up to this; 0: never poll).
    pub poll_us: u32,
}

impl DriveConfig {
    pub fn geometry(&self) -> DiskGeometry {
        DiskGeometry {
            sectors: self.capacity_bytes >> SECTOR_SHIFT,
            block_size: self.logical_block_size,
            read_only: self.read_only,
        }
    }

    /// The config space, as QEMU 10's export would show it for this disk.
    pub fn blk_config(&self, writeback: bool) -> BlkConfig {
        let mut c = BlkConfig::qemu_like(
            self.capacity_bytes >> SECTOR_SHIFT,
            self.logical_block_size,
            self.num_queues,
        );
        c.writeback = u8::from(writeback);
        c
    }
}

#[derive(Debug, Error)]
pub enum SwitchError {
    #[error("a switch is already running on drive {0}")]
    Busy(String),
    #[error("the new engine could not open queue contexts")]
    Prepare(#[source] EngineError),
    #[error("queue {queue} did not drain within {timeout:?}; switch rolled back, old engine kept")]
    DrainTimeout { queue: usize, timeout: Duration },
}

/// Counters of a drive, readable at any time.
#[derive(Debug, Default)]
pub struct DriveStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub get_ids: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Requests answered IOERR (bad requests and failed I/O).
    pub io_errors: AtomicU64,
    /// Requests answered UNSUPP.
    pub unsupported: AtomicU64,
    /// Requests popped and not yet completed, over all queues.
    pub in_flight: AtomicU64,
    /// Requests that went through the bounce pool (unaligned buffers with O_DIRECT).
    pub bounced: AtomicU64,
    pub switches: AtomicU64,
    pub last_pause_us: AtomicU64,
    /// Completion latency of every request, from pop to used ring.
    pub latency: LatencyHistogram,
}

/// Lock-free latency histogram: bucket i counts latencies in [2^(i-1), 2^i) microseconds.
#[derive(Debug)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; 40],
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl LatencyHistogram {
    pub fn record(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let i = (64 - us.leading_zeros() as usize).min(39);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts, for differences between two moments.
    pub fn snapshot(&self) -> [u64; 40] {
        std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed))
    }

    /// The upper bound (microseconds) of the bucket holding quantile `q` of `counts`; None
    /// when empty.
    pub fn quantile_us(counts: &[u64; 40], q: f64) -> Option<u64> {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(1u64 << i);
            }
        }
        Some(1u64 << 39)
    }
}

/// The outcome of one engine switch.
#[derive(Clone, Debug)]
pub struct SwitchReport {
    pub from: String,
    pub to: String,
    /// Queues that were running and were drained.
    pub queues: usize,
    /// From the first pause request to the last resume.
    pub pause: Duration,
}

struct EngineSlot {
    engine: Arc<dyn Engine>,
    generation: u64,
    /// A pause is in progress: workers that start now start paused, with no engine context.
    paused: bool,
}

pub struct Drive {
    cfg: DriveConfig,
    engine: Mutex<EngineSlot>,
    /// Set while a pause (a switch) is in progress: one at a time per drive.
    switching: AtomicBool,
    /// Held while a worker starts and while a pause or resume walks the workers, so a worker
    /// always starts on the current engine (or paused) and a switch sees every running worker.
    attach_lock: Mutex<()>,
    running: Mutex<Vec<Arc<QueueCtl>>>,
    /// Write cache enabled (config space `writeback`). On at start, as QEMU's own virtio-blk
    /// device shows it with its default cache modes: the driver flushes when it needs data
    /// durable. Off when the driver did not negotiate FLUSH (it could not flush), or when it
    /// writes 0 (CONFIG_WCE); then every write is write-through (RWF_DSYNC / NBD FUA).
    writeback: AtomicBool,
    pub stats: DriveStats,
    pub drain_timeout: Duration,
}

impl Drive {
    pub fn new(cfg: DriveConfig, engine: Arc<dyn Engine>) -> Arc<Self> {
        let writeback = !cfg.read_only;
        Arc::new(Drive {
            cfg,
            engine: Mutex::new(EngineSlot {
                engine,
                generation: 0,
                paused: false,
            }),
            switching: AtomicBool::new(false),
            attach_lock: Mutex::new(()),
            running: Mutex::new(Vec::new()),
            writeback: AtomicBool::new(writeback),
            stats: DriveStats::default(),
            drain_timeout: Duration::from_secs(30),
        })
    }

    pub fn config(&self) -> &DriveConfig {
        &self.cfg
    }

    pub fn engine(&self) -> Arc<dyn Engine> {
        lock(&self.engine).engine.clone()
    }

    pub fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    pub fn set_writeback(&self, on: bool) {
        self.writeback.store(on, Ordering::Relaxed);
    }

    /// Called by a worker as it starts: the current engine's context for its queue, or a null
    /// context and a paused start while the drive is held or a switch is in progress.
    /// Registers the worker so that switches pause it.
    pub(crate) fn attach_worker(
        &self,
        ctl: &Arc<QueueCtl>,
        depth: u32,
    ) -> Result<crate::worker::NextEngine, EngineError> {
        let _a = lock(&self.attach_lock);
        let (engine, paused) = {
            let slot = lock(&self.engine);
            (slot.engine.clone(), slot.paused)
        };
        let io = if paused || engine.holds() {
            ctl.start_paused();
            Box::new(NullIo::new()?) as Box<dyn crate::engine::QueueIo>
        } else {
            engine.open_queue(ctl.index(), depth)?
        };
        lock(&self.running).push(ctl.clone());
        Ok((io, engine))
    }

    pub(crate) fn detach_worker(&self, ctl: &Arc<QueueCtl>) {
        lock(&self.running).retain(|c| !Arc::ptr_eq(c, ctl));
    }

    /// Stops every queue from taking new requests (they stay in the vring) and waits until
    /// each queue's in-flight requests have completed on the current engine. Nothing is
    /// cancelled. On a drain timeout the queues resume on the current engine.
    ///
    /// The returned [`Paused`] ends the pause: [`Paused::resume`] on a new engine (or the same
    /// one); dropping it resumes on the current engine.
    pub fn pause(self: &Arc<Self>) -> Result<Paused, SwitchError> {
        if self.switching.swap(true, Ordering::AcqRel) {
            return Err(SwitchError::Busy(self.cfg.name.clone()));
        }
        let t0 = Instant::now();
        let from = self.engine().name().to_string();
        let workers = {
            let _a = lock(&self.attach_lock);
            lock(&self.engine).paused = true;
            lock(&self.running).clone()
        };
        for w in &workers {
            w.request_pause();
        }
        let deadline = t0 + self.drain_timeout;
        for w in &workers {
            if !w.wait_drained(deadline) {
                warn!(drive = %self.cfg.name, queue = w.index(), "drain timed out, pause abandoned");
                let _a = lock(&self.attach_lock);
                lock(&self.engine).paused = false;
                for w in lock(&self.running).iter() {
                    w.resume(None);
                }
                self.switching.store(false, Ordering::Release);
                return Err(SwitchError::DrainTimeout {
                    queue: w.index(),
                    timeout: self.drain_timeout,
                });
            }
        }
        Ok(Paused {
            drive: self.clone(),
            t0,
            from,
            queues: workers.len(),
            ended: false,
        })
    }

    /// Moves the drive to `new` without losing or reordering a request: pause, drain,
    /// resume on `new`. When `new` cannot open its queue contexts, the drive resumes on the
    /// old engine.
    pub fn switch_engine(
        self: &Arc<Self>,
        new: Arc<dyn Engine>,
    ) -> Result<SwitchReport, SwitchError> {
        let p = self.pause()?;
        match p.resume(new) {
            Ok(r) => Ok(r),
            Err((p, e)) => {
                drop(p);
                Err(e)
            }
        }
    }
}

/// A drive whose queues are paused and drained (see [`Drive::pause`]).
pub struct Paused {
    drive: Arc<Drive>,
    t0: Instant,
    from: String,
    queues: usize,
    ended: bool,
}

impl Paused {
    pub fn drive(&self) -> &Arc<Drive> {
        &self.drive
    }

    /// Time since the pause began.
    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }

    /// Ends the pause on `engine`: each queue gets a fresh context on it. A holding engine
    /// keeps the queues paused (requests wait in the vring). When a context cannot be opened,
    /// the drive stays paused and the pause comes back with the error, for a rollback.
    pub fn resume(
        mut self,
        engine: Arc<dyn Engine>,
    ) -> Result<SwitchReport, (Paused, SwitchError)> {
        let d = self.drive.clone();
        let a = lock(&d.attach_lock);
        let workers: Vec<Arc<QueueCtl>> = lock(&d.running).clone();
        let mut fresh = Vec::with_capacity(workers.len());
        if !engine.holds() {
            for w in &workers {
                match engine.open_queue(w.index(), w.depth()) {
                    Ok(io) => fresh.push(io),
                    Err(e) => {
                        drop(a);
                        return Err((self, SwitchError::Prepare(e)));
                    }
                }
            }
        }
        {
            let mut slot = lock(&d.engine);
            slot.engine = engine.clone();
            slot.generation += 1;
            slot.paused = false;
        }
        for (w, io) in workers.iter().zip(fresh) {
            w.resume(Some((io, engine.clone())));
        }
        drop(a);
        self.ended = true;
        d.switching.store(false, Ordering::Release);
        let pause = self.t0.elapsed();
        if engine.holds() {
            info!(drive = %d.cfg.name, from = %self.from, "drive held: requests wait in the vring");
        } else {
            d.stats.switches.fetch_add(1, Ordering::Relaxed);
            d.stats
                .last_pause_us
                .store(pause.as_micros() as u64, Ordering::Relaxed);
            info!(drive = %d.cfg.name, from = %self.from, to = engine.name(), queues = self.queues, pause_us = pause.as_micros() as u64, "engine switched");
        }
        Ok(SwitchReport {
            from: std::mem::take(&mut self.from),
            to: engine.name().to_string(),
            queues: self.queues,
            pause,
        })
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Abandoned: the queues go on with the current engine. Fresh contexts, since a worker
        // that started during the pause has none.
        let d = &self.drive;
        let _a = lock(&d.attach_lock);
        let engine = {
            let mut slot = lock(&d.engine);
            slot.paused = false;
            slot.engine.clone()
        };
        if !engine.holds() {
            for w in lock(&d.running).iter() {
                match engine.open_queue(w.index(), w.depth()) {
                    Ok(io) => w.resume(Some((io, engine.clone()))),
                    Err(e) => {
                        warn!(drive = %d.cfg.name, queue = w.index(), "cannot reopen the engine: {e}");
                        w.resume(None)
                    }
                }
            }
        }
        d.switching.store(false, Ordering::Release);
        warn!(drive = %d.cfg.name, "pause ended without a switch; queues resumed on {}", self.from);
    }
}

/// A queue context that has nothing to do: for workers that start paused. Anything pushed to
/// it fails with EIO (it is never used while paused).
struct NullIo {
    done: vmm_sys_util::eventfd::EventFd,
    failed: Vec<(u64, i32)>,
}

impl NullIo {
    fn new() -> Result<Self, EngineError> {
        Ok(NullIo {
            done: vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)
                .map_err(EngineError::EventFd)?,
            failed: Vec::new(),
        })
    }
}

impl crate::engine::QueueIo for NullIo {
    unsafe fn push(&mut self, _op: &crate::engine::IoOp, token: u64) -> bool {
        self.failed.push((token, -libc::EIO));
        let _ = self.done.write(1);
        true
    }
    fn submit(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn completion_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.done.as_raw_fd()
    }
    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        let _ = self.done.read();
        out.append(&mut self.failed);
    }
}

/// An engine that serves nothing: a drive on it keeps its requests in the vring until it is
/// switched to a real engine (a drive that needs QEMU before the supervisor has attached).
pub struct HeldEngine;

impl Engine for HeldEngine {
    fn name(&self) -> &str {
        "held"
    }
    fn buffer_alignment(&self) -> u32 {
        1
    }
    fn is_block_device(&self) -> bool {
        false
    }
    fn holds(&self) -> bool {
        true
    }
    fn open_queue(
        &self,
        _queue: usize,
        _depth: u32,
    ) -> Result<Box<dyn crate::engine::QueueIo>, EngineError> {
        Ok(Box::new(NullIo::new()?))
    }
}

/// Locks a mutex, recovering the data if a thread panicked while holding it: every value
/// under these locks stays consistent between statements.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
