//! The vhost-user side: protocol state of one connection, and the listener that outlives
//! connections.
//!
//! We implement the `vhost` crate's request-handler trait ourselves instead of using
//! `vhost-user-backend`, because that crate answers `GET_VRING_BASE` before the backend's
//! in-flight requests complete (exactly what BRIEF §2 measured QEMU's own export doing wrong).
//! Here `GET_VRING_BASE` stops the queue's worker, waits for every popped request to be in the
//! used ring, and only then replies with `next_avail`: a `stop`, a reconnect or a restart never
//! replays or loses a request.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use thiserror::Error;
use tracing::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    BackendListener, BackendReqHandler, Error as VuError, GpuBackend, Listener, Result as VuResult,
    VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::bindings::virtio_config::{VIRTIO_F_NOTIFY_ON_EMPTY, VIRTIO_F_VERSION_1};
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap};
use vmm_sys_util::eventfd::EventFd;

mod backend_channel;

pub use backend_channel::notify_config_change;

use crate::drive::Drive;
use crate::guest_mem::dirty_log::{DirtyLog, LogMap};
use crate::guest_mem::{Mem, MemHandle};
use crate::queue::inflight::InflightRegion;
use crate::queue::{self, CallHandle, WorkerHandle, WorkerParams, NO_USED_LOG};
use crate::util::lock;
use crate::virtio_blk::{self, CONFIG_LEN, CONFIG_WRITEBACK_OFFSET};

/// Memory slots we accept (libvhost-user and QEMU's export use the same number).
const MAX_MEM_SLOTS: u64 = 509;

/// The protocol features acceld implements. BACKEND_REQ is only for the config-change
/// message after a resize (see `backend_channel`). Not offered: BACKEND_SEND_FD,
/// HOST_NOTIFIER, PAGEFAULT (postcopy), DEVICE_STATE (virtio-blk has no backend state).
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
}

/// Virtio and vhost feature bits offered to the frontend for a drive: the device set of its
/// model (QEMU's virtio-blk, or its export), with VHOST_F_LOG_ALL (dirty logging for live
/// migration).
///
/// Not VIRTIO_F_RING_RESET, although QEMU's virtio-blk offers it and QEMU's vhost-user-blk
/// device would pass it to the guest: that device never tells its back-end of a guest's
/// ring reset, so acceld would go on serving the old ring (docs/libvirt.md).
pub fn virtio_features(cfg: &crate::drive::DriveConfig) -> u64 {
    virtio_blk::device_features(cfg.read_only, cfg.model, cfg.num_queues)
        | 1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_F_NOTIFY_ON_EMPTY
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | VhostUserVirtioFeatures::LOG_ALL.bits()
}

/// The used-ring log address a worker sees: [`NO_USED_LOG`] until SET_VRING_ADDR asks for
/// VHOST_VRING_F_LOG.
struct UsedLog(Arc<AtomicU64>);

impl Default for UsedLog {
    fn default() -> Self {
        UsedLog(Arc::new(AtomicU64::new(NO_USED_LOG)))
    }
}

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("socket {0} is in use by another server")]
    SocketInUse(PathBuf),
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: VuError,
    },
    #[error("cannot accept a connection")]
    Accept(#[source] VuError),
    #[error("poll failed")]
    Poll(#[source] io::Error),
}

/// One region of the frontend's memory table: where the frontend maps it, to translate the
/// vring addresses it sends (its own virtual addresses) into guest-physical ones.
struct Mapping {
    gpa: u64,
    size: u64,
    user_addr: u64,
    region: Arc<GuestRegionMmap<()>>,
}

impl Mapping {
    /// Maps one region the frontend sent (SET_MEM_TABLE or ADD_MEM_REGION). A region that
    /// reaches past the end of its file is refused: touching a mapped page past the end of a
    /// file is SIGBUS, which would end acceld and every drive it serves.
    fn new(r: &VhostUserMemoryRegion, file: File, untrusted: bool) -> VuResult<Self> {
        check_sealed(&file, untrusted)?;
        let meta = file.metadata().map_err(VuError::ReqHandlerError)?;
        let end = r.mmap_offset.checked_add(r.memory_size);
        if meta.file_type().is_file() && end.is_none_or(|e| e > meta.len()) {
            return Err(VuError::InvalidParam);
        }
        if r.memory_size == 0 || r.guest_phys_addr.checked_add(r.memory_size).is_none() {
            return Err(VuError::InvalidParam);
        }
        let region = GuestRegionMmap::new(r.mmap_region(file)?, GuestAddress(r.guest_phys_addr))
            .ok_or(VuError::InvalidParam)?;
        Ok(Mapping {
            gpa: r.guest_phys_addr,
            size: r.memory_size,
            user_addr: r.user_addr,
            region: Arc::new(region),
        })
    }
}

#[derive(Default)]
struct VringState {
    size: u16,
    base: u16,
    desc: u64,
    avail: u64,
    used: u64,
    addr_set: bool,
    kick: Option<EventFd>,
    call: CallHandle,
    /// The error eventfd (SET_VRING_ERR): signalled when the worker finds the ring broken.
    err: CallHandle,
    enabled: bool,
    worker: Option<WorkerHandle>,
    used_log: UsedLog,
}

/// Protocol state of one frontend connection. A new connection gets a new one.
pub struct Connection {
    drive: Arc<Drive>,
    acked_features: u64,
    acked_protocol: u64,
    owned: bool,
    mem: MemHandle,
    mem_set: bool,
    maps: Vec<Mapping>,
    vrings: Vec<VringState>,
    /// The inflight region (GET_INFLIGHT_FD / SET_INFLIGHT_FD): kept by the frontend across
    /// this backend's death, so a new acceld resubmits what was in flight.
    inflight: Option<Arc<InflightRegion>>,
    /// The dirty log (live migration), shared with the workers.
    log: Arc<DirtyLog>,
    /// The connection must close: a request failed that the frontend waits on without a
    /// reply (SET_LOG_BASE), and only a disconnect unblocks it.
    fatal: bool,
    /// When the switchover's first ring stop began (see `note_switchover_stop`).
    stop_started: Option<std::time::Instant>,
    /// The front-end does not run as root: the memory it maps into acceld must be sealed
    /// (see [`check_sealed`]).
    untrusted: bool,
}

impl Connection {
    pub fn new(drive: Arc<Drive>) -> Self {
        let n = usize::from(drive.config().num_queues);
        Connection {
            drive,
            acked_features: 0,
            acked_protocol: 0,
            owned: false,
            mem: Arc::new(Mutex::new(Arc::new(Mem::default()))),
            mem_set: false,
            maps: Vec::new(),
            vrings: (0..n).map(|_| VringState::default()).collect(),
            inflight: None,
            log: DirtyLog::new(),
            fatal: false,
            stop_started: None,
            untrusted: false,
        }
    }

    /// Whether the server must close this connection now (see `fatal`).
    pub fn must_close(&self) -> bool {
        self.fatal
    }

    /// A ring stops while the device logs: if every ring was running, the switchover's stop
    /// starts now (timed until the image is released).
    fn note_switchover_stop(&mut self) {
        if self.log_all_acked() && self.vrings.iter().all(|v| v.worker.is_some()) {
            self.stop_started = Some(std::time::Instant::now());
        }
    }

    fn log_all_acked(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0
    }

    fn event_idx(&self) -> bool {
        self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0
    }

    fn vring(&mut self, index: u32) -> VuResult<&mut VringState> {
        self.vrings
            .get_mut(index as usize)
            .ok_or(VuError::InvalidParam)
    }

    fn va_to_gpa(&self, va: u64) -> VuResult<u64> {
        self.maps
            .iter()
            .find(|m| va >= m.user_addr && va - m.user_addr < m.size)
            .map(|m| m.gpa + (va - m.user_addr))
            .ok_or(VuError::InvalidParam)
    }

    fn rebuild_memory(&mut self) -> VuResult<()> {
        let regions = self.maps.iter().map(|m| m.region.clone()).collect();
        let mem = GuestMemoryMmap::from_arc_regions(regions)
            .map_err(|e| VuError::ReqHandlerError(io::Error::other(e)))?;
        *lock(&self.mem) = Arc::new(mem);
        self.mem_set = !self.maps.is_empty();
        Ok(())
    }

    /// Starts the worker of a queue once it has everything it needs.
    fn maybe_start(&mut self, index: usize) -> VuResult<()> {
        let event_idx = self.event_idx();
        let mem_set = self.mem_set;
        let mem = self.mem.clone();
        let drive = self.drive.clone();
        let mut inflight = self.inflight.as_ref().and_then(|r| r.queue(index));
        let v = &mut self.vrings[index];
        if v.worker.is_some() || !v.enabled || !v.addr_set || v.kick.is_none() || !mem_set {
            return Ok(());
        }
        // The descriptor table, the avail ring and the used ring must not overlap (VIRTIO 1.2
        // §2.7): rings that do make the device's own writes change what it reads.
        let n = u64::from(v.size);
        let spans = [(v.desc, 16 * n), (v.avail, 6 + 2 * n), (v.used, 6 + 8 * n)];
        let overlap = |(a, la): (u64, u64), (b, lb): (u64, u64)| {
            a < b.saturating_add(lb) && b < a.saturating_add(la)
        };
        if overlap(spans[0], spans[1]) || overlap(spans[0], spans[2]) || overlap(spans[1], spans[2])
        {
            if let Some(n) = drive.stats.log.vhost.admit() {
                warn!(drive = %drive.config().name, queue = index, "vring parts overlap{}", crate::util::suppressed(n));
            }
            return Err(VuError::InvalidParam);
        }
        // A migration stop released the image (the source side); the rings restarting means
        // the migration failed or was cancelled, and this side serves the guest again. If the
        // migration did complete (someone restarted a migrated-away VM), the destination
        // holds the image's locks and the open fails: requests wait, nothing is corrupted.
        if drive.image_handed_off() {
            match drive.take_back_image() {
                Ok(()) => {
                    info!(drive = %drive.config().name, "image taken back after the migration stopped")
                }
                Err(e) => {
                    if let Some(n) = drive.stats.log.vhost.admit() {
                        warn!(drive = %drive.config().name, "cannot take the image back, requests wait: {}{}", crate::util::error_chain(&e), crate::util::suppressed(n));
                    }
                }
            }
        }
        let max = drive.config().queue_size;
        let mut q = Queue::new(max).map_err(|_| VuError::InvalidParam)?;
        q.try_set_size(v.size).map_err(|_| VuError::InvalidParam)?;
        q.try_set_desc_table_address(GuestAddress(v.desc))
            .map_err(|_| VuError::InvalidParam)?;
        q.try_set_avail_ring_address(GuestAddress(v.avail))
            .map_err(|_| VuError::InvalidParam)?;
        q.try_set_used_ring_address(GuestAddress(v.used))
            .map_err(|_| VuError::InvalidParam)?;
        q.set_event_idx(event_idx);
        q.set_next_avail(v.base);
        let mut resubmit = Vec::new();
        {
            let m = lock(&mem).clone();
            // The used index in guest memory is the truth (a previous backend may have left
            // it anywhere); start adding after it.
            let used = q
                .used_idx(&*m, std::sync::atomic::Ordering::Acquire)
                .map_err(|_| VuError::InvalidParam)?;
            q.set_next_used(used.0);
            if let Some(iq) = inflight.as_mut() {
                // Requests the previous backend popped and never completed are resubmitted
                // first, in their order; popping goes on after them (the frontend's base is
                // the used index after a crash).
                let rec = iq.start(used.0, v.size);
                if let Some(next) = rec.next_avail {
                    q.set_next_avail(next);
                }
                if !rec.resubmit.is_empty() {
                    // The frontend controls the region: budgeted like its other lines.
                    if let Some(n) = drive.stats.log.vhost.admit() {
                        info!(drive = %drive.config().name, queue = index, requests = rec.resubmit.len(),
                            "resubmitting the requests in flight when the previous acceld stopped{}",
                            crate::util::suppressed(n));
                    }
                }
                drive.stats.resubmitted.fetch_add(
                    rec.resubmit.len() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                resubmit = rec.resubmit;
            }
            q.set_ready(true);
            if !q.is_valid(&*m) {
                if let Some(n) = drive.stats.log.vhost.admit() {
                    warn!(drive = %drive.config().name, queue = index, "vring addresses outside guest memory{}", crate::util::suppressed(n));
                }
                return Err(VuError::InvalidParam);
            }
        }
        let kick = v
            .kick
            .as_ref()
            .expect("checked")
            .try_clone()
            .map_err(VuError::ReqHandlerError)?;
        let h = queue::spawn(WorkerParams {
            drive,
            index,
            queue: q,
            mem,
            kick,
            call: v.call.clone(),
            err: v.err.clone(),
            inflight,
            resubmit,
            log: self.log.clone(),
            used_log: v.used_log.0.clone(),
        })
        .map_err(|e| VuError::ReqHandlerError(io::Error::other(e)))?;
        debug!(queue = index, size = v.size, base = v.base, "queue started");
        v.worker = Some(h);
        Ok(())
    }

    /// Stops a queue's worker after its in-flight requests completed; keeps `next_avail`.
    fn stop_queue(&mut self, index: usize) {
        let v = &mut self.vrings[index];
        if let Some(h) = v.worker.take() {
            if let Some(q) = h.stop() {
                v.base = q.next_avail();
                debug!(queue = index, base = v.base, "queue stopped");
            }
        }
    }

    /// Drains and stops every queue: on disconnect, shutdown and reset.
    pub fn stop_all(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop_queue(i);
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// A kick, call or error descriptor the front-end sent, if it is an eventfd (anything else,
/// a full pipe for one, could hold a worker in `write`), made non-blocking: a write to a
/// counter at its maximum then fails at once instead of waiting for the front-end to read.
/// Memory a front-end that does not run as root maps into acceld (guest RAM, the dirty log,
/// the inflight region) must be a memfd sealed against shrinking: a region its owner could
/// truncate after acceld mapped it makes acceld's next access SIGBUS, which would end every
/// VM's drives. QEMU's `memory-backend-memfd` seals by default, and so are its dirty log and
/// acceld's own inflight region. A root front-end is trusted as far as root already is.
fn check_sealed(f: &File, untrusted: bool) -> VuResult<()> {
    if !untrusted {
        return Ok(());
    }
    // SAFETY: fcntl F_GET_SEALS on an open descriptor has no memory effects.
    let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(VuError::InvalidParam);
    }
    Ok(())
}

fn file_to_eventfd(f: File) -> VuResult<EventFd> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .map_err(VuError::ReqHandlerError)?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(VuError::InvalidParam);
    }
    crate::util::set_nonblocking(f.as_raw_fd(), true).map_err(VuError::ReqHandlerError)?;
    // SAFETY: the descriptor is an eventfd (checked above); we take ownership of it, which
    // the File gives up with into_raw_fd, so it is owned exactly once.
    Ok(unsafe { EventFd::from_raw_fd(f.into_raw_fd()) })
}

impl VhostUserBackendReqHandlerMut for Connection {
    fn set_owner(&mut self) -> VuResult<()> {
        if self.owned {
            return Err(VuError::InvalidOperation("already claimed"));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.stop_all();
        self.owned = false;
        self.acked_features = 0;
        self.log.set_log_all(false);
        self.acked_protocol = 0;
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        self.stop_all();
        for v in &mut self.vrings {
            *v = VringState::default();
        }
        self.acked_features = 0;
        self.log.set_log_all(false);
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(virtio_features(self.drive.config()))
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        let offered = virtio_features(self.drive.config());
        if features & !offered != 0 {
            return Err(VuError::InvalidParam);
        }
        let log_all = features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0;
        if log_all != self.log_all_acked() {
            if let Some(n) = self.drive.stats.log.vhost.admit() {
                info!(drive = %self.drive.config().name, on = log_all, "dirty logging (migration){}", crate::util::suppressed(n));
            }
        }
        self.log.set_log_all(log_all);
        self.acked_features = features;
        self.drive.set_acked_features(features);
        self.drive.features_acked(
            features & (1 << virtio_blk::F_FLUSH) != 0,
            features & (1 << virtio_blk::F_CONFIG_WCE) != 0,
        );
        // Without PROTOCOL_FEATURES, rings start enabled (vhost-user spec, "Ring states").
        let enabled = features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0;
        for i in 0..self.vrings.len() {
            if self.vrings[i].worker.is_none() {
                self.vrings[i].enabled = enabled;
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy_listening.is_some() {
            return Err(VuError::InvalidOperation("postcopy not supported"));
        }
        let maps = ctx
            .iter()
            .zip(files)
            .map(|(r, f)| Mapping::new(r, f, self.untrusted))
            .collect::<VuResult<Vec<_>>>()?;
        self.maps = maps;
        self.rebuild_memory()?;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        let max = u32::from(self.drive.config().queue_size);
        if num == 0 || num > max || !num.is_power_of_two() {
            return Err(VuError::InvalidParam);
        }
        self.vring(index)?.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> VuResult<()> {
        let desc = self.va_to_gpa(descriptor)?;
        let used = self.va_to_gpa(used)?;
        let avail = self.va_to_gpa(available)?;
        let v = self.vring(index)?;
        // The used ring's log address reaches a running worker too (QEMU turns F_LOG on for
        // started rings when a migration begins).
        let at = if flags.contains(VhostUserVringAddrFlags::VHOST_VRING_F_LOG) {
            log
        } else {
            NO_USED_LOG
        };
        v.used_log.0.store(at, Ordering::Release);
        v.desc = desc;
        v.used = used;
        v.avail = avail;
        v.addr_set = true;
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        let v = self.vring(index)?;
        if v.worker.is_some() {
            return Err(VuError::InvalidOperation("queue is running"));
        }
        v.base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        self.vring(index)?;
        self.note_switchover_stop();
        // Completes every popped request before answering (see the module doc).
        self.stop_queue(index as usize);
        // The last queue stopping while the device logs is a migration's switchover: the
        // destination opens the image once this reply went out and the VM state followed, so
        // the image is flushed and its locks released first.
        if self.log_all_acked() && self.vrings.iter().all(|v| v.worker.is_none()) {
            self.drive.hand_off_image();
            if let Some(t0) = self.stop_started.take() {
                self.drive
                    .stats
                    .switchover_stop_us
                    .store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            }
        }
        let v = &mut self.vrings[index as usize];
        let base = v.base;
        // The ring is stopped; a new start needs a new kick (vhost-user spec).
        v.kick = None;
        v.addr_set = false;
        v.enabled = self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0;
        Ok(VhostUserVringState::new(index, u32::from(base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let index = u32::from(index);
        self.vring(index)?;
        let Some(fd) = fd else {
            return Err(VuError::InvalidOperation(
                "polling mode (no kick fd) is not supported",
            ));
        };
        let ev = file_to_eventfd(fd)?;
        self.stop_queue(index as usize);
        self.vrings[index as usize].kick = Some(ev);
        self.maybe_start(index as usize)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let ev = fd.map(file_to_eventfd).transpose()?;
        let v = self.vring(u32::from(index))?;
        let running = v.worker.is_some();
        let mut call = lock(&v.call);
        *call = ev;
        // A running worker may have signalled the old fd after the front-end stopped
        // reading it (QEMU swaps a vector's call fd when the guest masks or unmasks it, and
        // reads the old one only before sending the new): that interrupt is lost. So one
        // interrupt on the new fd, sent after the swap and under the lock the worker takes
        // to signal, so that every completion is either before this signal or signalled
        // on the new fd itself. Signalling before the swap would leave a window: the guest
        // takes that interrupt, finds nothing, re-arms, and the worker's next completion
        // still goes to the old fd. A spurious interrupt only makes the driver look.
        if running {
            if let Some(e) = call.as_ref() {
                let _ = e.write(1);
            }
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let ev = fd.map(file_to_eventfd).transpose()?;
        let v = self.vring(u32::from(index))?;
        *lock(&v.err) = ev;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        if features & !protocol_features().bits() != 0 {
            return Err(VuError::InvalidParam);
        }
        self.acked_protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(u64::from(self.drive.config().num_queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        self.vring(index)?;
        let i = index as usize;
        if !enable {
            self.note_switchover_stop();
        }
        if enable {
            self.vrings[i].enabled = true;
            self.maybe_start(i)
        } else {
            self.stop_queue(i);
            self.vrings[i].enabled = false;
            Ok(())
        }
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VuResult<Vec<u8>> {
        let cfg = self.drive.blk_config().to_bytes();
        let (offset, size) = (offset as usize, size as usize);
        let end = offset.checked_add(size).ok_or(VuError::InvalidParam)?;
        if end > 256 {
            return Err(VuError::InvalidParam);
        }
        // Exactly `size` bytes; past the structure the space reads as zero.
        let mut out = vec![0u8; size];
        if offset < CONFIG_LEN {
            let n = (CONFIG_LEN - offset).min(size);
            out[..n].copy_from_slice(&cfg[offset..offset + n]);
        }
        Ok(out)
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VuResult<()> {
        // Only `writeback` is writable (VIRTIO_BLK_F_CONFIG_WCE).
        if offset as usize != CONFIG_WRITEBACK_OFFSET || buf.len() != 1 {
            return Err(VuError::InvalidParam);
        }
        self.drive.set_writeback(buf[0] != 0);
        Ok(())
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(VuError::InvalidOperation("not a gpu device"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(VuError::InvalidOperation(
            "shared objects are not supported",
        ))
    }

    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VuResult<(VhostUserInflight, File)> {
        // Sized from the front-end's numbers: never more than this device has.
        let c = self.drive.config();
        if inflight.num_queues > c.num_queues || inflight.queue_size > c.queue_size {
            return Err(VuError::InvalidParam);
        }
        let region = InflightRegion::create(inflight.num_queues, inflight.queue_size)
            .map_err(|e| VuError::ReqHandlerError(io::Error::other(e)))?;
        let file = region
            .file()
            .try_clone()
            .map_err(VuError::ReqHandlerError)?;
        let reply = VhostUserInflight {
            mmap_size: region.len() as u64,
            mmap_offset: 0,
            num_queues: inflight.num_queues,
            queue_size: inflight.queue_size,
        };
        self.inflight = Some(Arc::new(region));
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        let c = self.drive.config();
        if inflight.num_queues > c.num_queues || inflight.queue_size > c.queue_size {
            return Err(VuError::InvalidParam);
        }
        check_sealed(&file, self.untrusted)?;
        let region = InflightRegion::map(
            file,
            inflight.mmap_size,
            inflight.mmap_offset,
            inflight.num_queues,
            inflight.queue_size,
        )
        .map_err(|e| VuError::ReqHandlerError(io::Error::other(e)))?;
        if let Some(n) = self.drive.stats.log.vhost.admit() {
            info!(
                drive = %self.drive.config().name,
                queues = inflight.num_queues,
                queue_size = inflight.queue_size,
                "inflight region set{}",
                crate::util::suppressed(n)
            );
        }
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy_listening: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        if postcopy_listening.is_some() {
            return Err(VuError::InvalidOperation("postcopy not supported"));
        }
        if self.maps.len() as u64 >= MAX_MEM_SLOTS {
            return Err(VuError::InvalidParam);
        }
        self.maps.push(Mapping::new(region, fd, self.untrusted)?);
        if let Err(e) = self.rebuild_memory() {
            self.maps.pop();
            return Err(e);
        }
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        let before = self.maps.len();
        self.maps.retain(|m| {
            !(m.gpa == region.guest_phys_addr
                && m.size == region.memory_size
                && m.user_addr == region.user_addr)
        });
        if self.maps.len() == before {
            return Err(VuError::InvalidParam);
        }
        self.rebuild_memory()
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(VuError::InvalidOperation(
            "device state transfer is not supported",
        ))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(VuError::InvalidOperation(
            "device state transfer is not supported",
        ))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(VuError::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VuResult<()> {
        if let Err(e) = check_sealed(&file, self.untrusted) {
            // As for a log that cannot be mapped: the frontend waits for no reply.
            self.fatal = true;
            return Err(e);
        }
        match LogMap::map(&file, log.mmap_size, log.mmap_offset) {
            Ok(m) => {
                if let Some(n) = self.drive.stats.log.vhost.admit() {
                    info!(drive = %self.drive.config().name, bytes = m.len(), "dirty log set{}", crate::util::suppressed(n));
                }
                self.log.set_map(m);
                Ok(())
            }
            Err(e) => {
                // The frontend waits for this reply; an error gets none, so only closing the
                // connection lets it go on (QEMU treats it as a backend disconnect).
                if let Some(n) = self.drive.stats.log.vhost.admit() {
                    warn!(drive = %self.drive.config().name, "refusing the dirty log, closing the connection: {}{}", crate::util::error_chain(&e), crate::util::suppressed(n));
                }
                self.fatal = true;
                Err(VuError::ReqHandlerError(io::Error::other(e)))
            }
        }
    }
}

/// A persistent vhost-user listener for one drive: frontends come and go, each connection gets
/// fresh protocol state, and the drive (engine, counters) stays.
pub struct Server {
    drive: Arc<Drive>,
    path: PathBuf,
    listener: Listener,
    shutdown: Arc<EventFd>,
    /// Connections served so far.
    pub connections: u64,
}

/// Requests a server loop to stop: drain, close, return.
#[derive(Clone)]
pub struct ShutdownHandle(Arc<EventFd>);

impl ShutdownHandle {
    pub fn shutdown(&self) {
        let _ = self.0.write(1);
    }
}

impl Server {
    /// Binds the socket. An existing socket that a live server answers on is an error; a
    /// stale one (left by a crash) is replaced.
    pub fn bind(path: &Path, drive: Arc<Drive>) -> Result<Self, ServeError> {
        // Never a blocking connect: the socket's directory may be the VM's user's, who
        // can plant a listener that never accepts.
        if path.symlink_metadata().is_ok() {
            if crate::util::socket_listening(path) {
                return Err(ServeError::SocketInUse(path.to_path_buf()));
            }
            let _ = std::fs::remove_file(path);
        }
        let listener = Listener::new(path, true).map_err(|source| ServeError::Listen {
            path: path.to_path_buf(),
            source,
        })?;
        let shutdown =
            EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).map_err(ServeError::Poll)?;
        Ok(Server {
            drive,
            path: path.to_path_buf(),
            listener,
            shutdown: Arc::new(shutdown),
            connections: 0,
        })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.shutdown.clone())
    }

    pub fn drive(&self) -> &Arc<Drive> {
        &self.drive
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves frontends one after another until shutdown. On shutdown the current connection
    /// is drained (every popped request completes) before the socket closes, so a frontend that
    /// reconnects later replays nothing.
    pub fn run(&mut self) -> Result<(), ServeError> {
        loop {
            match wait_readable(self.listener.as_raw_fd(), self.shutdown.as_raw_fd())
                .map_err(ServeError::Poll)?
            {
                Ready::Shutdown => break,
                Ready::Fd => {}
            }
            let conn = Arc::new(Mutex::new(Connection::new(self.drive.clone())));
            let mut bl = BackendListener::new(&mut self.listener, conn.clone())
                .map_err(ServeError::Accept)?;
            let Some(handler) = bl.accept().map_err(ServeError::Accept)? else {
                continue;
            };
            self.connections += 1;
            let peer = crate::util::peer_uid(handler.as_raw_fd());
            let mut session = Session::new(self.drive.clone(), conn, handler, MESSAGE_TIMEOUT);
            session.set_untrusted(peer != Some(0));
            if let Some(n) = self.drive.stats.log.vhost.admit() {
                info!(drive = %self.drive.config().name, socket = %self.path.display(), "frontend connected{}", crate::util::suppressed(n));
            }
            let served = loop {
                match session.serve_next(self.shutdown.as_raw_fd()) {
                    Served::Next => {}
                    end => break end,
                }
            };
            // Dropping the session drains before the socket closes.
            drop(session);
            if served == Served::Shutdown {
                break;
            }
        }
        Ok(())
    }
}

/// What [`Session::serve_next`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A message was handled (answered, or refused with the connection intact).
    Next,
    /// The connection is over: the front-end left, broke the protocol, or took too long.
    Closed,
    /// The server was asked to stop.
    Shutdown,
}

/// One front-end's connection, served message by message as [`Server::run`] serves each: the
/// backend channel's peek, the lent rings taken back, the errors that keep or end the
/// connection. Dropping it drains every queue (every popped request completes) before the
/// socket closes.
pub struct Session {
    drive: Arc<Drive>,
    conn: Arc<Mutex<Connection>>,
    handler: BackendReqHandler<Mutex<Connection>>,
    timeout: std::time::Duration,
}

impl Session {
    fn new(
        drive: Arc<Drive>,
        conn: Arc<Mutex<Connection>>,
        handler: BackendReqHandler<Mutex<Connection>>,
        timeout: std::time::Duration,
    ) -> Self {
        // A frontend that sends half a message (or stops reading replies) must not hold
        // this thread forever: QEMU sends each message whole.
        if let Err(e) = set_socket_timeouts(handler.as_raw_fd(), timeout) {
            warn!(drive = %drive.config().name, "cannot bound the socket's waits: {e}");
        }
        Session {
            drive,
            conn,
            handler,
            timeout,
        }
    }

    /// A session on a stream that is already connected (a socket pair: the fuzz target, tests),
    /// waiting at most `timeout` for the rest of a message. The front-end is trusted as the
    /// server trusts it: when its peer is root.
    pub fn from_stream(
        stream: std::os::unix::net::UnixStream,
        drive: Arc<Drive>,
        timeout: std::time::Duration,
    ) -> Self {
        let peer = crate::util::peer_uid(stream.as_raw_fd());
        let conn = Arc::new(Mutex::new(Connection::new(drive.clone())));
        let handler = BackendReqHandler::from_stream(stream, conn.clone());
        let mut s = Session::new(drive, conn, handler, timeout);
        s.set_untrusted(peer != Some(0));
        s
    }

    /// Whether the front-end is held to the rules for one that is not root (sealed memory).
    pub fn set_untrusted(&mut self, untrusted: bool) {
        lock(&self.conn).untrusted = untrusted;
    }

    /// Waits for the next message (or for `shutdown`, an eventfd, to be signalled) and
    /// handles it.
    pub fn serve_next(&mut self, shutdown: RawFd) -> Served {
        let fd = self.handler.as_raw_fd();
        let log = &self.drive.stats.log.vhost;
        let name = &self.drive.config().name;
        match wait_readable(fd, shutdown) {
            Ok(Ready::Fd) => {}
            Ok(Ready::Shutdown) => return Served::Shutdown,
            Err(e) => {
                warn!("poll: {e}");
                return Served::Closed;
            }
        }
        match wait_header(fd, shutdown, self.timeout) {
            Ok(HeaderWait::Ready) => {}
            Ok(HeaderWait::Shutdown) => return Served::Shutdown,
            Ok(HeaderWait::TimedOut) => {
                if let Some(n) = log.admit() {
                    warn!(drive = %name, "part of a message header and nothing more for {:?}: closing the connection{}", self.timeout, crate::util::suppressed(n));
                }
                return Served::Closed;
            }
            Err(e) => {
                warn!("poll: {e}");
                return Served::Closed;
            }
        }
        if let Some(ch) = backend_channel::peek(fd) {
            *lock(&self.drive.backend_channel) = Some(ch);
        }
        // Lent rings come back before any message of QEMU's front-end is handled
        // (a ring stop, a memory table, dirty logging all find acceld serving).
        let handler = &mut self.handler;
        match self.drive.with_rings_owned(|| handler.handle_request()) {
            Ok(()) => Served::Next,
            // The frontend's request was answered with an error; the stream is
            // intact, so the connection goes on.
            Err(
                e @ (VuError::InvalidParam
                | VuError::InvalidOperation(_)
                | VuError::InactiveFeature(_)
                | VuError::InactiveOperation(_)
                | VuError::ReqHandlerError(_)
                | VuError::FeatureMismatch),
            ) => {
                if let Some(n) = log.admit() {
                    warn!(drive = %name, "vhost-user request refused: {e}{}", crate::util::suppressed(n));
                }
                if lock(&self.conn).must_close() {
                    Served::Closed
                } else {
                    Served::Next
                }
            }
            Err(VuError::Disconnected) => {
                if let Some(n) = log.admit() {
                    info!(drive = %name, "frontend disconnected{}", crate::util::suppressed(n));
                }
                Served::Closed
            }
            Err(e) => {
                if let Some(n) = log.admit() {
                    warn!(drive = %name, "closing the connection: {e}{}", crate::util::suppressed(n));
                }
                Served::Closed
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Drain before the socket closes (the handler, dropped after this, closes it).
        self.drive.with_rings_owned(|| lock(&self.conn).stop_all());
        *lock(&self.drive.backend_channel) = None;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Longest wait for the rest of a vhost-user message, or for the frontend to take a reply.
const MESSAGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn set_socket_timeouts(fd: RawFd, t: std::time::Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: tv is a valid timeval that outlives the call; the length is its size.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

enum Ready {
    Fd,
    Shutdown,
}

/// How often a server waiting for the rest of a message header looks again.
const HEADER_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// A vhost-user message header's size (request, flags, size: three u32).
const HEADER_LEN: usize = 12;

enum HeaderWait {
    /// A whole header is queued, or the stream ended or failed: the crate's read sees which.
    Ready,
    Shutdown,
    TimedOut,
}

/// Waits until a whole message header is queued on `fd` (at most `timeout`, and no longer
/// than `shutdown` stays quiet). The vhost crate reads a header in a loop that retries when
/// the socket's receive timeout ends, so without this wait a front-end that sends part of a
/// header and then nothing held the server's thread for ever, a shutdown included. QEMU sends
/// each message in one `sendmsg`: its headers arrive whole, and this costs one peek.
fn wait_header(fd: RawFd, shutdown: RawFd, timeout: std::time::Duration) -> io::Result<HeaderWait> {
    let deadline = std::time::Instant::now() + timeout;
    let mut hdr = [0u8; HEADER_LEN];
    loop {
        let n = backend_channel::peek_bytes(fd, &mut hdr);
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => return Ok(HeaderWait::Ready),
            }
        } else if n == 0 || n as usize == HEADER_LEN {
            return Ok(HeaderWait::Ready);
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(HeaderWait::TimedOut);
        }
        let ms = left.min(HEADER_POLL).as_millis().max(1) as libc::c_int;
        let mut p = libc::pollfd {
            fd: shutdown,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: p is a valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&raw mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else if p.revents != 0 {
            return Ok(HeaderWait::Shutdown);
        }
    }
}

fn wait_readable(fd: RawFd, shutdown: RawFd) -> io::Result<Ready> {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: shutdown,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: fds is a valid array of two pollfd for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Ok(Ready::Shutdown);
        }
        if fds[0].revents != 0 {
            return Ok(Ready::Fd);
        }
    }
}
