//! The qemu engine: an NBD client that sends a drive's requests to an export of the VM's own
//! QEMU (`nbd-server-start` + `block-export-add type=nbd`), so QEMU's block layer serves them.
//!
//! Protocol: the NBD spec's fixed newstyle handshake, `NBD_OPT_STRUCTURED_REPLY`, then
//! `NBD_OPT_GO` with a block-size info request; transmission with READ, WRITE (FUA for
//! write-through), FLUSH, TRIM and WRITE_ZEROES, many requests in flight per connection.
//!
//! Shape: one connection per queue (QEMU serves every connection of an export from one block
//! backend, so a FLUSH on one covers writes completed on the others). The queue's worker thread
//! writes requests, with write payloads gathered straight from guest pages (`writev`); a reader
//! thread per connection reads replies and scatters read payloads straight into guest pages
//! (`readv`), then posts (token, result) and signals an eventfd that the worker polls like an
//! io_uring completion. No buffer is sized by the guest: requests above the export's maximum
//! payload are split into parts, each a separate NBD request.
//!
//! Failure: if the export goes away, every request in flight and every later one completes
//! with `-EIO` (the guest sees IOERR), the error is counted and kept for `accelctl status`, and
//! nothing hangs: the reader sees EOF, writes have a send timeout.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use thiserror::Error;
use tracing::{debug, warn};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{Engine, EngineError, IoOp, QueueIo};
use crate::util::lock;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_BIT: u32 = 1 << 31;
const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags (server side).
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_FLAG_FUA: u16 = 1;
const CMD_FLAG_NO_HOLE: u16 = 2;

const REPLY_FLAG_DONE: u16 = 1;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;

/// The payload limit when the server names none (the spec's recommended 32 MiB).
const DEFAULT_MAX_PAYLOAD: u32 = 32 << 20;
/// Most parts one request may be split into; larger requests get EINVAL (IOERR).
const MAX_PARTS: u64 = 1 << 12;
/// Longest option reply payload read during the handshake.
const MAX_OPT_REPLY: u32 = 64 << 10;
/// Socket send timeout: a server that stops reading fails the connection instead of
/// blocking the worker.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum NbdError {
    #[error("cannot connect to NBD socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("NBD handshake I/O failed")]
    Io(#[from] io::Error),
    #[error("NBD server broke the protocol: {0}")]
    Protocol(String),
    #[error("NBD server refused export '{export}': {message} (reply type {code:#x})")]
    Refused {
        export: String,
        code: u32,
        message: String,
    },
    #[error("NBD export '{export}' changed size from {was} to {now} bytes")]
    SizeChanged { export: String, was: u64, now: u64 },
}

/// What the server told us about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
    /// Largest payload of one request.
    pub max_payload: u32,
    pub structured: bool,
}

impl ExportInfo {
    pub fn read_only(&self) -> bool {
        self.flags & TF_READ_ONLY != 0
    }
}

fn rd_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}
fn rd_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
fn rd_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn skip(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied != n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

fn send_option(w: &mut impl Write, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    w.write_all(&m)
}

/// Reads one option reply: (type, payload).
fn read_option_reply(r: &mut impl Read, opt: u32) -> Result<(u32, Vec<u8>), NbdError> {
    let magic = rd_u64(r)?;
    if magic != OPT_REPLY_MAGIC {
        return Err(NbdError::Protocol(format!("option reply magic {magic:#x}")));
    }
    let got = rd_u32(r)?;
    if got != opt {
        return Err(NbdError::Protocol(format!(
            "reply to option {got} while waiting for option {opt}"
        )));
    }
    let typ = rd_u32(r)?;
    let len = rd_u32(r)?;
    if len > MAX_OPT_REPLY {
        return Err(NbdError::Protocol(format!("option reply of {len} bytes")));
    }
    let mut data = vec![0; len as usize];
    r.read_exact(&mut data)?;
    Ok((typ, data))
}

/// Whether an NBD server greets on `path` (a fixed-newstyle greeting within `timeout`). The
/// connection is dropped before any option is sent.
pub fn greets(path: &Path, timeout: Duration) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    if s.set_read_timeout(Some(timeout)).is_err() {
        return false;
    }
    matches!(
        (rd_u64(&mut s), rd_u64(&mut s)),
        (Ok(NBDMAGIC), Ok(IHAVEOPT))
    )
}

/// Connects to `path` and negotiates `export`; returns the connection, ready for
/// transmission, and the export's parameters.
pub fn connect(path: &Path, export: &str) -> Result<(UnixStream, ExportInfo), NbdError> {
    let mut s = UnixStream::connect(path).map_err(|source| NbdError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    s.set_read_timeout(Some(SEND_TIMEOUT))?;
    s.set_write_timeout(Some(SEND_TIMEOUT))?;
    let magic = rd_u64(&mut s)?;
    let opt_magic = rd_u64(&mut s)?;
    if magic != NBDMAGIC || opt_magic != IHAVEOPT {
        return Err(NbdError::Protocol(format!(
            "greeting {magic:#x} {opt_magic:#x} is not fixed newstyle"
        )));
    }
    let hflags = rd_u16(&mut s)?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::Protocol(
            "server does not offer fixed newstyle negotiation".into(),
        ));
    }
    let cflags = u32::from(FLAG_FIXED_NEWSTYLE | (hflags & FLAG_NO_ZEROES));
    s.write_all(&cflags.to_be_bytes())?;

    send_option(&mut s, OPT_STRUCTURED_REPLY, &[])?;
    let (typ, _) = read_option_reply(&mut s, OPT_STRUCTURED_REPLY)?;
    let structured = typ == REP_ACK;

    let mut go = Vec::new();
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(&mut s, OPT_GO, &go)?;
    let mut size = None;
    let mut flags = 0;
    let mut max_payload = DEFAULT_MAX_PAYLOAD;
    loop {
        let (typ, data) = read_option_reply(&mut s, OPT_GO)?;
        if typ & REP_ERR_BIT != 0 {
            return Err(NbdError::Refused {
                export: export.to_string(),
                code: typ,
                message: String::from_utf8_lossy(&data).into_owned(),
            });
        }
        match typ {
            REP_ACK => break,
            REP_INFO if data.len() >= 2 => {
                let info = u16::from_be_bytes([data[0], data[1]]);
                match info {
                    INFO_EXPORT if data.len() >= 12 => {
                        size = Some(u64::from_be_bytes(data[2..10].try_into().expect("8")));
                        flags = u16::from_be_bytes([data[10], data[11]]);
                    }
                    INFO_BLOCK_SIZE if data.len() >= 14 => {
                        let max = u32::from_be_bytes(data[10..14].try_into().expect("4"));
                        if max > 0 {
                            max_payload = max.min(DEFAULT_MAX_PAYLOAD);
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    let size =
        size.ok_or_else(|| NbdError::Protocol("NBD_OPT_GO ended without export info".into()))?;
    s.set_read_timeout(None)?;
    Ok((
        s,
        ExportInfo {
            size,
            flags,
            max_payload,
            structured,
        },
    ))
}

/// Counters and the last error of an NBD engine, for status.
#[derive(Debug, Default)]
pub struct NbdStats {
    pub connections: AtomicU64,
    pub errors: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

impl NbdStats {
    fn record(&self, e: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_error) = Some(e);
    }
}

/// The qemu engine: one NBD connection per queue to one export.
pub struct NbdEngine {
    path: PathBuf,
    export: String,
    info: ExportInfo,
    conns: Mutex<Vec<Weak<Conn>>>,
    stats: Arc<NbdStats>,
}

impl NbdEngine {
    /// Checks that the export exists and learns its parameters (the connection is closed;
    /// each queue opens its own).
    pub fn connect(path: &Path, export: &str) -> Result<Self, NbdError> {
        let (s, info) = connect(path, export)?;
        disconnect(&s);
        Ok(NbdEngine {
            path: path.to_path_buf(),
            export: export.to_string(),
            info,
            conns: Mutex::new(Vec::new()),
            stats: Arc::new(NbdStats::default()),
        })
    }

    pub fn info(&self) -> ExportInfo {
        self.info
    }

    pub fn stats(&self) -> Arc<NbdStats> {
        self.stats.clone()
    }

    pub fn export(&self) -> &str {
        &self.export
    }

    /// Closes every connection (after a drain, before the export is deleted). Requests still
    /// in flight, if any, fail with EIO.
    pub fn close(&self) {
        for c in lock(&self.conns).drain(..).filter_map(|w| w.upgrade()) {
            c.closing.store(true, Ordering::Relaxed);
            if let Some(s) = c.sock.get() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

impl Drop for NbdEngine {
    fn drop(&mut self) {
        self.close();
    }
}

fn disconnect(s: &UnixStream) {
    let mut req = [0u8; 28];
    req[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    req[6..8].copy_from_slice(&CMD_DISC.to_be_bytes());
    let _ = (&*s).write_all(&req);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

impl Engine for NbdEngine {
    fn name(&self) -> &str {
        "nbd"
    }

    fn release(&self) {
        self.close();
    }

    fn buffer_alignment(&self) -> u32 {
        1
    }

    fn is_block_device(&self) -> bool {
        false
    }

    fn open_queue(&self, queue: usize, _depth: u32) -> Result<Box<dyn QueueIo>, EngineError> {
        // The connection is made by the queue's reader thread, not here: this may run inside
        // a vhost-user message from QEMU's main thread, and QEMU's NBD server cannot accept
        // while that thread waits for our reply.
        let done = EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?;
        let conn = Arc::new(Conn {
            sock: std::sync::OnceLock::new(),
            done,
            st: Mutex::new(ConnState::default()),
            closing: AtomicBool::new(false),
            stats: self.stats.clone(),
            queue,
        });
        let c2 = conn.clone();
        let path = self.path.clone();
        let export = self.export.clone();
        let want = self.info;
        std::thread::Builder::new()
            .name(format!("nbd-q{queue}"))
            .spawn(move || connect_and_read(c2, &path, &export, want))
            .map_err(EngineError::EventFd)?;
        {
            let mut conns = lock(&self.conns);
            conns.retain(|w| w.strong_count() > 0);
            conns.push(Arc::downgrade(&conn));
        }
        Ok(Box::new(NbdQueue {
            conn,
            info: self.info,
            out: Vec::new(),
            hdrs: Vec::new(),
            iov: Vec::new(),
            next_slot: 0,
        }))
    }
}

/// The reader thread: connects, then reads replies until the connection ends.
fn connect_and_read(conn: Arc<Conn>, path: &Path, export: &str, want: ExportInfo) {
    let (sock, info) = match connect(path, export) {
        Ok(x) => x,
        Err(e) => return conn.fail_all(&format!("cannot connect: {}", crate::error_chain(&e))),
    };
    if info.size != want.size {
        disconnect(&sock);
        return conn.fail_all(&format!(
            "export '{export}' changed size from {} to {} bytes",
            want.size, info.size
        ));
    }
    let reader_sock = match sock.try_clone() {
        Ok(s) => s,
        Err(e) => return conn.fail_all(&format!("cannot clone the socket: {e}")),
    };
    let _ = conn.sock.set(sock);
    conn.stats.connections.fetch_add(1, Ordering::Relaxed);
    if conn.closing.load(Ordering::Relaxed) {
        if let Some(s) = conn.sock.get() {
            disconnect(s);
        }
    }
    // Wake the worker: requests pushed meanwhile wait to be sent.
    conn.signal();
    reader(conn, reader_sock, info);
}

/// The guest's iovec array of one request (it lives in the worker's slot until completion).
#[derive(Clone, Copy)]
struct IoVecs {
    ptr: *const libc::iovec,
    cnt: u32,
}

// SAFETY: the pointers name guest memory (or a bounce buffer) that the worker keeps valid and
// untouched until it reaps this request's completion (the QueueIo::push contract); the reader
// thread only touches them for a request that is still in flight.
unsafe impl Send for IoVecs {}

struct Pending {
    token: u64,
    /// Byte offset of the request on the disk, and its length.
    offset: u64,
    len: u64,
    iov: Option<IoVecs>,
    read: bool,
    parts_left: u64,
    result: i32,
}

#[derive(Default)]
struct ConnState {
    /// In flight, by slot (the NBD cookie's high 32 bits).
    inflight: HashMap<u32, Pending>,
    completions: Vec<(u64, i32)>,
    dead: bool,
}

struct Conn {
    /// Set once the reader thread has connected.
    sock: std::sync::OnceLock<UnixStream>,
    done: EventFd,
    st: Mutex<ConnState>,
    /// Set by a deliberate close: EOF is then not an error.
    closing: AtomicBool,
    stats: Arc<NbdStats>,
    queue: usize,
}

impl Conn {
    fn signal(&self) {
        let _ = self.done.write(1);
    }

    /// Marks the connection dead and fails everything in flight with EIO.
    fn fail_all(&self, why: &str) {
        let mut st = lock(&self.st);
        if !st.dead && !self.closing.load(Ordering::Relaxed) {
            warn!(queue = self.queue, "NBD connection lost: {why}");
            self.stats.record(format!("queue {}: {why}", self.queue));
        }
        st.dead = true;
        let failed: Vec<(u64, i32)> = st
            .inflight
            .drain()
            .map(|(_, p)| (p.token, -libc::EIO))
            .collect();
        st.completions.extend(failed);
        drop(st);
        if let Some(s) = self.sock.get() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.signal();
    }
}

/// A write's payload: the request's iovecs, and the byte range of them this part sends.
type Payload = (IoVecs, u64, u64);

struct NbdQueue {
    conn: Arc<Conn>,
    info: ExportInfo,
    /// Request headers and payload references pushed since the last submit.
    out: Vec<(usize, Option<Payload>)>,
    hdrs: Vec<[u8; 28]>,
    iov: Vec<libc::iovec>,
    next_slot: u32,
}

// SAFETY: the only raw pointers are in the iovec scratch vector, filled and used within one
// `submit` call on the owning thread; between calls they are never dereferenced.
unsafe impl Send for NbdQueue {}

fn header(flags: u16, typ: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&typ.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

/// Appends to `out` the pieces of `iov` covering bytes [from, from+len) of the request.
///
/// # Safety
/// `iov` must point to `cnt` valid iovecs.
unsafe fn sub_iovecs(iov: IoVecs, from: u64, len: u64, out: &mut Vec<libc::iovec>) -> u64 {
    // SAFETY: the caller guarantees the array is valid.
    let all = unsafe { std::slice::from_raw_parts(iov.ptr, iov.cnt as usize) };
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
            // SAFETY: skip < iov_len, so the pointer stays inside the buffer.
            iov_base: unsafe { (v.iov_base as *mut u8).add(skip as usize) }.cast(),
            iov_len: take as usize,
        });
        left -= take;
        skip = 0;
    }
    len - left
}

impl NbdQueue {
    fn complete_now(&mut self, token: u64, res: i32) {
        lock(&self.conn.st).completions.push((token, res));
        self.conn.signal();
    }

    fn iov_len(iov: IoVecs) -> u64 {
        // SAFETY: push's contract: the iovec array is valid while the request is in flight.
        let all = unsafe { std::slice::from_raw_parts(iov.ptr, iov.cnt as usize) };
        all.iter().map(|v| v.iov_len as u64).sum()
    }
}

impl QueueIo for NbdQueue {
    unsafe fn push(&mut self, op: &IoOp, token: u64) -> bool {
        let tf = self.info.flags;
        let (typ, flags, offset, len, iov) = match *op {
            IoOp::Readv {
                offset,
                iov,
                iovcnt,
            } => {
                let v = IoVecs {
                    ptr: iov,
                    cnt: iovcnt,
                };
                (CMD_READ, 0, offset, Self::iov_len(v), Some(v))
            }
            IoOp::Writev {
                offset,
                iov,
                iovcnt,
                dsync,
            } => {
                if tf & TF_READ_ONLY != 0 {
                    self.complete_now(token, -libc::EROFS);
                    return true;
                }
                let v = IoVecs {
                    ptr: iov,
                    cnt: iovcnt,
                };
                let fua = if dsync && tf & TF_SEND_FUA != 0 {
                    CMD_FLAG_FUA
                } else {
                    0
                };
                (CMD_WRITE, fua, offset, Self::iov_len(v), Some(v))
            }
            IoOp::Flush => {
                if tf & TF_SEND_FLUSH == 0 {
                    // The server has no volatile cache to flush.
                    self.complete_now(token, 0);
                    return true;
                }
                (CMD_FLUSH, 0, 0, 0, None)
            }
            IoOp::Fallocate {
                offset,
                len,
                mode,
                zeroes,
            } => {
                if !zeroes {
                    if tf & TF_SEND_TRIM == 0 {
                        self.complete_now(token, -libc::EOPNOTSUPP);
                        return true;
                    }
                    (CMD_TRIM, 0, offset, len, None)
                } else {
                    if tf & TF_SEND_WRITE_ZEROES == 0 {
                        self.complete_now(token, -libc::EOPNOTSUPP);
                        return true;
                    }
                    let punch = mode & libc::FALLOC_FL_PUNCH_HOLE != 0;
                    (
                        CMD_WRITE_ZEROES,
                        if punch { 0 } else { CMD_FLAG_NO_HOLE },
                        offset,
                        len,
                        None,
                    )
                }
            }
        };
        let maxp = u64::from(self.info.max_payload);
        let parts = if typ == CMD_FLUSH {
            1
        } else {
            len.div_ceil(maxp).max(1)
        };
        if parts > MAX_PARTS || offset.checked_add(len).is_none_or(|e| e > self.info.size) {
            self.complete_now(token, -libc::EINVAL);
            return true;
        }
        let slot = {
            let mut st = lock(&self.conn.st);
            if st.dead {
                st.completions.push((token, -libc::EIO));
                drop(st);
                self.conn.signal();
                return true;
            }
            // A free slot: in-flight requests are few (the queue depth), so this ends fast.
            let mut slot = self.next_slot;
            while st.inflight.contains_key(&slot) {
                slot = slot.wrapping_add(1);
            }
            self.next_slot = slot.wrapping_add(1);
            st.inflight.insert(
                slot,
                Pending {
                    token,
                    offset,
                    len,
                    iov,
                    read: typ == CMD_READ,
                    parts_left: parts,
                    result: 0,
                },
            );
            slot
        };
        for part in 0..parts {
            let poff = part * maxp;
            let plen = (len - poff.min(len)).min(maxp);
            let cookie = (u64::from(slot) << 32) | part;
            let h = header(flags, typ, cookie, offset + poff, plen as u32);
            self.hdrs.push(h);
            let payload = if typ == CMD_WRITE {
                iov.map(|v| (v, poff, plen))
            } else {
                None
            };
            self.out.push((self.hdrs.len() - 1, payload));
        }
        true
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        if lock(&self.conn.st).dead {
            // Everything registered was failed with EIO already.
            self.out.clear();
            self.hdrs.clear();
            return Ok(());
        }
        let Some(sock) = self.conn.sock.get() else {
            // Not connected yet: sent when the reader thread signals the connection.
            return Ok(());
        };
        let fd = sock.as_raw_fd();
        self.iov.clear();
        for (h, payload) in &self.out {
            self.iov.push(libc::iovec {
                iov_base: self.hdrs[*h].as_ptr() as *mut libc::c_void,
                iov_len: 28,
            });
            if let Some((v, from, len)) = payload {
                // SAFETY: push's contract keeps the request's iovecs valid until completion,
                // and a request cannot complete before its payload has been sent.
                unsafe { sub_iovecs(*v, *from, *len, &mut self.iov) };
            }
        }
        let res = write_all_vectored(fd, &mut self.iov);
        self.out.clear();
        self.hdrs.clear();
        if let Err(e) = res {
            // The reader fails every request in flight (including these) when it sees the
            // socket shut down.
            self.conn.fail_all(&format!("sending requests: {e}"));
        }
        Ok(())
    }

    fn completion_fd(&self) -> RawFd {
        self.conn.done.as_raw_fd()
    }

    fn has_completions(&mut self) -> bool {
        !lock(&self.conn.st).completions.is_empty()
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        let _ = self.conn.done.read();
        if !self.out.is_empty() {
            // Requests pushed before the connection was up.
            let _ = self.submit();
        }
        out.append(&mut lock(&self.conn.st).completions);
    }
}

impl Drop for NbdQueue {
    fn drop(&mut self) {
        self.conn.closing.store(true, Ordering::Relaxed);
        if let Some(s) = self.conn.sock.get() {
            disconnect(s);
        }
    }
}

/// Writes every byte of `iov` (in IOV_MAX batches), adjusting it after short writes.
fn write_all_vectored(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<()> {
    // SAFETY: the iovecs are valid over live memory (see submit); writev only reads them.
    transfer_all(iov, |v, n| unsafe { libc::writev(fd, v, n) })
}

/// Reads exactly the bytes `iov` describes.
fn read_all_vectored(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<()> {
    // SAFETY: the iovecs point into guest memory of a request in flight (see reader).
    transfer_all(iov, |v, n| unsafe { libc::readv(fd, v, n) })
}

/// Runs `op` (readv or writev) until every byte of `iov` moved, in IOV_MAX batches, advancing
/// past short transfers; EINTR is retried and a zero-byte transfer is end of file.
fn transfer_all(
    iov: &mut [libc::iovec],
    mut op: impl FnMut(*const libc::iovec, libc::c_int) -> isize,
) -> io::Result<()> {
    let mut start = 0;
    while start < iov.len() && iov[start].iov_len == 0 {
        start += 1;
    }
    while start < iov.len() {
        let n = (iov.len() - start).min(1024);
        let r = op(iov[start..].as_ptr(), n as libc::c_int);
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let mut done = r as usize;
        while done > 0 && start < iov.len() {
            if done >= iov[start].iov_len {
                done -= iov[start].iov_len;
                start += 1;
            } else {
                // SAFETY: done < iov_len, so the pointer stays inside the buffer.
                iov[start].iov_base = unsafe { (iov[start].iov_base as *mut u8).add(done) }.cast();
                iov[start].iov_len -= done;
                done = 0;
            }
        }
        while start < iov.len() && iov[start].iov_len == 0 {
            start += 1;
        }
    }
    Ok(())
}

/// NBD errors are errno values of the protocol's own numbering; these match Linux's.
fn nbd_errno(e: u32) -> i32 {
    match e {
        1 | 5 | 12 | 22 | 28 | 75 | 95 | 108 => -(e as i32),
        _ => -libc::EIO,
    }
}

fn reader(conn: Arc<Conn>, mut s: UnixStream, info: ExportInfo) {
    let why = match read_replies(&conn, &mut s, info) {
        Ok(()) => "server closed the connection".to_string(),
        Err(e) => e,
    };
    debug!(queue = conn.queue, "NBD reader ends: {why}");
    conn.fail_all(&why);
}

/// Where a reply's bytes go: the request's iovecs for [from, from+len) of the request.
fn target(
    conn: &Conn,
    slot: u32,
    abs_offset: u64,
    len: u64,
    iov: &mut Vec<libc::iovec>,
) -> Result<(), String> {
    let st = lock(&conn.st);
    let p = st
        .inflight
        .get(&slot)
        .ok_or_else(|| format!("reply for unknown request slot {slot}"))?;
    let from = abs_offset
        .checked_sub(p.offset)
        .filter(|f| f.checked_add(len).is_some_and(|e| e <= p.len))
        .ok_or_else(|| format!("reply data at {abs_offset}+{len} outside the request"))?;
    let v = p
        .iov
        .ok_or_else(|| "data reply to a request without data".to_string())?;
    iov.clear();
    // SAFETY: the request is in flight, so its iovecs are valid (push contract).
    unsafe { sub_iovecs(v, from, len, iov) };
    Ok(())
}

/// One part of request `slot` finished with `err` (0: success).
fn part_done(conn: &Conn, slot: u32, err: i32) -> Result<(), String> {
    let mut st = lock(&conn.st);
    let p = st
        .inflight
        .get_mut(&slot)
        .ok_or_else(|| format!("reply for unknown request slot {slot}"))?;
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

fn read_replies(conn: &Conn, s: &mut UnixStream, info: ExportInfo) -> Result<(), String> {
    let io = |e: io::Error| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            "server closed the connection".to_string()
        } else {
            format!("reading replies: {e}")
        }
    };
    let maxp = u64::from(info.max_payload);
    let mut iov: Vec<libc::iovec> = Vec::new();
    static ZEROES: [u8; 4096] = [0; 4096];
    loop {
        let magic = match rd_u32(s) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io(e)),
        };
        match magic {
            SIMPLE_REPLY_MAGIC => {
                let err = rd_u32(s).map_err(io)?;
                let cookie = rd_u64(s).map_err(io)?;
                let slot = (cookie >> 32) as u32;
                let part = cookie & 0xffff_ffff;
                // Simple replies are only negotiated when structured replies are refused;
                // then a successful read carries its data right after the header.
                let read_len = {
                    let st = lock(&conn.st);
                    st.inflight.get(&slot).and_then(|p| {
                        (p.is_read() && err == 0).then(|| {
                            let poff = part * maxp;
                            (p.offset + poff, (p.len - poff.min(p.len)).min(maxp))
                        })
                    })
                };
                if let Some((off, len)) = read_len {
                    target(conn, slot, off, len, &mut iov)?;
                    read_all_vectored(s.as_raw_fd(), &mut iov).map_err(io)?;
                }
                part_done(conn, slot, if err == 0 { 0 } else { nbd_errno(err) })?;
            }
            STRUCTURED_REPLY_MAGIC => {
                let flags = rd_u16(s).map_err(io)?;
                let typ = rd_u16(s).map_err(io)?;
                let cookie = rd_u64(s).map_err(io)?;
                let len = rd_u32(s).map_err(io)?;
                let slot = (cookie >> 32) as u32;
                let mut err = 0;
                match typ {
                    REPLY_TYPE_NONE => skip(s, u64::from(len)).map_err(io)?,
                    REPLY_TYPE_OFFSET_DATA => {
                        if len < 8 {
                            return Err(format!("OFFSET_DATA chunk of {len} bytes"));
                        }
                        let off = rd_u64(s).map_err(io)?;
                        target(conn, slot, off, u64::from(len - 8), &mut iov)?;
                        read_all_vectored(s.as_raw_fd(), &mut iov).map_err(io)?;
                    }
                    REPLY_TYPE_OFFSET_HOLE => {
                        if len != 12 {
                            return Err(format!("OFFSET_HOLE chunk of {len} bytes"));
                        }
                        let off = rd_u64(s).map_err(io)?;
                        let hole = rd_u32(s).map_err(io)?;
                        target(conn, slot, off, u64::from(hole), &mut iov)?;
                        for v in &iov {
                            let mut done = 0;
                            while done < v.iov_len {
                                let n = (v.iov_len - done).min(ZEROES.len());
                                // SAFETY: the iovec is inside guest memory of a request in
                                // flight; ZEROES has n bytes.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        ZEROES.as_ptr(),
                                        (v.iov_base as *mut u8).add(done),
                                        n,
                                    )
                                };
                                done += n;
                            }
                        }
                    }
                    t if t & REPLY_TYPE_ERROR_BIT != 0 => {
                        if len < 6 {
                            return Err(format!("error chunk of {len} bytes"));
                        }
                        let e = rd_u32(s).map_err(io)?;
                        let msg_len = rd_u16(s).map_err(io)?;
                        if u32::from(msg_len) + 6 > len {
                            return Err("error message longer than its chunk".into());
                        }
                        let mut msg = vec![0; usize::from(msg_len)];
                        s.read_exact(&mut msg).map_err(io)?;
                        skip(s, u64::from(len - 6 - u32::from(msg_len))).map_err(io)?;
                        debug!(
                            queue = conn.queue,
                            "NBD error {e}: {}",
                            String::from_utf8_lossy(&msg)
                        );
                        err = nbd_errno(e);
                        if err == 0 {
                            err = -libc::EIO;
                        }
                    }
                    _ => skip(s, u64::from(len)).map_err(io)?,
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
            m => return Err(format!("reply magic {m:#x}")),
        }
    }
}

impl Pending {
    fn is_read(&self) -> bool {
        self.read
    }
}
