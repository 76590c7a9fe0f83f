//! Held requests: a request whose error its policy holds (werror=enospc, werror=stop) stays
//! in flight, invisible to the guest, and is retried every [`HOLD_RETRY`] or on request
//! (`accelctl resume`), in its order. While any is held the queue pops nothing new, so no
//! request queued behind a held write overtakes it.

use std::collections::VecDeque;
use std::time::Instant;

use crate::drive::HOLD_RETRY;

#[derive(Default)]
pub(super) struct Holds {
    /// Held slots, oldest first.
    held: VecDeque<usize>,
    /// Held requests resubmitted by a retry and not finished yet.
    pub(super) retrying: usize,
    next_retry: Option<Instant>,
    /// Requests were held: once the last one went through, take new ones again.
    was_holding: bool,
}

impl Holds {
    /// Whether the queue holds requests (held, or resubmitted by a retry).
    pub(super) fn holding(&self) -> bool {
        !self.held.is_empty() || self.retrying > 0
    }

    pub(super) fn any_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// How long the worker may sleep before the next retry is due (epoll's timeout: -1 for
    /// none, at most a second).
    pub(super) fn timeout_ms(&self, now: Instant) -> i32 {
        self.next_retry.map_or(-1, |t| {
            t.saturating_duration_since(now).as_millis().min(1000) as i32
        })
    }

    pub(super) fn retry_due(&self, now: Instant) -> bool {
        self.next_retry.is_some_and(|t| now >= t)
    }

    /// Holds slot `idx` (a retry is due in [`HOLD_RETRY`] if none is yet).
    pub(super) fn push(&mut self, idx: usize) {
        self.held.push_back(idx);
        self.was_holding = true;
        self.next_retry
            .get_or_insert_with(|| Instant::now() + HOLD_RETRY);
    }

    /// Every held slot, in order, for a retry (the next one is due when one is held again).
    pub(super) fn take(&mut self) -> VecDeque<usize> {
        self.next_retry = None;
        std::mem::take(&mut self.held)
    }

    /// The last held request went through since the previous call: the queue pops again.
    pub(super) fn released(&mut self) -> bool {
        if self.was_holding && !self.holding() {
            self.was_holding = false;
            return true;
        }
        false
    }
}
