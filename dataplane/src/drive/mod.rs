//! A drive: what the guest sees (config, serial, geometry), which engine serves it, and the
//! live engine switch.
//!
//! A switch never cancels a request and never loses one: it stops every queue worker from
//! popping new requests (they stay in the vring), waits until each queue's in-flight requests
//! have completed on the old engine, hands each worker a context on the new engine, and lets
//! them resume. The time between the first pause and the last resume is the pause the guest
//! can observe, and it is recorded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::engine::held::NullIo;
use crate::engine::{Engine, EngineError, FileEngine, FileEngineConfig, HeldEngine, QueueIo};
use crate::guest_mem::Mem;
use crate::util::lock;
pub use crate::virtio_blk::DeviceModel;
use crate::virtio_blk::{BlkConfig, DiskGeometry, SECTOR_SHIFT};

pub mod lend;
pub mod queue_ctl;
pub mod stats;
pub mod switch;

pub use lend::{LendError, LendReport, Lender};
pub use queue_ctl::{NextEngine, QueueCtl};
pub use stats::{AcctClass, BlockAcct, DriveStats, LatencyHistogram};
pub use switch::{Draining, Paused, SwitchError, SwitchReport};

pub use accel_api::control::{DiscardMode, ErrorPolicy};

/// How often a queue retries the requests it holds (werror=enospc or stop).
pub const HOLD_RETRY: Duration = Duration::from_millis(100);

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
    /// What a failed write, flush, discard or write-zeroes does (QEMU's `werror`).
    pub werror: ErrorPolicy,
    /// What a failed read does (QEMU's `rerror`).
    pub rerror: ErrorPolicy,
    /// Whose device the guest sees: QEMU's virtio-blk's, or (a drive that may lend its
    /// rings) QEMU's vhost-user-blk export's.
    pub model: DeviceModel,
    /// The CHS geometry the virtio-blk model shows (QEMU guesses it from the disk's first
    /// sector at the device's start: [`crate::virtio_blk::guess_chs`]); None: by size.
    pub chs: Option<crate::virtio_blk::Chs>,
}

// The control API checks serials against the same bound the device answers with.
const _: () = assert!(crate::virtio_blk::ID_BYTES == accel_api::control::MAX_SERIAL_BYTES);

/// A drive config that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum DriveConfigError {
    #[error("holds {size} bytes, less than one {block}-byte block")]
    TooSmall { size: u64, block: u32 },
    #[error("serial '{0}' is longer than 20 bytes")]
    SerialTooLong(String),
}

impl DriveConfig {
    /// The one way to finish a config: checks the serial (GET_ID answers 20 bytes at most)
    /// and the size, and rounds the capacity down to whole logical blocks (a tail shorter than
    /// one is not addressable).
    pub fn checked(mut self) -> Result<Self, DriveConfigError> {
        if self.serial.len() > crate::virtio_blk::ID_BYTES {
            return Err(DriveConfigError::SerialTooLong(self.serial));
        }
        let block = u64::from(self.logical_block_size);
        if self.capacity_bytes < block {
            return Err(DriveConfigError::TooSmall {
                size: self.capacity_bytes,
                block: self.logical_block_size,
            });
        }
        self.capacity_bytes = self.capacity_bytes / block * block;
        Ok(self)
    }

    pub fn geometry(&self) -> DiskGeometry {
        DiskGeometry {
            sectors: self.capacity_bytes >> SECTOR_SHIFT,
            block_size: self.logical_block_size,
            read_only: self.read_only,
            model: self.model,
        }
    }
}

struct EngineState {
    engine: Arc<dyn Engine>,
    generation: u64,
    /// A pause is in progress: workers that start now start paused, with no engine context.
    paused: bool,
}

pub struct Drive {
    cfg: DriveConfig,
    engine: Mutex<EngineState>,
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
    /// Whether the last driver session negotiated CONFIG_WCE (0 none yet, 1 no, 2 yes).
    session_wce: std::sync::atomic::AtomicU8,
    /// A migration's switchover released the image (flushed, unlocked, closed): how to open
    /// it again if the migration does not complete.
    handed_off: Mutex<Option<FileEngineConfig>>,
    /// The direct engine an overlapped switch left, until its writes are durable: a flush
    /// meanwhile syncs it first (the new engine, QEMU, skips a flush when nothing was
    /// written through it).
    unsynced: Mutex<Option<Arc<dyn Engine>>>,
    /// The disk's size as the guest sees it (whole logical blocks): the config's at start, a
    /// resize's afterwards (see [`Drive::set_capacity`]).
    capacity: std::sync::atomic::AtomicU64,
    /// The frontend's backend channel (vhost-user `SET_BACKEND_REQ_FD`), kept by the vhost
    /// layer to tell the frontend that the config space changed.
    pub backend_channel: Mutex<Option<std::os::unix::net::UnixStream>>,
    /// The features the guest's driver negotiated (vhost-user SET_FEATURES).
    acked_features: std::sync::atomic::AtomicU64,
    /// Held by whoever changes who owns the rings: each vhost-user message, a lend, a
    /// take-back (see `lend`).
    ring_gate: Mutex<()>,
    /// The rings lent to QEMU's export, while they are.
    lent: Mutex<Option<Lent>>,
    /// (changes of the running queues, a lender must stop), for a [`lend::Lender`].
    queue_events: (Mutex<(u64, bool)>, std::sync::Condvar),
    pub stats: DriveStats,
    pub drain_timeout: Duration,
}

/// A lend in place (made and ended by [`lend`]; here because the drive holds it).
struct Lent {
    client: crate::vu_frontend::Client,
    socket: std::path::PathBuf,
    peer_uid: Option<u32>,
    rings: Vec<LentRing>,
    since: std::time::Instant,
}

struct LentRing {
    ctl: Arc<QueueCtl>,
    index: u32,
    size: u16,
    used: u64,
    mem: Arc<Mem>,
}

impl Drive {
    pub fn new(cfg: DriveConfig, engine: Arc<dyn Engine>) -> Arc<Self> {
        let writeback = !cfg.read_only;
        let capacity = std::sync::atomic::AtomicU64::new(cfg.capacity_bytes);
        Arc::new(Drive {
            cfg,
            capacity,
            backend_channel: Mutex::new(None),
            acked_features: std::sync::atomic::AtomicU64::new(0),
            ring_gate: Mutex::new(()),
            lent: Mutex::new(None),
            queue_events: (Mutex::new((0, false)), std::sync::Condvar::new()),
            engine: Mutex::new(EngineState {
                engine,
                generation: 0,
                paused: false,
            }),
            switching: AtomicBool::new(false),
            attach_lock: Mutex::new(()),
            running: Mutex::new(Vec::new()),
            writeback: AtomicBool::new(writeback),
            session_wce: std::sync::atomic::AtomicU8::new(0),
            handed_off: Mutex::new(None),
            unsynced: Mutex::new(None),
            stats: DriveStats::default(),
            drain_timeout: Duration::from_secs(30),
        })
    }

    /// The drive's fixed configuration. Its `capacity_bytes` is the size at start; the live
    /// size is [`Drive::capacity`].
    pub fn config(&self) -> &DriveConfig {
        &self.cfg
    }

    /// The disk's size now, in bytes (whole logical blocks).
    pub fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Acquire)
    }

    /// The image was resized (QEMU's `block_resize`, the drive paused): requests are checked
    /// against `bytes`, rounded down to whole logical blocks, from now on, and the config
    /// space shows it. Returns the new capacity.
    pub fn set_capacity(&self, bytes: u64) -> u64 {
        let block = u64::from(self.cfg.logical_block_size.max(1));
        let c = bytes / block * block;
        self.capacity.store(c, Ordering::Release);
        c
    }

    /// Whether any queue runs (the guest's driver started the device).
    pub fn has_running_queues(&self) -> bool {
        !lock(&self.running).is_empty()
    }

    /// Waits until at least `n` queues run (their workers attached), at most `timeout`.
    pub fn wait_running_queues(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &self.queue_events;
        let mut g = lock(m);
        while lock(&self.running).len() < n {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            g = cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Sectors, block size and read-only, with the live capacity.
    pub fn geometry(&self) -> DiskGeometry {
        DiskGeometry {
            sectors: self.capacity() >> SECTOR_SHIFT,
            ..self.cfg.geometry()
        }
    }

    /// The config space as the device the drive looks like (its `model`) would show it now.
    pub fn blk_config(&self) -> BlkConfig {
        let (sectors, bs, q) = (
            self.capacity() >> SECTOR_SHIFT,
            self.cfg.logical_block_size,
            self.cfg.num_queues,
        );
        let mut c = match self.cfg.model {
            DeviceModel::Export => BlkConfig::qemu_like(sectors, bs, q),
            DeviceModel::VirtioBlk => {
                // QEMU guesses the geometry once, at the device's start: a resize keeps it.
                let at_start = self.cfg.capacity_bytes >> SECTOR_SHIFT;
                let mut c = match self.cfg.chs {
                    Some(chs) => BlkConfig::virtio_blk_with_chs(at_start, bs, q, chs),
                    None => BlkConfig::virtio_blk_like(at_start, bs, q),
                };
                c.capacity = sectors;
                c
            }
        };
        c.writeback = u8::from(self.writeback());
        c
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

    /// A driver acked its features: the cache mode follows QEMU's virtio-blk. Without
    /// CONFIG_WCE the write cache is what FLUSH says (virtio 1.2, 5.2.6.1: a driver that cannot
    /// flush gets write-through); with it, the mode the driver last chose stays, except after a
    /// session without CONFIG_WCE (firmware before the OS, as SeaBIOS), which QEMU's reset
    /// undoes: the default comes back.
    pub fn features_acked(&self, flush: bool, config_wce: bool) {
        let prev = self
            .session_wce
            .swap(if config_wce { 2 } else { 1 }, Ordering::Relaxed);
        if !config_wce {
            self.set_writeback(flush && !self.cfg.read_only);
        } else if prev == 1 {
            self.set_writeback(!self.cfg.read_only);
        }
    }

    /// Retries every held request of the drive now (werror=enospc or stop; they are also
    /// retried on their own every [`HOLD_RETRY`]). Returns how many were held.
    pub fn retry_held(&self) -> u64 {
        let held = self.stats.held_requests.load(Ordering::Relaxed);
        for w in lock(&self.running).iter() {
            w.request_retry();
        }
        held
    }

    /// The engine whose completed writes a flush must sync first (see `unsynced`).
    pub(crate) fn unsynced_old(&self) -> Option<Arc<dyn Engine>> {
        lock(&self.unsynced).clone()
    }

    /// Whether a migration's switchover released the image (see [`Drive::hand_off_image`]).
    pub fn image_handed_off(&self) -> bool {
        lock(&self.handed_off).is_some()
    }

    /// A migration's switchover, on the source: with every queue stopped and drained, makes
    /// the image durable (fdatasync, as QEMU flushes before it inactivates its nodes), drops
    /// its locks and closes it, so the destination can open it. The drive holds until
    /// [`Drive::take_back_image`]. Only the direct engine owns an image; the others keep
    /// what they have. Returns whether the image was released.
    pub fn hand_off_image(&self) -> bool {
        if self.switching.swap(true, Ordering::AcqRel) {
            warn!(drive = %self.cfg.name, "a switch is running at the migration's switchover; image kept");
            return false;
        }
        let released = {
            let mut slot = lock(&self.engine);
            match slot.engine.file_config() {
                Some(cfg) if lock(&self.running).is_empty() => {
                    if let Err(e) = slot.engine.sync_data() {
                        // The writes were acknowledged already; the destination reads the
                        // page cache on this host, and a remote one sees the error's effect.
                        warn!(drive = %self.cfg.name, "fdatasync before the hand-off failed: {e}");
                    }
                    slot.engine.release();
                    // The last reference to the file goes here (queue contexts went with
                    // the workers): closing it is what NFS's close-to-open needs.
                    slot.engine = Arc::new(HeldEngine);
                    slot.generation += 1;
                    *lock(&self.handed_off) = Some(cfg);
                    true
                }
                _ => false,
            }
        };
        self.switching.store(false, Ordering::Release);
        if released {
            info!(drive = %self.cfg.name, "migration switchover: image flushed, unlocked and closed");
        }
        released
    }

    /// Opens the image released by [`Drive::hand_off_image`] again, with its locks (the
    /// migration failed or was cancelled). Fails if another holder has it (the destination).
    pub fn take_back_image(&self) -> Result<(), EngineError> {
        let Some(cfg) = lock(&self.handed_off).clone() else {
            return Ok(());
        };
        let e = FileEngine::open(cfg)?;
        let mut slot = lock(&self.engine);
        slot.engine = Arc::new(e);
        slot.generation += 1;
        *lock(&self.handed_off) = None;
        Ok(())
    }

    /// Called by a worker as it starts: the current engine's context for its queue, or a null
    /// context and a paused start while the drive is held or a switch is in progress (the
    /// `bool`: the worker must start paused, whatever its control state says by the time its
    /// thread runs, since the resume that ends the pause may come first and leaves the real
    /// context in [`QueueCtl`]'s `next`). Registers the worker so that switches pause it.
    pub(crate) fn attach_worker(
        &self,
        ctl: &Arc<QueueCtl>,
        depth: u32,
    ) -> Result<(NextEngine, bool), EngineError> {
        let _a = lock(&self.attach_lock);
        let (engine, paused) = {
            let slot = lock(&self.engine);
            (slot.engine.clone(), slot.paused)
        };
        let start_paused = paused || engine.holds();
        let io = if start_paused {
            ctl.start_paused();
            Box::new(NullIo::new()?) as Box<dyn QueueIo>
        } else {
            engine.open_queue(ctl.index(), depth, ctl.mem())?
        };
        lock(&self.running).push(ctl.clone());
        self.queues_changed();
        Ok(((io, engine), start_paused))
    }

    pub(crate) fn detach_worker(&self, ctl: &Arc<QueueCtl>) {
        lock(&self.running).retain(|c| !Arc::ptr_eq(c, ctl));
        self.queues_changed();
    }
}
