//! Guest memory: the memory map type, and the iovec arithmetic every engine path shares
//! (guest ranges to host iovecs, sub-ranges, advancing past transferred bytes, copies).

use std::sync::{Arc, Mutex};

pub mod dirty_log;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::virtio_blk::Seg;

/// The guest's memory, as the frontend's memory table maps it.
pub type Mem = GuestMemoryMmap<()>;
/// The guest memory map, replaced as a whole when the frontend changes it; requests in flight
/// keep the map they started with alive.
pub type MemHandle = Arc<Mutex<Arc<Mem>>>;

/// A guest range that is not guest memory, or that needs more than [`MAX_IOV`] pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("guest range outside guest memory or too fragmented")]
pub struct BadRange;

/// Most iovecs one operation may have (the kernel's UIO_MAXIOV).
pub const MAX_IOV: usize = 1024;

/// Maps guest ranges to host iovecs. Returns whether the ranges were mapped, and whether every
/// piece is 512-aligned in address and length (the common case, checked again against the
/// engine's own alignment when that is not 512).
pub fn build_iovecs(mem: &Mem, segs: &[Seg], iov: &mut Vec<libc::iovec>) -> Result<bool, BadRange> {
    iov.clear();
    let mut aligned = true;
    for s in segs {
        for vs in GuestMemoryBackend::get_slices(mem, GuestAddress(s.addr), s.len as usize) {
            let vs = vs.map_err(|_| BadRange)?;
            if iov.len() >= MAX_IOV {
                return Err(BadRange);
            }
            let base = vs.ptr_guard_mut().as_ptr();
            aligned &= (base as usize) % 512 == 0 && vs.len() % 512 == 0;
            iov.push(libc::iovec {
                iov_base: base.cast(),
                iov_len: vs.len(),
            });
        }
    }
    Ok(aligned)
}

pub fn iov_aligned(iov: &[libc::iovec], align: usize) -> bool {
    iov.iter()
        .all(|v| (v.iov_base as usize) % align == 0 && v.iov_len % align == 0)
}

/// Moves past `n` transferred bytes of `iov[start..]`: whole iovecs are skipped, a partial
/// one is shortened in place, and empty ones after it are skipped too. Returns the new start.
pub fn consume_iov(iov: &mut [libc::iovec], mut start: usize, mut n: usize) -> usize {
    while start < iov.len() {
        let v = &mut iov[start];
        if n < v.iov_len {
            // Pointer arithmetic only (no access): stays inside the same buffer, n < iov_len.
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
            v.iov_len -= n;
            break;
        }
        n -= v.iov_len;
        start += 1;
    }
    start
}

/// Drops the first `n` bytes of an iovec list.
pub fn advance_iov(iov: &mut Vec<libc::iovec>, n: usize) {
    let consumed = consume_iov(iov, 0, n);
    iov.drain(..consumed);
}

/// Appends to `out` the pieces of `all` covering bytes [from, from+len) of it; returns how
/// many bytes were covered (less than `len` when `all` is shorter).
pub fn sub_iovecs(all: &[libc::iovec], from: u64, len: u64, out: &mut Vec<libc::iovec>) -> u64 {
    let mut skip = from;
    let mut left = len;
    for v in all {
        if left == 0 {
            break;
        }
        let vl = v.iov_len as u64;
        if skip >= vl {
            skip -= vl;
            continue;
        }
        let take = (vl - skip).min(left);
        out.push(libc::iovec {
            // Pointer arithmetic only: skip < iov_len, so it stays inside the buffer.
            iov_base: v.iov_base.cast::<u8>().wrapping_add(skip as usize).cast(),
            iov_len: take as usize,
        });
        left -= take;
        skip = 0;
    }
    len - left
}

/// Copies guest bytes, starting `skip` bytes into `segs`, into `dst` (which must be covered).
pub fn copy_from_guest(mem: &Mem, segs: &[Seg], skip: u64, dst: &mut [u8]) -> Result<(), BadRange> {
    walk_segs(segs, skip, dst.len(), |addr, pos, n| {
        mem.read_slice(&mut dst[pos..pos + n], GuestAddress(addr))
            .map_err(|_| BadRange)
    })
}

/// Copies `src` into guest memory, starting `skip` bytes into `segs`.
pub fn copy_to_guest(mem: &Mem, segs: &[Seg], skip: u64, src: &[u8]) -> Result<(), BadRange> {
    walk_segs(segs, skip, src.len(), |addr, pos, n| {
        mem.write_slice(&src[pos..pos + n], GuestAddress(addr))
            .map_err(|_| BadRange)
    })
}

/// Calls `f(guest_addr, buf_pos, n)` for each piece of `len` bytes of `segs` after `skip`.
pub fn walk_segs(
    segs: &[Seg],
    mut skip: u64,
    len: usize,
    mut f: impl FnMut(u64, usize, usize) -> Result<(), BadRange>,
) -> Result<(), BadRange> {
    let mut pos = 0;
    for s in segs {
        if pos == len {
            break;
        }
        let sl = u64::from(s.len);
        if skip >= sl {
            skip -= sl;
            continue;
        }
        let n = ((sl - skip) as usize).min(len - pos);
        f(s.addr.checked_add(skip).ok_or(BadRange)?, pos, n)?;
        pos += n;
        skip = 0;
    }
    if pos == len {
        Ok(())
    } else {
        Err(BadRange)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_segs_skips_and_splits() {
        let segs = [
            Seg { addr: 100, len: 4 },
            Seg { addr: 200, len: 4 },
            Seg { addr: 300, len: 4 },
        ];
        let mut seen = vec![];
        walk_segs(&segs, 6, 5, |a, p, n| {
            seen.push((a, p, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![(202, 0, 2), (300, 2, 3)]);
        assert!(walk_segs(&segs, 10, 5, |_, _, _| Ok(())).is_err());
    }

    #[test]
    fn advance_iov_partial() {
        let mut buf = [0u8; 64];
        let p = buf.as_mut_ptr();
        let mut iov = vec![
            libc::iovec {
                iov_base: p.cast(),
                iov_len: 16,
            },
            libc::iovec {
                // SAFETY: inside `buf`.
                iov_base: unsafe { p.add(16) }.cast(),
                iov_len: 16,
            },
        ];
        advance_iov(&mut iov, 20);
        assert_eq!(iov.len(), 1);
        assert_eq!(iov[0].iov_len, 12);
        // SAFETY: inside `buf`.
        assert_eq!(iov[0].iov_base, unsafe { p.add(20) }.cast());
    }

    #[test]
    fn consume_skips_whole_partial_and_empty_iovecs() {
        let mut buf = [0u8; 64];
        let p = buf.as_mut_ptr();
        let v = |off: usize, len: usize| libc::iovec {
            iov_base: p.wrapping_add(off).cast(),
            iov_len: len,
        };
        let mut iov = [v(0, 8), v(8, 0), v(8, 8), v(16, 0), v(16, 8)];
        assert_eq!(
            consume_iov(&mut iov, 0, 8),
            2,
            "the empty one after a whole one"
        );
        assert_eq!(consume_iov(&mut iov, 2, 3), 2);
        assert_eq!(
            (iov[2].iov_base, iov[2].iov_len),
            (p.wrapping_add(11).cast(), 5)
        );
        assert_eq!(
            consume_iov(&mut iov, 2, 5),
            4,
            "the empty one after a partial one"
        );
        assert_eq!(consume_iov(&mut iov, 4, 8), 5);
        let mut out = Vec::new();
        let all = [v(0, 8), v(8, 8), v(16, 8)];
        assert_eq!(sub_iovecs(&all, 6, 12, &mut out), 12);
        assert_eq!(out.len(), 3);
        assert_eq!(
            (out[0].iov_base, out[0].iov_len),
            (p.wrapping_add(6).cast(), 2)
        );
        assert_eq!(out[2].iov_len, 2);
        out.clear();
        assert_eq!(sub_iovecs(&all, 20, 10, &mut out), 4, "short list");
    }
}
