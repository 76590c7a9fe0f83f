//! The plain fuzz runner: each target for N executions on random and mutated inputs from its
//! seeds, on any toolchain. Prints executions and crashes per target; exit 1 on a crash, with
//! the input saved under `--crash-dir`.
//!
//! ```sh
//! cargo run --release -p accel-fuzz -- --runs 10000000            # every target
//! cargo run --release -p accel-fuzz -- --runs 100000 nbd_reply     # one
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

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

fn main() -> ExitCode {
    let args = Args::parse();
    accel_fuzz::count_panics();
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
        let r = accel_fuzz::run_target(
            name,
            *f,
            args.runs,
            args.seed,
            args.max_len,
            Some(&args.crash_dir),
        );
        println!(
            "{name}: {} executions, {} crashes, {:.1} s ({:.0}/s)",
            r.executions,
            r.crashes,
            r.secs,
            r.executions as f64 / r.secs.max(1e-9)
        );
        let _ = std::io::stdout().flush();
        failed |= r.crashes > 0;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
