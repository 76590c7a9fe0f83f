//! The plain fuzz runner: each target for N executions on random and mutated inputs from its
//! seeds, on any toolchain. Prints executions and crashes per target; exit 1 on a crash, with
//! the input saved under `--crash-dir`.
//!
//! ```sh
//! cargo run --release -p accel-fuzz -- --runs 10000000            # every target
//! cargo run --release -p accel-fuzz -- --runs 100000 nbd_reply     # one
//! ```

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "accel-fuzz",
    about = "Run accel's fuzz targets for N executions each"
)]
struct Args {
    /// Executions per target.
    #[arg(long, default_value_t = 100_000)]
    runs: u64,
    /// PRNG seed (a run is reproducible from it).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where a crashing input is written.
    #[arg(long, default_value = "fuzz/crashes")]
    crash_dir: PathBuf,
    /// Largest input, in bytes.
    #[arg(long, default_value_t = 4096)]
    max_len: usize,
    /// Targets to run (default: all).
    targets: Vec<String>,
}

/// Panics anywhere in the process (queue workers included), counted by the hook.
static PANICS: AtomicU64 = AtomicU64::new(0);

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One input: fresh random bytes, or a seed or the previous input mutated (flips, interesting
/// values, inserted and deleted runs, splices).
fn input(rng: &mut Rng, seeds: &[Vec<u8>], last: &[u8], max: usize) -> Vec<u8> {
    let mut v = match rng.below(8) {
        0 => (0..rng.below(max)).map(|_| rng.next() as u8).collect(),
        1..=4 if !seeds.is_empty() => seeds[rng.below(seeds.len())].clone(),
        _ => last.to_vec(),
    };
    for _ in 0..1 + rng.below(8) {
        let n = v.len();
        match rng.below(7) {
            0 if n > 0 => {
                let i = rng.below(n);
                v[i] ^= 1 << rng.below(8);
            }
            1 if n > 0 => {
                let i = rng.below(n);
                v[i] = [0, 1, 0x7f, 0x80, 0xff, 16, 64][rng.below(7)];
            }
            2 if n >= 4 => {
                let i = rng.below(n - 3);
                let x: u32 = [0, 1, u32::MAX, 0x8000_0000, 4096, 65535, 65536][rng.below(7)];
                v[i..i + 4].copy_from_slice(&x.to_le_bytes());
            }
            3 if v.len() < max => {
                let i = rng.below(n + 1);
                let k = rng.below(32);
                let ins: Vec<u8> = (0..k).map(|_| rng.next() as u8).collect();
                v.splice(i..i, ins);
            }
            4 if n > 0 => {
                let i = rng.below(n);
                let k = rng.below(n - i + 1);
                v.drain(i..i + k);
            }
            5 if !seeds.is_empty() => {
                let s = &seeds[rng.below(seeds.len())];
                let i = rng.below(v.len() + 1);
                let j = rng.below(s.len() + 1);
                v.truncate(i);
                v.extend_from_slice(&s[j..]);
            }
            _ => v.push(rng.next() as u8),
        }
    }
    v.truncate(max);
    v
}

fn main() -> ExitCode {
    let args = Args::parse();
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        prev(info);
    }));
    let chosen: Vec<_> = accel_fuzz::TARGETS
        .iter()
        .filter(|(name, _)| args.targets.is_empty() || args.targets.iter().any(|t| t == name))
        .collect();
    if chosen.is_empty() {
        eprintln!(
            "accel-fuzz: no such target; targets: {}",
            accel_fuzz::TARGETS.map(|t| t.0).join(", ")
        );
        return ExitCode::from(2);
    }
    let mut failed = false;
    for (name, f) in chosen {
        let seeds = accel_fuzz::seeds(name);
        let mut rng = Rng(args.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut last = seeds.first().cloned().unwrap_or_default();
        let t0 = Instant::now();
        let mut crashes = 0u64;
        for n in 0..args.runs {
            let data = if n < seeds.len() as u64 {
                seeds[n as usize].clone()
            } else {
                input(&mut rng, &seeds, &last, args.max_len)
            };
            let before = PANICS.load(Ordering::Relaxed);
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| f(&data)));
            if r.is_err() || PANICS.load(Ordering::Relaxed) != before {
                crashes += 1;
                let _ = std::fs::create_dir_all(&args.crash_dir);
                let p = args.crash_dir.join(format!("{name}-{n}"));
                let _ = std::fs::write(&p, &data);
                eprintln!(
                    "{name}: crash at execution {n}, input saved to {}",
                    p.display()
                );
            }
            last = data;
        }
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "{name}: {} executions, {crashes} crashes, {secs:.1} s ({:.0}/s)",
            args.runs,
            args.runs as f64 / secs.max(1e-9)
        );
        let _ = std::io::stdout().flush();
        failed |= crashes > 0;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
