//! Engines: where a drive's requests go once they are parsed and validated.
//!
//! An [`Engine`] is shared by a drive's queues; each queue worker asks it for its own
//! [`QueueIo`], a submission/completion context owned by that one thread (an io_uring ring for
//! the file engine, a connection for the NBD engine). The worker polls
//! [`QueueIo::completion_fd`] in its epoll set, so every engine plugs into the same event loop.
//!
//! Switching a drive's engine (see `drive.rs`) drains every queue, drops the old `QueueIo`s
//! and asks the new engine for fresh ones, so an engine never sees another engine's requests.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use thiserror::Error;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("cannot open image {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("image {path} is not a regular file or block device")]
    NotAFileOrDevice { path: PathBuf },
    #[error("image {path}: {what}")]
    Unsupported { path: PathBuf, what: String },
    #[error("cannot set up io_uring for queue {queue}")]
    Ring {
        queue: usize,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the NBD connection of queue {queue}")]
    Nbd {
        queue: usize,
        #[source]
        source: Box<crate::nbd::NbdError>,
    },
    #[error(
        "image {path} is in use by another process ({what} lock conflict): is QEMU or another \
         acceld using it?"
    )]
    Locked { path: PathBuf, what: &'static str },
    #[error("cannot lock image {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create an eventfd")]
    EventFd(#[source] io::Error),
}

/// One operation for an engine. Offsets and lengths were validated against the disk; the
/// iovecs point into guest memory or a bounce buffer that the caller keeps alive until the
/// completion is reaped.
#[derive(Clone, Copy, Debug)]
pub enum IoOp {
    Readv {
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
    },
    Writev {
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
        /// Write-through: the data is durable when the write completes (RWF_DSYNC).
        dsync: bool,
    },
    /// Make every completed write durable.
    Flush,
    /// `fallocate(2)` with this mode (punch hole or zero range, always KEEP_SIZE). `zeroes`:
    /// the range must read as zeroes afterwards (WRITE_ZEROES); false for a DISCARD hint.
    Fallocate {
        offset: u64,
        len: u64,
        mode: i32,
        zeroes: bool,
    },
}

/// A queue's private I/O context. Results are bytes transferred or a negative errno.
pub trait QueueIo: Send {
    /// Queues one operation under `token`; it is sent at the next [`QueueIo::submit`].
    /// Returns false when the context is full (never the case while the caller keeps no more
    /// operations in flight than the depth it asked for).
    ///
    /// # Safety
    /// Every iovec of `op`, and the memory it points to, must stay valid and untouched by
    /// anything but this operation until the completion for `token` has been reaped.
    unsafe fn push(&mut self, op: &IoOp, token: u64) -> bool;
    /// Sends what was pushed, in one system call where the engine can.
    fn submit(&mut self) -> io::Result<()>;
    /// Readable when completions may be waiting; the worker then calls [`QueueIo::reap`].
    fn completion_fd(&self) -> RawFd;
    /// Moves finished operations into `out` as (token, result).
    fn reap(&mut self, out: &mut Vec<(u64, i32)>);
    /// Whether completions are waiting, checked without a system call (for polling).
    fn has_completions(&mut self) -> bool {
        false
    }
}

/// The storage side of a drive.
pub trait Engine: Send + Sync {
    /// A short name for logs and status ("io_uring", "nbd").
    fn name(&self) -> &str;
    /// Memory and length alignment that I/O buffers need (O_DIRECT); 1 when any will do.
    fn buffer_alignment(&self) -> u32;
    /// Whether fallocate can punch holes and zero ranges on this image.
    fn is_block_device(&self) -> bool;
    /// Whether queues on this engine stay paused (requests wait in the vring).
    fn holds(&self) -> bool {
        false
    }
    /// Gives the storage up for another user after a drain: drops image locks, closes
    /// connections. The engine is not used again afterwards.
    fn release(&self) {}
    /// A private context for queue `queue` that keeps up to `depth` operations in flight.
    fn open_queue(&self, queue: usize, depth: u32) -> Result<Box<dyn QueueIo>, EngineError>;
}

/// How the file engine opens an image.
#[derive(Clone, Debug)]
pub struct FileEngineConfig {
    pub path: PathBuf,
    pub read_only: bool,
    /// O_DIRECT: bypass the host page cache.
    pub direct: bool,
    /// The guest's logical block size; direct I/O must be possible at that granularity.
    pub logical_block_size: u32,
    /// Take QEMU-compatible image locks (see [`qemu_lock`]) while the engine exists.
    pub lock: bool,
    /// How requests reach the file (see [`IoMode`]).
    pub io: IoMode,
}

/// How the file engine issues I/O.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoMode {
    /// `Inline` for images in memory (tmpfs, ramfs, hugetlbfs), `Uring` for everything else.
    #[default]
    Auto,
    /// io_uring, one ring per queue: many requests in flight, one system call per batch.
    Uring,
    /// preadv2/pwritev2 on the queue's own thread. For memory file systems, where the kernel
    /// cannot do I/O without blocking (no RWF_NOWAIT) and io_uring would hand every request
    /// to a kernel worker thread: a copy on the queue's thread is cheaper than that hop.
    /// Never for slow storage: one request at a time per queue.
    Inline,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Auto => "auto",
            IoMode::Uring => "io_uring",
            IoMode::Inline => "inline",
        }
    }
}

/// The direct engine: io_uring on a raw file or block device, one ring per queue.
pub struct FileEngine {
    cfg: FileEngineConfig,
    file: Arc<File>,
    size: u64,
    block_device: bool,
    mem_align: u32,
    /// `cfg.io` resolved: never `Auto`.
    io: IoMode,
}

impl FileEngine {
    pub fn open(cfg: FileEngineConfig) -> Result<Self, EngineError> {
        let open_err = |source| EngineError::Open {
            path: cfg.path.clone(),
            source,
        };
        let mut oo = OpenOptions::new();
        oo.read(true).write(!cfg.read_only);
        let mut flags = libc::O_CLOEXEC;
        if cfg.direct {
            flags |= libc::O_DIRECT;
        }
        oo.custom_flags(flags);
        let file = oo.open(&cfg.path).map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let ft = meta.file_type();
        let (size, block_device) = if ft.is_file() {
            (meta.len(), false)
        } else if ft.is_block_device() {
            (block_device_size(&file).map_err(open_err)?, true)
        } else {
            return Err(EngineError::NotAFileOrDevice {
                path: cfg.path.clone(),
            });
        };
        if cfg.lock {
            qemu_lock(&file, &cfg.path, cfg.read_only)?;
        }
        let mut mem_align = 1;
        if cfg.direct {
            let (mem, offset) = dio_alignment(&file).unwrap_or((512, 512));
            if offset > cfg.logical_block_size {
                return Err(EngineError::Unsupported {
                    path: cfg.path.clone(),
                    what: format!(
                        "direct I/O needs {offset}-byte aligned offsets, larger than the logical \
                         block size {}; use a larger --logical-block-size or --direct off",
                        cfg.logical_block_size
                    ),
                });
            }
            mem_align = mem.max(1);
        }
        let io = match cfg.io {
            IoMode::Auto if in_memory_fs(&file) => IoMode::Inline,
            IoMode::Auto => IoMode::Uring,
            m => m,
        };
        Ok(FileEngine {
            cfg,
            file: Arc::new(file),
            size,
            block_device,
            mem_align,
            io,
        })
    }

    /// Like [`FileEngine::open`], but waits up to `wait` while another holder's image locks
    /// are still there. A process's OFD locks go with its last file reference, which the
    /// kernel may drop a moment after the process exited (io_uring rings are torn down
    /// asynchronously), so a restarted acceld can briefly see its predecessor's locks.
    pub fn open_waiting(
        cfg: FileEngineConfig,
        wait: std::time::Duration,
    ) -> Result<Self, EngineError> {
        let t0 = std::time::Instant::now();
        loop {
            match Self::open(cfg.clone()) {
                Err(EngineError::Locked { .. }) if t0.elapsed() < wait => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                r => return r,
            }
        }
    }

    /// Image size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn config(&self) -> &FileEngineConfig {
        &self.cfg
    }

    /// The I/O mode in use (`Auto` resolved).
    pub fn io_mode(&self) -> IoMode {
        self.io
    }
}

/// Whether the file lives in memory (tmpfs, ramfs, hugetlbfs): its I/O is a copy that never
/// waits for a device, and that the kernel cannot start without blocking.
fn in_memory_fs(f: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open and st is a valid statfs buffer that outlives the call.
    if unsafe { libc::fstatfs(f.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    matches!(
        st.f_type as i64,
        TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC
    )
}

// QEMU's image locking (block/file-posix.c): one byte per permission, shared (read) OFD
// locks only. A holder of permission P locks byte 100+P; a holder that does not share P with
// others locks byte 200+P. An opener checks both directions and fails on a conflict, which is
// how QEMU reports "Failed to get "write" lock".
const LOCK_PERM_BASE: i64 = 100;
const LOCK_SHARED_BASE: i64 = 200;
const PERM_CONSISTENT_READ: i64 = 0;
const PERM_WRITE: i64 = 1;
const PERM_RESIZE: i64 = 3;
const PERM_NAMES: [&str; 5] = [
    "consistent read",
    "write",
    "write unchanged",
    "resize",
    "graph modification",
];

fn ofd_lock(fd: RawFd, cmd: libc::c_int, typ: libc::c_int, byte: i64) -> io::Result<libc::flock> {
    // SAFETY: flock is plain old data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    // SAFETY: fd is open; fl is a valid flock that outlives the call.
    let r = unsafe { libc::fcntl(fd, cmd, &mut fl) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl)
}

/// Whether another open file description holds a lock on `byte`.
fn lock_held_elsewhere(fd: RawFd, byte: i64) -> io::Result<bool> {
    let fl = ofd_lock(fd, libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_int, byte)?;
    Ok(i32::from(fl.l_type) != libc::F_UNLCK)
}

/// Takes the locks QEMU itself takes for a guest disk that is not shared (share-rw=off):
/// consistent read and, when writable, write; nobody else may write or resize. Fails, like
/// QEMU, when another process holds a conflicting lock; afterwards QEMU (and qemu-img without
/// -U) fails to open the image for writing while acceld serves it.
pub fn qemu_lock(f: &File, path: &Path, read_only: bool) -> Result<(), EngineError> {
    let fd = f.as_raw_fd();
    let mut perms = vec![PERM_CONSISTENT_READ];
    if !read_only {
        perms.push(PERM_WRITE);
    }
    let unshared = [PERM_WRITE, PERM_RESIZE];
    let err = |source| EngineError::Lock {
        path: path.to_path_buf(),
        source,
    };
    for &p in &perms {
        if lock_held_elsewhere(fd, LOCK_SHARED_BASE + p).map_err(err)? {
            return Err(EngineError::Locked {
                path: path.to_path_buf(),
                what: PERM_NAMES[p as usize],
            });
        }
    }
    for &p in &unshared {
        if lock_held_elsewhere(fd, LOCK_PERM_BASE + p).map_err(err)? {
            return Err(EngineError::Locked {
                path: path.to_path_buf(),
                what: PERM_NAMES[p as usize],
            });
        }
    }
    let bytes = perms
        .iter()
        .map(|p| LOCK_PERM_BASE + p)
        .chain(unshared.iter().map(|p| LOCK_SHARED_BASE + p));
    for b in bytes {
        ofd_lock(fd, libc::F_OFD_SETLK, libc::F_RDLCK as libc::c_int, b).map_err(err)?;
    }
    Ok(())
}

/// Drops every lock [`qemu_lock`] took on this open file.
pub fn qemu_unlock(f: &File) {
    let fd = f.as_raw_fd();
    for b in (LOCK_PERM_BASE..LOCK_PERM_BASE + 5).chain(LOCK_SHARED_BASE..LOCK_SHARED_BASE + 5) {
        let _ = ofd_lock(fd, libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_int, b);
    }
}

/// Size of a block device (BLKGETSIZE64).
fn block_device_size(f: &File) -> io::Result<u64> {
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live u64.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Direct I/O alignment (memory, offset) from statx(STATX_DIOALIGN), when the kernel and the
/// file system report it.
fn dio_alignment(f: &File) -> Option<(u32, u32)> {
    const STATX_DIOALIGN: u32 = 0x2000;
    // SAFETY: statx is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open, the empty path with AT_EMPTY_PATH names it, and stx is a valid
    // statx buffer that outlives the call.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r != 0 || stx.stx_mask & STATX_DIOALIGN == 0 || stx.stx_dio_mem_align == 0 {
        return None;
    }
    Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
}

impl Engine for FileEngine {
    fn name(&self) -> &str {
        self.io.name()
    }

    fn release(&self) {
        if self.cfg.lock {
            qemu_unlock(&self.file);
        }
    }

    fn buffer_alignment(&self) -> u32 {
        self.mem_align
    }

    fn is_block_device(&self) -> bool {
        self.block_device
    }

    fn open_queue(&self, queue: usize, depth: u32) -> Result<Box<dyn QueueIo>, EngineError> {
        if self.io == IoMode::Inline {
            return Ok(Box::new(InlineQueue {
                file: self.file.clone(),
                pending: Vec::with_capacity(depth as usize),
                ready: Vec::with_capacity(depth as usize),
                depth: depth as usize,
                idle: EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?,
            }));
        }
        let ring_err = |source| EngineError::Ring { queue, source };
        let entries = depth.clamp(8, 4096).next_power_of_two();
        let mut b = IoUring::builder();
        // SINGLE_ISSUER makes the submitting task the ring's owner; the ring is created here
        // (by the vhost-user thread or a switch) but used by the queue's worker, so it starts
        // disabled and the worker enables it on its first submission (R_DISABLED).
        b.setup_single_issuer()
            .setup_coop_taskrun()
            .setup_r_disabled();
        // CQ twice the SQ (the default): in-flight never exceeds `entries`, so it cannot
        // overflow.
        let ring = match b.build(entries) {
            Ok(r) => r,
            // Older kernels lack SINGLE_ISSUER or COOP_TASKRUN: plain ring.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::builder()
                .setup_r_disabled()
                .build(entries)
                .map_err(ring_err)?,
            Err(e) => return Err(ring_err(e)),
        };
        let done = EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?;
        ring.submitter()
            .register_files(&[self.file.as_raw_fd()])
            .map_err(ring_err)?;
        ring.submitter()
            .register_eventfd(done.as_raw_fd())
            .map_err(ring_err)?;
        Ok(Box::new(RingQueue {
            ring,
            done,
            _file: self.file.clone(),
            queued: 0,
            enabled: false,
        }))
    }
}

struct RingQueue {
    ring: IoUring,
    done: EventFd,
    // Keeps the registered file open for the ring's lifetime.
    _file: Arc<File>,
    queued: u32,
    /// Enabled by the first submission, from the worker thread that owns the ring.
    enabled: bool,
}

const FIXED_FILE: types::Fixed = types::Fixed(0);

impl QueueIo for RingQueue {
    unsafe fn push(&mut self, op: &IoOp, token: u64) -> bool {
        let sqe = match *op {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            } => opcode::Readv::new(FIXED_FILE, iov, iovcnt)
                .offset(offset)
                .build(),
            IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync,
            } => opcode::Writev::new(FIXED_FILE, iov, iovcnt)
                .offset(offset)
                .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
            // IO_DRAIN: the flush starts only after every earlier operation of this ring has
            // completed, so it covers them (never reordered ahead of a write).
            IoOp::Flush => opcode::Fsync::new(FIXED_FILE)
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .flags(squeue::Flags::IO_DRAIN),
            IoOp::Fallocate {
                offset, len, mode, ..
            } => opcode::Fallocate::new(FIXED_FILE, len)
                .offset(offset)
                .mode(mode)
                .build(),
        }
        .user_data(token);
        // SAFETY: the caller guarantees the iovecs and their buffers outlive the operation.
        let ok = unsafe { self.ring.submission().push(&sqe).is_ok() };
        if ok {
            self.queued += 1;
        }
        ok
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.queued == 0 {
            return Ok(());
        }
        if !self.enabled {
            self.ring.submitter().register_enable_rings()?;
            self.enabled = true;
        }
        loop {
            match self.ring.submit() {
                Ok(_) => {
                    self.queued = 0;
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY/EAGAIN: the kernel is short of resources; completions will free some,
                // and the worker submits again after reaping.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => {
                    return Ok(())
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn completion_fd(&self) -> RawFd {
        self.done.as_raw_fd()
    }

    fn has_completions(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        // Clear the eventfd first: a completion posted after this read re-arms it.
        let _ = self.done.read();
        if self.queued > 0 {
            // Retry a submission that the kernel deferred with EBUSY.
            let _ = self.submit();
        }
        for cqe in self.ring.completion() {
            out.push((cqe.user_data(), cqe.result()));
        }
    }
}

/// The inline mode's queue: operations are kept at `push` and run, in order, on the worker's
/// thread at `submit`; their results are ready at once.
struct InlineQueue {
    file: Arc<File>,
    pending: Vec<(Pending, u64)>,
    ready: Vec<(u64, i32)>,
    depth: usize,
    /// Never signalled: completions are reaped right after `submit` (`has_completions`).
    idle: EventFd,
}

/// An operation waiting for `submit`.
struct Pending(IoOp);

// SAFETY: the raw iovec pointers in a pending operation are only dereferenced by `submit`, on
// the thread that owns the queue, and the `push` contract keeps them valid until the
// operation's completion is reaped.
unsafe impl Send for Pending {}

impl InlineQueue {
    /// Runs one operation on `fd` to completion: bytes transferred or -errno.
    fn run(fd: RawFd, op: &IoOp) -> i32 {
        loop {
            // SAFETY: fd is open; the iovecs and the memory they point to are valid for the
            // operation (the `push` contract).
            let r: i64 = unsafe {
                match *op {
                    IoOp::Readv {
                        offset,
                        iov,
                        iovcnt,
                    } => libc::preadv2(fd, iov, iovcnt as i32, offset as i64, 0) as i64,
                    IoOp::Writev {
                        offset,
                        iov,
                        iovcnt,
                        dsync,
                    } => libc::pwritev2(
                        fd,
                        iov,
                        iovcnt as i32,
                        offset as i64,
                        if dsync { libc::RWF_DSYNC } else { 0 },
                    ) as i64,
                    IoOp::Flush => libc::fdatasync(fd) as i64,
                    IoOp::Fallocate {
                        offset, len, mode, ..
                    } => libc::fallocate(fd, mode, offset as i64, len as i64) as i64,
                }
            };
            if r >= 0 {
                return r.min(i64::from(i32::MAX)) as i32;
            }
            let errno = io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if errno != libc::EINTR {
                return -errno;
            }
        }
    }
}

impl QueueIo for InlineQueue {
    unsafe fn push(&mut self, op: &IoOp, token: u64) -> bool {
        if self.pending.len() >= self.depth {
            return false;
        }
        self.pending.push((Pending(*op), token));
        true
    }

    fn submit(&mut self) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        for (op, token) in self.pending.drain(..) {
            self.ready.push((token, Self::run(fd, &op.0)));
        }
        Ok(())
    }

    fn completion_fd(&self) -> RawFd {
        self.idle.as_raw_fd()
    }

    fn has_completions(&mut self) -> bool {
        !self.ready.is_empty()
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        out.append(&mut self.ready);
    }
}

/// Opens `path` to learn its size without keeping it: for config and capacity.
pub fn image_size(path: &Path) -> io::Result<u64> {
    let f = File::open(path)?;
    let meta = f.metadata()?;
    if meta.file_type().is_block_device() {
        block_device_size(&f)
    } else {
        Ok(meta.len())
    }
}
