//! Inline I/O: preadv2/pwritev2 on the queue's own thread (images in memory).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{EngineError, IoOp, QueueIo};

/// The inline mode's queue: operations are kept at `push` and run, in order, on the worker's
/// thread at `submit`; their results are ready at once.
pub(super) struct InlineQueue {
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
    pub(super) fn new(file: Arc<File>, depth: u32) -> Result<Self, EngineError> {
        Ok(InlineQueue {
            file,
            pending: Vec::with_capacity(depth as usize),
            ready: Vec::with_capacity(depth as usize),
            depth: depth as usize,
            idle: EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?,
        })
    }

    /// Runs one operation on `fd` to completion: bytes transferred or -errno.
    fn run(fd: RawFd, op: &IoOp) -> i32 {
        loop {
            let r: i64 = match *op {
                IoOp::Readv {
                    offset,
                    iov,
                    iovcnt,
                } => {
                    // SAFETY: fd is open; the iovecs and the memory they point to are valid
                    // for the operation (the `push` contract).
                    (unsafe { libc::preadv2(fd, iov, iovcnt as i32, offset as i64, 0) }) as i64
                }
                IoOp::Writev {
                    offset,
                    iov,
                    iovcnt,
                    dsync,
                } => {
                    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                    // SAFETY: as for preadv2; pwritev2 only reads the buffers.
                    (unsafe { libc::pwritev2(fd, iov, iovcnt as i32, offset as i64, flags) }) as i64
                }
                // SAFETY: fdatasync on an open fd touches no memory of ours.
                IoOp::Flush => (unsafe { libc::fdatasync(fd) }) as i64,
                IoOp::Fallocate {
                    offset, len, mode, ..
                } => {
                    // SAFETY: fallocate on an open fd touches no memory of ours.
                    (unsafe { libc::fallocate(fd, mode, offset as i64, len as i64) }) as i64
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
