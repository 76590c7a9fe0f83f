//! The direct engine: the raw file or block device itself, through io_uring ([`uring`]) or
//! inline preadv2/pwritev2 ([`inline`]), with QEMU-compatible image locks ([`image_lock`]).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use super::{Engine, EngineError, EngineKind, QueueIo};

mod config;
mod image_lock;
mod inline;
mod uring;

pub use config::{FileEngineConfig, ImageId, IoMode};
pub use image_lock::{qemu_lock, qemu_lock_sharing_write, qemu_unlock, set_write_shared};
use inline::InlineQueue;
use uring::RingQueue;

/// Opens `path` with `flags` (and `O_CLOEXEC | O_NOCTTY | O_NONBLOCK`: a FIFO or a device
/// that waits for a peer never holds the caller; the caller clears `O_NONBLOCK`), following
/// no symbolic link when `no_symlinks`.
fn open_flags(path: &Path, flags: libc::c_int, no_symlinks: bool) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    let flags = flags | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK;
    let fd = if no_symlinks {
        // SAFETY: open_how is plain old data; all-zero is a valid value, filled below.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = flags as u64;
        how.resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
        // SAFETY: c is a NUL-terminated path and how a valid open_how of the size given,
        // both alive for the call; the result is checked.
        unsafe {
            libc::syscall(
                libc::SYS_openat2,
                libc::AT_FDCWD,
                c.as_ptr(),
                &raw const how,
                std::mem::size_of::<libc::open_how>(),
            )
        }
    } else {
        // SAFETY: c is a NUL-terminated path alive for the call; the result is checked.
        libc::c_long::from(unsafe { libc::open(c.as_ptr(), flags) })
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd as libc::c_int) })
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
        Self::open_locking(cfg, false)
    }

    /// [`FileEngine::open`], sharing write with the image's current writer until
    /// [`Engine::share_write`] `false` (a switch from the qemu engine prepared before the
    /// pause: QEMU's export still holds write, idle).
    pub fn open_sharing_write(cfg: FileEngineConfig) -> Result<Self, EngineError> {
        Self::open_locking(cfg, true)
    }

    fn open_locking(cfg: FileEngineConfig, sharing_write: bool) -> Result<Self, EngineError> {
        let open_err = |source| EngineError::Open {
            path: cfg.path.clone(),
            source,
        };
        let mut flags = if cfg.read_only {
            libc::O_RDONLY
        } else {
            libc::O_RDWR
        };
        if cfg.direct {
            flags |= libc::O_DIRECT;
        }
        let file = open_flags(&cfg.path, flags, cfg.identity.is_some()).map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        if let Some(want) = cfg.identity {
            let got = ImageId::of(&meta);
            if got != want {
                return Err(EngineError::NotTheImage {
                    path: cfg.path.clone(),
                    want_dev: want.dev,
                    want_ino: want.ino,
                    got_dev: got.dev,
                    got_ino: got.ino,
                });
            }
        }
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
        // An image: its reads and writes may block (O_NONBLOCK came with the open).
        crate::util::set_nonblocking(file.as_raw_fd(), false).map_err(open_err)?;
        if cfg.lock && sharing_write {
            qemu_lock_sharing_write(&file, &cfg.path, cfg.read_only)?;
        } else if cfg.lock {
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
        cfg: &FileEngineConfig,
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
    fn kind(&self) -> EngineKind {
        EngineKind::Direct
    }
    fn io_path(&self) -> &str {
        self.io.name()
    }

    fn release(&self) {
        if self.cfg.lock {
            qemu_unlock(&self.file);
        }
    }

    fn share_write(&self, shared: bool) -> Result<(), EngineError> {
        if !self.cfg.lock || self.cfg.read_only {
            return Ok(());
        }
        set_write_shared(&self.file, &self.cfg.path, shared)
    }

    fn sync_data(&self) -> io::Result<()> {
        if self.cfg.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }

    fn file_config(&self) -> Option<FileEngineConfig> {
        Some(self.cfg.clone())
    }

    fn buffer_alignment(&self) -> u32 {
        self.mem_align
    }

    fn is_block_device(&self) -> bool {
        self.block_device
    }

    fn open_queue(
        &self,
        queue: usize,
        depth: u32,
        _mem: &crate::guest_mem::MemHandle,
    ) -> Result<Box<dyn QueueIo>, EngineError> {
        if self.io == IoMode::Inline {
            return Ok(Box::new(InlineQueue::new(self.file.clone(), depth)?));
        }
        Ok(Box::new(RingQueue::new(self.file.clone(), queue, depth)?))
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
