//! io_uring: one ring per queue, registered file, one submit per batch.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{EngineError, IoOp, QueueIo};

pub(super) struct RingQueue {
    ring: IoUring,
    done: EventFd,
    // Keeps the registered file open for the ring's lifetime.
    _file: Arc<File>,
    queued: u32,
    /// Enabled by the first submission, from the worker thread that owns the ring.
    enabled: bool,
}

const FIXED_FILE: types::Fixed = types::Fixed(0);

impl RingQueue {
    /// A ring for one queue of `depth` operations on `file` (registered as fixed file 0).
    pub(super) fn new(file: Arc<File>, queue: usize, depth: u32) -> Result<Self, EngineError> {
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
            .register_files(&[file.as_raw_fd()])
            .map_err(ring_err)?;
        ring.submitter()
            .register_eventfd(done.as_raw_fd())
            .map_err(ring_err)?;
        Ok(RingQueue {
            ring,
            done,
            _file: file,
            queued: 0,
            enabled: false,
        })
    }
}

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
