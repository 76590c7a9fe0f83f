//! A drive's counters and latency histogram.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters of a drive, readable at any time.
#[derive(Debug, Default)]
pub struct DriveStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub get_ids: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Requests answered IOERR (bad requests and failed I/O).
    pub io_errors: AtomicU64,
    /// Requests answered UNSUPP.
    pub unsupported: AtomicU64,
    /// Requests popped and not yet completed, over all queues.
    pub in_flight: AtomicU64,
    /// Requests that went through the bounce pool (unaligned buffers with O_DIRECT).
    pub bounced: AtomicU64,
    pub switches: AtomicU64,
    pub last_pause_us: AtomicU64,
    /// Completion latency of every request, from pop to used ring.
    pub latency: LatencyHistogram,
}

/// Lock-free latency histogram: bucket i counts latencies in [2^(i-1), 2^i) microseconds.
#[derive(Debug)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; 40],
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl LatencyHistogram {
    pub fn record(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let i = (64 - us.leading_zeros() as usize).min(39);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts, for differences between two moments.
    pub fn snapshot(&self) -> [u64; 40] {
        std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed))
    }

    /// The upper bound (microseconds) of the bucket holding quantile `q` of `counts`; None
    /// when empty.
    pub fn quantile_us(counts: &[u64; 40], q: f64) -> Option<u64> {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(1u64 << i);
            }
        }
        Some(1u64 << 39)
    }
}
