//! The guest's ring as the worker sees it: the virtqueue, its guest memory, its eventfds,
//! the inflight region (SIGKILL recovery) and the dirty log (live migration).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vmm_sys_util::eventfd::EventFd;

use crate::guest_mem::dirty_log::DirtyLog;
use crate::guest_mem::{Mem, MemHandle};
use crate::queue::inflight::InflightQueue;
use crate::util::lock;

/// The call eventfd, which the frontend may replace while the queue runs.
pub type CallHandle = Arc<Mutex<Option<EventFd>>>;

/// A ring the driver corrupted: the queue stops (QEMU's `virtio_error` marks the device
/// broken for the same cases in `virtqueue_pop`).
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("the avail index moved from {next} to {avail}, more than the queue size {size}")]
    AvailIndex { next: u16, avail: u16, size: u16 },
    #[error("the driver says descriptor {head} is available; the queue has {size}")]
    Head { head: u16, size: u16 },
    #[error("cannot access the ring in guest memory ({0})")]
    Access(String),
    /// The avail index moves with the device's own writes (rings that overlap): re-checking
    /// it after re-enabling notifications would never end.
    #[error(
        "the avail index changes under the device's own notification writes (overlapping rings)"
    )]
    Unstable,
}

pub(super) struct Ring {
    pub(super) queue: Queue,
    pub(super) mem: MemHandle,
    pub(super) kick: EventFd,
    pub(super) call: CallHandle,
    /// The vring's error eventfd (SET_VRING_ERR).
    pub(super) err: CallHandle,
    pub(super) inflight: Option<InflightQueue>,
    /// The order of the next popped request (inflight tracking).
    pub(super) inflight_counter: u64,
    /// Heads the previous backend left in flight, started before anything new.
    pub(super) resubmit: Vec<u16>,
    pub(super) log: Arc<DirtyLog>,
    /// Where the used ring is logged, or `NO_USED_LOG`.
    pub(super) used_log: Arc<AtomicU64>,
    /// The driver corrupted the ring: nothing more is popped until the frontend resets the
    /// queue (a new worker). Requests already popped complete.
    pub(super) broken: bool,
    /// The next batch interrupts the driver whatever EVENT_IDX says (after a lend, the
    /// notification state the queue kept is stale).
    pub(super) force_call: bool,
    /// Heads were put in the used ring since the last notification.
    pub(super) used_added: bool,
}

impl Ring {
    /// The guest memory map now (the frontend may replace it while the queue runs).
    pub(super) fn memory(&self) -> Arc<Mem> {
        lock(&self.mem).clone()
    }

    /// The next available chain, checked as QEMU's `virtqueue_pop` checks it: the avail index
    /// may run ahead of what was popped by at most the queue size, and the head must name a
    /// descriptor of the table. Either violation is a broken ring, not a bad request.
    pub(super) fn pop<'m>(
        &mut self,
        mem: &'m Mem,
    ) -> Result<Option<DescriptorChain<&'m Mem>>, RingError> {
        let size = self.queue.size();
        let next = self.queue.next_avail();
        let avail = self
            .queue
            .avail_idx(mem, Ordering::Acquire)
            .map_err(|e| RingError::Access(e.to_string()))?
            .0;
        let pending = avail.wrapping_sub(next);
        if pending == 0 {
            return Ok(None);
        }
        if pending > size {
            return Err(RingError::AvailIndex { next, avail, size });
        }
        let chain = self
            .queue
            .iter(mem)
            .map_err(|e| RingError::Access(e.to_string()))?
            .next()
            .ok_or_else(|| RingError::Access("the avail ring entry is unreadable".into()))?;
        if chain.head_index() >= size {
            return Err(RingError::Head {
                head: chain.head_index(),
                size,
            });
        }
        Ok(Some(chain))
    }
}
