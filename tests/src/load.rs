//! A verifying load: random reads and writes at a fixed queue depth on every queue, with a
//! model of what each block must hold. Each queue owns its own blocks and never has two
//! requests on one block at once, so every read has exactly one right answer.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{check_pattern, pattern, BlkFrontend, Buf, FrontendError, Used, S_OK, T_IN, T_OUT};

/// Sets its flag when dropped: a thread that drives a test's load (switches, lends) stops
/// the load when it ends, also by a panic.
pub struct SetOnDrop(pub Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Bytes per request (a multiple of 512).
    pub block_size: u32,
    /// Disk region used, in blocks, split evenly between the queues.
    pub blocks: u64,
    /// Requests in flight per queue.
    pub depth: usize,
    /// Percentage of writes.
    pub write_pct: u32,
    /// Stop after this many requests in all (or at `duration`).
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
    /// Write patterned data and check every read against the model. Off: writes send whatever
    /// their slot holds, and the final model means nothing.
    pub verify: bool,
    /// Seed the initial content was written with (see [`fill_image`]).
    pub initial_seed: u64,
    pub rng_seed: u64,
    /// Random or sequential offsets within each queue's part of the region.
    pub sequential: bool,
    /// Byte offset of the region on the disk (a multiple of the block size).
    pub region_offset: u64,
    /// Spin on the used rings instead of sleeping on the call eventfds.
    pub poll: bool,
    /// Sequential only: each queue covers its blocks exactly once, then stops.
    pub single_pass: bool,
    /// What each block holds at the start (a previous report's `final_model`); default: the
    /// pattern of `initial_seed` everywhere.
    pub initial_model: Option<Arc<Vec<u64>>>,
    /// Stop when this becomes true (in addition to `requests` and `duration`).
    pub stop: Option<Arc<AtomicBool>>,
}

impl LoadSpec {
    /// The tests' standard load: 4 KiB random requests, half writes, QD32 on every queue, every
    /// read verified, over `blocks` blocks that start with the pattern of seed 1 (see
    /// [`fill_image`]). It runs until `stop` (set `requests` or `duration` otherwise).
    pub fn verified_mix(blocks: u64, rng_seed: u64, stop: Option<Arc<AtomicBool>>) -> Self {
        LoadSpec {
            block_size: 4096,
            blocks,
            depth: 32,
            write_pct: 50,
            requests: None,
            duration: Some(Duration::from_secs(300)),
            verify: true,
            initial_seed: 1,
            rng_seed,
            stop,
            sequential: false,
            region_offset: 0,
            single_pass: false,
            initial_model: None,
            poll: false,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    pub reads: u64,
    pub writes: u64,
    pub bytes: u64,
    /// Requests answered with a status other than OK.
    pub errors: u64,
    /// Reads whose data did not match the model (first few, as messages).
    pub mismatches: Vec<String>,
    pub mismatch_count: u64,
    pub elapsed: Duration,
    pub latency: Histogram,
    /// What each block must hold at the end: (block, seed of its pattern); u64::MAX where a
    /// write failed and the content is unknown.
    pub final_model: Vec<u64>,
}

impl LoadReport {
    /// Checks an image against the final model (host side, after the load).
    pub fn verify_image(&self, path: &std::path::Path, block_size: u32) -> Result<u64, String> {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; block_size as usize];
        let mut checked = 0;
        for (b, &seed) in self.final_model.iter().enumerate() {
            f.read_exact(&mut buf).map_err(|e| e.to_string())?;
            if seed == u64::MAX {
                continue;
            }
            let off = b as u64 * u64::from(block_size);
            check_pattern(off, seed, &buf)
                .map_err(|at| format!("image block {b} differs at byte {at}"))?;
            checked += 1;
        }
        Ok(checked)
    }
}

impl LoadReport {
    pub fn summary(&self) -> String {
        format!(
            "{} reads, {} writes, {} errors, {} mismatches in {:?}",
            self.reads, self.writes, self.errors, self.mismatch_count, self.elapsed
        )
    }
}

impl LoadReport {
    pub fn requests(&self) -> u64 {
        self.reads + self.writes
    }
}

/// Latency histogram: 64 linear sub-buckets per power of two of nanoseconds.
#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; 64 * 64],
            total: 0,
        }
    }
}

impl Histogram {
    fn bucket(ns: u64) -> usize {
        if ns < 64 {
            return ns as usize;
        }
        let exp = 63 - ns.leading_zeros() as usize; // >= 6
        let sub = ((ns >> (exp - 6)) & 63) as usize;
        ((exp - 5) * 64 + sub).min(64 * 64 - 1)
    }

    fn lower(b: usize) -> u64 {
        if b < 64 {
            return b as u64;
        }
        let exp = b / 64 + 5;
        let sub = (b % 64) as u64;
        (1u64 << exp) + (sub << (exp - 6))
    }

    pub fn record(&mut self, d: Duration) {
        let ns = d.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.counts[Self::bucket(ns)] += 1;
        self.total += 1;
    }

    pub fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.total += o.total;
    }

    /// The latency at quantile `q` (0..=1), as the lower bound of its bucket.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        let want = ((self.total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Duration::from_nanos(Self::lower(b));
            }
        }
        Duration::from_nanos(Self::lower(self.counts.len() - 1))
    }
}

/// xorshift64*: small, fast, deterministic.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Writes the initial pattern of `seed` over the first `len` bytes of an image (host side).
pub fn fill_image(path: &std::path::Path, len: u64, seed: u64) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        let n = ((len - off) as usize).min(buf.len());
        pattern(off, seed, &mut buf[..n]);
        f.write_all(&buf[..n])?;
        off += n as u64;
    }
    f.sync_all()
}

#[derive(Clone, Copy)]
struct Inflight {
    block: u64,
    write: bool,
    seed: u64,
    start: Instant,
}

struct QueueState {
    first_block: u64,
    /// Next block of a sequential workload.
    cursor: u64,
    issued: u64,
    blocks: u64,
    /// Seed each block was last written with.
    model: Vec<u64>,
    busy: Vec<bool>,
    free_tags: Vec<u16>,
    tags: Vec<Option<Inflight>>,
    by_head: Vec<Option<u16>>,
}

/// Runs the load until the request count or duration is reached; then lets every request in
/// flight finish. A frontend error (timeout, protocol) ends it with the error.
pub fn run_load(fe: &mut BlkFrontend, spec: &LoadSpec) -> Result<LoadReport, FrontendError> {
    assert!(spec.block_size % 512 == 0 && spec.block_size as usize <= fe.max_data());
    let nq = fe.queues();
    let per_q = spec.blocks / nq as u64;
    assert!(per_q > spec.depth as u64, "region too small for the depth");
    let depth = spec.depth.min(usize::from(fe.queue_size()));
    let mut qs: Vec<QueueState> = (0..nq)
        .map(|q| QueueState {
            first_block: spec.region_offset / u64::from(spec.block_size) + q as u64 * per_q,
            cursor: 0,
            issued: 0,
            blocks: per_q,
            model: match &spec.initial_model {
                Some(m) => {
                    m[(q as u64 * per_q) as usize..((q as u64 + 1) * per_q) as usize].to_vec()
                }
                None => vec![spec.initial_seed; per_q as usize],
            },
            busy: vec![false; per_q as usize],
            free_tags: (0..depth as u16).rev().collect(),
            tags: vec![None; depth],
            by_head: vec![None; usize::from(fe.queue_size())],
        })
        .collect();
    let mut rng = Rng::new(spec.rng_seed);
    let mut rep = LoadReport::default();
    let bs = u64::from(spec.block_size);
    let start = Instant::now();
    let mut issued = 0u64;
    let mut used = Vec::with_capacity(256);
    let mut buf = vec![0u8; spec.block_size as usize];
    let mut seed_counter = spec.rng_seed << 20;
    let mut last_progress = Instant::now();
    loop {
        let stop = spec.requests.is_some_and(|n| issued >= n)
            || spec.duration.is_some_and(|d| start.elapsed() >= d)
            || spec
                .stop
                .as_ref()
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed));
        // Refill every queue to its depth.
        let mut in_flight = 0;
        for (q, st) in qs.iter_mut().enumerate() {
            while !stop && !st.free_tags.is_empty() {
                if spec.requests.is_some_and(|n| issued >= n) {
                    break;
                }
                if spec.single_pass && st.issued >= st.blocks {
                    break;
                }
                // A block with no request in flight.
                let mut block;
                let mut tries = 0;
                loop {
                    block = if spec.sequential {
                        let b = st.cursor;
                        st.cursor = (st.cursor + 1) % st.blocks;
                        b
                    } else {
                        rng.below(st.blocks)
                    };
                    if !st.busy[block as usize] || tries >= 64 {
                        break;
                    }
                    tries += 1;
                }
                if st.busy[block as usize] {
                    break;
                }
                let tag = st.free_tags.pop().expect("checked");
                let write = (rng.below(100) as u32) < spec.write_pct;
                let disk_off = (st.first_block + block) * bs;
                let s = fe.slot(q, tag);
                let seed = if write {
                    seed_counter += 1;
                    // Without verification the data is whatever the slot holds (like fio's
                    // default of not refilling buffers): the client's own cost stays out of
                    // the server's numbers.
                    if spec.verify {
                        pattern(disk_off, seed_counter, &mut buf);
                        fe.mem.write(s.data, &buf);
                    }
                    seed_counter
                } else {
                    0
                };
                fe.mem.write(
                    s.header,
                    &crate::header(if write { T_OUT } else { T_IN }, disk_off / 512),
                );
                fe.mem.write(s.status, &[0xff]);
                let bufs = [
                    Buf {
                        addr: s.header,
                        len: 16,
                        writable: false,
                    },
                    Buf {
                        addr: s.data,
                        len: spec.block_size,
                        writable: !write,
                    },
                    Buf {
                        addr: s.status,
                        len: 1,
                        writable: true,
                    },
                ];
                let head = fe.queue_chain(q, &bufs)?;
                st.busy[block as usize] = true;
                st.tags[usize::from(tag)] = Some(Inflight {
                    block,
                    write,
                    seed,
                    start: Instant::now(),
                });
                st.by_head[usize::from(head)] = Some(tag);
                issued += 1;
                st.issued += 1;
            }
            fe.kick(q);
            in_flight += st.tags.len() - st.free_tags.len();
        }
        let passes_done = spec.single_pass && qs.iter().all(|st| st.issued >= st.blocks);
        if (stop || passes_done) && in_flight == 0 {
            break;
        }
        if in_flight == 0 {
            continue;
        }
        // Completions from every queue; block on the first queue's call fd only briefly.
        let mut got = 0;
        for (q, st) in qs.iter_mut().enumerate() {
            used.clear();
            fe.poll_used(q, &mut used);
            got += used.len();
            for u in used.drain(..) {
                complete(fe, st, q, u, spec, &mut rep, &mut buf);
            }
        }
        if got == 0 {
            if spec.poll {
                if last_progress.elapsed() > Duration::from_secs(10) {
                    return Err(FrontendError::Timeout {
                        queue: 0,
                        timeout: Duration::from_secs(10),
                    });
                }
                std::hint::spin_loop();
            } else {
                wait_any_call(fe, Duration::from_secs(10))?;
            }
        } else {
            last_progress = Instant::now();
        }
    }
    rep.elapsed = start.elapsed();
    for st in &qs {
        rep.final_model.extend_from_slice(&st.model);
    }
    Ok(rep)
}

fn complete(
    fe: &BlkFrontend,
    st: &mut QueueState,
    q: usize,
    u: Used,
    spec: &LoadSpec,
    rep: &mut LoadReport,
    buf: &mut [u8],
) {
    let Some(tag) = st
        .by_head
        .get_mut(usize::from(u.head))
        .and_then(|t| t.take())
    else {
        rep.errors += 1;
        rep.mismatches.push(format!(
            "queue {q}: used head {} that is not in flight",
            u.head
        ));
        return;
    };
    let inf = st.tags[usize::from(tag)].take().expect("tag in flight");
    rep.latency.record(inf.start.elapsed());
    let s = fe.slot(q, tag);
    let mut status = [0u8];
    fe.mem.read(s.status, &mut status);
    let bs = u64::from(spec.block_size);
    let disk_off = (st.first_block + inf.block) * bs;
    if status[0] != S_OK {
        rep.errors += 1;
        if rep.mismatches.len() < 8 {
            rep.mismatches.push(format!(
                "queue {q}: {} at offset {disk_off} answered status {}",
                if inf.write { "write" } else { "read" },
                status[0]
            ));
        }
        // A failed write leaves the block unknown: stop verifying it.
        if inf.write {
            st.model[inf.block as usize] = u64::MAX;
        }
    } else if inf.write {
        rep.writes += 1;
        rep.bytes += bs;
        st.model[inf.block as usize] = inf.seed;
    } else {
        rep.reads += 1;
        rep.bytes += bs;
        let want = st.model[inf.block as usize];
        if spec.verify && want != u64::MAX {
            fe.mem.read(s.data, buf);
            if let Err(at) = check_pattern(disk_off, want, buf) {
                rep.mismatch_count += 1;
                if rep.mismatches.len() < 8 {
                    rep.mismatches.push(format!(
                        "queue {q}: read at offset {disk_off} differs at byte {at} (expected seed {want})"
                    ));
                }
            }
        }
    }
    st.busy[inf.block as usize] = false;
    st.free_tags.push(tag);
}

fn wait_any_call(fe: &BlkFrontend, timeout: Duration) -> Result<(), FrontendError> {
    use std::os::fd::AsRawFd;
    let mut fds: Vec<libc::pollfd> = (0..fe.queues())
        .map(|q| libc::pollfd {
            fd: fe.call_fd(q).as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: fds is a valid array for the duration of the call.
    let r = unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            timeout.as_millis() as i32,
        )
    };
    for q in 0..fe.queues() {
        let _ = fe.call_fd(q).read();
    }
    if r == 0 {
        // Last look before declaring a hang (a completion without interrupt is also a bug,
        // but the used ring is what counts).
        return Err(FrontendError::Timeout { queue: 0, timeout });
    }
    Ok(())
}
