//! Lending a drive's rings to QEMU's own `vhost-user-blk` export.
//!
//! On the qemu engine every request crosses NBD to the VM's QEMU, whose NBD server alone
//! costs more CPU per request than QEMU's whole vhost-user-blk export
//! (`docs/benchmarks.md`). A lent drive costs exactly what that export costs: acceld, the
//! guest's vhost-user back-end, becomes a front-end of the export and hands it the guest's
//! memory, its split rings at acceld's position and the guest's kick and call eventfds. The
//! export then serves the guest directly; acceld does nothing per request. The drive stays on
//! the qemu engine meanwhile (its NBD connections idle): taking the rings back resumes the
//! queues there, without a request lost or replayed.
//!
//! Lending: pause the drive (acceld's requests drain), each queue's worker parks (it stops
//! watching the kick eventfd and touches the ring no more) and describes its ring; a fresh
//! session with the export gets the features the guest negotiated, the memory table, each
//! ring (SET_VRING_CALL before SET_VRING_KICK) and one kick for what waits in the ring.
//!
//! Taking back: SET_VRING_KICK without a descriptor (once acknowledged the export pops no
//! more: it pops only in its kick handler, on the thread that answers), then wait until
//! every request it popped is in the used ring: with EVENT_IDX the export writes its next
//! avail index to `avail_event` at every pop, so the ring is idle when `used->idx` reaches
//! it. Only then GET_VRING_BASE (QEMU's export answers it at once, with requests in flight)
//! and close; the workers resume at that base and interrupt the guest once. Lending needs
//! EVENT_IDX for that reason.
//!
//! Whoever changes who owns the rings holds the drive's ring gate: the vhost-user handler for
//! every message of QEMU's front-end (each takes the rings back first: memory tables, ring
//! stops, dirty logging and the rest all find acceld serving), a lend, and a take-back. A
//! lend connects to the export before it takes the gate (QEMU accepts in its main loop, which
//! may be waiting for a message's answer, which waits for the gate), and calls itself off if
//! the queues or the memory changed meanwhile. Under the gate nothing waits for QEMU's main
//! loop: the export answers from its iothread.
//!
//! What the guest can tell while lent (QEMU's export, not acceld, answers): GET_ID returns
//! `vhost_user_blk` instead of the drive's serial; a failed request is reported to the guest
//! at once (no `werror` hold); acceld's per-drive counters do not see the requests (QEMU's
//! `query-blockstats` of the node does). Lending is therefore asked for per drive.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

/// The worker's hand-over, a queue-control type; named here too because queue/worker.rs
/// names it `drive::lend::RingLoan`.
pub use super::queue_ctl::RingLoan;
use super::{Drive, Lent, LentRing, QueueCtl, SwitchError};
use crate::guest_mem::Mem;
use crate::util::lock;

use crate::vu_frontend::{self as client, Client, ClientError, Region, RingAddr};

/// How long a worker may take to park or to resume from a lend.
const PARK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the ring may take to look idle (`used->idx == avail_event`) once the export's
/// kicks are detached; past it, the export's own drain is waited for (see `reclaim_locked`).
const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest wait for the export to finish its session after that.
const DRAIN_PROOF_TIMEOUT: Duration = Duration::from_secs(60);
/// The same when the session broke (QEMU gone, or the export deleted): whatever it still
/// finishes, it finishes soon or never.
const BROKEN_IDLE_TIMEOUT: Duration = Duration::from_secs(1);

const F_EVENT_IDX: u64 = 1 << 29;
const F_LOG_ALL: u64 = 1 << 26;

#[derive(Debug, Error)]
pub enum LendError {
    #[error("drive {drive} cannot be lent: {why}")]
    NotLendable { drive: String, why: String },
    #[error("cannot pause the drive")]
    Pause(#[source] SwitchError),
    #[error("queue {0} did not park within {PARK_TIMEOUT:?}")]
    Park(usize),
    #[error("the export refused the rings")]
    Export(#[source] ClientError),
}

/// What a lend reads of the drive: the guest's features, the running queues, the memory.
type LendState = (u64, Vec<Arc<QueueCtl>>, Arc<Mem>);

/// The outcome of a lend or a take-back.
#[derive(Clone, Debug)]
pub struct LendReport {
    pub queues: usize,
    /// How long the guest's requests waited (drain, hand-over, resume).
    pub pause: Duration,
}

impl Drive {
    /// Whether QEMU's export serves the drive's rings now.
    pub fn rings_lent(&self) -> bool {
        lock(&self.lent).is_some()
    }

    /// Records the features the guest's driver negotiated (vhost-user SET_FEATURES).
    pub fn set_acked_features(&self, features: u64) {
        self.acked_features.store(features, Ordering::Relaxed);
    }

    /// Hands every running queue's ring to QEMU's vhost-user-blk export listening on
    /// `socket` (see the module doc). The session with the export (features, memory table)
    /// is set up before the drive pauses; the pause is the drain, the workers parking and
    /// one round trip for the rings. On any failure the queues resume on the current
    /// engine, where they were. `peer_uid`: the export's server must run as this user
    /// (SO_PEERCRED).
    pub fn lend_rings(
        self: &Arc<Self>,
        socket: &Path,
        peer_uid: Option<u32>,
    ) -> Result<LendReport, LendError> {
        let not = |why: &str| LendError::NotLendable {
            drive: self.cfg.name.clone(),
            why: why.to_string(),
        };
        // What the lend needs, read without the gate: the session with the export is made
        // before it is taken. QEMU accepts the connection in its main loop, which may be
        // waiting for acceld's answer to a vhost-user message, and that answer waits for the
        // gate. Everything is read again under the gate, and a change calls the lend off.
        let snapshot = || -> Result<LendState, LendError> {
            if lock(&self.lent).is_some() {
                return Err(not("its rings are lent already"));
            }
            let features = self.acked_features.load(Ordering::Relaxed);
            if features & F_EVENT_IDX == 0 {
                return Err(not("the driver did not negotiate EVENT_IDX"));
            }
            if features & F_LOG_ALL != 0 {
                return Err(not("the device logs dirty memory (a migration)"));
            }
            if self.stats.held_requests.load(Ordering::Relaxed) > 0 {
                return Err(not("it holds failed requests"));
            }
            if self.engine().holds() {
                return Err(not("it is held"));
            }
            let workers: Vec<Arc<QueueCtl>> = lock(&self.running).clone();
            let Some(first) = workers.first() else {
                return Err(not("no queue runs"));
            };
            let mem = lock(&first.mem).clone();
            Ok((features, workers, mem))
        };
        let (features, workers, mem) = snapshot()?;
        let queues = workers
            .iter()
            .map(|w| w.index() as u32 + 1)
            .max()
            .unwrap_or(1);
        let mut client = {
            let regions = regions(&mem).map_err(|why| not(&why))?;
            let mut c =
                Client::connect(socket, peer_uid, features, queues).map_err(LendError::Export)?;
            c.set_mem_table(&regions).map_err(LendError::Export)?;
            c
        };
        // The queues and the memory map change only through vhost-user messages, which wait
        // for the gate: what is read under it holds until the rings are lent.
        let _gate = lock(&self.ring_gate);
        let (features_now, workers_now, mem_now) = snapshot()?;
        let same_queues = workers_now.len() == workers.len()
            && workers_now
                .iter()
                .zip(&workers)
                .all(|(a, b)| Arc::ptr_eq(a, b));
        if features_now != features || !same_queues || !Arc::ptr_eq(&mem_now, &mem) {
            return Err(not(
                "its queues changed while the export's session was set up",
            ));
        }
        // Each worker parks as soon as the pause finds it with nothing in flight.
        for w in &workers {
            w.ask_lend();
        }
        let t0 = Instant::now();
        let paused = match self.pause_now() {
            Ok(p) => p,
            Err(e) => {
                self.withdraw_lend(&workers);
                return Err(LendError::Pause(e));
            }
        };
        let drained = t0.elapsed();
        let workers: Vec<Arc<QueueCtl>> = lock(&self.running).clone();
        let deadline = Instant::now() + PARK_TIMEOUT;
        let mut loans = Vec::with_capacity(workers.len());
        let mut failed = None;
        for w in &workers {
            match w.wait_loan(deadline) {
                Some(l) => loans.push((w.clone(), l)),
                None => failed = Some(LendError::Park(w.index())),
            }
        }
        if failed.is_none() {
            if let Some((_, l)) = loans.iter().find(|(_, l)| {
                !l.event_idx || !Arc::ptr_eq(&l.mem, &mem) || l.index as u32 >= queues
            }) {
                failed = Some(not(&format!("queue {} changed under the lend", l.index)));
            }
        }
        if let Some(e) = failed {
            // Nothing reached the export's rings: each worker takes its ring back where it
            // was.
            drop(client);
            self.withdraw_lend(&workers);
            drop(paused);
            return Err(e);
        }
        let rings: Vec<_> = loans
            .iter()
            .map(|(_, l)| {
                let r = RingAddr {
                    index: l.index as u32,
                    size: l.size,
                    desc: l.desc,
                    avail: l.avail,
                    used: l.used,
                    base: l.next_avail,
                };
                (r, l.call.as_ref().map(borrow), borrow(&l.kick))
            })
            .collect();
        let parked = t0.elapsed();
        let started = client.start_rings(&rings);
        let lent_rings = loans
            .iter()
            .map(|(ctl, l)| LentRing {
                ctl: ctl.clone(),
                index: l.index as u32,
                size: l.size,
                used: l.used,
                mem: l.mem.clone(),
            })
            .collect();
        paused.keep();
        *lock(&self.lent) = Some(Lent {
            client,
            socket: socket.to_path_buf(),
            peer_uid,
            rings: lent_rings,
            since: Instant::now(),
        });
        if let Err(e) = started {
            // A ring the export got may have been popped from already (its kick eventfd
            // holds the guest's kicks since the workers parked): the ordinary take-back
            // learns where each ring stands.
            self.reclaim_locked();
            return Err(LendError::Export(e));
        }
        // Whatever the guest made available meanwhile (acceld's paused workers read its
        // kicks) is seen now.
        for (_, l) in &loans {
            let _ = l.kick.write(1);
        }
        self.stats.lends.fetch_add(1, Ordering::Relaxed);
        let pause = t0.elapsed();
        super::stats::record_pause(&self.stats.lend_pauses_us, pause.as_micros() as u64);
        // A guest can make its front-end take the rings back (a device reset) as often as it
        // likes, and each time they are lent again: budgeted.
        if let Some(n) = self.stats.log.vhost.admit() {
            info!(drive = %self.cfg.name, queues = loans.len(), pause_us = pause.as_micros() as u64, drain_us = drained.as_micros() as u64, park_us = (parked - drained).as_micros() as u64, rings_us = (pause - parked).as_micros() as u64, "rings lent to QEMU's vhost-user-blk export{}", crate::util::suppressed(n));
        }
        Ok(LendReport {
            queues: loans.len(),
            pause,
        })
    }

    /// Undoes a lend that gave the export nothing: every worker withdraws the request and,
    /// if it parked, takes its ring back where it stood.
    fn withdraw_lend(&self, workers: &[Arc<QueueCtl>]) {
        for w in workers {
            w.request_reclaim(None);
        }
        for w in workers {
            if !w.wait_reclaimed(Instant::now() + PARK_TIMEOUT) {
                warn!(drive = %self.cfg.name, queue = w.index(), "queue did not withdraw from a lend within {PARK_TIMEOUT:?}");
            }
        }
    }

    /// Takes lent rings back (see the module doc), then the queues resume on the drive's
    /// engine. Nothing happens when no rings are lent. Returns the pause the take-back
    /// caused (the export served until its kicks were detached).
    pub fn reclaim_rings(&self) -> Option<LendReport> {
        let _gate = lock(&self.ring_gate);
        self.reclaim_locked()
    }

    /// Runs `f` (a vhost-user message of QEMU's front-end) with the rings acceld's own: lent
    /// ones are taken back first, and no lend starts until `f` returns.
    pub fn with_rings_owned<R>(&self, f: impl FnOnce() -> R) -> R {
        let _gate = lock(&self.ring_gate);
        self.reclaim_locked();
        f()
    }

    fn reclaim_locked(&self) -> Option<LendReport> {
        let mut lent = lock(&self.lent).take()?;
        let t0 = Instant::now();
        let lent_for = lent.since.elapsed();
        // 1. The export pops no more. A session that fails here is closed below; the ring
        //    is then judged from guest memory alone.
        let indices: Vec<u32> = lent.rings.iter().map(|r| r.index).collect();
        let session_ok = match lent.client.detach_kicks(&indices) {
            Ok(()) => true,
            Err(e) => {
                if let Some(n) = self.stats.log.vhost.admit() {
                    warn!(drive = %self.cfg.name, "taking the kicks back from the export failed: {}{}", crate::util::error_chain(&e), crate::util::suppressed(n));
                }
                false
            }
        };
        let detached = t0.elapsed();
        // 2. Every request it popped completes.
        let deadline = Instant::now()
            + if session_ok {
                IDLE_TIMEOUT
            } else {
                BROKEN_IDLE_TIMEOUT
            };
        let mut bases = Vec::with_capacity(lent.rings.len());
        let mut idle_seen = true;
        for r in &lent.rings {
            let (mut used, mut next) = ring_positions(&r.mem, r.used, r.size);
            while used != next && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(20));
                (used, next) = ring_positions(&r.mem, r.used, r.size);
            }
            idle_seen &= used == next;
            bases.push(next);
        }
        let idle = t0.elapsed();
        // 3. Only now may the ring stop in the export (GET_VRING_BASE answers at once, with
        //    requests in flight or not). Its answer must agree with `avail_event`, which the
        //    idle check relied on; if it does not, `avail_event` stands (it is where the
        //    export's pops stopped, in the guest's own ring).
        if session_ok && idle_seen {
            match lent.client.get_vring_bases(&indices) {
                Ok(got) => {
                    for ((r, b), base) in lent.rings.iter().zip(&bases).zip(got) {
                        if base != *b {
                            if let Some(n) = self.stats.log.vhost.admit() {
                                warn!(drive = %self.cfg.name, queue = r.index, base, avail_event = *b, "the export's base differs from its avail_event; resuming at avail_event{}", crate::util::suppressed(n));
                            }
                        }
                    }
                }
                Err(e) => {
                    if let Some(n) = self.stats.log.vhost.admit() {
                        warn!(drive = %self.cfg.name, "GET_VRING_BASE from the export failed: {}{}", crate::util::error_chain(&e), crate::util::suppressed(n));
                    }
                }
            }
        }
        drop(lent.client);
        if session_ok && !idle_seen {
            // The ring does not look idle (a slow request, a request the export dropped
            // without a completion, or a guest writing its used ring itself). The export
            // accepts its next client only once the closed session drained: an answer on a
            // new connection proves nothing of it still writes the ring. That answer needs
            // QEMU's main loop, which may be waiting for acceld (a vhost-user message), so the
            // ring is watched meanwhile too.
            let t = Instant::now();
            let proof = drain_proof(&lent.socket, lent.peer_uid, || {
                lent.rings.iter().all(|r| {
                    let (used, next) = ring_positions(&r.mem, r.used, r.size);
                    used == next
                })
            });
            bases = lent
                .rings
                .iter()
                .map(|r| ring_positions(&r.mem, r.used, r.size).1)
                .collect();
            if let Some(n) = self.stats.log.vhost.admit() {
                warn!(drive = %self.cfg.name, proof, waited_ms = t.elapsed().as_millis() as u64, "the ring did not look idle within {IDLE_TIMEOUT:?}; resumed after the export's session ended{}", crate::util::suppressed(n));
            }
        }
        // Each worker takes its ring back and resumes in one wake-up (the take-back comes
        // first in its control pass).
        for (r, b) in lent.rings.iter().zip(&bases) {
            r.ctl.request_reclaim(Some(*b));
        }
        let lent_queues: Vec<Arc<QueueCtl>> = lent.rings.iter().map(|r| r.ctl.clone()).collect();
        self.resume_after_lend(&lent_queues);
        for r in &lent.rings {
            if !r.ctl.wait_reclaimed(Instant::now() + PARK_TIMEOUT) {
                warn!(drive = %self.cfg.name, queue = r.index, "queue did not take its ring back within {PARK_TIMEOUT:?}");
            }
        }
        self.queues_changed();
        let pause = t0.elapsed();
        super::stats::record_pause(&self.stats.take_back_pauses_us, pause.as_micros() as u64);
        if let Some(n) = self.stats.log.vhost.admit() {
            info!(drive = %self.cfg.name, queues = lent.rings.len(), pause_us = pause.as_micros() as u64, detach_us = detached.as_micros() as u64, idle_us = (idle - detached).as_micros() as u64, lent_ms = lent_for.as_millis() as u64, "rings taken back from QEMU's export{}", crate::util::suppressed(n));
        }
        Some(LendReport {
            queues: lent.rings.len(),
            pause,
        })
    }
}

/// Waits (up to [`DRAIN_PROOF_TIMEOUT`]) until the export on `socket` answers a new session
/// (it takes one only after the previous one drained: QEMU's vhost-user server waits for its
/// requests in flight before it listens again) or `idle` holds. Says which, or "timeout".
fn drain_proof(socket: &Path, peer_uid: Option<u32>, idle: impl Fn() -> bool) -> &'static str {
    let deadline = Instant::now() + DRAIN_PROOF_TIMEOUT;
    let mut probe = client::Probe::start(socket, peer_uid).ok();
    while Instant::now() < deadline {
        if idle() {
            return "idle";
        }
        match probe
            .as_mut()
            .map(|p| p.answered(Duration::from_millis(10)))
        {
            Some(Ok(true)) => return "new session answered",
            Some(Ok(false)) => {}
            Some(Err(_)) | None => {
                probe = None;
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    "timeout"
}

fn borrow(e: &EventFd) -> std::os::fd::BorrowedFd<'_> {
    // SAFETY: the descriptor belongs to `e`, which outlives the returned borrow.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(std::os::fd::AsRawFd::as_raw_fd(e)) }
}

/// The guest memory regions of `mem`, each with its file (the export maps them itself).
fn regions(mem: &Mem) -> Result<Vec<Region<'_>>, String> {
    let mut out = Vec::new();
    for r in mem.iter() {
        let Some(fo) = r.file_offset() else {
            return Err("guest memory that is not a shared file".into());
        };
        out.push(Region {
            gpa: r.start_addr().raw_value(),
            size: r.len(),
            fd: std::os::fd::AsFd::as_fd(fo.file()),
            offset: fo.start(),
        });
    }
    Ok(out)
}

/// How long the drive's queues must stay unchanged before a lender lends them (a front-end
/// starts its rings one message at a time).
const SETTLE: Duration = Duration::from_millis(20);

/// Keeps a drive's rings lent to an export while its queues run: lends once they settle,
/// and again after anything took them back (a front-end's message, a queue restart). Dropping
/// it stops the thread and takes the rings back.
pub struct Lender {
    drive: Arc<Drive>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drive {
    /// Counts a change of the drive's queues (started, stopped, rings taken back) and wakes
    /// a lender.
    pub(crate) fn queues_changed(&self) {
        let (m, cv) = &self.queue_events;
        let mut g = lock(m);
        g.0 = g.0.wrapping_add(1);
        cv.notify_all();
    }

    /// Starts a [`Lender`] of this drive's rings to the export on `socket`.
    pub fn spawn_lender(
        self: &Arc<Self>,
        socket: std::path::PathBuf,
        peer_uid: Option<u32>,
    ) -> std::io::Result<Lender> {
        lock(&self.queue_events.0).1 = false;
        let d = self.clone();
        let thread = std::thread::Builder::new()
            .name("lender".into())
            .spawn(move || d.lender_loop(&socket, peer_uid))?;
        Ok(Lender {
            drive: self.clone(),
            thread: Some(thread),
        })
    }

    fn lender_loop(self: &Arc<Self>, socket: &Path, peer_uid: Option<u32>) {
        let (m, cv) = &self.queue_events;
        let mut seen = None;
        loop {
            let mut g = lock(m);
            while !g.1 && seen == Some(g.0) {
                g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            // Settle: no change for SETTLE.
            loop {
                if g.1 {
                    return;
                }
                let at = g.0;
                g = cv
                    .wait_timeout(g, SETTLE)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                if g.0 == at {
                    break;
                }
            }
            seen = Some(g.0);
            drop(g);
            if self.rings_lent() || !self.has_running_queues() {
                continue;
            }
            match self.lend_rings(socket, peer_uid) {
                Ok(_) => {}
                Err(e) => {
                    if let Some(n) = self.stats.log.vhost.admit() {
                        info!(drive = %self.cfg.name, "rings not lent: {}{}", crate::util::error_chain(&e), crate::util::suppressed(n));
                    }
                }
            }
            // What the lend itself changed is not a new reason to lend.
            seen = Some(lock(m).0);
        }
    }
}

impl Drop for Lender {
    fn drop(&mut self) {
        {
            let (m, cv) = &self.drive.queue_events;
            lock(m).1 = true;
            cv.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.drive.reclaim_rings();
    }
}

/// `used->idx` and `avail_event` of a split ring of `size` entries whose used ring is at
/// `used`, in guest memory (a ring that cannot be read counts as idle: nothing can be
/// learnt from it).
fn ring_positions(mem: &Mem, used: u64, size: u16) -> (u16, u16) {
    let avail_event = used + 4 + 8 * u64::from(size);
    let rd = |a: u64| {
        mem.load::<u16>(GuestAddress(a), Ordering::Acquire)
            .map(u16::from_le)
    };
    match (rd(used + 2), rd(avail_event)) {
        (Ok(u), Ok(n)) => (u, n),
        _ => (0, 0),
    }
}
