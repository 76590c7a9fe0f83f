//! The relay: the qemu engine through QEMU's own vhost-user-blk export of the drive's node,
//! with rings of acceld's own. acceld stays the guest's back-end (its worker pops, validates,
//! answers GET_ID, counts and completes every request, as on every engine); for each request
//! it posts a chain on a shadow ring in its own region (see [`shadow`]) whose data
//! descriptors are the guest's own buffers (zero copy: the export maps the guest's memory from
//! the same memory table) and whose header and status byte are acceld's. The export completes
//! on the shadow used ring and signals the queue's call eventfd, which is in the worker's poll
//! set like an io_uring's or an NBD socket's.
//!
//! Session (all acknowledged, REPLY_ACK): acceld's own virtio features (never LOG_ALL: the
//! export's dirty log code asserts on any address outside QEMU's log, and acceld marks what
//! the export wrote itself, at completion), a back-end channel (a resize's config change is
//! written there; without one the export stops serving), ADD_MEM_REG of the shadow region
//! and of every guest region, then per queue NUM, BASE, ADDR, CALL, KICK, ENABLE. Every
//! set-up step ends with a round trip (`ping`): QEMU's export acknowledges a message it
//! failed on and closes the session afterwards.
//!
//! The export's used ring is input: an id it never got, one in use twice, or an index that
//! moves past what was posted ends the session. A session that ends (the export deleted, its
//! process gone) fails what is in flight and everything later with EIO.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use thiserror::Error;
use tracing::info;
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::engine::{Engine, EngineError, EngineKind, QueueIo};
use crate::guest_mem::MemHandle;
use crate::util::lock;
use crate::vu_frontend::{Client, ClientError, ExportConfig, Region, RingAddr};

mod queue;
pub mod ring;
mod session;
pub mod shadow;
mod state;

use queue::RelayQueue;
pub use session::RelayStats;

/// The relay's `io_path` in status: QEMU's vhost-user-blk export.
pub const IO_PATH: &str = "vhost-user";
use session::{shutdown, watch, Exported, QueueSlot, Session};
use shadow::{Shadow, RING_SIZE, SHADOW_GPA};
use state::QueueState;

#[derive(Debug, Error)]
pub enum RelayError {
    #[error("QEMU's vhost-user-blk export on {path}")]
    Export {
        path: PathBuf,
        #[source]
        source: ClientError,
    },
    #[error("cannot make the relay's shadow region")]
    Shadow(#[source] std::io::Error),
    #[error("cannot make the relay's back-end channel or eventfds")]
    Fds(#[source] std::io::Error),
    #[error("cannot start the relay's session thread")]
    Spawn(#[source] std::io::Error),
    #[error("queue {queue} of the relay: {why}")]
    Queue { queue: usize, why: String },
    #[error("the relay's session ended: {0}")]
    Dead(String),
}

impl From<RelayError> for EngineError {
    fn from(e: RelayError) -> Self {
        EngineError::Relay(Box::new(e))
    }
}

/// The relay engine: one session with QEMU's vhost-user-blk export of the drive's node.
pub struct RelayEngine {
    s: Arc<Session>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl RelayEngine {
    /// Connects to the export on `path` (whose server must run as `peer_uid`, when given)
    /// with `queues` shadow rings, adds the shadow region to its table, and starts the
    /// thread that watches the session and answers the export's back-end channel. Guest
    /// memory and the rings reach the export as queues open. Never call this inside a
    /// vhost-user message of the VM's QEMU (its export accepts in QEMU's main loop).
    pub fn connect(
        path: &Path,
        peer_uid: Option<u32>,
        queues: usize,
    ) -> Result<RelayEngine, RelayError> {
        let export = |source| RelayError::Export {
            path: path.to_path_buf(),
            source,
        };
        let queues = queues.clamp(1, 64);
        let shadow = Shadow::new(queues).map_err(RelayError::Shadow)?;
        let (ours, theirs) = UnixStream::pair().map_err(RelayError::Fds)?;
        let (mut client, cfg) =
            Client::connect_relay(path, peer_uid, queues as u32, Some(theirs.as_fd()))
                .map_err(export)?;
        drop(theirs);
        client
            .add_mem_region(&Region {
                gpa: SHADOW_GPA,
                size: shadow.len() as u64,
                fd: shadow.fd(),
                offset: 0,
            })
            .and_then(|()| client.ping())
            .map_err(export)?;
        let mut calls = Vec::with_capacity(queues);
        let mut kicks = Vec::with_capacity(queues);
        for _ in 0..queues {
            calls.push(EventFd::new(EFD_NONBLOCK).map_err(RelayError::Fds)?);
            kicks.push(EventFd::new(EFD_NONBLOCK).map_err(RelayError::Fds)?);
        }
        let sock: OwnedFd = client
            .socket()
            .try_clone_to_owned()
            .map_err(RelayError::Fds)?;
        let s = Arc::new(Session {
            path: path.to_path_buf(),
            client: Mutex::new(client),
            cfg,
            shadow,
            exported: Mutex::new(Exported::default()),
            queues: (0..queues).map(|_| Mutex::new(QueueSlot::Unused)).collect(),
            calls,
            kicks,
            write_cache: Mutex::new(None),
            write_through: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            hold_when_lost: AtomicBool::new(false),
            why: Mutex::new(None),
            ended: std::sync::Condvar::new(),
            stats: RelayStats::default(),
            stop: EventFd::new(EFD_NONBLOCK).map_err(RelayError::Fds)?,
            image: std::sync::OnceLock::new(),
        });
        let s2 = s.clone();
        let thread = std::thread::Builder::new()
            .name("relay-session".into())
            .spawn(move || watch(&s2, &sock, &ours))
            .map_err(RelayError::Spawn)?;
        info!(export = %path.display(), queues, capacity = cfg.capacity, features = format_args!("{:#x}", cfg.features), "relay session up");
        Ok(RelayEngine {
            s,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The image file the export's node writes to (a qcow2's or a raw file's): a write the
    /// export fails while its file system is full then fails with ENOSPC, so `werror=enospc`
    /// holds it as on the other engines. Set once; later calls change nothing.
    pub fn set_image(&self, path: PathBuf) {
        let _ = self.s.image.set(path);
    }

    /// Once the session ends, requests fail with [`crate::engine::PATH_LOST`] (the worker
    /// holds them, the guest sees nothing) instead of EIO: for a supervisor that then moves
    /// the drive to NBD (it sees [`Engine::lost`]). Without one (`acceld serve --relay-to`)
    /// nothing would ever release them. `false` goes back to EIO (a held request's next
    /// retry fails then).
    pub fn hold_when_lost(&self, on: bool) {
        self.s.hold_when_lost.store(on, Ordering::Release);
    }

    /// What the export said of itself at set-up.
    pub fn config(&self) -> ExportConfig {
        self.s.cfg
    }

    pub fn stats(&self) -> &RelayStats {
        &self.s.stats
    }

    /// Why the session ended, if it did.
    pub fn failure(&self) -> Option<String> {
        lock(&self.s.why).clone()
    }

    /// Waits up to `timeout` for the session to end; why it did, if it did.
    pub fn wait_failed(&self, timeout: std::time::Duration) -> Option<String> {
        let g = lock(&self.s.why);
        let (g, _) = self
            .s
            .ended
            .wait_timeout_while(g, timeout, |w| w.is_none())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        g.clone()
    }

    /// Ends the session (after a drain): the export's rings stop with it.
    pub fn close(&self) {
        if !self.s.dead.swap(true, Ordering::AcqRel) {
            *lock(&self.s.why) = Some("closed".into());
            self.s.ended.notify_all();
            let _ = shutdown(&lock(&self.s.client));
        }
        let _ = self.s.stop.write(1);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl Drop for RelayEngine {
    fn drop(&mut self) {
        self.close();
    }
}

impl Engine for RelayEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Qemu
    }
    fn io_path(&self) -> &str {
        IO_PATH
    }
    fn buffer_alignment(&self) -> u32 {
        1
    }
    fn is_block_device(&self) -> bool {
        false
    }
    fn release(&self) {
        self.close();
    }
    fn lost(&self) -> bool {
        self.s.is_dead()
    }

    fn open_queue(
        &self,
        queue: usize,
        depth: u32,
        mem: &MemHandle,
    ) -> Result<Box<dyn QueueIo>, EngineError> {
        let bad = |why: String| EngineError::from(RelayError::Queue { queue, why });
        if queue >= self.s.queues.len() {
            return Err(bad(format!("the relay has {} queues", self.s.queues.len())));
        }
        if depth > u32::from(RING_SIZE) {
            return Err(bad(format!("depth {depth}")));
        }
        if self.s.is_dead() {
            let why = lock(&self.s.why).clone().unwrap_or_default();
            return Err(RelayError::Dead(why).into());
        }
        let slot = std::mem::replace(&mut *lock(&self.s.queues[queue]), QueueSlot::Taken);
        let mut state = match slot {
            QueueSlot::Here(st) => st,
            // SAFETY: queue `queue`'s part of the session's live shadow region, driven by
            // this queue's one context at a time (the state moves with it).
            QueueSlot::Unused => unsafe {
                QueueState::new(self.s.shadow.host(queue), Shadow::gpa(queue))
            },
            QueueSlot::Taken => {
                return Err(bad("a context of this queue is still open".into()));
            }
        };
        let current = lock(mem).clone();
        if current.num_regions() > 0 {
            if let Err(w) = self.s.sync_memory(&current) {
                self.s.give_back(queue, state);
                self.s.fail(&w);
                return Err(bad(w));
            }
        }
        if !state.started {
            let r = &state.ring;
            let addr = RingAddr {
                index: queue as u32,
                size: RING_SIZE,
                desc: r.desc_gpa(),
                avail: r.avail_gpa(),
                used: r.used_gpa(),
                base: 0,
            };
            let call = borrow(&self.s.calls[queue]);
            let kick = borrow(&self.s.kicks[queue]);
            let r = {
                let mut c = lock(&self.s.client);
                c.start_rings(&[(addr, Some(call), kick)])
                    .and_then(|()| c.ping())
            };
            if let Err(e) = r {
                let w = crate::util::error_chain(&e);
                self.s.give_back(queue, state);
                self.s.fail(&w);
                return Err(bad(w));
            }
            state.started = true;
        }
        Ok(Box::new(RelayQueue::new(
            self.s.clone(),
            queue,
            state,
            mem.clone(),
            current,
        )))
    }
}

fn borrow(e: &EventFd) -> std::os::fd::BorrowedFd<'_> {
    // SAFETY: the descriptor belongs to `e`, which outlives the returned borrow.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(e.as_raw_fd()) }
}
