//! Inflight I/O tracking (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`, split rings): a shared
//! memory region that QEMU keeps across the backend's death, in which acceld marks every
//! request it popped and clears it once the request is in the used ring. A new acceld that
//! finds requests marked resubmits exactly those, in the order they were popped, and none
//! that completed (vhost-user spec, "Inflight I/O tracking").
//!
//! Layout, per queue, `queue_region_size(queue_size)` bytes (64-aligned), queues one after
//! the other:
//!
//! ```text
//! u64 features | u16 version | u16 desc_num | u16 last_batch_head | u16 used_idx
//! desc[desc_num]: u8 inflight | u8 padding[5] | u16 next | u64 counter
//! ```

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

const HEADER: usize = 16;
const DESC: usize = 16;
const ALIGN: usize = 64;
/// The layout version acceld writes (0: a region nobody used yet).
const VERSION: u16 = 1;

/// Bytes of one queue's region.
pub fn queue_region_size(queue_size: u16) -> usize {
    (HEADER + DESC * usize::from(queue_size)).next_multiple_of(ALIGN)
}

#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    #[error("cannot create the inflight region")]
    Create(#[source] std::io::Error),
    #[error("cannot map the inflight region")]
    Map(#[source] std::io::Error),
    #[error("inflight region of {have} bytes is too small for {queues} queues of {size}")]
    TooSmall { have: u64, queues: u16, size: u16 },
    #[error("inflight region for {queues} queues of {size} descriptors is not valid")]
    Shape { queues: u16, size: u16 },
}

/// The whole region: every queue's part, mapped.
pub struct InflightRegion {
    file: File,
    addr: *mut u8,
    len: usize,
    pub num_queues: u16,
    pub queue_size: u16,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics at offsets
// checked against `len`; it lives until Drop unmaps it.
unsafe impl Send for InflightRegion {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for InflightRegion {}

impl InflightRegion {
    /// A new zeroed region (GET_INFLIGHT_FD).
    pub fn create(num_queues: u16, queue_size: u16) -> Result<Self, InflightError> {
        if num_queues == 0 || queue_size == 0 || queue_size > 32768 {
            return Err(InflightError::Shape {
                queues: num_queues,
                size: queue_size,
            });
        }
        let len = queue_region_size(queue_size) * usize::from(num_queues);
        // Its size is fixed: QEMU keeps the descriptor and cannot shrink the region under
        // this acceld or the next one (a mapped page past the end is SIGBUS).
        let file = crate::util::memfd(
            c"accel-inflight",
            len as u64,
            Some(libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL),
        )
        .map_err(InflightError::Create)?;
        Self::map(file, len as u64, 0, num_queues, queue_size)
    }

    /// Maps a region the frontend kept (SET_INFLIGHT_FD).
    pub fn map(
        file: File,
        mmap_size: u64,
        mmap_offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Self, InflightError> {
        if num_queues == 0 || queue_size == 0 || queue_size > 32768 {
            return Err(InflightError::Shape {
                queues: num_queues,
                size: queue_size,
            });
        }
        let need = queue_region_size(queue_size) as u64 * u64::from(num_queues);
        let file_len = file.metadata().map_err(InflightError::Map)?.len();
        if mmap_size < need
            || mmap_offset
                .checked_add(mmap_size)
                .is_none_or(|e| e > file_len)
        {
            return Err(InflightError::TooSmall {
                have: mmap_size.min(file_len.saturating_sub(mmap_offset)),
                queues: num_queues,
                size: queue_size,
            });
        }
        let len = need as usize;
        // SAFETY: a new shared mapping of `len` bytes of the file, inside it (checked above);
        // no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                mmap_offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(InflightError::Map(std::io::Error::last_os_error()));
        }
        Ok(InflightRegion {
            file,
            addr: p.cast(),
            len,
            num_queues,
            queue_size,
        })
    }

    /// The region's file, to send to the frontend.
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queue `q`'s part.
    pub fn queue(self: &Arc<Self>, q: usize) -> Option<InflightQueue> {
        (q < usize::from(self.num_queues)).then(|| InflightQueue {
            region: self.clone(),
            off: q * queue_region_size(self.queue_size),
            desc_num: self.queue_size,
        })
    }
}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, not used after this.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// What a queue starting on a region found: the requests to resubmit, oldest first, and
/// where popping goes on.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Heads in flight when the previous backend stopped, in the order they were popped.
    pub resubmit: Vec<u16>,
    /// The avail index after the last popped request (used index + requests in flight);
    /// None on a fresh region.
    pub next_avail: Option<u16>,
}

/// One queue's part of the region.
pub struct InflightQueue {
    region: Arc<InflightRegion>,
    off: usize,
    desc_num: u16,
}

impl InflightQueue {
    fn at<T>(&self, off: usize) -> &T {
        assert!(self.off + off + std::mem::size_of::<T>() <= self.region.len);
        // Pointer arithmetic only: inside the mapping (asserted).
        let p = self.region.addr.wrapping_add(self.off + off);
        // SAFETY: p is inside the live mapping, aligned for T (every field sits at its own
        // size's alignment in a 64-aligned region of a page-aligned mapping), and the memory
        // is only ever accessed through atomics.
        unsafe { &*p.cast::<T>() }
    }
    fn version(&self) -> &AtomicU16 {
        self.at(8)
    }
    fn last_batch_head(&self) -> &AtomicU16 {
        self.at(12)
    }
    fn used_idx(&self) -> &AtomicU16 {
        self.at(14)
    }
    fn inflight(&self, head: u16) -> &AtomicU8 {
        self.at(HEADER + DESC * usize::from(head))
    }
    fn counter(&self, head: u16) -> &AtomicU64 {
        self.at(HEADER + DESC * usize::from(head) + 8)
    }

    /// Called as the queue starts, with the used index in guest memory and the ring's size:
    /// a fresh region is initialized; a used one says what to resubmit (libvhost-user's
    /// `vu_check_queue_inflights`).
    pub fn start(&mut self, ring_used_idx: u16, ring_size: u16) -> Recovery {
        if self.version().load(Ordering::Acquire) == 0 {
            for h in 0..self.desc_num {
                self.inflight(h).store(0, Ordering::Relaxed);
            }
            self.used_idx().store(ring_used_idx, Ordering::Relaxed);
            self.at::<AtomicU16>(10)
                .store(self.desc_num, Ordering::Relaxed);
            self.version().store(VERSION, Ordering::Release);
            return Recovery::default();
        }
        // The previous backend may have published a completion in the used ring and died
        // before clearing its mark: the used index tells.
        if self.used_idx().load(Ordering::Acquire) != ring_used_idx {
            let h = self.last_batch_head().load(Ordering::Acquire);
            if h < self.desc_num {
                self.inflight(h).store(0, Ordering::Release);
            }
            self.used_idx().store(ring_used_idx, Ordering::Release);
        }
        let n = self.desc_num.min(ring_size);
        let mut marked: Vec<(u64, u16)> = (0..n)
            .filter(|&h| self.inflight(h).load(Ordering::Acquire) == 1)
            .map(|h| (self.counter(h).load(Ordering::Acquire), h))
            .collect();
        // Marks past the ring's size cannot be real requests: drop them.
        for h in n..self.desc_num {
            self.inflight(h).store(0, Ordering::Relaxed);
        }
        marked.sort_unstable();
        Recovery {
            next_avail: Some(ring_used_idx.wrapping_add(marked.len() as u16)),
            resubmit: marked.into_iter().map(|(_, h)| h).collect(),
        }
    }

    /// The next counter after what the region holds (resubmitted requests keep theirs).
    pub fn next_counter(&self) -> u64 {
        (0..self.desc_num)
            .filter(|&h| self.inflight(h).load(Ordering::Relaxed) == 1)
            .map(|h| self.counter(h).load(Ordering::Relaxed) + 1)
            .max()
            .unwrap_or(0)
    }

    /// Marks `head` in flight (at pop), with its place in the order.
    pub fn get(&self, head: u16, counter: u64) {
        if head < self.desc_num {
            self.counter(head).store(counter, Ordering::Relaxed);
            self.inflight(head).store(1, Ordering::Release);
        }
    }

    /// Another back-end (QEMU's export, during a lend) moved the used index to `used_idx`,
    /// with nothing of ours in flight.
    pub fn resync(&self, used_idx: u16) {
        self.used_idx().store(used_idx, Ordering::Release);
    }

    /// Before `head` goes into the used ring.
    pub fn pre_put(&self, head: u16) {
        self.last_batch_head().store(head, Ordering::Release);
    }

    /// After `head` is in the used ring and the used index is `used_idx`.
    pub fn post_put(&self, head: u16, used_idx: u16) {
        if head < self.desc_num {
            self.inflight(head).store(0, Ordering::Release);
        }
        self.used_idx().store(used_idx, Ordering::Release);
    }
}

/// The descriptors of the chain at `head`, read from guest memory the way virtio-queue's
/// iterator reads them (for requests resubmitted by head, which the avail ring no longer
/// names): `(descriptor, has NEXT)`, ending quietly where the chain cannot go on (a loop cut
/// at the table's size, a `next` past the table, a bad or nested indirect table, memory that
/// is not guest memory). The caller treats a chain whose last descriptor has NEXT as cut.
pub fn chain_at(
    mem: &crate::guest_mem::Mem,
    desc_table: u64,
    queue_size: u16,
    head: u16,
) -> Vec<(crate::virtio_blk::Desc, bool)> {
    use vm_memory::{Bytes, GuestAddress};
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const F_INDIRECT: u16 = 4;
    let read = |table: u64, i: u16| -> Option<(u64, u32, u16, u16)> {
        let mut d = [0u8; 16];
        let at = table.checked_add(16 * u64::from(i))?;
        mem.read_slice(&mut d, GuestAddress(at)).ok()?;
        Some((
            u64::from_le_bytes(d[0..8].try_into().ok()?),
            u32::from_le_bytes(d[8..12].try_into().ok()?),
            u16::from_le_bytes(d[12..14].try_into().ok()?),
            u16::from_le_bytes(d[14..16].try_into().ok()?),
        ))
    };
    let mut out = Vec::new();
    let (mut table, mut size, mut i) = (desc_table, queue_size, head);
    let mut ttl = queue_size;
    let mut indirect = false;
    let mut total: u32 = 0;
    while ttl > 0 && i < size {
        let Some((addr, len, flags, next)) = read(table, i) else {
            break;
        };
        if flags & F_INDIRECT != 0 {
            if indirect || len % 16 != 0 || len / 16 > u32::from(u16::MAX) || len == 0 {
                break;
            }
            indirect = true;
            table = addr;
            size = (len / 16) as u16;
            ttl = size;
            i = 0;
            continue;
        }
        let Some(t) = total.checked_add(len) else {
            break;
        };
        total = t;
        let has_next = flags & F_NEXT != 0;
        out.push((
            crate::virtio_blk::Desc {
                addr,
                len,
                writable: flags & F_WRITE != 0,
            },
            has_next,
        ));
        if !has_next {
            break;
        }
        i = next;
        ttl -= 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(size: u16) -> InflightQueue {
        let r = Arc::new(InflightRegion::create(2, size).unwrap());
        assert_eq!(r.len(), 2 * queue_region_size(size));
        r.queue(1).unwrap()
    }

    #[test]
    fn a_fresh_region_starts_clean_and_resubmits_nothing() {
        let mut q = queue(8);
        assert_eq!(q.start(5, 8), Recovery::default());
        assert_eq!(q.next_counter(), 0);
    }

    #[test]
    fn unfinished_requests_come_back_in_their_order_and_finished_ones_do_not() {
        let mut q = queue(8);
        q.start(0, 8);
        // Popped 3, 7, 1, 5 (in that order); 7 and 5 completed (used index 2).
        for (c, h) in [3u16, 7, 1, 5].into_iter().enumerate() {
            q.get(h, c as u64);
        }
        for (i, h) in [7u16, 5].into_iter().enumerate() {
            q.pre_put(h);
            q.post_put(h, i as u16 + 1);
        }
        let rec = q.start(2, 8);
        assert_eq!(rec.resubmit, vec![3, 1]);
        assert_eq!(rec.next_avail, Some(4), "used index + requests in flight");
        assert_eq!(q.next_counter(), 3);
    }

    #[test]
    fn a_completion_published_but_not_cleared_is_not_resubmitted() {
        let mut q = queue(8);
        q.start(0, 8);
        q.get(2, 0);
        q.get(4, 1);
        // 4 went into the used ring (used index 1 in guest memory), then the backend died
        // before clearing its mark.
        q.pre_put(4);
        let rec = q.start(1, 8);
        assert_eq!(rec.resubmit, vec![2]);
        assert_eq!(rec.next_avail, Some(2));
    }

    #[test]
    fn a_region_of_the_wrong_shape_is_refused() {
        assert!(InflightRegion::create(0, 8).is_err());
        assert!(InflightRegion::create(1, 0).is_err());
        let r = InflightRegion::create(1, 8).unwrap();
        let f = r.file().try_clone().unwrap();
        assert!(InflightRegion::map(f, 64, 0, 4, 8).is_err(), "too small");
        let f = r.file().try_clone().unwrap();
        assert!(
            InflightRegion::map(f, u64::MAX, 4096, 1, 8).is_err(),
            "past the file"
        );
        let f = r.file().try_clone().unwrap();
        assert!(InflightRegion::map(f, r.len() as u64, 0, 1, 8).is_ok());
    }
}
