//! The bounce pool: fixed per-queue buffers for guest buffers that O_DIRECT cannot use
//! (misaligned), moved chunk by chunk. Never an allocation sized by the guest.

use super::Worker;
use crate::engine::IoOp;
use crate::guest_mem::copy_from_guest;
use crate::virtio_blk::{Op, S_IOERR};

/// Bounce pool: buffers per queue and bytes per buffer. A bounced request holds one buffer
/// and moves its data through it in chunks of this size.
const BOUNCE_BUFS: usize = 8;
const BOUNCE_SIZE: usize = 256 * 1024;
const BOUNCE_ALIGN: usize = 4096;

/// A fixed set of aligned buffers, allocated on first use.
pub(super) struct BouncePool {
    pub(super) bufs: Vec<Vec<u8>>,
    pub(super) free: Vec<usize>,
}

impl BouncePool {
    pub(super) fn take(&mut self) -> Option<usize> {
        if self.bufs.is_empty() {
            self.bufs = (0..BOUNCE_BUFS)
                .map(|_| vec![0u8; BOUNCE_SIZE + BOUNCE_ALIGN])
                .collect();
            self.free = (0..BOUNCE_BUFS).collect();
        }
        self.free.pop()
    }

    pub(super) fn buf(&mut self, i: usize) -> &mut [u8] {
        let b = &mut self.bufs[i];
        let off = b.as_ptr().align_offset(BOUNCE_ALIGN);
        &mut b[off..off + BOUNCE_SIZE]
    }
}
impl Worker {
    pub(super) fn start_bounce(&mut self, idx: usize) {
        match self.bounce.take() {
            Some(b) => {
                self.slots[idx].bounce = Some(b);
                self.bounce_chunk(idx);
            }
            None => self.bounce_wait.push_back(idx),
        }
    }

    /// Submits the next chunk of a bounced request.
    pub(super) fn bounce_chunk(&mut self, idx: usize) {
        let slot = &mut self.slots[idx];
        let b = slot.bounce.expect("bounce buffer held");
        let n = ((slot.total() - slot.done) as usize).min(BOUNCE_SIZE);
        let offset = slot.offset() + slot.done;
        let read = matches!(slot.op, Op::Read { .. });
        let buf = self.bounce.buf(b);
        if !read {
            if slot.zero_fill {
                buf[..n].fill(0);
            } else if copy_from_guest(
                slot.mem.as_deref().expect("set"),
                &slot.segs,
                slot.done,
                &mut buf[..n],
            )
            .is_err()
            {
                return self.complete(idx, S_IOERR);
            }
        }
        slot.iov.clear();
        slot.iov.push(libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: n,
        });
        let (iov, iovcnt) = (slot.iov.as_ptr(), 1);
        let op = if read {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            }
        } else {
            IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync: !self.drive.writeback(),
            }
        };
        self.push(idx, op);
    }
}
