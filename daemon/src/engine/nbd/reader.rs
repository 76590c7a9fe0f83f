//! The reader thread of one NBD connection: connects, then reads replies (parsed by
//! [`super::reply`]) and scatters read payloads straight into guest pages.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;

use tracing::debug;

use super::handshake::skip;
use super::handshake::{connect, disconnect};
use super::queue::{transfer_all, Conn};
use super::reply::{self, Chunk, ReplyError, ReplyHeader};
use super::*;
use crate::guest_mem::sub_iovecs;
use crate::util::lock;

/// The reader thread: connects, then reads replies until the connection ends.
pub(super) fn connect_and_read(conn: &Conn, path: &Path, export: &str, want: ExportInfo) {
    let (sock, info) = match connect(path, export) {
        Ok(x) => x,
        Err(e) => return conn.fail_all(&format!("cannot connect: {}", crate::error_chain(&e))),
    };
    if info.size != want.size {
        disconnect(&sock);
        let e = NbdError::SizeChanged {
            export: export.to_string(),
            was: want.size,
            now: info.size,
        };
        return conn.fail_all(&e.to_string());
    }
    let reader_sock = match sock.try_clone() {
        Ok(s) => s,
        Err(e) => return conn.fail_all(&format!("cannot clone the socket: {e}")),
    };
    let _ = conn.sock.set(sock);
    conn.stats.connections.fetch_add(1, Ordering::Relaxed);
    conn.set_up();
    if conn.closing.load(Ordering::Relaxed) {
        if let Some(s) = conn.sock.get() {
            disconnect(s);
        }
    }
    // Wake the worker: requests pushed meanwhile wait to be sent.
    conn.signal();
    reader(conn, reader_sock, info);
}

fn read_all_vectored(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<()> {
    // SAFETY: the iovecs point into guest memory of a request in flight (see reader).
    transfer_all(iov, |v, n| unsafe { libc::readv(fd, v, n) })
}

fn reader(conn: &Conn, mut s: UnixStream, info: ExportInfo) {
    let why = match read_replies(conn, &mut s, info) {
        Ok(()) => ReplyError::Closed.to_string(),
        Err(e) => crate::error_chain(&e),
    };
    debug!(queue = conn.queue, "NBD reader ends: {why}");
    conn.fail_all(&why);
}

/// Where a reply's bytes go: the request's iovecs for disk bytes [offset, offset+len).
fn target(
    conn: &Conn,
    slot: u32,
    offset: u64,
    len: u64,
    iov: &mut Vec<libc::iovec>,
) -> Result<(), ReplyError> {
    let st = lock(&conn.st);
    let p = st
        .inflight
        .get(&slot)
        .ok_or(ReplyError::UnknownSlot(slot))?;
    let from = reply::data_range(p.offset, p.len, offset, len)?;
    let v = p.iov.ok_or(ReplyError::NoData)?;
    iov.clear();
    // SAFETY: the request is in flight, so its iovecs are valid (push contract).
    sub_iovecs(unsafe { v.as_slice() }, from, len, iov);
    Ok(())
}

/// One part of request `slot` finished with `err` (0: success).
fn part_done(conn: &Conn, slot: u32, err: i32) -> Result<(), ReplyError> {
    let mut st = lock(&conn.st);
    let p = st
        .inflight
        .get_mut(&slot)
        .ok_or(ReplyError::UnknownSlot(slot))?;
    if err != 0 && p.result == 0 {
        p.result = err;
    }
    p.parts_left -= 1;
    if p.parts_left == 0 {
        let p = st.inflight.remove(&slot).expect("present");
        let res = if p.result != 0 {
            p.result
        } else {
            p.len.min(i32::MAX as u64) as i32
        };
        st.completions.push((p.token, res));
        drop(st);
        conn.signal();
    }
    Ok(())
}

/// Fills guest pages with zeroes (a hole reply).
fn zero_fill(iov: &[libc::iovec]) {
    static ZEROES: [u8; 4096] = [0; 4096];
    for v in iov {
        let mut done = 0;
        while done < v.iov_len {
            let n = (v.iov_len - done).min(ZEROES.len());
            // Pointer arithmetic only: done < iov_len.
            let dst = v.iov_base.cast::<u8>().wrapping_add(done);
            // SAFETY: dst..dst+n is inside the iovec, which is guest memory of a request in
            // flight (target checked the range against the request); ZEROES has n bytes.
            unsafe { std::ptr::copy_nonoverlapping(ZEROES.as_ptr(), dst, n) };
            done += n;
        }
    }
}

fn read_replies(conn: &Conn, s: &mut UnixStream, info: ExportInfo) -> Result<(), ReplyError> {
    let io = |e: io::Error| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ReplyError::Closed
        } else {
            ReplyError::Io(e)
        }
    };
    let maxp = u64::from(info.max_payload);
    let mut iov: Vec<libc::iovec> = Vec::new();
    let mut hdr = [0u8; 20];
    loop {
        match s.read_exact(&mut hdr[..4]) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(ReplyError::Io(e)),
        }
        let n = reply::header_len(u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]))?;
        s.read_exact(&mut hdr[4..n]).map_err(io)?;
        let h = reply::parse_header(&hdr[..n])?;
        let slot = (h.cookie() >> 32) as u32;
        match h {
            ReplyHeader::Simple { error, cookie } => {
                let part = cookie & 0xffff_ffff;
                // Simple replies are only negotiated when structured replies are refused;
                // then a successful read carries its data right after the header.
                let read_len = {
                    let st = lock(&conn.st);
                    st.inflight.get(&slot).and_then(|p| {
                        (p.read && error == 0)
                            .then(|| reply::simple_read_part(p.offset, p.len, part, maxp))
                    })
                };
                if let Some((off, len)) = read_len {
                    target(conn, slot, off, len, &mut iov)?;
                    read_all_vectored(s.as_raw_fd(), &mut iov).map_err(io)?;
                }
                part_done(conn, slot, reply::nbd_errno(error))?;
            }
            ReplyHeader::Structured {
                flags, typ, len, ..
            } => {
                let mut prefix = [0u8; 12];
                let plen = reply::chunk_prefix_len(typ, len)?;
                s.read_exact(&mut prefix[..plen]).map_err(io)?;
                let mut err = 0;
                match reply::parse_chunk(typ, len, &prefix[..plen])? {
                    Chunk::Skip { skip: n } => skip(s, u64::from(n)).map_err(io)?,
                    Chunk::Data { offset, len } => {
                        target(conn, slot, offset, u64::from(len), &mut iov)?;
                        read_all_vectored(s.as_raw_fd(), &mut iov).map_err(io)?;
                    }
                    Chunk::Hole { offset, len } => {
                        target(conn, slot, offset, u64::from(len), &mut iov)?;
                        zero_fill(&iov);
                    }
                    Chunk::Error {
                        errno,
                        msg_len,
                        skip: rest,
                    } => {
                        let mut msg = vec![0; usize::from(msg_len)];
                        s.read_exact(&mut msg).map_err(io)?;
                        skip(s, u64::from(rest)).map_err(io)?;
                        debug!(
                            queue = conn.queue,
                            "NBD error {errno}: {}",
                            String::from_utf8_lossy(&msg)
                        );
                        err = errno;
                    }
                }
                if err != 0 {
                    let mut st = lock(&conn.st);
                    if let Some(p) = st.inflight.get_mut(&slot) {
                        if p.result == 0 {
                            p.result = err;
                        }
                    }
                }
                if flags & REPLY_FLAG_DONE != 0 {
                    part_done(conn, slot, 0)?;
                }
            }
        }
    }
}
