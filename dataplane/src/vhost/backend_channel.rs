//! The backend channel (vhost-user `SET_BACKEND_REQ_FD`): the one message acceld sends the
//! frontend on it, `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`, after a resize.
//!
//! The vhost crate (0.18) takes the channel's descriptor and offers no way to send that
//! message, so acceld keeps its own copy: before the crate reads a `SET_BACKEND_REQ_FD`, the
//! server loop peeks at it (`MSG_PEEK` with room for descriptors installs duplicates of them
//! in this process, and leaves the message whole for the crate).

use std::io::{self, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::drive::Drive;
use crate::util::lock;

/// `VHOST_USER_SET_BACKEND_REQ_FD` (vhost-user spec, front-end message types).
const SET_BACKEND_REQ_FD: u32 = 21;
/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` (back-end message types).
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1, no reply wanted.
const VERSION_1: u32 = 0x1;
/// Most descriptors one message carries (the spec's limit).
const MAX_FDS: usize = 8;
/// Copies what is queued on `fd` into `buf` without consuming it and without waiting: the
/// byte count, or -1 with errno set (`EAGAIN` when nothing is queued).
pub(super) fn peek_bytes(fd: RawFd, buf: &mut [u8]) -> isize {
    // SAFETY: buf is a writable buffer of the length passed; MSG_PEEK leaves the data queued.
    unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    }
}

/// The peek's control buffer in u64 words: a cmsghdr (16 bytes) and MAX_FDS descriptors.
const CBUF_WORDS: usize = (16 + MAX_FDS * 4).div_ceil(8);

/// If the next message on `fd` is `SET_BACKEND_REQ_FD`, a duplicate of the channel it
/// carries. Never blocks and never consumes a byte.
pub(super) fn peek(fd: RawFd) -> Option<UnixStream> {
    let mut hdr = [0u8; 12];
    let n = peek_bytes(fd, &mut hdr);
    if n != 12 || u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) != SET_BACKEND_REQ_FD {
        return None;
    }
    let mut iov = libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: hdr.len(),
    };
    // Room for MAX_FDS descriptors (and no more: the kernel installs only what fits and
    // flags the rest MSG_CTRUNC), aligned for cmsghdr.
    let mut cbuf = [0u64; CBUF_WORDS];
    // SAFETY: msghdr is plain old data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points at live buffers (iov, cbuf) of the lengths given.
    let n = unsafe {
        libc::recvmsg(
            fd,
            &raw mut msg,
            libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    // Every descriptor the peek installed is closed below, whatever happens to the message.
    let fds = installed_fds(&msg);
    if n <= 0 {
        close_all(fds);
        return None;
    }
    let mut fds = fds.into_iter();
    let first = fds.next()?;
    close_all(fds);
    // SAFETY: first was installed in this process by the peek; the stream now owns it.
    Some(unsafe { UnixStream::from_raw_fd(first) })
}

/// Closes descriptors the peek installed that nothing owns.
fn close_all(fds: impl IntoIterator<Item = RawFd>) {
    for fd in fds {
        // SAFETY: fd was installed in this process by the peek and is owned by nobody else.
        unsafe { libc::close(fd) };
    }
}

/// The descriptors of every `SCM_RIGHTS` message in `msg`'s control data (all of them, so
/// that none is left open).
fn installed_fds(msg: &libc::msghdr) -> Vec<RawFd> {
    if msg.msg_control.is_null() || msg.msg_controllen == 0 {
        return Vec::new();
    }
    let mut fds = Vec::new();
    // SAFETY: msg was filled by recvmsg; CMSG_FIRSTHDR reads only its control fields.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(msg) };
    while !c.is_null() {
        // SAFETY: c points at a cmsghdr inside cbuf (CMSG_FIRSTHDR/CMSG_NXTHDR bound it).
        let h = unsafe { &*c };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: computing the header length of a zero-byte payload has no preconditions.
            let base = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (h.cmsg_len as usize).saturating_sub(base) / std::mem::size_of::<RawFd>();
            // Never past the control data the kernel filled.
            let room = msg.msg_controllen.saturating_sub(base) / std::mem::size_of::<RawFd>();
            let count = count.min(room);
            // SAFETY: c is a valid cmsghdr; CMSG_DATA points at its payload.
            let data = unsafe { libc::CMSG_DATA(c) }.cast::<RawFd>();
            for i in 0..count {
                // Pointer arithmetic only: i < count keeps it inside this cmsg's payload.
                let p = data.wrapping_add(i);
                // SAFETY: p points at a descriptor inside the payload (above); unaligned,
                // since the payload follows the header without a padding guarantee.
                fds.push(unsafe { p.read_unaligned() });
            }
        }
        // SAFETY: msg and c are valid (above); CMSG_NXTHDR returns null past the end.
        c = unsafe { libc::CMSG_NXTHDR(msg, c) };
    }
    fds
}

/// Tells the frontend that the drive's config space changed (QEMU's vhost-user-blk then reads
/// it again and, if the capacity differs, interrupts the guest). Returns false when the
/// frontend gave acceld no backend channel (it did not take the feature, or is not connected).
pub fn notify_config_change(drive: &Drive) -> io::Result<bool> {
    let mut slot = lock(&drive.backend_channel);
    let Some(ch) = slot.as_mut() else {
        return Ok(false);
    };
    ch.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut msg = [0u8; 12];
    msg[0..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
    msg[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
    if let Err(e) = ch.write_all(&msg) {
        *slot = None;
        return Err(e);
    }
    Ok(true)
}
