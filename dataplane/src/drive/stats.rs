//! A drive's counters and latency histogram.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::util::LogLimit;

/// Counters of a drive, readable at any time.
#[derive(Debug, Default)]
pub struct DriveStats {
    /// Requests by type as they arrive (reads and writes, and their bytes, are counted once,
    /// at completion, in `acct`).
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub get_ids: AtomicU64,
    /// Requests answered IOERR (bad requests and failed I/O).
    pub io_errors: AtomicU64,
    /// Requests answered UNSUPP.
    pub unsupported: AtomicU64,
    /// Requests popped and not yet completed, over all queues.
    pub in_flight: AtomicU64,
    /// Requests that went through the bounce pool (unaligned buffers with O_DIRECT).
    pub bounced: AtomicU64,
    pub switches: AtomicU64,
    /// Queues that took an overlapped switch with requests in flight (they finished on the
    /// old engine).
    pub overlapped: AtomicU64,
    pub last_pause_us: AtomicU64,
    /// Times the drive's rings were lent to QEMU's export (see `drive::lend`).
    pub lends: AtomicU64,
    /// The pauses of the last [`PAUSE_SAMPLES`] lends and take-backs (microseconds).
    pub lend_pauses_us: Mutex<VecDeque<u64>>,
    pub take_back_pauses_us: Mutex<VecDeque<u64>>,
    /// The last migration switchover's stop of the drive's last ring, as the source saw it:
    /// drain, fdatasync and image release, until the GET_VRING_BASE reply (microseconds).
    pub switchover_stop_us: AtomicU64,
    /// Completion latency of every request, from pop to used ring.
    pub latency: LatencyHistogram,
    /// Accounting per request class, in QEMU's blockstats terms.
    pub acct: BlockAcct,
    /// Queues whose ring the driver corrupted, stopped until the frontend resets them.
    pub broken_queues: AtomicU64,
    /// Rings found broken since the drive started.
    pub ring_errors: AtomicU64,
    pub last_ring_error: Mutex<Option<String>>,
    /// Requests held after an error (werror=enospc or stop): not completed, retried.
    pub held_requests: AtomicU64,
    /// Requests that failed with ENOSPC and were held.
    pub nospace_events: AtomicU64,
    /// The errno of the last held failure (ENOSPC: the drive shows `nospace`).
    pub hold_errno: std::sync::atomic::AtomicI32,
    /// Requests a previous acceld left in flight and this one resubmitted (INFLIGHT_SHMFD).
    pub resubmitted: AtomicU64,
    /// Log budgets of what a guest or a disk can trigger on this drive.
    pub log: DriveLogLimits,
}

/// How many lend and take-back pauses a drive keeps.
pub const PAUSE_SAMPLES: usize = 1000;

/// Records one pause in a bounded list of samples.
pub fn record_pause(v: &Mutex<VecDeque<u64>>, us: u64) {
    let mut v = crate::util::lock(v);
    if v.len() >= PAUSE_SAMPLES {
        v.pop_front();
    }
    v.push_back(us);
}

/// One log budget per kind of line a guest, a disk or a frontend can repeat.
#[derive(Debug, Default)]
pub struct DriveLogLimits {
    /// Failed I/O (a failing disk, a lost NBD export).
    pub io: LogLimit,
    /// Broken rings.
    pub ring: LogLimit,
    /// The call eventfd cannot be written.
    pub call: LogLimit,
    /// vhost-user messages refused, connections opened and closed.
    pub vhost: LogLimit,
    /// Requests held for lack of space (or any error with werror=stop).
    pub hold: LogLimit,
}

/// The request classes QEMU's block accounting knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcctClass {
    Read = 0,
    /// WRITE and WRITE_ZEROES.
    Write = 1,
    Flush = 2,
    /// DISCARD.
    Unmap = 3,
}

#[derive(Debug, Default)]
struct ClassAcct {
    ops: AtomicU64,
    bytes: AtomicU64,
    time_ns: AtomicU64,
    failed: AtomicU64,
    invalid: AtomicU64,
}

/// Per-class counters: done (with bytes and time), failed, invalid.
#[derive(Debug, Default)]
pub struct BlockAcct {
    class: [ClassAcct; 4],
}

impl BlockAcct {
    /// A request of `class` completed after `took`: `ok` with `bytes`, or failed.
    pub fn done(&self, class: AcctClass, ok: bool, bytes: u64, took: Duration) {
        let c = &self.class[class as usize];
        if ok {
            c.ops.fetch_add(1, Ordering::Relaxed);
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
            let ns = took.as_nanos().min(u128::from(u64::MAX)) as u64;
            c.time_ns.fetch_add(ns, Ordering::Relaxed);
        } else {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request of `class` was rejected before any I/O.
    pub fn invalid(&self, class: AcctClass) {
        self.class[class as usize]
            .invalid
            .fetch_add(1, Ordering::Relaxed);
    }

    pub fn counters(&self) -> accel_api::status::IoCounters {
        let g = |c: AcctClass| {
            let a = &self.class[c as usize];
            [&a.ops, &a.bytes, &a.time_ns, &a.failed, &a.invalid].map(|x| x.load(Ordering::Relaxed))
        };
        let [rd_operations, rd_bytes, rd_total_time_ns, failed_rd_operations, invalid_rd_operations] =
            g(AcctClass::Read);
        let [wr_operations, wr_bytes, wr_total_time_ns, failed_wr_operations, invalid_wr_operations] =
            g(AcctClass::Write);
        let [flush_operations, _, flush_total_time_ns, failed_flush_operations, invalid_flush_operations] =
            g(AcctClass::Flush);
        let [unmap_operations, unmap_bytes, unmap_total_time_ns, failed_unmap_operations, invalid_unmap_operations] =
            g(AcctClass::Unmap);
        accel_api::status::IoCounters {
            rd_bytes,
            wr_bytes,
            unmap_bytes,
            rd_operations,
            wr_operations,
            flush_operations,
            unmap_operations,
            rd_total_time_ns,
            wr_total_time_ns,
            flush_total_time_ns,
            unmap_total_time_ns,
            failed_rd_operations,
            failed_wr_operations,
            failed_flush_operations,
            failed_unmap_operations,
            invalid_rd_operations,
            invalid_wr_operations,
            invalid_flush_operations,
            invalid_unmap_operations,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounting_keeps_classes_apart() {
        let a = BlockAcct::default();
        a.done(AcctClass::Read, true, 4096, Duration::from_nanos(100));
        a.done(AcctClass::Read, false, 0, Duration::from_nanos(7));
        a.done(AcctClass::Write, true, 512, Duration::from_nanos(50));
        a.done(AcctClass::Unmap, true, 1 << 20, Duration::from_nanos(9));
        a.invalid(AcctClass::Flush);
        let c = a.counters();
        assert_eq!(
            (c.rd_operations, c.rd_bytes, c.rd_total_time_ns),
            (1, 4096, 100)
        );
        assert_eq!(c.failed_rd_operations, 1);
        assert_eq!(
            (c.wr_operations, c.wr_bytes, c.wr_total_time_ns),
            (1, 512, 50)
        );
        assert_eq!((c.unmap_operations, c.unmap_bytes), (1, 1 << 20));
        assert_eq!((c.flush_operations, c.invalid_flush_operations), (0, 1));
    }
}
