//! Bytes with file descriptors over a unix stream socket (SCM_RIGHTS), blocking: the control
//! socket's `register` and libvirt's monitor relay (`getfd` of a `virsh save`).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries (QEMU's monitor takes one per command).
pub const MAX_FDS: usize = 8;

const FD_SIZE: u32 = std::mem::size_of::<i32>() as u32;

/// One `sendmsg` of (a first part of) `bytes` with `fds` attached; returns the bytes sent.
pub fn send(sock: RawFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "too many descriptors for one message",
        ));
    }
    let mut cmsg = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(FD_SIZE * fds.len() as u32) } as usize;
    assert!(space <= std::mem::size_of_val(&cmsg));
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `cmsg`, large enough for one header (asserted).
        let hdr = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        assert!(!hdr.is_null());
        // SAFETY: CMSG_LEN only computes a size.
        let len = unsafe { libc::CMSG_LEN(FD_SIZE * fds.len() as u32) };
        let h = libc::cmsghdr {
            cmsg_len: len as _,
            cmsg_level: libc::SOL_SOCKET,
            cmsg_type: libc::SCM_RIGHTS,
        };
        // SAFETY: `hdr` points into `cmsg` (CMSG_FIRSTHDR of a buffer of `space` bytes).
        unsafe { std::ptr::write_unaligned(hdr, h) };
        // SAFETY: the header is inside `cmsg`; its data follows it within `space`.
        let data = unsafe { libc::CMSG_DATA(hdr) }.cast::<i32>();
        for (i, fd) in fds.iter().enumerate() {
            // SAFETY: `fds.len()` i32s fit after the header (CMSG_SPACE above): in bounds.
            let at = unsafe { data.add(i) };
            // SAFETY: `at` is in bounds of `cmsg` (above).
            unsafe { std::ptr::write_unaligned(at, fd.as_raw_fd()) };
        }
    }
    // SAFETY: `msg` points at `iov` (over `bytes`, only read) and `cmsg`, alive for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One `recvmsg`: the bytes read and the descriptors that came with them (close-on-exec).
pub fn recv(sock: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(FD_SIZE * MAX_FDS as u32) } as usize;
    assert!(space <= std::mem::size_of_val(&cmsg));
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `cmsg`, both alive for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR reads its control fields.
    let mut hdr = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !hdr.is_null() {
        // SAFETY: a non-null header from CMSG_FIRSTHDR/NXTHDR lies inside `cmsg`.
        let h = unsafe { std::ptr::read_unaligned(hdr) };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN only computes a size.
            let head = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (h.cmsg_len as usize).saturating_sub(head) / FD_SIZE as usize;
            // SAFETY: the header is inside `cmsg`; its data follows it there.
            let data = unsafe { libc::CMSG_DATA(hdr) }.cast::<i32>();
            for i in 0..count {
                // SAFETY: `count` descriptors follow the header inside `cmsg` (the kernel
                // wrote them within msg_controllen): the i-th is in bounds.
                let at = unsafe { data.add(i) };
                // SAFETY: `at` is in bounds (above).
                let fd = unsafe { std::ptr::read_unaligned(at) };
                if fd >= 0 {
                    // SAFETY: the kernel just gave this descriptor to us; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // SAFETY: `hdr` is a header of `msg` (above).
        hdr = unsafe { libc::CMSG_NXTHDR(&msg, hdr) };
    }
    Ok((n as usize, fds))
}
