//! The connecting thread of one NBD connection, and the reply reader the queue's worker runs
//! when the socket is readable: replies parsed by [`super::reply`], read payloads scattered
//! straight into guest pages.
//!
//! The reader never blocks and keeps its place between calls (a reply may arrive in pieces).
//! Bytes that are not guest data (headers, chunk prefixes, error messages) go through a small
//! buffer; how much is read at once follows what can come next:
//! - no read in flight: no reply can carry guest data, so replies are read in bulk, as many
//!   as the buffer holds in one `recv`;
//! - otherwise a header is read alone (20 bytes with structured replies, 16 without: every
//!   reply header is at least that long, so this never takes bytes of a payload);
//! - a read's payload is read with one `recvmsg` into the guest's pages, together with the
//!   chunk's offset prefix when the chunk covers exactly the request's part (it must then
//!   start at the part's offset, which is checked) and the next reply's header.
//!
//! So a read costs about one system call and a write reply a share of one.

use std::io;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::Ordering;

use tracing::debug;

use super::conn::{connect_link, Conn, Flight};
use super::handshake::{disconnect, ExportInfo, NbdError};
use super::proto::{REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA};
use super::reply::{self, Chunk, ReplyError, ReplyHeader};
use crate::guest_mem::{consume_iov, sub_iovecs, MAX_IOV};

/// The connecting thread: connects, hands the socket to the worker, and ends.
pub(super) fn connect_thread(conn: &Conn, path: &Path, export: &str, want: ExportInfo) {
    let link = match connect_link(path, export, want.size) {
        Ok(l) => l,
        Err(e @ NbdError::SizeChanged { .. }) => return conn.set_failed(e.to_string()),
        Err(e) => {
            return conn.set_failed(format!("cannot connect: {}", crate::error_chain(&e)));
        }
    };
    let _ = conn.link.set(link);
    conn.stats.connections.fetch_add(1, Ordering::Relaxed);
    if conn.closing.load(Ordering::Relaxed) {
        if let Some(l) = conn.link.get() {
            disconnect(&l.sock);
        }
    }
    conn.set_up();
}

/// Bytes of the buffer for what is not guest data.
const RX_BUF: usize = 4096;
/// The most of an error message kept for the log.
const MSG_KEEP: usize = 256;

#[derive(Clone, Copy, Debug)]
enum Stage {
    /// Between replies: the next header is (partly) in the buffer.
    Header,
    /// A structured chunk's fixed prefix of `need` bytes comes next.
    Prefix {
        slot: u32,
        part: u64,
        flags: u16,
        typ: u16,
        len: u32,
        need: usize,
    },
    /// A payload into guest pages.
    Data(Payload),
    /// `left` bytes to discard (an unknown chunk's payload, an error message), keeping up
    /// to `keep` of them for the log; then the chunk ends with `err`.
    Skip {
        slot: u32,
        flags: u16,
        left: u64,
        keep: usize,
        err: i32,
    },
}

/// A payload on its way into guest pages: `need` bytes in all (the 8-byte prefix first when
/// `check` names the offset it must hold), `got` so far. Up to `trailing` bytes past `need`
/// are the next reply's header, received into the buffer.
#[derive(Clone, Copy, Debug)]
struct Payload {
    slot: u32,
    flags: u16,
    need: u64,
    got: u64,
    check: Option<u64>,
    trailing: usize,
}

/// The reply reader's state, owned by the queue's worker.
pub(super) struct Rx {
    buf: Box<[u8; RX_BUF]>,
    start: usize,
    end: usize,
    stage: Stage,
    /// Where a payload goes (guest pages, and the prefix and the next header around them).
    iov: Vec<libc::iovec>,
    at: usize,
    prefix: Box<[u8; 8]>,
    msg: Vec<u8>,
}

/// Disk offset and length of part `part` of a request at `offset` of `len` bytes.
fn part_range(offset: u64, len: u64, part: u64, maxp: u64) -> (u64, u64) {
    reply::simple_read_part(offset, len, part, maxp)
}

impl Rx {
    pub(super) fn new() -> Self {
        Rx {
            buf: Box::new([0; RX_BUF]),
            start: 0,
            end: 0,
            stage: Stage::Header,
            iov: Vec::new(),
            at: 0,
            prefix: Box::new([0; 8]),
            msg: Vec::new(),
        }
    }

    /// Reads and handles every reply that is there; returns when the socket has nothing
    /// more. An error ends the connection.
    pub(super) fn pump(
        &mut self,
        fd: RawFd,
        structured: bool,
        maxp: u64,
        flight: &mut Flight,
    ) -> Result<(), ReplyError> {
        let min_hdr = if structured { 20 } else { 16 };
        loop {
            match self.stage {
                Stage::Header => {
                    let have = self.end - self.start;
                    let need = if have >= 4 {
                        reply::header_len(be32(&self.buf[self.start..]))?
                    } else {
                        min_hdr
                    };
                    if have < need {
                        if !self.fill(fd, need.max(min_hdr) - have, flight.reads == 0)? {
                            return Ok(());
                        }
                        continue;
                    }
                    let h = reply::parse_header(&self.buf[self.start..self.start + need])?;
                    self.start += need;
                    self.on_header(h, structured, maxp, flight, min_hdr)?;
                }
                Stage::Prefix {
                    slot,
                    part,
                    flags,
                    typ,
                    len,
                    need,
                } => {
                    let have = self.end - self.start;
                    if have < need {
                        if !self.fill(fd, need - have, flight.reads == 0)? {
                            return Ok(());
                        }
                        continue;
                    }
                    let chunk =
                        reply::parse_chunk(typ, len, &self.buf[self.start..self.start + need])?;
                    self.start += need;
                    self.on_chunk(slot, part, flags, chunk, maxp, flight, min_hdr)?;
                }
                Stage::Data(p) => {
                    if !self.recv_data(fd, p, flight)? {
                        return Ok(());
                    }
                }
                Stage::Skip {
                    slot,
                    flags,
                    mut left,
                    keep,
                    err,
                } => {
                    while left > 0 {
                        let have = self.end - self.start;
                        if have == 0 {
                            let want = left.min(RX_BUF as u64) as usize;
                            if !self.fill(fd, want, flight.reads == 0)? {
                                self.stage = Stage::Skip {
                                    slot,
                                    flags,
                                    left,
                                    keep,
                                    err,
                                };
                                return Ok(());
                            }
                            continue;
                        }
                        let take = (have as u64).min(left) as usize;
                        let room = keep.saturating_sub(self.msg.len()).min(take);
                        self.msg
                            .extend_from_slice(&self.buf[self.start..self.start + room]);
                        self.start += take;
                        left -= take as u64;
                    }
                    if err != 0 {
                        debug!("NBD error {err}: {}", String::from_utf8_lossy(&self.msg));
                    }
                    self.end_chunk(slot, flags, err, flight)?;
                }
            }
        }
    }

    /// Receives into the buffer: `want` bytes at most, or as much as fits when `bulk`.
    /// False when nothing is there now.
    fn fill(&mut self, fd: RawFd, want: usize, bulk: bool) -> Result<bool, ReplyError> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if RX_BUF - self.end < want.max(64) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = RX_BUF - self.end;
        let max = if bulk { room } else { want.min(room) };
        loop {
            let dst = self.buf[self.end..].as_mut_ptr();
            // SAFETY: dst..dst+max is inside the buffer (max <= RX_BUF - end), which this Rx
            // owns.
            let r = unsafe { libc::recv(fd, dst.cast(), max, libc::MSG_DONTWAIT) };
            if r > 0 {
                self.end += r as usize;
                return Ok(true);
            }
            if r == 0 {
                return Err(ReplyError::Closed);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(false),
                _ => return Err(ReplyError::Io(e)),
            }
        }
    }

    fn on_header(
        &mut self,
        h: ReplyHeader,
        structured: bool,
        maxp: u64,
        flight: &mut Flight,
        min_hdr: usize,
    ) -> Result<(), ReplyError> {
        let slot = (h.cookie() >> 32) as u32;
        let part = h.cookie() & 0xffff_ffff;
        match h {
            ReplyHeader::Simple { error, .. } => {
                let p = flight.get(slot)?;
                if !(p.read && error == 0) {
                    return flight.part_done(slot, reply::nbd_errno(error));
                }
                if structured {
                    // The spec: with structured replies, a read is answered in chunks.
                    return Err(ReplyError::SimpleRead);
                }
                // Without structured replies a successful read's data follows the header.
                let (off, len) = part_range(p.offset, p.len, part, maxp);
                self.target(flight, slot, part, off, len, maxp)?;
                self.start_data(slot, REPLY_FLAG_DONE, len, None, min_hdr, flight)
            }
            ReplyHeader::Structured {
                flags, typ, len, ..
            } => {
                let need = reply::chunk_prefix_len(typ, len)?;
                if typ == REPLY_TYPE_OFFSET_DATA {
                    let p = flight.get(slot)?;
                    let (off, plen) = part_range(p.offset, p.len, part, maxp);
                    if p.read && plen > 0 && u64::from(len) == 8 + plen {
                        // The chunk covers the whole part, so it starts at the part's
                        // offset: read the prefix, the data and the next header at once.
                        self.target(flight, slot, part, off, plen, maxp)?;
                        self.iov.insert(
                            0,
                            libc::iovec {
                                iov_base: self.prefix.as_mut_ptr().cast(),
                                iov_len: 8,
                            },
                        );
                        return self.start_data(
                            slot,
                            flags,
                            u64::from(len),
                            Some(off),
                            min_hdr,
                            flight,
                        );
                    }
                }
                self.stage = Stage::Prefix {
                    slot,
                    part,
                    flags,
                    typ,
                    len,
                    need,
                };
                Ok(())
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // one chunk's identity, and where its bytes go
    fn on_chunk(
        &mut self,
        slot: u32,
        part: u64,
        flags: u16,
        chunk: Chunk,
        maxp: u64,
        flight: &mut Flight,
        min_hdr: usize,
    ) -> Result<(), ReplyError> {
        match chunk {
            Chunk::Skip { skip } => {
                self.stage = Stage::Skip {
                    slot,
                    flags,
                    left: u64::from(skip),
                    keep: 0,
                    err: 0,
                };
                Ok(())
            }
            Chunk::Data { offset, len } => {
                self.target(flight, slot, part, offset, u64::from(len), maxp)?;
                self.start_data(slot, flags, u64::from(len), None, min_hdr, flight)
            }
            Chunk::Hole { offset, len } => {
                self.target(flight, slot, part, offset, u64::from(len), maxp)?;
                zero_fill(&self.iov);
                self.end_chunk(slot, flags, 0, flight)
            }
            Chunk::Error {
                errno,
                msg_len,
                skip,
            } => {
                self.msg.clear();
                self.stage = Stage::Skip {
                    slot,
                    flags,
                    left: u64::from(msg_len) + u64::from(skip),
                    keep: usize::from(msg_len).min(MSG_KEEP),
                    err: errno,
                };
                Ok(())
            }
        }
    }

    /// Points `iov` at the guest pages for disk bytes [offset, offset+len) of part `part` of
    /// request `slot`, which must be a read and must cover them.
    fn target(
        &mut self,
        flight: &Flight,
        slot: u32,
        part: u64,
        offset: u64,
        len: u64,
        maxp: u64,
    ) -> Result<(), ReplyError> {
        let p = flight.get(slot)?;
        if !p.read {
            return Err(ReplyError::NoData);
        }
        let v = p.iov.ok_or(ReplyError::NoData)?;
        let (poff, plen) = part_range(p.offset, p.len, part, maxp);
        let from = reply::data_range(poff, plen, offset, len)? + (poff - p.offset);
        self.iov.clear();
        // SAFETY: the request is in flight, so its iovecs are valid (push contract).
        sub_iovecs(unsafe { v.as_slice() }, from, len, &mut self.iov);
        Ok(())
    }

    /// Starts receiving a payload of `need` bytes into `iov` (plus the next header).
    fn start_data(
        &mut self,
        slot: u32,
        flags: u16,
        need: u64,
        check: Option<u64>,
        trailing: usize,
        flight: &mut Flight,
    ) -> Result<(), ReplyError> {
        self.at = 0;
        let mut got = 0u64;
        // Bytes already buffered belong to this payload (only a server that ignores what
        // was asked sends them this early): a copy of those few.
        while self.start < self.end && got < need && self.at < self.iov.len() {
            let v = self.iov[self.at];
            let n = (self.end - self.start)
                .min(v.iov_len)
                .min((need - got) as usize);
            let src = self.buf[self.start..].as_ptr();
            // SAFETY: v names guest pages of a read in flight (or the prefix scratch), at
            // least n bytes long; src has n bytes inside the buffer (n <= end - start).
            unsafe { std::ptr::copy_nonoverlapping(src, v.iov_base.cast::<u8>(), n) };
            self.start += n;
            got += n as u64;
            self.at = consume_iov(&mut self.iov, self.at, n);
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        let trailing = if self.start == self.end {
            // The next header lands in the (empty) buffer.
            self.iov.push(libc::iovec {
                iov_base: self.buf.as_mut_ptr().cast(),
                iov_len: trailing,
            });
            trailing
        } else {
            0
        };
        let p = Payload {
            slot,
            flags,
            need,
            got,
            check,
            trailing,
        };
        self.stage = Stage::Data(p);
        if got >= need {
            return self.finish_data(p, flight);
        }
        Ok(())
    }

    /// Receives a payload; false when the rest is not there yet.
    fn recv_data(
        &mut self,
        fd: RawFd,
        mut p: Payload,
        flight: &mut Flight,
    ) -> Result<bool, ReplyError> {
        while p.got < p.need {
            let n = (self.iov.len() - self.at).min(MAX_IOV);
            // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = self.iov[self.at..].as_mut_ptr();
            msg.msg_iovlen = n;
            // SAFETY: the iovecs name guest pages of a read in flight (push contract), the
            // prefix scratch, and the buffer's free space from its start (empty: see
            // start_data); all of it is ours to write until the read completes.
            let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
            if r > 0 {
                p.got += r as u64;
                self.at = consume_iov(&mut self.iov, self.at, r as usize);
                continue;
            }
            if r == 0 {
                return Err(ReplyError::Closed);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    self.stage = Stage::Data(p);
                    return Ok(false);
                }
                _ => return Err(ReplyError::Io(e)),
            }
        }
        self.finish_data(p, flight)?;
        Ok(true)
    }

    fn finish_data(&mut self, p: Payload, flight: &mut Flight) -> Result<(), ReplyError> {
        if p.trailing > 0 {
            // What came past the payload is the start of the next header, received at the
            // (then empty) buffer's start.
            self.start = 0;
            self.end = (p.got - p.need) as usize;
        }
        if let Some(off) = p.check {
            let at = u64::from_be_bytes(*self.prefix);
            if at != off {
                return Err(ReplyError::OutsideRequest {
                    offset: at,
                    len: p.need - 8,
                });
            }
        }
        self.end_chunk(p.slot, p.flags, 0, flight)
    }

    /// A chunk of request `slot` ended; the reply too when `flags` says DONE.
    fn end_chunk(
        &mut self,
        slot: u32,
        flags: u16,
        err: i32,
        flight: &mut Flight,
    ) -> Result<(), ReplyError> {
        self.stage = Stage::Header;
        if err != 0 {
            if let Some(p) = flight.inflight.get_mut(&slot) {
                if p.result == 0 {
                    p.result = err;
                }
            }
        }
        if flags & REPLY_FLAG_DONE != 0 {
            flight.part_done(slot, 0)?;
        }
        Ok(())
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Fills guest pages with zeroes (a hole reply).
fn zero_fill(iov: &[libc::iovec]) {
    for v in iov {
        // SAFETY: the iovec is guest memory of a read in flight that `target` checked
        // against the request; iov_len bytes from iov_base are ours to write.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
    }
}
