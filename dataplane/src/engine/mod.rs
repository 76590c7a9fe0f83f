//! Engines: where a drive's requests go once they are parsed and validated.
//!
//! An [`Engine`] is shared by a drive's queues; each queue worker asks it for its own
//! [`QueueIo`], a submission/completion context owned by that one thread (an io_uring ring for
//! the file engine, a connection for the NBD engine). The worker polls
//! [`QueueIo::completion_fd`] in its epoll set, so every engine plugs into the same event loop.
//!
//! Switching a drive's engine (see `drive/switch.rs`) drains every queue, drops the old `QueueIo`s
//! and asks the new engine for fresh ones, so an engine never sees another engine's requests.

use std::io;
use std::os::fd::RawFd;
use std::path::PathBuf;

pub use accel_api::status::EngineKind;
use thiserror::Error;

use crate::guest_mem::MemHandle;

pub mod file;
pub mod held;
pub mod nbd;
pub mod relay;

pub use file::{image_size, FileEngine, FileEngineConfig, IoMode};
pub use held::HeldEngine;

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
    #[error("image {path} is not the file registered (device {want_dev:#x} inode {want_ino}; found device {got_dev:#x} inode {got_ino})")]
    NotTheImage {
        path: PathBuf,
        want_dev: u64,
        want_ino: u64,
        got_dev: u64,
        got_ino: u64,
    },
    #[error("image {path}: {what}")]
    Unsupported { path: PathBuf, what: String },
    #[error("cannot set up io_uring for queue {queue}")]
    Ring {
        queue: usize,
        #[source]
        source: io::Error,
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
    #[error("cannot spawn a thread")]
    Spawn(#[source] io::Error),
    /// The relay's own error (`relay::RelayError`), boxed: this layer's types do not name
    /// the engines'.
    #[error("the relay to QEMU's vhost-user-blk export")]
    Relay(#[source] Box<dyn std::error::Error + Send + Sync>),
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

/// The result of a request whose path was lost under it, when its engine was told a
/// fallback exists (the relay's `hold_when_lost`): not the storage's failure, so the worker
/// holds the request whatever the drive's error policy and retries it, on whichever engine
/// is current by then, once the supervisor moved the drive (an overlapped switch).
pub const PATH_LOST: i32 = -libc::ENOTCONN;

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
    /// Which engine this is, as status shows it: direct, qemu or held.
    fn kind(&self) -> EngineKind;
    /// The I/O path under the engine, for logs and benchmarks: "io_uring" or "inline" (the
    /// direct engine), "nbd" (the qemu engine), "held". Not the engine's kind.
    fn io_path(&self) -> &str;
    /// Memory and length alignment that I/O buffers need (O_DIRECT); 1 when any will do.
    fn buffer_alignment(&self) -> u32;
    /// Whether fallocate can punch holes and zero ranges on this image.
    fn is_block_device(&self) -> bool;
    /// Whether queues on this engine stay paused (requests wait in the vring).
    fn holds(&self) -> bool {
        false
    }
    /// Whether the path under the engine is gone for good (the relay's session with QEMU's
    /// export ended). Requests on it then fail with [`PATH_LOST`] or EIO (see
    /// `RelayEngine::hold_when_lost`), and the engine is of no more use.
    fn lost(&self) -> bool {
        false
    }
    /// Gives the storage up for another user after a drain: drops image locks, closes
    /// connections. The engine is not used again afterwards.
    fn release(&self) {}

    /// Shares the image's write permission with another writer (QEMU's export that takes
    /// over at the coming switch, attached but idle), or stops sharing it (fails if another
    /// writer holds it now). Only the direct engine locks an image.
    fn share_write(&self, _shared: bool) -> Result<(), EngineError> {
        Ok(())
    }

    /// Makes every completed write durable (fdatasync), before the image changes hands.
    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    /// How to open this engine's image again (direct engine only).
    fn file_config(&self) -> Option<FileEngineConfig> {
        None
    }
    /// A private context for queue `queue` that keeps up to `depth` operations in flight.
    /// `mem` is the guest memory the queue's requests point into (the relay gives it to
    /// QEMU's export; the other engines take iovecs and need no map).
    fn open_queue(
        &self,
        queue: usize,
        depth: u32,
        mem: &MemHandle,
    ) -> Result<Box<dyn QueueIo>, EngineError>;
    /// Waits (up to `timeout`) until every queue context opened so far can carry requests;
    /// false on timeout. Contexts that set themselves up in the background (the qemu engine
    /// connects from a thread) finish here; a context that failed counts as settled. Never
    /// called from inside a vhost-user message.
    fn wait_ready(&self, _timeout: std::time::Duration) -> bool {
        true
    }
}
