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
    /// Busy-poll the vring and the engine for this long before sleeping (0: never poll).
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
}

pub struct Drive {
    cfg: DriveConfig,
    engine: Mutex<EngineSlot>,
    /// Held for the whole of a switch, and while a worker starts, so a worker always starts on
    /// the current engine and a switch sees every running worker.
    switch_lock: Mutex<()>,
    running: Mutex<Vec<Arc<QueueCtl>>>,
    /// Write cache enabled (config space `writeback`, set by the driver with CONFIG_WCE). When
    /// false, every write is write-through.
    writeback: AtomicBool,
    pub stats: DriveStats,
    pub drain_timeout: Duration,
}

impl Drive {
    pub fn new(cfg: DriveConfig, engine: Arc<dyn Engine>) -> Arc<Self> {
        Arc::new(Drive {
            cfg,
            engine: Mutex::new(EngineSlot {
                engine,
                generation: 0,
            }),
            switch_lock: Mutex::new(()),
            running: Mutex::new(Vec::new()),
            writeback: AtomicBool::new(false),
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

    /// Called by a worker as it starts: the current engine's context for its queue. Registers
    /// the worker so that switches pause it.
    pub(crate) fn attach_worker(
        &self,
        ctl: &Arc<QueueCtl>,
        depth: u32,
    ) -> Result<crate::worker::NextEngine, EngineError> {
        let _sw = lock(&self.switch_lock);
        let engine = self.engine();
        let io = engine.open_queue(ctl.index(), depth)?;
        lock(&self.running).push(ctl.clone());
        Ok((io, engine))
    }

    pub(crate) fn detach_worker(&self, ctl: &Arc<QueueCtl>) {
        lock(&self.running).retain(|c| !Arc::ptr_eq(c, ctl));
    }

    /// Moves the drive to `new` without losing or reordering a request: see the module doc.
    pub fn switch_engine(&self, new: Arc<dyn Engine>) -> Result<SwitchReport, SwitchError> {
        let _sw = self
            .switch_lock
            .try_lock()
            .map_err(|_| SwitchError::Busy(self.cfg.name.clone()))?;
        let from = self.engine().name().to_string();
        let workers: Vec<Arc<QueueCtl>> = lock(&self.running).clone();
        // Open the new contexts before pausing, so the pause holds no set-up work.
        let mut fresh = Vec::with_capacity(workers.len());
        for w in &workers {
            fresh.push(
                new.open_queue(w.index(), w.depth())
                    .map_err(SwitchError::Prepare)?,
            );
        }
        let t0 = Instant::now();
        for w in &workers {
            w.request_pause();
        }
        let deadline = t0 + self.drain_timeout;
        for w in &workers {
            if !w.wait_drained(deadline) {
                // Rollback: the old engine keeps every queue; nothing was cancelled.
                for w in &workers {
                    w.resume(None);
                }
                warn!(drive = %self.cfg.name, queue = w.index(), "drain timed out, switch rolled back");
                return Err(SwitchError::DrainTimeout {
                    queue: w.index(),
                    timeout: self.drain_timeout,
                });
            }
        }
        {
            let mut slot = lock(&self.engine);
            slot.engine = new.clone();
            slot.generation += 1;
        }
        for (w, io) in workers.iter().zip(fresh) {
            w.resume(Some((io, new.clone())));
        }
        let pause = t0.elapsed();
        self.stats.switches.fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_pause_us
            .store(pause.as_micros() as u64, Ordering::Relaxed);
        info!(drive = %self.cfg.name, %from, to = new.name(), queues = workers.len(), pause_us = pause.as_micros() as u64, "engine switched");
        Ok(SwitchReport {
            from,
            to: new.name().to_string(),
            queues: workers.len(),
            pause,
        })
    }
}

/// Locks a mutex, recovering the data if a thread panicked while holding it: every value
/// under these locks stays consistent between statements.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
