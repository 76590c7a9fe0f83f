//! The qemu engine: an NBD client that sends a drive's requests to an export of the VM's own
//! QEMU (`nbd-server-start` + `block-export-add type=nbd`), so QEMU's block layer serves them.
//!
//! Protocol: the NBD spec's fixed newstyle handshake, `NBD_OPT_STRUCTURED_REPLY`, then
//! `NBD_OPT_GO` with a block-size info request; transmission with READ (with DF where the
//! server offers it: QEMU then skips a block-status walk per read), WRITE (FUA for
//! write-through), FLUSH, TRIM and WRITE_ZEROES, many requests in flight per connection.
//!
//! Shape: one connection per queue (QEMU serves every connection of an export from one block
//! backend, so a FLUSH on one covers writes completed on the others), driven by the queue's
//! worker thread alone: it sends requests in one `sendmsg` per batch, write payloads gathered
//! straight from guest pages, and reads replies when the socket is readable (the socket is in
//! the poll set the worker waits on), read payloads scattered straight into guest pages. A
//! thread per connection only makes the connection. No buffer is sized by the guest: requests
//! above the export's maximum payload are split into parts, each a separate NBD request.
//!
//! Failure: if the export goes away, every request in flight and every later one completes
//! with `-EIO` (the guest sees IOERR), the error is counted and kept for `accelctl status`, and
//! nothing hangs: the reader sees EOF, writes have a send timeout.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use thiserror::Error;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{Engine, EngineError, EngineKind, QueueIo};
use crate::util::lock;

mod handshake;
pub mod proto;
mod queue;
mod reader;
pub mod reply;

use handshake::disconnect;
pub use handshake::{connect, greets};
use proto::{
    IHAVEOPT, NBDMAGIC, OPT_GO, OPT_REPLY_MAGIC, OPT_STRUCTURED_REPLY, REP_ACK, REP_ERR_BIT,
    REP_INFO,
};
use queue::{Conn, ConnState, Link, NbdQueue};
use reader::connect_thread;

const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags (server side).
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_FLAG_FUA: u16 = 1;
const CMD_FLAG_NO_HOLE: u16 = 2;
/// "Don't fragment": the read's data in one OFFSET_DATA chunk, holes included. QEMU then
/// skips the block-status walk it does for every sparse read (nbd/server.c).
const CMD_FLAG_DF: u16 = 4;

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

/// One more connection to `export`, which must still hold `size` bytes.
fn connect_link(path: &Path, export: &str, size: u64) -> Result<Link, NbdError> {
    let (sock, info) = connect(path, export)?;
    if info.size != size {
        disconnect(&sock);
        return Err(NbdError::SizeChanged {
            export: export.to_string(),
            was: size,
            now: info.size,
        });
    }
    Ok(Link { sock, info })
}

/// The qemu engine: one NBD connection per queue to one export.
pub struct NbdEngine {
    path: PathBuf,
    export: String,
    info: ExportInfo,
    conns: Mutex<Vec<Weak<Conn>>>,
    /// Connections made ahead (handshake done, idle), taken by the queues as they open.
    ready: Mutex<Vec<Link>>,
    stats: Arc<NbdStats>,
}

impl NbdEngine {
    /// Checks that the export exists and learns its parameters (the connection is closed;
    /// each queue opens its own).
    pub fn connect(path: &Path, export: &str) -> Result<Self, NbdError> {
        Self::connect_ahead(path, export, 0)
    }

    /// Like [`NbdEngine::connect`], and makes `queues` connections now, one per queue to
    /// come (the first is the one that checked the export): a switch makes them before the
    /// drive pauses, so the queues resume on connections that are up. Never call this inside
    /// a vhost-user message (QEMU's NBD server cannot accept while QEMU waits for acceld).
    pub fn connect_ahead(path: &Path, export: &str, queues: usize) -> Result<Self, NbdError> {
        let (s, info) = connect(path, export)?;
        let mut ready = Vec::new();
        if queues == 0 {
            disconnect(&s);
        } else {
            ready.push(Link { sock: s, info });
        }
        while ready.len() < queues {
            match connect_link(path, export, info.size) {
                Ok(l) => ready.push(l),
                Err(e) => {
                    for l in ready.drain(..) {
                        disconnect(&l.sock);
                    }
                    return Err(e);
                }
            }
        }
        Ok(NbdEngine {
            path: path.to_path_buf(),
            export: export.to_string(),
            info,
            conns: Mutex::new(Vec::new()),
            ready: Mutex::new(ready),
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
        for l in lock(&self.ready).drain(..) {
            disconnect(&l.sock);
        }
        for c in lock(&self.conns).drain(..).filter_map(|w| w.upgrade()) {
            c.closing.store(true, Ordering::Relaxed);
            c.shut();
        }
    }
}

impl Drop for NbdEngine {
    fn drop(&mut self) {
        self.close();
    }
}

impl Engine for NbdEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Qemu
    }
    fn io_path(&self) -> &str {
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
        // The connection is made by a thread of its own, not here: this may run inside a
        // vhost-user message from QEMU's main thread, and QEMU's NBD server cannot accept
        // while that thread waits for our reply. The worker takes the socket over once
        // connected.
        let done = EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?;
        let conn = Arc::new(Conn {
            link: std::sync::OnceLock::new(),
            done,
            st: Mutex::new(ConnState::default()),
            settled: std::sync::Condvar::new(),
            closing: AtomicBool::new(false),
            stats: self.stats.clone(),
            queue,
        });
        let q = NbdQueue::new(conn.clone(), self.info).map_err(EngineError::EventFd)?;
        let ahead = lock(&self.ready).pop();
        if let Some(link) = ahead {
            let _ = conn.link.set(link);
            self.stats.connections.fetch_add(1, Ordering::Relaxed);
            conn.set_up();
        } else {
            let c2 = conn.clone();
            let path = self.path.clone();
            let export = self.export.clone();
            let want = self.info;
            std::thread::Builder::new()
                .name(format!("nbd-q{queue}"))
                .spawn(move || connect_thread(&c2, &path, &export, want))
                .map_err(EngineError::Spawn)?;
        }
        {
            let mut conns = lock(&self.conns);
            conns.retain(|w| w.strong_count() > 0);
            conns.push(Arc::downgrade(&conn));
        }
        Ok(Box::new(q))
    }

    /// QEMU 10.0's NBD server marks a client quiescing only if it was a client when the drain
    /// began: a connection still in its handshake when a drain starts (a snapshot, a job, a
    /// VM stop) joins the export unquiesced, and the drain then waits for it forever with the
    /// main loop spinning. So whoever makes a graph change after a switch to this engine waits
    /// here first.
    fn wait_ready(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let conns: Vec<Arc<Conn>> = lock(&self.conns).iter().filter_map(Weak::upgrade).collect();
        conns.iter().all(|c| c.wait_settled(deadline))
    }
}
