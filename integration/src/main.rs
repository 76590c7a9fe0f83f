//! accel-integration: the demo (and, later, scenario runners).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use accel_integration::supervised::{boot_registered, writer_script, AcceldRun, SideQmp};
use accel_integration::{guest_value, host_md5};
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
    /// The product's story: acceld run, a registered VM (TCG) writing and verifying, the disk
    /// direct, throttled on QEMU's block layer, direct again, and live-migrated to a second
    /// acceld.
    Demo {
        /// Where to put the image, sockets and logs (default: a new temp dir).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Writers in the guest (each owns 256 KiB of the disk).
        #[arg(long, default_value_t = 16)]
        writers: u32,
    },
    /// Capture QEMU 10's QMP outputs (block nodes, graph, status…) of a lab VM into DIR.
    Capture {
        #[arg(long)]
        out: PathBuf,
    },
    /// Benchmark: fio bare metal vs qemu-storage-daemon vs acceld on one file (release build).
    Compare(accel_integration::compare::CompareOpts),
    /// Benchmark: live migrations between two acceld vs two qemu-storage-daemon exports.
    MigrationBench(accel_integration::migration_bench::MigBenchOpts),
    /// Benchmark: engine switch pauses (direct <-> qemu) under a verifying guest.
    SwitchBench(accel_integration::switch_bench::SwitchBenchOpts),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Demo { dir, writers } => demo(dir, writers),
        Cmd::Capture { out } => accel_integration::capture::capture(&out),
        Cmd::Compare(o) => accel_integration::compare::compare(&o),
        Cmd::MigrationBench(o) => accel_integration::migration_bench::migration_bench(&o),
        Cmd::SwitchBench(o) => accel_integration::switch_bench::switch_bench(&o),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn demo(dir: Option<PathBuf>, writers: u32) -> Result<()> {
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
    let image = dir.join("disk0.raw");
    let size: u64 = 256 << 20;
    std::fs::File::create(&image)?.set_len(size)?;
    let run = dir.join("run");
    println!(
        "[1/9] raw image {} ({} MiB); acceld run --run-dir {}",
        image.display(),
        size >> 20,
        run.display()
    );
    let mut acc = AcceldRun::start(&run, "quiet-period-ms = 1000\npoll-interval-ms = 250\n")?;
    let qmp = dir.join("qmp.sock");
    let side = dir.join("side-qmp.sock");
    let drive = format!(
        "id=disk0,image={},queues=2,serial=accel-demo-disk",
        image.display()
    );
    acc.ctl_ok(&[
        "register",
        "--vm",
        "demo",
        "--qmp",
        qmp.to_str().context("path")?,
        "--drive",
        &drive,
        "--cont",
    ])?;
    println!(
        "[2/9] accelctl register --vm demo --qmp {} --drive {drive} --cont",
        qmp.display()
    );
    println!("      accelctl qemu-args --vm demo (the VM contract QEMU runs with):");
    for a in acc
        .ctl_ok(&["qemu-args", "--vm", "demo", "--memory", "256M", "--shell"])?
        .split(" -")
    {
        println!("        -{}", a.trim_start_matches('-').trim());
    }
    let t0 = Instant::now();
    let mut g = boot_registered(
        &acc,
        "demo",
        "256M",
        &side,
        &writer_script("/dev/vda", writers, 64),
    )?;
    g.wait_for("READY", Duration::from_secs(180))?;
    println!(
        "[3/9] guest (QEMU 10, TCG) up in {:.1} s: {writers} writers write random 4 KiB blocks and verify them",
        t0.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(2));
    print!("{}", indent(&acc.ctl_ok(&["status"])?));
    let t = SideQmp::connect(&side)?;

    let t1 = Instant::now();
    acc.ctl_ok(&["throttle", "demo", "disk0", "--iops-total", "60"])?;
    acc.wait_engine("demo", "disk0", "qemu", Duration::from_secs(10))?;
    println!(
        "[4/9] accelctl throttle demo disk0 --iops-total 60: on QEMU's block layer in {} ms",
        t1.elapsed().as_millis()
    );
    std::thread::sleep(Duration::from_secs(3));
    print!("{}", indent(&acc.ctl_ok(&["status"])?));
    print!("{}", indent(&acc.ctl_ok(&["explain", "demo", "disk0"])?));
    let filters = t.throttle_filters()?;
    let limits = t.cmd(
        "qom-get",
        serde_json::json!({"path": "accel-tg-disk0", "property": "limits"}),
    )?;
    println!(
        "      QEMU's graph: throttle filter {:?}, group accel-tg-disk0 iops-total = {}",
        filters, limits["iops-total"]
    );

    let t2 = Instant::now();
    acc.ctl_ok(&["throttle", "demo", "disk0", "--clear"])?;
    acc.wait_engine("demo", "disk0", "direct", Duration::from_secs(20))?;
    println!(
        "[5/9] accelctl throttle demo disk0 --clear: direct again after the quiet period, in {} ms",
        t2.elapsed().as_millis()
    );
    std::thread::sleep(Duration::from_secs(2));
    print!("{}", indent(&acc.ctl_ok(&["status"])?));
    let filters = t.throttle_filters()?;
    println!("      QEMU's graph: throttle filters {filters:?}; drive node removed while direct");

    // Management through the VM's QMP proxy, as it would talk to QEMU: an external snapshot
    // of the accelerated drive, then an active commit back into the raw image.
    let proxy = acc.run_dir.join("demo").join("monitor.sock");
    let m = SideQmp::connect(&proxy)?;
    let t4 = Instant::now();
    let overlay = dir.join("disk0-overlay.qcow2");
    m.cmd(
        "blockdev-snapshot-sync",
        serde_json::json!({"node-name": "disk0", "snapshot-file": overlay,
                           "snapshot-node-name": "ov", "format": "qcow2"}),
    )?;
    let took = t4.elapsed();
    let blk = m.cmd("query-block", serde_json::Value::Null)?;
    let ins = blk
        .as_array()
        .and_then(|l| {
            l.iter()
                .find(|b| b["qdev"] == "/machine/peripheral/disk0/virtio-backend")
        })
        .map(|b| b["inserted"].clone())
        .unwrap_or_default();
    let d = acc.drive("demo", "disk0")?;
    println!(
        "[6/9] QMP proxy {}: blockdev-snapshot-sync in {} ms; query-block shows node {} ({}, backing depth {}); acceld: engine {}, data on {}",
        proxy.display(),
        took.as_millis(),
        ins["node-name"],
        ins["drv"],
        ins["backing_file_depth"],
        d["engine"],
        d["data_node"]
    );
    let t5 = Instant::now();
    m.cmd(
        "block-commit",
        serde_json::json!({"job-id": "commit0", "device": "ov"}),
    )?;
    loop {
        let jobs = m.cmd("query-jobs", serde_json::Value::Null)?;
        let j = jobs
            .as_array()
            .and_then(|l| l.iter().find(|j| j["id"] == "commit0"))
            .cloned();
        match j {
            None => break,
            Some(j) if j["status"] == "ready" => {
                m.cmd("job-complete", serde_json::json!({"id": "commit0"}))?;
            }
            Some(j) if j["status"] == "concluded" => {
                m.cmd("job-dismiss", serde_json::json!({"id": "commit0"}))?;
            }
            Some(_) => {}
        }
        if t5.elapsed() > Duration::from_secs(60) {
            bail!("the commit did not end within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    acc.wait_engine("demo", "disk0", "direct", Duration::from_secs(20))?;
    println!(
        "      block-commit + job-complete through the proxy: back on the raw image and direct again in {} ms",
        t5.elapsed().as_millis()
    );
    drop(m);

    // Live migration to a second acceld (another host sharing the storage, here another run
    // dir): accelctl registers the VM there, the destination QEMU waits with -incoming.
    let run_b = dir.join("run-b");
    let mut acc_b = AcceldRun::start(&run_b, "quiet-period-ms = 1000\npoll-interval-ms = 250\n")?;
    let t3 = Instant::now();
    let (text, mut g2) = accel_integration::migration::accelctl_migrate(
        &acc,
        &acc_b,
        "demo",
        &dir,
        &writer_script("/dev/vda", writers, 64),
        &[],
    )?;
    let uri = format!("unix:{}", dir.join("mig.sock").display());
    println!(
        "[7/9] accelctl migrate demo --to {} --dest-qmp … --uri {uri}: in {:.1} s",
        run_b.display(),
        t3.elapsed().as_secs_f64()
    );
    print!("{}", indent(text.trim_end()));
    println!();
    acc_b.wait_engine("demo", "disk0", "direct", Duration::from_secs(10))?;
    let _ = g.wait_exit(Duration::from_secs(30))?;
    print!("{}", indent(&acc_b.ctl_ok(&["status"])?));
    let g = &mut g2.guest;
    g.wait_for("progress=", Duration::from_secs(60))?;
    g.send_line("STOP")?;
    let out = g.wait_exit(Duration::from_secs(300))?;
    let iters = guest_value(&out, "iterations")?;
    let errors = guest_value(&out, "errors")?;
    let kerr = guest_value(&out, "kernel_errors")?;
    let md5 = guest_value(&out, "md5")?;
    println!("[8/9] guest verdict (on the destination): {iters} write+read-back iterations, errors={errors}, kernel I/O errors={kerr}");
    let host = host_md5(&image, u64::from(writers) * 64 * 4096)?;
    println!(
        "      host md5 of the written region {host} ({} the guest's)",
        if host == md5 {
            "equal to"
        } else {
            "DIFFERENT from"
        }
    );
    let st = acc.terminate()?;
    let st_b = acc_b.terminate()?;
    println!("[9/9] the VM exited; both accelds stopped with SIGTERM: {st}, {st_b}");
    let pass = out.iter().any(|l| l.contains("RESULT: PASS"))
        && host == md5
        && st.success()
        && st_b.success();
    if !pass {
        bail!(
            "the guest or the host saw wrong data; acceld log: {}",
            acc.log.display()
        );
    }
    println!("RESULT: PASS — one guest disk, served directly, handed to QEMU's throttle and taken back, snapshotted and committed through the QMP proxy, live-migrated to another acceld, under a guest that verified every block");
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("      {l}\n")).collect()
}
