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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{Engine, EngineError, EngineKind, QueueIo};
use crate::util::lock;

mod conn;
mod handshake;
pub mod proto;
mod queue;
mod reader;
pub mod reply;

pub use conn::NbdStats;
use conn::{connect_link, Conn, ConnState, Link};
use handshake::disconnect;
pub use handshake::{connect, greets, ExportInfo, NbdError};
/// Transmission flags (server side).
pub use proto::{
    TF_CAN_MULTI_CONN, TF_READ_ONLY, TF_SEND_DF, TF_SEND_FLUSH, TF_SEND_FUA, TF_SEND_TRIM,
    TF_SEND_WRITE_ZEROES,
};
use queue::NbdQueue;
use reader::connect_thread;

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

    fn open_queue(
        &self,
        queue: usize,
        _depth: u32,
        _mem: &crate::guest_mem::MemHandle,
    ) -> Result<Box<dyn QueueIo>, EngineError> {
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
