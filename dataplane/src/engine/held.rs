//! The held engine: serves nothing, so a drive on it keeps its requests in the vring.

use std::os::fd::{AsRawFd, RawFd};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Engine, EngineError, EngineKind, IoOp, QueueIo};

/// A queue context that has nothing to do: for workers that start paused. Anything pushed to
/// it fails with EIO (it is never used while paused).
pub(crate) struct NullIo {
    done: EventFd,
    failed: Vec<(u64, i32)>,
}

impl NullIo {
    pub(crate) fn new() -> Result<Self, EngineError> {
        Ok(NullIo {
            done: EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?,
            failed: Vec::new(),
        })
    }
}

impl QueueIo for NullIo {
    unsafe fn push(&mut self, _op: &IoOp, token: u64) -> bool {
        self.failed.push((token, -libc::EIO));
        let _ = self.done.write(1);
        true
    }
    fn submit(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn completion_fd(&self) -> RawFd {
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
    fn kind(&self) -> EngineKind {
        EngineKind::Held
    }
    fn io_path(&self) -> &str {
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
        _mem: &crate::guest_mem::MemHandle,
    ) -> Result<Box<dyn QueueIo>, EngineError> {
        Ok(Box::new(NullIo::new()?))
    }
}
