//! The live engine switch: pause (stop popping, drain), then resume on a new engine.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use super::{Drive, QueueCtl};
use crate::engine::{Engine, EngineError, QueueIo};
use crate::util::lock;

/// How long a switch waits for the new engine's queues to be set up (NBD handshakes).
const READY_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum SwitchError {
    #[error("a switch is already running on drive {0}")]
    Busy(String),
    #[error("the new engine could not open queue contexts")]
    Prepare(#[source] EngineError),
    #[error("a queue has no context on the new engine, or the drive is paused")]
    NotPrepared,
    #[error("queue {queue} did not drain within {timeout:?}; switch rolled back, old engine kept")]
    DrainTimeout { queue: usize, timeout: Duration },
}

/// The outcome of one engine switch.
#[derive(Clone, Debug)]
pub struct SwitchReport {
    pub from: String,
    pub to: String,
    /// Queues that were running and were drained.
    pub queues: usize,
    /// How long the drive took no requests: from the first pause request to the last
    /// resume; for an overlapped switch, the longest a queue's worker stopped popping while it
    /// took the new engine (the queues served throughout otherwise).
    pub pause: Duration,
    /// From the start of the switch until every queue was on the new engine (the pause, for
    /// a switch that drains; for an overlapped one, until each worker acknowledged it).
    pub handover: Duration,
}

impl Drive {
    /// Stops every queue from taking new requests (they stay in the vring) and waits until
    /// each queue's in-flight requests have completed on the current engine. Nothing is
    /// cancelled. On a drain timeout the queues resume on the current engine.
    ///
    /// The returned [`Paused`] ends the pause: [`Paused::resume`] on a new engine (or the same
    /// one); dropping it resumes on the current engine. Lent rings are taken back first.
    pub fn pause(self: &Arc<Self>) -> Result<Paused, SwitchError> {
        self.reclaim_rings();
        self.pause_now()
    }

    /// [`Drive::pause`] of rings acceld serves now (a lend is in place: `Busy`).
    pub(crate) fn pause_now(self: &Arc<Self>) -> Result<Paused, SwitchError> {
        if self.switching.swap(true, Ordering::AcqRel) {
            return Err(SwitchError::Busy(self.cfg.name.clone()));
        }
        let t0 = Instant::now();
        let from = self.engine().io_path().to_string();
        let workers = {
            let _a = lock(&self.attach_lock);
            lock(&self.engine).paused = true;
            lock(&self.running).clone()
        };
        for w in &workers {
            w.request_pause();
        }
        let deadline = t0 + self.drain_timeout;
        for w in &workers {
            if !w.wait_drained(deadline) {
                warn!(drive = %self.cfg.name, queue = w.index(), "drain timed out, pause abandoned");
                let _a = lock(&self.attach_lock);
                lock(&self.engine).paused = false;
                for w in lock(&self.running).iter() {
                    w.resume(None);
                }
                self.switching.store(false, Ordering::Release);
                return Err(SwitchError::DrainTimeout {
                    queue: w.index(),
                    timeout: self.drain_timeout,
                });
            }
        }
        Ok(Paused {
            drive: self.clone(),
            t0,
            from,
            queues: workers.len(),
            ended: false,
        })
    }

    /// Moves the drive to `new` without losing or reordering a request: pause, drain,
    /// resume on `new`. When `new` cannot open its queue contexts, the drive resumes on the
    /// old engine.
    pub fn switch_engine(
        self: &Arc<Self>,
        new: Arc<dyn Engine>,
    ) -> Result<SwitchReport, SwitchError> {
        let p = self.pause()?;
        match p.resume(new) {
            Ok(r) => Ok(r),
            Err((p, e)) => {
                drop(p);
                Err(e)
            }
        }
    }
}

/// Queue contexts opened on an engine before a pause (see [`Drive::open_contexts`]).
pub struct Contexts(Vec<(usize, u32, Box<dyn QueueIo>)>);

impl Drive {
    /// Moves the drive to `new` without a drain: each queue takes new requests on `new`
    /// (its context from `ahead`) at once, and the requests in flight finish on the old
    /// engine (virtio-blk orders nothing between requests in flight, and both engines reach
    /// the same image). The pause is the hand-over itself. The old engine must be kept (not
    /// released) until [`Draining::wait`] says its last request completed; until then no
    /// other switch or pause starts.
    ///
    /// `ahead` must hold a context for every running queue; when it does not (a queue
    /// started meanwhile), nothing happens and `ahead` comes back for an ordinary switch.
    #[allow(clippy::needless_pass_by_value)] // the drive and each queue keep a clone
    pub fn swap_engine(
        self: &Arc<Self>,
        new: Arc<dyn Engine>,
        mut ahead: Contexts,
    ) -> Result<(SwitchReport, Draining), (Contexts, SwitchError)> {
        self.reclaim_rings();
        if self.switching.swap(true, Ordering::AcqRel) {
            return Err((ahead, SwitchError::Busy(self.cfg.name.clone())));
        }
        let t0 = Instant::now();
        let from = self.engine().io_path().to_string();
        let a = lock(&self.attach_lock);
        let workers: Vec<Arc<QueueCtl>> = lock(&self.running).clone();
        let covered = workers.iter().all(|w| {
            ahead
                .0
                .iter()
                .any(|(i, d, _)| *i == w.index() && *d == w.depth())
        });
        // Held requests (werror) would keep the old engine until the error clears: such a
        // drive drains (and rolls back on the drain's timeout) as before. Unless the old
        // engine's path is gone: its held requests (PATH_LOST) are in flight nowhere, and
        // their next retry goes to the new engine.
        let holding = self.stats.held_requests.load(Ordering::Relaxed) > 0 && !self.engine().lost();
        if !covered || holding || lock(&self.engine).paused || new.holds() {
            drop(a);
            self.switching.store(false, Ordering::Release);
            return Err((ahead, SwitchError::NotPrepared));
        }
        let old = {
            let mut slot = lock(&self.engine);
            let old = std::mem::replace(&mut slot.engine, new.clone());
            slot.generation += 1;
            old
        };
        if old.file_config().is_some() {
            *lock(&self.unsynced) = Some(old.clone());
        }
        for w in &workers {
            let io = ahead.take(w.index(), w.depth()).expect("covered above");
            w.request_swap((io, new.clone()));
        }
        drop(a);
        let deadline = t0 + self.drain_timeout;
        for w in &workers {
            if !w.wait_swapped(deadline) {
                // A worker that does not answer its control eventfd is stuck in the engine;
                // it takes the new one whenever it comes back.
                warn!(drive = %self.cfg.name, queue = w.index(), "queue did not take the new engine within {:?}", self.drain_timeout);
            }
        }
        let handover = t0.elapsed();
        let pause = workers
            .iter()
            .map(|w| w.swap_took())
            .max()
            .unwrap_or_default();
        self.stats.switches.fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_pause_us
            .store(pause.as_micros() as u64, Ordering::Relaxed);
        info!(drive = %self.cfg.name, from = %from, to = new.io_path(), queues = workers.len(), pause_us = pause.as_micros() as u64, handover_us = handover.as_micros() as u64, "engine swapped; requests in flight finish on the old one");
        if !new.wait_ready(READY_TIMEOUT) {
            if let Some(n) = self.stats.log.io.admit() {
                warn!(drive = %self.cfg.name, to = new.io_path(), "the new engine's queues were not ready within {READY_TIMEOUT:?}{}", crate::util::suppressed(n));
            }
        }
        Ok((
            SwitchReport {
                from,
                to: new.io_path().to_string(),
                queues: workers.len(),
                pause,
                handover,
            },
            Draining {
                drive: self.clone(),
                workers,
                old,
                done: false,
            },
        ))
    }
}

/// The old engine of an overlapped switch ([`Drive::swap_engine`]) while requests finish on
/// it. Until it is done no other switch or pause starts; dropping it leaves the wait to a
/// thread.
pub struct Draining {
    drive: Arc<Drive>,
    workers: Vec<Arc<QueueCtl>>,
    old: Arc<dyn Engine>,
    done: bool,
}

impl Draining {
    /// Waits until every request on the old engine completed, then makes its writes durable
    /// (fdatasync, for a direct engine) and ends the switch. After `timeout` with requests
    /// still there it comes back: the old engine must stay until [`Draining::wait_all`].
    pub fn wait(mut self, timeout: Duration) -> Result<(), Draining> {
        let deadline = Instant::now() + timeout;
        if self.workers.iter().all(|w| w.wait_old_drained(deadline)) {
            self.finish();
            Ok(())
        } else {
            Err(self)
        }
    }

    /// Waits however long it takes (for a thread of its own).
    pub fn wait_all(mut self) {
        while !self
            .workers
            .iter()
            .all(|w| w.wait_old_drained(Instant::now() + Duration::from_secs(1)))
        {}
        self.finish();
    }

    fn finish(&mut self) {
        if let Err(e) = self.old.sync_data() {
            if let Some(n) = self.drive.stats.log.io.admit() {
                warn!(drive = %self.drive.cfg.name, "fdatasync of the old engine after a switch failed: {e}{}", crate::util::suppressed(n));
            }
        }
        *lock(&self.drive.unsynced) = None;
        self.done = true;
        self.drive.switching.store(false, Ordering::Release);
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        if !self.done {
            let rest = Draining {
                drive: self.drive.clone(),
                workers: std::mem::take(&mut self.workers),
                old: self.old.clone(),
                done: false,
            };
            self.done = true;
            std::thread::spawn(move || rest.wait_all());
        }
    }
}

impl Contexts {
    /// The context opened for queue `index` at `depth`, if any.
    fn take(&mut self, index: usize, depth: u32) -> Option<Box<dyn QueueIo>> {
        let at = self
            .0
            .iter()
            .position(|(i, d, _)| *i == index && *d == depth)?;
        Some(self.0.swap_remove(at).2)
    }
}

impl Drive {
    /// Opens a context on `engine` for every running queue, before a pause, so that the
    /// pause does not wait for them (an io_uring ring takes milliseconds to set up on a busy
    /// host). A queue that starts or stops meanwhile gets its context at the resume.
    pub fn open_contexts(&self, engine: &dyn Engine) -> Result<Contexts, EngineError> {
        let workers: Vec<Arc<QueueCtl>> = lock(&self.running).clone();
        let mut v = Vec::with_capacity(workers.len());
        for w in &workers {
            v.push((
                w.index(),
                w.depth(),
                engine.open_queue(w.index(), w.depth(), w.mem())?,
            ));
        }
        Ok(Contexts(v))
    }
}

/// A drive whose queues are paused and drained (see [`Drive::pause`]).
pub struct Paused {
    drive: Arc<Drive>,
    t0: Instant,
    from: String,
    queues: usize,
    ended: bool,
}

impl Paused {
    pub fn drive(&self) -> &Arc<Drive> {
        &self.drive
    }

    /// Time since the pause began.
    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }

    /// Ends the pause on `engine`: each queue gets a fresh context on it. A holding engine
    /// keeps the queues paused (requests wait in the vring). When a context cannot be opened,
    /// the drive stays paused and the pause comes back with the error, for a rollback.
    pub fn resume(self, engine: Arc<dyn Engine>) -> Result<SwitchReport, (Paused, SwitchError)> {
        self.resume_with(engine, None)
    }

    /// [`Paused::resume`] with contexts opened before the pause on the same engine.
    #[allow(clippy::needless_pass_by_value)] // the drive keeps the engine (cloned into it)
    pub fn resume_with(
        mut self,
        engine: Arc<dyn Engine>,
        mut ahead: Option<Contexts>,
    ) -> Result<SwitchReport, (Paused, SwitchError)> {
        let d = self.drive.clone();
        let a = lock(&d.attach_lock);
        let workers: Vec<Arc<QueueCtl>> = lock(&d.running).clone();
        let mut fresh = Vec::with_capacity(workers.len());
        if !engine.holds() {
            for w in &workers {
                if let Some(io) = ahead.as_mut().and_then(|c| c.take(w.index(), w.depth())) {
                    fresh.push(io);
                    continue;
                }
                match engine.open_queue(w.index(), w.depth(), w.mem()) {
                    Ok(io) => fresh.push(io),
                    Err(e) => {
                        drop(a);
                        return Err((self, SwitchError::Prepare(e)));
                    }
                }
            }
        }
        {
            let mut slot = lock(&d.engine);
            slot.engine = engine.clone();
            slot.generation += 1;
            slot.paused = false;
        }
        for (w, io) in workers.iter().zip(fresh) {
            w.resume(Some((io, engine.clone())));
        }
        drop(a);
        self.ended = true;
        d.switching.store(false, Ordering::Release);
        let pause = self.t0.elapsed();
        if engine.holds() {
            if let Some(n) = d.stats.log.hold.admit() {
                info!(drive = %d.cfg.name, from = %self.from, "drive held: requests wait in the vring{}", crate::util::suppressed(n));
            }
        } else {
            d.stats.switches.fetch_add(1, Ordering::Relaxed);
            d.stats
                .last_pause_us
                .store(pause.as_micros() as u64, Ordering::Relaxed);
            info!(drive = %d.cfg.name, from = %self.from, to = engine.io_path(), queues = self.queues, pause_us = pause.as_micros() as u64, "engine switched");
            // The drive runs already; the switch is over for whoever comes next (a graph
            // change on QEMU, say) once the new engine's queues are set up.
            if !engine.wait_ready(READY_TIMEOUT) {
                if let Some(n) = d.stats.log.io.admit() {
                    warn!(drive = %d.cfg.name, to = engine.io_path(), "the new engine's queues were not ready within {READY_TIMEOUT:?}{}", crate::util::suppressed(n));
                }
            }
        }
        Ok(SwitchReport {
            from: std::mem::take(&mut self.from),
            to: engine.io_path().to_string(),
            queues: self.queues,
            pause,
            handover: pause,
        })
    }
}

impl Paused {
    /// Ends the pause object without resuming: the queues stay paused and the drive keeps
    /// its switch flag, until [`Drive::resume_after_lend`] (the rings are lent meanwhile).
    pub(crate) fn keep(mut self) {
        self.ended = true;
    }
}

impl Drive {
    /// Resumes the queues after a lend (see `lend`): the lent ones on the contexts they kept,
    /// any other on a fresh context of the current engine; then the drive takes switches
    /// again.
    pub(crate) fn resume_after_lend(&self, lent: &[Arc<QueueCtl>]) {
        let _a = lock(&self.attach_lock);
        let engine = {
            let mut slot = lock(&self.engine);
            slot.paused = false;
            slot.engine.clone()
        };
        for w in lock(&self.running).iter() {
            if lent.iter().any(|l| Arc::ptr_eq(l, w)) || engine.holds() {
                w.resume(None);
                continue;
            }
            match engine.open_queue(w.index(), w.depth(), w.mem()) {
                Ok(io) => w.resume(Some((io, engine.clone()))),
                Err(e) => {
                    warn!(drive = %self.cfg.name, queue = w.index(), "cannot reopen the engine: {e}");
                    w.resume(None)
                }
            }
        }
        self.switching.store(false, Ordering::Release);
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Abandoned: the queues go on with the current engine. Fresh contexts, since a worker
        // that started during the pause has none.
        let d = &self.drive;
        let _a = lock(&d.attach_lock);
        let engine = {
            let mut slot = lock(&d.engine);
            slot.paused = false;
            slot.engine.clone()
        };
        if !engine.holds() {
            for w in lock(&d.running).iter() {
                match engine.open_queue(w.index(), w.depth(), w.mem()) {
                    Ok(io) => w.resume(Some((io, engine.clone()))),
                    Err(e) => {
                        warn!(drive = %d.cfg.name, queue = w.index(), "cannot reopen the engine: {e}");
                        w.resume(None)
                    }
                }
            }
        }
        d.switching.store(false, Ordering::Release);
        warn!(drive = %d.cfg.name, "pause ended without a switch; queues resumed on {}", self.from);
    }
}
