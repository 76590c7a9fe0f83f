//! The engines a queue sends its requests to: the current one and, after an overlapped
//! switch, the one it left, until the requests started there have finished. The worker's
//! epoll set watches the completion fd of each (`TOKEN_IO`, `TOKEN_IO_OLD`).

use std::sync::Arc;

use tracing::error;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::drive::NextEngine;
use crate::engine::{Engine, QueueIo};

/// The worker's epoll token of the current engine's completion fd.
pub(super) const TOKEN_IO: u64 = 1;
/// The completion fd of the engine an overlapped switch left (its requests finish there).
pub(super) const TOKEN_IO_OLD: u64 = 3;

/// The engine before an overlapped switch, while requests popped before it finish there.
struct OldIo {
    io: Box<dyn QueueIo>,
    engine: Arc<dyn Engine>,
    /// Requests still on it (slots marked `on_old`).
    in_flight: usize,
}

/// What [`Engines::swap`] did.
pub(super) enum Swapped {
    /// Nothing was in flight: the old context, to be dropped after the swap is acknowledged
    /// (its teardown is no part of the pause).
    Idle(NextEngine),
    /// Requests in flight finish on the old engine: the caller marks them `on_old`.
    Overlapped,
    /// The previous overlapped switch still finishes: this one is taken after it.
    Deferred,
}

pub(super) struct Engines {
    io: Box<dyn QueueIo>,
    engine: Arc<dyn Engine>,
    old: Option<OldIo>,
    /// A swap that came while `old` still had requests (the drive never sends one): taken
    /// when `old` retires, so no old engine is dropped with requests on it.
    pending_swap: Option<NextEngine>,
    queue: usize,
}

impl Engines {
    pub(super) fn new(io: Box<dyn QueueIo>, engine: Arc<dyn Engine>, queue: usize) -> Self {
        Engines {
            io,
            engine,
            old: None,
            pending_swap: None,
            queue,
        }
    }

    /// The current engine.
    pub(super) fn current(&self) -> &Arc<dyn Engine> {
        &self.engine
    }

    /// Whether an overlapped switch still has requests on the engine it left.
    pub(super) fn overlapping(&self) -> bool {
        self.old.is_some()
    }

    /// The engine a request runs on: the old one for requests started before an overlapped
    /// switch.
    pub(super) fn engine_for(&self, on_old: bool) -> &Arc<dyn Engine> {
        match &self.old {
            Some(o) if on_old => &o.engine,
            _ => &self.engine,
        }
    }

    /// The queue context a request is pushed on.
    pub(super) fn io_for(&mut self, on_old: bool) -> &mut dyn QueueIo {
        match self.old.as_mut() {
            Some(o) if on_old => &mut *o.io,
            _ => &mut *self.io,
        }
    }

    /// Sends what was pushed to either engine.
    pub(super) fn submit(&mut self) {
        if let Err(e) = self.io.submit() {
            error!(queue = self.queue, "engine submit failed: {e}");
        }
        if let Some(o) = self.old.as_mut() {
            if let Err(e) = o.io.submit() {
                error!(queue = self.queue, "engine submit failed: {e}");
            }
        }
    }

    pub(super) fn has_completions(&mut self) -> bool {
        self.io.has_completions() || self.old.as_mut().is_some_and(|o| o.io.has_completions())
    }

    /// Appends the completions both engines have now.
    pub(super) fn reap(&mut self, done: &mut Vec<(u64, i32)>) {
        self.io.reap(done);
        if let Some(o) = self.old.as_mut() {
            o.io.reap(done);
        }
    }

    /// An overlapped switch: new requests go to `io` at once, the `in_flight` ones finish on
    /// the engine they started on (virtio-blk orders nothing between requests in flight).
    pub(super) fn swap(
        &mut self,
        epoll: &Epoll,
        io: Box<dyn QueueIo>,
        engine: Arc<dyn Engine>,
        in_flight: usize,
    ) -> Swapped {
        if self.old.is_some() {
            error!(
                queue = self.queue,
                "engine swap while the last one still finishes; taken after it"
            );
            self.pending_swap = Some((io, engine));
            return Swapped::Deferred;
        }
        if in_flight == 0 {
            return Swapped::Idle(self.replace(epoll, io, engine));
        }
        let _ = epoll.ctl(
            ControlOperation::Modify,
            self.io.completion_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_IO_OLD),
        );
        if let Err(e) = epoll.ctl(
            ControlOperation::Add,
            io.completion_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_IO),
        ) {
            error!(queue = self.queue, "cannot watch the new engine: {e}");
        }
        self.old = Some(OldIo {
            io: std::mem::replace(&mut self.io, io),
            engine: std::mem::replace(&mut self.engine, engine),
            in_flight,
        });
        Swapped::Overlapped
    }

    /// A request on the old engine finished; true when it was the last one there (the
    /// caller then calls [`Engines::retire_old`]).
    pub(super) fn old_finished(&mut self) -> bool {
        match self.old.as_mut() {
            Some(o) => {
                o.in_flight -= 1;
                o.in_flight == 0
            }
            None => false,
        }
    }

    /// Drops the old engine's context (its last request completed) and takes a swap that
    /// waited for it (`in_flight` requests are on the current engine): what that swap did,
    /// for the caller to act on as after [`Engines::swap`].
    pub(super) fn retire_old(&mut self, epoll: &Epoll, in_flight: usize) -> Option<Swapped> {
        let o = self.old.take()?;
        let _ = epoll.ctl(
            ControlOperation::Delete,
            o.io.completion_fd(),
            EpollEvent::default(),
        );
        drop(o);
        let (io, engine) = self.pending_swap.take()?;
        Some(self.swap(epoll, io, engine, in_flight))
    }

    /// Puts `io` in place of the current context (nothing in flight); returns the old one,
    /// for the caller to drop when it suits (tearing an io_uring ring down takes time).
    pub(super) fn replace(
        &mut self,
        epoll: &Epoll,
        io: Box<dyn QueueIo>,
        engine: Arc<dyn Engine>,
    ) -> NextEngine {
        let _ = epoll.ctl(
            ControlOperation::Delete,
            self.io.completion_fd(),
            EpollEvent::default(),
        );
        if let Err(e) = epoll.ctl(
            ControlOperation::Add,
            io.completion_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_IO),
        ) {
            error!(queue = self.queue, "cannot watch the new engine: {e}");
        }
        (
            std::mem::replace(&mut self.io, io),
            std::mem::replace(&mut self.engine, engine),
        )
    }
}
