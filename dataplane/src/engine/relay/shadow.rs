//! The relay's own memory: one sealed memfd that acceld maps and adds to the export's memory
//! table at guest-physical addresses no guest RAM uses. It holds, per queue, the split ring
//! acceld drives (descriptor table, avail ring, used ring), the request headers, discard
//! segments and status bytes the export reads and writes, and one indirect table per head.
//! The guest never sees it (it is not in acceld's guest memory map, so a guest descriptor
//! aimed at it fails acceld's translation), and only acceld writes what the export reads.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};
use std::ptr::NonNull;

/// Where the region starts in the export's guest-physical (and user) address space: above any
/// x86-64 physical address (MAXPHYADDR is at most 52 bits), so no guest RAM, now or hotplugged
/// later, overlaps it.
pub const SHADOW_GPA: u64 = 1 << 62;

/// Heads (and descriptors) per shadow ring: the largest virtqueue a guest may have.
pub const RING_SIZE: u16 = 1024;
/// Descriptors in one head's indirect table: QEMU's export maps at most 1024 iovecs per
/// request (`VIRTQUEUE_MAX_SIZE`), the header and the status byte included.
pub const INDIRECT_MAX: usize = 1024;

const PAGE: usize = 4096;
const N: usize = RING_SIZE as usize;

/// Byte offsets of one queue's parts inside its stride.
pub const DESC_OFF: usize = 0;
pub const AVAIL_OFF: usize = 16 * N;
pub const USED_OFF: usize = AVAIL_OFF + PAGE;
/// Per head: the 16-byte request header, the 16-byte discard/write-zeroes segment, the
/// status byte.
pub const SLOT_OFF: usize = USED_OFF + 3 * PAGE;
pub const SLOT_LEN: usize = 64;
pub const SLOT_HDR: usize = 0;
pub const SLOT_SEG: usize = 16;
pub const SLOT_STATUS: usize = 32;
pub const INDIRECT_OFF: usize = SLOT_OFF + SLOT_LEN * N;
/// One queue's share of the region.
pub const STRIDE: usize = INDIRECT_OFF + 16 * INDIRECT_MAX * N;

const _: () = assert!(6 + 2 * N + 2 <= PAGE, "the avail ring fits its page");
const _: () = assert!(6 + 8 * N + 2 <= 3 * PAGE, "the used ring fits its pages");
const _: () = assert!(STRIDE % PAGE == 0);

/// The mapped memfd.
pub struct Shadow {
    file: File,
    base: NonNull<u8>,
    len: usize,
    queues: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through raw pointers whose
// users (one ring per queue, each driven by one thread at a time) synchronise themselves.
unsafe impl Send for Shadow {}
// SAFETY: as for Send: `Shadow` hands out addresses, never references.
unsafe impl Sync for Shadow {}

impl Shadow {
    /// A region for `queues` queues, sealed against shrinking and growing (the export maps it
    /// with the size acceld says; a shrink would make its accesses fault).
    pub fn new(queues: usize) -> io::Result<Shadow> {
        let len = STRIDE
            .checked_mul(queues.max(1))
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a NUL-terminated name and valid flags; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"accel-relay".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own, with a valid command and argument.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of `len` bytes of our memfd (sealed at that size);
        // the result is checked before use and unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Shadow {
            file,
            base,
            len,
            queues: queues.max(1),
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn queues(&self) -> usize {
        self.queues
    }

    /// acceld's address of queue `q`'s part (`q` < [`Shadow::queues`]).
    pub fn host(&self, q: usize) -> *mut u8 {
        assert!(q < self.queues);
        // SAFETY: q * STRIDE is inside the mapping (q < queues, len = STRIDE * queues).
        unsafe { self.base.as_ptr().add(q * STRIDE) }
    }

    /// The export's (guest-physical) address of queue `q`'s part.
    pub fn gpa(q: usize) -> u64 {
        SHADOW_GPA + (q * STRIDE) as u64
    }
}

impl Drop for Shadow {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes; nothing uses it after Drop.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_is_sealed_at_its_size_and_laid_out_per_queue() {
        let s = Shadow::new(2).unwrap();
        assert_eq!(s.len(), 2 * STRIDE);
        assert_eq!(s.file.metadata().unwrap().len(), 2 * STRIDE as u64);
        // Sealed: neither shrink nor grow.
        assert!(s.file.set_len(STRIDE as u64).is_err());
        assert!(s.file.set_len(3 * STRIDE as u64).is_err());
        assert_eq!(Shadow::gpa(1) - Shadow::gpa(0), STRIDE as u64);
        assert_eq!(s.host(1) as usize - s.host(0) as usize, STRIDE);
        // Writable, and shared with the file.
        // SAFETY: the first byte of queue 1's part is inside the mapping.
        unsafe { s.host(1).write(7) };
        let mut b = [0u8; 1];
        std::os::unix::fs::FileExt::read_at(&s.file, &mut b, STRIDE as u64).unwrap();
        assert_eq!(b[0], 7);
        assert_eq!(USED_OFF % 4, 0);
        assert_eq!(INDIRECT_OFF % 16, 0);
    }
}
