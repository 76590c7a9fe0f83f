//! accel-bench: a host-side vhost-user-blk load generator. It plays QEMU and the guest driver
//! (shared memfd memory, Q queues, D requests in flight per queue) against any vhost-user-blk
//! socket — acceld or qemu-storage-daemon — and reports IOPS, bandwidth, latency percentiles
//! and, with `--server-pid`, the server's CPU time from /proc.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use accel_tests::load::{run_load, LoadReport, LoadSpec};
use accel_tests::{BlkFrontend, FrontendOptions};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Randread,
    Randwrite,
    Read,
    Write,
    Randrw,
}

#[derive(Parser, Debug)]
#[command(about = "vhost-user-blk load generator (host-side frontend)")]
struct Args {
    /// vhost-user-blk socket of the server.
    #[arg(long)]
    socket: PathBuf,
    #[arg(long, value_enum, default_value_t = Workload::Randread)]
    workload: Workload,
    /// Percentage of reads for randrw.
    #[arg(long, default_value_t = 70, value_parser = clap::value_parser!(u32).range(0..=100))]
    rwmix_read: u32,
    /// Block size in bytes: 512 to 1 MiB, a multiple of 512 (suffixes k and m accepted).
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    bs: u64,
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// Seconds to run (ignored with --requests).
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Run exactly this many requests instead of a duration.
    #[arg(long)]
    requests: Option<u64>,
    /// Region of the disk used: offset and size (default: the whole disk).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    offset: u64,
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Write a per-block pattern (offset ^ seed) over the region first, then check every read;
    /// any mismatch fails with its offset.
    #[arg(long)]
    verify: bool,
    /// Account these processes' CPU time (the serving side's, summed) from /proc; a
    /// comma-separated list, e.g. acceld's and QEMU's pids for the qemu engine.
    #[arg(long, value_delimiter = ',')]
    server_pid: Vec<u32>,
    /// Spin on the used rings instead of sleeping (as a busy guest vCPU would).
    #[arg(long)]
    poll: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mul) = match s.chars().last() {
        Some('k') => (&s[..s.len() - 1], 1024),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (&s[..], 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("'{s}' is not a size"))
}

/// utime + stime of a process (all threads), in seconds.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat (is --server-pid right?)"))?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').context("bad /proc stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11).context("bad /proc stat")?.parse()?;
    let stime: f64 = f.get(12).context("bad /proc stat")?.parse()?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((utime + stime) / hz)
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("accel-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: &Args) -> Result<()> {
    if a.bs < 512 || a.bs > 1 << 20 || a.bs % 512 != 0 {
        bail!(
            "--bs {} is not a multiple of 512 between 512 and 1 MiB",
            a.bs
        );
    }
    if a.queues == 0 || a.depth == 0 {
        bail!("--queues and --depth must be at least 1");
    }
    if !a.socket.exists() {
        bail!("socket {} does not exist", a.socket.display());
    }
    // Each request uses 3 descriptors; the ring must hold depth of them.
    let queue_size = ((a.depth * 3).next_power_of_two()).clamp(64, 1024) as u16;
    if a.depth * 3 > 1024 {
        bail!(
            "--depth {} is too deep for a 1024-entry ring (at most 341)",
            a.depth
        );
    }
    let mut fe = BlkFrontend::connect(
        &a.socket,
        FrontendOptions {
            queues: a.queues,
            queue_size,
            max_data: a.bs as usize,
            event_idx: true,
            inflight: false,
        },
    )
    .with_context(|| format!("connecting to {}", a.socket.display()))?;
    let disk = fe.negotiated.capacity_sectors() * 512;
    let size = a.size.unwrap_or(disk.saturating_sub(a.offset));
    if a.offset % a.bs != 0 {
        bail!("--offset {} is not a multiple of --bs", a.offset);
    }
    if a.offset + size > disk {
        bail!(
            "region {}+{} is larger than the disk ({} bytes)",
            a.offset,
            size,
            disk
        );
    }
    let blocks = size / a.bs;
    if blocks < (a.queues * (a.depth + 1)) as u64 {
        bail!(
            "region of {blocks} blocks is too small for {} queues × depth {}",
            a.queues,
            a.depth
        );
    }
    let base = LoadSpec {
        block_size: a.bs as u32,
        blocks,
        depth: a.depth,
        write_pct: 0,
        requests: None,
        duration: None,
        verify: a.verify,
        initial_seed: 0x5eed,
        rng_seed: 1,
        sequential: false,
        region_offset: a.offset,
        single_pass: false,
        initial_model: None,
        poll: a.poll,
        stop: None,
    };
    let mut base = base;
    if a.verify {
        // Lay a known pattern down through the device: one sequential pass over the region;
        // the measured run starts from what that pass wrote.
        let r = run_load(
            &mut fe,
            &LoadSpec {
                write_pct: 100,
                sequential: true,
                single_pass: true,
                // Writes carry the pattern only when verifying.
                verify: true,
                rng_seed: 0x5eed,
                ..base.clone()
            },
        )?;
        if r.errors > 0 {
            bail!("preparing the region failed: {:?}", r.mismatches);
        }
        base.initial_model = Some(std::sync::Arc::new(r.final_model));
    }
    let (write_pct, sequential) = match a.workload {
        Workload::Randread => (0, false),
        Workload::Randwrite => (100, false),
        Workload::Read => (0, true),
        Workload::Write => (100, true),
        Workload::Randrw => (100 - a.rwmix_read, false),
    };
    let spec = LoadSpec {
        write_pct,
        sequential,
        requests: a.requests,
        duration: if a.requests.is_some() {
            None
        } else {
            Some(Duration::from_secs_f64(a.duration))
        },
        ..base
    };
    let serving_cpu =
        |pids: &[u32]| -> Result<f64> { pids.iter().map(|&p| cpu_seconds(p)).sum::<Result<f64>>() };
    let cpu0 = serving_cpu(&a.server_pid)?;
    let rep = run_load(&mut fe, &spec)?;
    let cpu = if a.server_pid.is_empty() {
        None
    } else {
        Some(serving_cpu(&a.server_pid)? - cpu0)
    };
    print_report(a, &rep, cpu);
    if rep.errors > 0 || rep.mismatch_count > 0 {
        bail!(
            "{} errors, {} mismatches: {}",
            rep.errors,
            rep.mismatch_count,
            rep.mismatches.join("; ")
        );
    }
    Ok(())
}

fn print_report(a: &Args, r: &LoadReport, cpu: Option<f64>) {
    let secs = r.elapsed.as_secs_f64();
    let iops = r.requests() as f64 / secs;
    let mbs = r.bytes as f64 / secs / 1e6;
    let us = |q: f64| r.latency.quantile(q).as_nanos() as f64 / 1000.0;
    let per_cpu = cpu.filter(|c| *c > 0.0).map(|c| r.requests() as f64 / c);
    if a.json {
        println!(
            "{{\"workload\":\"{:?}\",\"bs\":{},\"queues\":{},\"depth\":{},\"requests\":{},\"reads\":{},\"writes\":{},\"seconds\":{:.3},\"iops\":{:.0},\"mb_s\":{:.1},\"p50_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"server_cpu_s\":{},\"iops_per_cpu_s\":{},\"errors\":{},\"mismatches\":{},\"verified\":{}}}",
            a.workload,
            a.bs,
            a.queues,
            a.depth,
            r.requests(),
            r.reads,
            r.writes,
            secs,
            iops,
            mbs,
            us(0.5),
            us(0.99),
            us(0.999),
            cpu.map(|c| format!("{c:.3}")).unwrap_or("null".into()),
            per_cpu.map(|c| format!("{c:.0}")).unwrap_or("null".into()),
            r.errors,
            r.mismatch_count,
            a.verify
        );
    } else {
        println!(
            "{:?} bs={} queues={} depth={}: {} requests in {:.2} s",
            a.workload,
            a.bs,
            a.queues,
            a.depth,
            r.requests(),
            secs
        );
        println!("  IOPS {iops:.0}  {mbs:.1} MB/s");
        println!(
            "  latency p50 {:.1} us  p99 {:.1} us  p99.9 {:.1} us",
            us(0.5),
            us(0.99),
            us(0.999)
        );
        if let Some(c) = cpu {
            println!(
                "  server CPU {c:.3} s  ({} IOPS per server CPU-second)",
                per_cpu.map(|p| format!("{p:.0}")).unwrap_or("-".into())
            );
        }
        println!(
            "  errors {}  mismatches {}{}",
            r.errors,
            r.mismatch_count,
            if a.verify {
                "  (every read verified)"
            } else {
                ""
            }
        );
    }
}
