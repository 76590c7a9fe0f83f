//! The bounce pool: fixed per-queue buffers for guest buffers that O_DIRECT cannot use
//! (misaligned), moved chunk by chunk. Never an allocation sized by the guest.

use std::collections::VecDeque;

/// Bounce pool: buffers per queue and bytes per buffer. A bounced request holds one buffer
/// and moves its data through it in chunks of this size.
const BOUNCE_BUFS: usize = 8;
pub(super) const BOUNCE_SIZE: usize = 256 * 1024;
const BOUNCE_ALIGN: usize = 4096;

/// A fixed set of aligned buffers, allocated on first use.
#[derive(Default)]
pub(super) struct BouncePool {
    bufs: Vec<Vec<u8>>,
    pub(super) free: Vec<usize>,
    /// Slots waiting for a buffer, oldest first.
    pub(super) waiting: VecDeque<usize>,
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
