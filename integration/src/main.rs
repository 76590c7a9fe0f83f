//! accel-integration: the demo (and, later, scenario runners).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use accel_integration::{
    guest_value, host_md5, report_and_verify_script, Acceld, Guest, GuestDisk, GuestSpec,
};
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "accel's real-QEMU demo")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a tiny guest (TCG) whose disk acceld serves; the guest writes and verifies data.
    Demo {
        /// Where to put the image, sockets and logs (default: a new temp dir).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// MiB the guest writes and verifies.
        #[arg(long, default_value_t = 16)]
        mib: u32,
    },
    /// Capture QEMU 10's QMP outputs (block nodes, graph, status…) of a lab VM into DIR.
    Capture {
        #[arg(long)]
        out: PathBuf,
    },
    /// Benchmark: fio bare metal vs qemu-storage-daemon vs acceld on one file (release build).
    Compare(accel_integration::compare::CompareOpts),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Demo { dir, mib } => demo(dir, mib),
        Cmd::Capture { out } => accel_integration::capture::capture(&out),
        Cmd::Compare(o) => accel_integration::compare::compare(&o),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn demo(dir: Option<PathBuf>, mib: u32) -> Result<()> {
    let tmp;
    let dir = match dir {
        Some(d) => {
            std::fs::create_dir_all(&d)?;
            d
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("accel-demo")
                .tempdir_in("/var/tmp")?;
            tmp.path().to_path_buf()
        }
    };
    let image = dir.join("disk.raw");
    let size: u64 = 256 << 20;
    std::fs::File::create(&image)?.set_len(size)?;
    println!("[1/4] raw image {} ({} MiB)", image.display(), size >> 20);
    let sock = dir.join("vdisk0.sock");
    let log = dir.join("acceld.log");
    let mut d = Acceld::serve(
        &sock,
        &[
            "--image",
            image.to_str().context("path")?,
            "--queues",
            "2",
            "--serial",
            "accel-demo-disk",
        ],
        &log,
    )?;
    println!(
        "[2/4] acceld serves it on {} (2 queues, io_uring, O_DIRECT)",
        sock.display()
    );
    println!("      QEMU: -chardev socket,id=vub0,path={},reconnect-ms=1000 -device vhost-user-blk-pci,chardev=vub0,num-queues=2", sock.display());
    let t0 = Instant::now();
    let mut g = Guest::boot(&GuestSpec {
        disks: &[GuestDisk {
            socket: sock.clone(),
            queues: 2,
        }],
        script: &report_and_verify_script(mib),
        mem_mb: 256,
        timeout: Duration::from_secs(300),
    })?;
    let out = g.wait_exit(Duration::from_secs(300))?;
    println!(
        "[3/4] guest (QEMU 10, TCG) ran in {:.1} s and saw:",
        t0.elapsed().as_secs_f64()
    );
    for k in [
        "size",
        "serial",
        "queues",
        "logical_block",
        "discard_max",
        "verify",
    ] {
        println!("      {k:>14} = {}", guest_value(&out, k)?);
    }
    let guest_md5 = guest_value(&out, "md5")?;
    let host = host_md5(&image, u64::from(mib) << 20)?;
    println!(
        "[4/4] host reads the image: md5 of the first {mib} MiB {host} ({} the guest's)",
        if host == guest_md5 {
            "equal to"
        } else {
            "DIFFERENT from"
        }
    );
    let st = d.terminate()?;
    let ok = guest_value(&out, "verify")? == "ok" && host == guest_md5 && st.success();
    println!("acceld stopped with SIGTERM after draining: {st}");
    if !ok {
        bail!(
            "the guest or the host saw wrong data; acceld log: {}",
            log.display()
        );
    }
    println!("RESULT: PASS — the guest's disk was served by acceld, its data verified in the guest and on the host");
    Ok(())
}
