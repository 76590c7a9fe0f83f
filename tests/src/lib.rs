//! A vhost-user-blk frontend and virtio driver in one, for tests and benchmarks: it plays
//! QEMU (the `vhost` crate's `Frontend`: memfd memory table, vrings, config) and the guest's
//! virtio_blk driver (split rings in that shared memory, requests, EVENT_IDX), against any
//! vhost-user-blk server: acceld, or qemu-storage-daemon for comparison.
//!
//! Guest-physical layout of the shared memory:
//! - `RING_BASE + q * RING_STRIDE`: queue q's descriptor table, avail ring, used ring;
//! - `SLOT_BASE + (q * queue_size + tag) * slot_size`: request `tag`'s area: header, status,
//!   an indirect table, then `max_data` bytes of data.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use accel_dataplane::virtio_blk::{
    S_IOERR, S_OK, S_UNSUPP, T_DISCARD, T_FLUSH, T_GET_ID, T_IN, T_OUT, T_WRITE_ZEROES,
};

pub const RING_BASE: u64 = 0x1000;
pub const RING_STRIDE: u64 = 0x10000;
pub const SLOT_BASE: u64 = 0x40_0000;
/// Per-slot room before the data: header at +0, status at +64, indirect table at +128.
const SLOT_HDR: u64 = 4096;

pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
pub const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
pub const VIRTIO_F_NOTIFY_ON_EMPTY: u64 = 1 << 24;
pub const VHOST_F_LOG_ALL: u64 = 1 << 26;
pub const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 1 << 30;

const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;
const VRING_DESC_F_INDIRECT: u16 = 4;

#[derive(Debug, Error)]
pub enum FrontendError {
    #[error("cannot connect to {path}")]
    Connect {
        path: String,
        #[source]
        source: vhost::Error,
    },
    #[error("vhost-user {what} failed")]
    Protocol {
        what: &'static str,
        #[source]
        source: vhost::Error,
    },
    #[error("the server does not offer {0}")]
    MissingFeature(&'static str),
    #[error("cannot create the shared guest memory")]
    Memory(#[source] io::Error),
    #[error("no completion on queue {queue} within {timeout:?}")]
    Timeout { queue: usize, timeout: Duration },
    #[error("request too large: {0} bytes")]
    TooLarge(usize),
    #[error("no free descriptors or slots on queue {0}")]
    Full(usize),
}

fn proto(what: &'static str) -> impl FnOnce(vhost::Error) -> FrontendError {
    move |source| FrontendError::Protocol { what, source }
}

/// Shared memory playing the guest's RAM (memfd, MAP_SHARED).
pub struct GuestMem {
    pub file: File,
    ptr: *mut u8,
    size: usize,
}

// SAFETY: the mapping is plain shared memory; all access goes through volatile reads and
// writes with bounds checks, and the pointer stays valid until drop.
unsafe impl Send for GuestMem {}
// SAFETY: as above; concurrent access is to disjoint slots or through the ring protocol.
unsafe impl Sync for GuestMem {}

impl GuestMem {
    /// A sealed memfd (no shrink, no grow), as QEMU's `memory-backend-memfd` makes it.
    pub fn new(size: usize) -> io::Result<Self> {
        Self::make(size, true)
    }

    /// An unsealed memfd: memory its owner can truncate under the back-end.
    pub fn new_unsealed(size: usize) -> io::Result<Self> {
        Self::make(size, false)
    }

    fn make(size: usize, sealed: bool) -> io::Result<Self> {
        let seals = sealed.then_some(libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        let file = accel_dataplane::util::memfd(c"accel-guest", size as u64, seals)?;
        // SAFETY: a new shared mapping of our memfd; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(GuestMem {
            file,
            ptr: ptr.cast(),
            size,
        })
    }

    fn check(&self, gpa: u64, len: usize) -> usize {
        let off = gpa as usize;
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.size),
            "guest access {gpa:#x}+{len} outside memory"
        );
        off
    }

    /// Bytes of guest memory.
    pub fn len(&self) -> usize {
        self.size
    }

    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    pub fn write(&self, gpa: u64, data: &[u8]) {
        let off = self.check(gpa, data.len());
        // SAFETY: in bounds (checked); the region is ours and shared with the backend, which
        // only touches buffers we handed it.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.wrapping_add(off), data.len())
        };
    }

    pub fn read(&self, gpa: u64, out: &mut [u8]) {
        let off = self.check(gpa, out.len());
        // SAFETY: in bounds (checked).
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.wrapping_add(off), out.as_mut_ptr(), out.len())
        };
    }

    pub fn fill(&self, gpa: u64, len: usize, byte: u8) {
        let off = self.check(gpa, len);
        // SAFETY: in bounds (checked).
        unsafe { std::ptr::write_bytes(self.ptr.wrapping_add(off), byte, len) };
    }

    fn w16(&self, gpa: u64, v: u16) {
        let off = self.check(gpa, 2);
        // SAFETY: in bounds and 2-aligned (ring fields are).
        unsafe { std::ptr::write_volatile(self.ptr.wrapping_add(off).cast::<u16>(), v.to_le()) };
    }

    fn r16(&self, gpa: u64) -> u16 {
        let off = self.check(gpa, 2);
        // SAFETY: in bounds and 2-aligned.
        u16::from_le(unsafe { std::ptr::read_volatile(self.ptr.wrapping_add(off).cast::<u16>()) })
    }

    fn r32(&self, gpa: u64) -> u32 {
        let off = self.check(gpa, 4);
        // SAFETY: in bounds and 4-aligned.
        u32::from_le(unsafe { std::ptr::read_volatile(self.ptr.wrapping_add(off).cast::<u32>()) })
    }

    fn desc(&self, gpa: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.write(gpa, &d);
    }

    pub fn host_addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for GuestMem {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.size) };
    }
}

/// One buffer of a chain: guest address, length, device-writable.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

impl Buf {
    /// A device-readable buffer.
    pub fn r(addr: u64, len: u32) -> Self {
        Buf {
            addr,
            len,
            writable: false,
        }
    }
    /// A device-writable buffer.
    pub fn w(addr: u64, len: u32) -> Self {
        Buf {
            addr,
            len,
            writable: true,
        }
    }
}

/// A used-ring entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    pub head: u16,
    pub len: u32,
}

struct DriverQueue {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    free_desc: Vec<u16>,
    /// Descriptors of each in-flight chain, by head.
    chains: Vec<Vec<u16>>,
    avail_idx: u16,
    /// avail_idx at the last kick decision.
    kicked_idx: u16,
    last_used: u16,
    kick: EventFd,
    call: EventFd,
    /// SET_VRING_ERR: the device signals it when it finds the ring broken.
    err: EventFd,
}

/// Options of a frontend connection.
#[derive(Clone, Debug)]
pub struct FrontendOptions {
    pub queues: usize,
    pub queue_size: u16,
    /// Largest data buffer per request.
    pub max_data: usize,
    /// Negotiate EVENT_IDX when offered.
    pub event_idx: bool,
    /// Ask for an inflight region (INFLIGHT_SHMFD) and keep it across `reconnect`, as QEMU
    /// does.
    pub inflight: bool,
}

impl Default for FrontendOptions {
    fn default() -> Self {
        FrontendOptions {
            queues: 1,
            queue_size: 128,
            max_data: 128 * 1024,
            event_idx: true,
            inflight: false,
        }
    }
}

/// What the server said during the handshake.
#[derive(Clone, Debug)]
pub struct Negotiated {
    pub features: u64,
    pub acked_features: u64,
    pub protocol_features: u64,
    pub queue_num: u64,
    /// The first 60 bytes of the config space.
    pub config: Vec<u8>,
}

impl Negotiated {
    pub fn capacity_sectors(&self) -> u64 {
        u64::from_le_bytes(self.config[0..8].try_into().expect("8 bytes"))
    }
}

/// A connected vhost-user-blk frontend with running queues.
pub struct BlkFrontend {
    fe: Frontend,
    pub mem: GuestMem,
    queues: Vec<DriverQueue>,
    opts: FrontendOptions,
    slot_size: u64,
    pub negotiated: Negotiated,
    path: std::path::PathBuf,
    inflight: Option<(vhost::vhost_user::message::VhostUserInflight, File)>,
}

/// Sets up ring `q` on the backend: size, base, addresses, eventfds, enable.
fn send_vring(
    fe: &mut Frontend,
    host: u64,
    q: usize,
    dq: &DriverQueue,
    base: u16,
) -> Result<(), FrontendError> {
    let n = dq.size;
    fe.set_vring_num(q, n).map_err(proto("SET_VRING_NUM"))?;
    fe.set_vring_base(q, base)
        .map_err(proto("SET_VRING_BASE"))?;
    fe.set_vring_addr(
        q,
        &VringConfigData {
            queue_max_size: n,
            queue_size: n,
            flags: 0,
            desc_table_addr: host + dq.desc,
            used_ring_addr: host + dq.used,
            avail_ring_addr: host + dq.avail,
            log_addr: None,
        },
    )
    .map_err(proto("SET_VRING_ADDR"))?;
    fe.set_vring_kick(q, &dq.kick)
        .map_err(proto("SET_VRING_KICK"))?;
    fe.set_vring_call(q, &dq.call)
        .map_err(proto("SET_VRING_CALL"))?;
    fe.set_vring_err(q, &dq.err)
        .map_err(proto("SET_VRING_ERR"))?;
    fe.set_vring_enable(q, true)
        .map_err(proto("SET_VRING_ENABLE"))
}

/// Protocol features the test frontend uses when offered.
pub fn wanted_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::BACKEND_REQ
}

/// Connects and performs only the handshake (features, protocol features, config), as QEMU
/// does when it realizes the device.
pub fn handshake(path: &Path, queues: usize) -> Result<(Frontend, Negotiated), FrontendError> {
    let mut fe =
        Frontend::connect(path, queues as u64).map_err(|source| FrontendError::Connect {
            path: path.display().to_string(),
            source,
        })?;
    fe.set_owner().map_err(proto("SET_OWNER"))?;
    let features = fe.get_features().map_err(proto("GET_FEATURES"))?;
    if features & VHOST_USER_F_PROTOCOL_FEATURES == 0 {
        return Err(FrontendError::MissingFeature(
            "VHOST_USER_F_PROTOCOL_FEATURES",
        ));
    }
    let pf = fe
        .get_protocol_features()
        .map_err(proto("GET_PROTOCOL_FEATURES"))?;
    if !pf.contains(VhostUserProtocolFeatures::CONFIG) {
        return Err(FrontendError::MissingFeature(
            "VHOST_USER_PROTOCOL_F_CONFIG",
        ));
    }
    fe.set_protocol_features(pf & wanted_protocol_features())
        .map_err(proto("SET_PROTOCOL_FEATURES"))?;
    let queue_num = fe.get_queue_num().map_err(proto("GET_QUEUE_NUM"))?;
    let (_, config) = fe
        .get_config(0, 60, VhostUserConfigFlags::empty(), &[0u8; 60])
        .map_err(proto("GET_CONFIG"))?;
    Ok((
        fe,
        Negotiated {
            features,
            acked_features: 0,
            protocol_features: pf.bits(),
            queue_num,
            config,
        },
    ))
}

impl BlkFrontend {
    pub fn connect(path: &Path, opts: FrontendOptions) -> Result<Self, FrontendError> {
        let (mut fe, mut negotiated) = handshake(path, opts.queues)?;
        if negotiated.queue_num < opts.queues as u64 {
            return Err(FrontendError::MissingFeature("enough queues"));
        }
        let mut ack = negotiated.features
            & (VIRTIO_F_VERSION_1
                | VIRTIO_RING_F_INDIRECT_DESC
                | VHOST_USER_F_PROTOCOL_FEATURES
                | 0x7fff);
        if opts.event_idx {
            ack |= negotiated.features & VIRTIO_RING_F_EVENT_IDX;
        }
        fe.set_features(ack).map_err(proto("SET_FEATURES"))?;
        negotiated.acked_features = ack;
        let slot_size = SLOT_HDR + opts.max_data.next_multiple_of(4096) as u64;
        let slots = opts.queues as u64 * u64::from(opts.queue_size);
        let size = SLOT_BASE + slots * slot_size;
        let mem = GuestMem::new(size as usize).map_err(FrontendError::Memory)?;
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: size,
            userspace_addr: mem.host_addr(),
            mmap_offset: 0,
            mmap_handle: mem.file.as_raw_fd(),
        };
        fe.set_mem_table(&[region])
            .map_err(proto("SET_MEM_TABLE"))?;
        let inflight = if opts.inflight {
            let want = vhost::vhost_user::message::VhostUserInflight {
                mmap_size: 0,
                mmap_offset: 0,
                num_queues: opts.queues as u16,
                queue_size: opts.queue_size,
            };
            let (info, file) = fe
                .get_inflight_fd(&want)
                .map_err(proto("GET_INFLIGHT_FD"))?;
            fe.set_inflight_fd(&info, file.as_raw_fd())
                .map_err(proto("SET_INFLIGHT_FD"))?;
            Some((info, file))
        } else {
            None
        };
        let mut me = BlkFrontend {
            fe,
            mem,
            queues: Vec::new(),
            opts,
            slot_size,
            negotiated,
            path: path.to_path_buf(),
            inflight,
        };
        for q in 0..me.opts.queues {
            me.start_queue(q)?;
        }
        Ok(me)
    }

    fn start_queue(&mut self, q: usize) -> Result<(), FrontendError> {
        let n = self.opts.queue_size;
        let base = RING_BASE + q as u64 * RING_STRIDE;
        let desc = base;
        let avail = desc + 16 * u64::from(n);
        let used = (avail + 6 + 2 * u64::from(n)).next_multiple_of(4);
        assert!(used + 6 + 8 * u64::from(n) <= base + RING_STRIDE);
        self.mem.fill(base, RING_STRIDE as usize, 0);
        let kick = EventFd::new(EFD_NONBLOCK).map_err(FrontendError::Memory)?;
        let call = EventFd::new(EFD_NONBLOCK).map_err(FrontendError::Memory)?;
        let err = EventFd::new(EFD_NONBLOCK).map_err(FrontendError::Memory)?;
        let dq = DriverQueue {
            size: n,
            desc,
            avail,
            used,
            free_desc: (0..n).rev().collect(),
            chains: vec![Vec::new(); usize::from(n)],
            avail_idx: 0,
            kicked_idx: 0,
            last_used: 0,
            kick,
            call,
            err,
        };
        send_vring(&mut self.fe, self.mem.host_addr(), q, &dq, 0)?;
        if q < self.queues.len() {
            self.queues[q] = dq;
        } else {
            self.queues.push(dq);
        }
        Ok(())
    }

    /// Connects again to the same socket (a new backend, after the old one died), keeping the
    /// guest's memory, rings and requests, as QEMU does on `reconnect-ms`: the same memory
    /// table and inflight region, each ring's base at its used index.
    pub fn reconnect(&mut self) -> Result<(), FrontendError> {
        let (mut fe, _) = handshake(&self.path, self.opts.queues)?;
        fe.set_features(self.negotiated.acked_features)
            .map_err(proto("SET_FEATURES"))?;
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: self.mem.size as u64,
            userspace_addr: self.mem.host_addr(),
            mmap_offset: 0,
            mmap_handle: self.mem.file.as_raw_fd(),
        };
        fe.set_mem_table(&[region])
            .map_err(proto("SET_MEM_TABLE"))?;
        if let Some((info, file)) = &self.inflight {
            fe.set_inflight_fd(info, file.as_raw_fd())
                .map_err(proto("SET_INFLIGHT_FD"))?;
        }
        self.fe = fe;
        let host = self.mem.host_addr();
        for (q, dq) in self.queues.iter().enumerate() {
            let base = self.mem.r16(dq.used + 2);
            send_vring(&mut self.fe, host, q, dq, base)?;
        }
        Ok(())
    }

    pub fn queues(&self) -> usize {
        self.queues.len()
    }

    pub fn queue_size(&self) -> u16 {
        self.opts.queue_size
    }

    pub fn max_data(&self) -> usize {
        self.opts.max_data
    }

    pub fn frontend(&mut self) -> &mut Frontend {
        &mut self.fe
    }

    /// Guest address of request slot `tag` of queue `q`: (header, status, indirect table,
    /// data).
    pub fn slot(&self, q: usize, tag: u16) -> SlotAddrs {
        let base = SLOT_BASE
            + (q as u64 * u64::from(self.opts.queue_size) + u64::from(tag)) * self.slot_size;
        SlotAddrs {
            header: base,
            status: base + 64,
            indirect: base + 128,
            data: base + SLOT_HDR,
        }
    }

    /// Puts a chain in the avail ring (direct descriptors, or one indirect table placed at
    /// `indirect`), kicks, returns the head.
    pub fn submit_chain(
        &mut self,
        q: usize,
        bufs: &[Buf],
        indirect: Option<u64>,
    ) -> Result<u16, FrontendError> {
        let head = self.write_chain(q, bufs, indirect)?;
        let dq = &mut self.queues[q];
        fence(Ordering::SeqCst);
        let _ = dq.kick.write(1);
        dq.kicked_idx = dq.avail_idx;
        Ok(head)
    }

    /// Like [`BlkFrontend::submit_chain`] with direct descriptors, without kicking: call
    /// [`BlkFrontend::kick`] after the batch.
    pub fn queue_chain(&mut self, q: usize, bufs: &[Buf]) -> Result<u16, FrontendError> {
        self.write_chain(q, bufs, None)
    }

    /// Writes the descriptors of a chain and publishes its head, without kicking.
    fn write_chain(
        &mut self,
        q: usize,
        bufs: &[Buf],
        indirect: Option<u64>,
    ) -> Result<u16, FrontendError> {
        let dq = &mut self.queues[q];
        let need = if indirect.is_some() { 1 } else { bufs.len() };
        if dq.free_desc.len() < need || need == 0 {
            return Err(FrontendError::Full(q));
        }
        let ids: Vec<u16> = (0..need)
            .map(|_| dq.free_desc.pop().expect("checked"))
            .collect();
        let (table, first_id) = match indirect {
            Some(t) => (t, 0u16),
            None => (dq.desc, u16::MAX),
        };
        for (i, b) in bufs.iter().enumerate() {
            let mut flags = if b.writable { VRING_DESC_F_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= VRING_DESC_F_NEXT;
            }
            // In an indirect table entries are numbered 0..n; in the ring, by their ids.
            let (slot, next) = if first_id == 0 {
                (i as u64, i as u16 + 1)
            } else {
                (u64::from(ids[i]), ids.get(i + 1).copied().unwrap_or(0))
            };
            self.mem.desc(table + 16 * slot, b.addr, b.len, flags, next);
        }
        if let Some(t) = indirect {
            self.mem.desc(
                dq.desc + 16 * u64::from(ids[0]),
                t,
                16 * bufs.len() as u32,
                VRING_DESC_F_INDIRECT,
                0,
            );
        }
        let head = ids[0];
        dq.chains[usize::from(head)] = ids;
        self.publish(q, head);
        Ok(head)
    }

    /// Puts `head` in the avail ring (no kick).
    /// Hostile ring: moves the avail index `jump` entries ahead without writing any entry,
    /// and kicks.
    pub fn corrupt_avail_idx(&mut self, q: usize, jump: u16) {
        let dq = &mut self.queues[q];
        dq.avail_idx = dq.avail_idx.wrapping_add(jump);
        self.mem.w16(dq.avail + 2, dq.avail_idx);
        fence(Ordering::SeqCst);
        let _ = dq.kick.write(1);
        dq.kicked_idx = dq.avail_idx;
    }

    /// Hostile ring: publishes `head` as available whatever it is (at or past the queue size
    /// included), and kicks.
    pub fn publish_head(&mut self, q: usize, head: u16) {
        self.publish(q, head);
        let dq = &mut self.queues[q];
        fence(Ordering::SeqCst);
        let _ = dq.kick.write(1);
        dq.kicked_idx = dq.avail_idx;
    }

    /// Whether the device signalled the queue's error eventfd (SET_VRING_ERR), waiting up to
    /// `timeout` for it.
    pub fn wait_err(&self, q: usize, timeout: Duration) -> bool {
        let fd = self.queues[q].err.as_raw_fd();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis().min(60_000) as i32) };
        r == 1 && self.queues[q].err.read().is_ok()
    }

    fn publish(&mut self, q: usize, head: u16) {
        let dq = &mut self.queues[q];
        let slot = u64::from(dq.avail_idx % dq.size);
        self.mem.w16(dq.avail + 4 + 2 * slot, head);
        fence(Ordering::Release);
        dq.avail_idx = dq.avail_idx.wrapping_add(1);
        self.mem.w16(dq.avail + 2, dq.avail_idx);
    }

    /// Kicks queue `q` if the device asked to be told about what was published since the last
    /// kick (EVENT_IDX `avail_event`; always without EVENT_IDX), as a guest driver does.
    pub fn kick(&mut self, q: usize) {
        let event_idx = self.negotiated.acked_features & VIRTIO_RING_F_EVENT_IDX != 0;
        let dq = &mut self.queues[q];
        if dq.kicked_idx == dq.avail_idx {
            return;
        }
        fence(Ordering::SeqCst);
        let need = if event_idx {
            let avail_event = self.mem.r16(dq.used + 4 + 8 * u64::from(dq.size));
            // vring_need_event(event, new, old)
            dq.avail_idx.wrapping_sub(avail_event).wrapping_sub(1)
                < dq.avail_idx.wrapping_sub(dq.kicked_idx)
        } else {
            true
        };
        dq.kicked_idx = dq.avail_idx;
        if need {
            let _ = dq.kick.write(1);
        }
    }

    /// Hostile chains: writes raw descriptors (flags and `next` as given, `next` being an index
    /// into `descs`, mapped to the real descriptor ids) and publishes the first as the head.
    pub fn submit_raw(
        &mut self,
        q: usize,
        descs: &[(u64, u32, u16, u16)],
    ) -> Result<u16, FrontendError> {
        let dq = &mut self.queues[q];
        if dq.free_desc.len() < descs.len() || descs.is_empty() {
            return Err(FrontendError::Full(q));
        }
        let ids: Vec<u16> = (0..descs.len())
            .map(|_| dq.free_desc.pop().expect("checked"))
            .collect();
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let next_id = ids.get(usize::from(next)).copied().unwrap_or(next);
            self.mem
                .desc(dq.desc + 16 * u64::from(ids[i]), addr, len, flags, next_id);
        }
        let head = ids[0];
        dq.chains[usize::from(head)] = ids;
        self.publish(q, head);
        let dq = &mut self.queues[q];
        fence(Ordering::SeqCst);
        let _ = dq.kick.write(1);
        dq.kicked_idx = dq.avail_idx;
        Ok(head)
    }

    /// Harvests the used ring without waiting.
    pub fn poll_used(&mut self, q: usize, out: &mut Vec<Used>) {
        let dq = &mut self.queues[q];
        let used_idx = self.mem.r16(dq.used + 2);
        fence(Ordering::Acquire);
        while dq.last_used != used_idx {
            let e = dq.used + 4 + 8 * u64::from(dq.last_used % dq.size);
            let head = self.mem.r32(e) as u16;
            let len = self.mem.r32(e + 4);
            dq.last_used = dq.last_used.wrapping_add(1);
            if let Some(ids) = dq.chains.get_mut(usize::from(head)) {
                dq.free_desc.append(ids);
            }
            out.push(Used { head, len });
        }
        // EVENT_IDX: interrupt me at the next completion.
        let used_event = dq.avail + 4 + 2 * u64::from(dq.size);
        self.mem.w16(used_event, dq.last_used);
        fence(Ordering::SeqCst);
    }

    /// Waits for at least one completion (through the call eventfd), up to `timeout`.
    pub fn wait_used(
        &mut self,
        q: usize,
        out: &mut Vec<Used>,
        timeout: Duration,
    ) -> Result<(), FrontendError> {
        let deadline = Instant::now() + timeout;
        loop {
            let before = out.len();
            self.poll_used(q, out);
            // Re-check after publishing used_event, to not miss a completion in between.
            self.poll_used(q, out);
            if out.len() > before {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FrontendError::Timeout { queue: q, timeout });
            }
            let mut pfd = libc::pollfd {
                fd: self.queues[q].call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = (deadline - now).as_millis().min(1000) as i32;
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms.max(1)) };
            let _ = self.queues[q].call.read();
        }
    }

    /// Raw call eventfd of a queue (for tests that check notifications).
    pub fn call_fd(&self, q: usize) -> &EventFd {
        &self.queues[q].call
    }

    /// One synchronous request in slot 0 of queue `q`: the header, then `out` as readable
    /// data, then `in_len` writable bytes, then the status. Returns (status, data, used len).
    pub fn request(
        &mut self,
        q: usize,
        req_type: u32,
        sector: u64,
        out: &[u8],
        in_len: usize,
    ) -> Result<(u8, Vec<u8>, u32), FrontendError> {
        if out.len() > self.opts.max_data || in_len > self.opts.max_data {
            return Err(FrontendError::TooLarge(out.len().max(in_len)));
        }
        let s = self.slot(q, 0);
        self.mem.write(s.header, &header(req_type, sector));
        self.mem.write(s.status, &[0xff]);
        let mut bufs = vec![Buf {
            addr: s.header,
            len: 16,
            writable: false,
        }];
        if !out.is_empty() {
            self.mem.write(s.data, out);
            bufs.push(Buf {
                addr: s.data,
                len: out.len() as u32,
                writable: false,
            });
        }
        if in_len > 0 {
            self.mem.fill(s.data, in_len, 0xee);
            bufs.push(Buf {
                addr: s.data,
                len: in_len as u32,
                writable: true,
            });
        }
        bufs.push(Buf {
            addr: s.status,
            len: 1,
            writable: true,
        });
        let (st, used) = self.submit_wait(q, &bufs, None)?;
        let mut data = vec![0u8; in_len];
        self.mem.read(s.data, &mut data);
        Ok((st, data, used))
    }

    /// Submits one chain and waits for it; returns (byte at the chain's status address —
    /// the last byte of its last writable buffer —, used length).
    pub fn submit_wait(
        &mut self,
        q: usize,
        bufs: &[Buf],
        indirect: Option<u64>,
    ) -> Result<(u8, u32), FrontendError> {
        let head = self.submit_chain(q, bufs, indirect)?;
        let mut used = Vec::new();
        loop {
            self.wait_used(q, &mut used, Duration::from_secs(10))?;
            if let Some(u) = used.iter().find(|u| u.head == head) {
                let status = bufs
                    .iter()
                    .rev()
                    .find(|b| b.writable && b.len > 0)
                    .map(|b| {
                        let mut s = [0u8];
                        self.mem.read(b.addr + u64::from(b.len) - 1, &mut s);
                        s[0]
                    })
                    .unwrap_or(0xff);
                return Ok((status, u.len));
            }
        }
    }

    pub fn get_vring_base(&mut self, q: usize) -> Result<u32, FrontendError> {
        self.fe.get_vring_base(q).map_err(proto("GET_VRING_BASE"))
    }

    /// Starts ring `q` again after [`BlkFrontend::get_vring_base`] returned `base`, as QEMU's
    /// `vhost_dev_start` does (same addresses, new base).
    pub fn restart_queue(&mut self, q: usize, base: u16) -> Result<(), FrontendError> {
        let host = self.mem.host_addr();
        send_vring(&mut self.fe, host, q, &self.queues[q], base)
    }

    /// SET_LOG_BASE with `file` as the log (`size` bytes from offset 0); waits for the reply.
    pub fn set_log_base(&mut self, file: &File, size: u64) -> Result<(), FrontendError> {
        use vhost::VhostUserDirtyLogRegion;
        self.fe
            .set_log_base(
                0,
                Some(VhostUserDirtyLogRegion {
                    mmap_size: size,
                    mmap_offset: 0,
                    mmap_handle: file.as_raw_fd(),
                }),
            )
            .map_err(proto("SET_LOG_BASE"))
    }

    /// SET_FEATURES with the negotiated features plus or minus VHOST_F_LOG_ALL, on the running
    /// device (what QEMU sends when a migration starts or ends).
    pub fn set_log_all(&mut self, on: bool) -> Result<(), FrontendError> {
        let mut f = self.negotiated.acked_features;
        if on {
            f |= VHOST_F_LOG_ALL;
        }
        self.fe.set_features(f).map_err(proto("SET_FEATURES"))?;
        // QEMU waits for the back-end to log before it goes on (vhost_user_set_features: a
        // reply, or a GET_FEATURES round trip without REPLY_ACK); without it a kick on the
        // eventfd can overtake the message on the socket. QEMU does not wait when logging
        // ends; the frontend does, so that what is marked afterwards is well defined.
        self.sync()
    }

    /// A GET_FEATURES round trip: every message sent before it has been handled.
    fn sync(&mut self) -> Result<(), FrontendError> {
        self.fe.get_features().map_err(proto("GET_FEATURES"))?;
        Ok(())
    }

    /// SET_VRING_ADDR of ring `q` with the same addresses and VHOST_VRING_F_LOG on or off;
    /// the log address is the used ring's guest address, as QEMU sends it.
    pub fn set_used_log(&mut self, q: usize, on: bool) -> Result<(), FrontendError> {
        let host = self.mem.host_addr();
        let dq = &self.queues[q];
        self.fe
            .set_vring_addr(
                q,
                &VringConfigData {
                    queue_max_size: dq.size,
                    queue_size: dq.size,
                    flags: u32::from(on),
                    desc_table_addr: host + dq.desc,
                    used_ring_addr: host + dq.used,
                    avail_ring_addr: host + dq.avail,
                    log_addr: on.then_some(dq.used),
                },
            )
            .map_err(proto("SET_VRING_ADDR"))?;
        if on {
            // QEMU's vhost_user_set_vring_addr waits for a reply when F_LOG is set.
            self.sync()?;
        }
        Ok(())
    }

    /// Guest address and length of ring `q`'s used ring (with avail_event).
    pub fn used_ring(&self, q: usize) -> (u64, u64) {
        let dq = &self.queues[q];
        (dq.used, 4 + 8 * u64::from(dq.size) + 2)
    }
}

/// Addresses of one request slot.
#[derive(Clone, Copy, Debug)]
pub struct SlotAddrs {
    pub header: u64,
    pub status: u64,
    pub indirect: u64,
    pub data: u64,
}

pub fn header(req_type: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&req_type.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}

pub fn dwz_segment(sector: u64, num_sectors: u32, flags: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&num_sectors.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    s
}

/// The verification pattern: every 8 bytes hold (byte offset on disk ^ seed), so any block
/// read back names where it came from.
pub fn pattern(disk_offset: u64, seed: u64, buf: &mut [u8]) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let v = (disk_offset + 8 * i as u64) ^ seed;
        c.copy_from_slice(&v.to_le_bytes()[..c.len()]);
    }
}

/// Checks a buffer against [`pattern`]; returns the disk offset of the first bad byte.
pub fn check_pattern(disk_offset: u64, seed: u64, buf: &[u8]) -> Result<(), u64> {
    for (i, c) in buf.chunks(8).enumerate() {
        let v = (disk_offset + 8 * i as u64) ^ seed;
        if c != &v.to_le_bytes()[..c.len()] {
            return Err(disk_offset + 8 * i as u64);
        }
    }
    Ok(())
}

pub mod acceld_run;
pub mod fake_qemu;
pub mod harness;
pub mod hostile_nbd;
pub mod load;
pub mod nbd_server;

/// CPU time (user + system) the threads of this process named `name` used so far; None when
/// no thread has that name.
pub fn thread_cpu(name: &str) -> Option<Duration> {
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut ticks = 0u64;
    let mut found = false;
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        found = true;
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the ")" that ends the command: state is field 3, utime 14, stime 15.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            ticks += num(11) + num(12);
        }
    }
    found.then(|| Duration::from_millis(ticks * 1000 / hz))
}
