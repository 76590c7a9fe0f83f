//! How a queue's worker waits: busy-polling for a window that adapts to the traffic, and
//! giving the CPU up now and then so that queues sharing a core take turns.

use std::time::{Duration, Instant};

/// How long a worker busy-polls before sleeping, adapted like QEMU's event loop
/// (`poll-max-ns`, `poll-grow`, `poll-shrink`): a wait that polling would have caught (shorter
/// than the maximum) doubles the window, starting at 4 µs; a longer wait means the queue went
/// idle and turns polling off until waits are short again. An idle drive costs nothing, a
/// steady low-depth stream never sleeps between requests.
#[derive(Debug)]
pub(super) struct AdaptivePoll {
    max: Duration,
    pub(super) window: Duration,
}

impl AdaptivePoll {
    const START: Duration = Duration::from_micros(4);

    pub(super) fn new(max_us: u32) -> Self {
        AdaptivePoll {
            max: Duration::from_micros(u64::from(max_us)),
            window: Duration::ZERO,
        }
    }

    /// After a sleep: `waited` is the time from when polling started to the wake-up.
    pub(super) fn adapt(&mut self, waited: Duration) {
        if self.max.is_zero() || waited <= self.window {
            return;
        }
        if waited > self.max {
            self.window = Duration::ZERO;
        } else if self.window < self.max {
            self.window = (self.window * 2).max(Self::START).min(self.max);
        }
    }
}

/// The worker's waiting state.
pub(super) struct Poller {
    pub(super) adaptive: AdaptivePoll,
    /// Inside `Worker::poll`: guest notifications stay off.
    pub(super) polling: bool,
    /// Since when this worker has run without sleeping or yielding.
    on_cpu_since: Instant,
}

impl Poller {
    pub(super) fn new(max_us: u32) -> Self {
        Poller {
            adaptive: AdaptivePoll::new(max_us),
            polling: false,
            on_cpu_since: Instant::now(),
        }
    }

    /// Whether the worker polls before it sleeps.
    pub(super) fn window(&self) -> Duration {
        self.adaptive.window
    }

    /// The worker slept (gave the CPU up) until `now`.
    pub(super) fn slept(&mut self, now: Instant) {
        self.on_cpu_since = now;
    }

    /// Lets the other threads of this core run once this worker has been `after` on the CPU
    /// without a sleep ([`super::YIELD_AFTER`] when working, [`super::IDLE_YIELD_AFTER`] when
    /// only spinning). A busy queue (polling, or always finding more work) never sleeps;
    /// without this, two such queues on one core would take turns of a whole scheduler slice
    /// (4 ms of latency for the waiting one), and a polling queue would delay any other
    /// thread there.
    pub(super) fn share_cpu(&mut self, now: Instant, after: Duration) {
        if now - self.on_cpu_since >= after {
            std::thread::yield_now();
            self.on_cpu_since = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_window_grows_on_short_waits_and_stops_on_long_ones() {
        let us = Duration::from_micros;
        let mut p = AdaptivePoll::new(32);
        assert_eq!(p.window, Duration::ZERO, "no polling before any traffic");
        p.adapt(us(20));
        assert_eq!(p.window, us(4));
        for _ in 0..10 {
            p.adapt(us(31));
        }
        assert_eq!(p.window, us(32), "capped at the maximum");
        p.adapt(us(10));
        assert_eq!(p.window, us(32), "a wait polling covers changes nothing");
        p.adapt(us(500));
        assert_eq!(p.window, Duration::ZERO, "an idle queue sleeps");
        let mut off = AdaptivePoll::new(0);
        off.adapt(us(1));
        assert_eq!(off.window, Duration::ZERO, "0 turns polling off");
    }
}
