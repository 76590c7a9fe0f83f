//! `accel-integration migration-bench`: live migrations of one guest under verifying writers,
//! between two acceld instances (shared image, direct engine) and, for reference, between two
//! qemu-storage-daemon exports of the same image (QEMU's own vhost-user-blk backend). Prints
//! QEMU's total time and downtime per migration, the time from `completed` to the destination
//! running, and acceld's own ring stop at the switchover (drain, fdatasync, image release).

use std::path::Path;
use std::time::Duration;

use accel_tests::harness::{Qsd, QsdOptions};
use anyhow::{bail, Result};

use crate::guest_value;
use crate::migration::{migrate, Instance, Migrated};
use crate::supervised::{writer_script, AcceldRun};

#[derive(clap::Args, Debug)]
pub struct MigBenchOpts {
    /// Migrations per backend (alternating directions).
    #[arg(long, default_value_t = 6)]
    pub rounds: u32,
    /// Writers in the guest (each owns 256 KiB).
    #[arg(long, default_value_t = 16)]
    pub writers: u32,
    /// Where to put images, sockets and logs (default: a new temp dir).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
}

struct Row {
    backend: &'static str,
    runs: Vec<Migrated>,
    /// acceld only: the switchover ring stop per migration (us).
    stop_us: Vec<u64>,
    verdict: String,
}

fn p50_max(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (0.0, 0.0);
    }
    (v[v.len() / 2], v[v.len() - 1])
}

const MIB256: &str = "256M";

fn qsd_args(sock: &Path) -> Vec<String> {
    [
        "-object",
        &format!("memory-backend-memfd,id=mem,size={MIB256},share=on"),
        "-machine",
        "memory-backend=mem",
        "-m",
        MIB256,
        "-chardev",
        &format!(
            "socket,id=d0-sock,path={},reconnect-ms=1000",
            sock.display()
        ),
        "-device",
        "vhost-user-blk-pci,id=d0,chardev=d0-sock,num-queues=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn finish(i: &mut Instance) -> Result<String> {
    i.guest.wait_for("progress=", Duration::from_secs(60))?;
    i.guest.send_line("STOP")?;
    let out = i.guest.wait_exit(Duration::from_secs(180))?;
    let pass = out.iter().any(|l| l.contains("RESULT: PASS"));
    Ok(format!(
        "{}: {} iterations, errors={}",
        if pass { "PASS" } else { "FAIL" },
        guest_value(&out, "iterations").unwrap_or_default(),
        guest_value(&out, "errors").unwrap_or_default()
    ))
}

fn bench_acceld(dir: &Path, o: &MigBenchOpts) -> Result<Row> {
    let img = dir.join("acceld.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let drive = format!("id=d0,image={},queues=2", img.display());
    let cfg = "quiet-period-ms = 300\npoll-interval-ms = 200\n";
    let accs = [
        AcceldRun::start(&dir.join("run-a"), cfg)?,
        AcceldRun::start(&dir.join("run-b"), cfg)?,
    ];
    let reg = |acc: &AcceldRun, n: u32, incoming: bool| -> Result<()> {
        let q = dir.join(format!("a-qmp{n}.sock"));
        let flags: &[&str] = if incoming {
            &["--cont", "--incoming"]
        } else {
            &["--cont"]
        };
        acc.register("vm1", &q, &drive, flags)
    };
    let script = writer_script("/dev/vda", o.writers, 64);
    reg(&accs[0], 0, false)?;
    let mut cur =
        Instance::boot_registered(&accs[0], "vm1", &dir.join("a-side0.sock"), &[], &script)?;
    cur.guest.wait_for("READY", Duration::from_secs(180))?;
    accs[0].wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    let (mut runs, mut stop_us) = (Vec::new(), Vec::new());
    let mut at = 0;
    for n in 1..=o.rounds {
        let to = 1 - at;
        reg(&accs[to], n, true)?;
        let mig = dir.join(format!("a-mig{n}.sock"));
        let dst = Instance::boot_registered(
            &accs[to],
            "vm1",
            &dir.join(format!("a-side{n}.sock")),
            &["-incoming".into(), format!("unix:{}", mig.display())],
            &script,
        )?;
        accs[to].wait_attached("vm1", Duration::from_secs(10))?;
        cur.guest.wait_for("progress=", Duration::from_secs(60))?;
        runs.push(migrate(&cur, &dst, &format!("unix:{}", mig.display()))?);
        stop_us.push(
            accs[at].drive("vm1", "d0")?["migration"]["switchover_stop_us"]
                .as_u64()
                .unwrap_or(0),
        );
        let _ = cur.side.cmd("quit", serde_json::Value::Null);
        cur.guest.wait_exit(Duration::from_secs(30))?;
        while accs[at].drive("vm1", "d0").is_ok() {
            std::thread::sleep(Duration::from_millis(20));
        }
        cur = dst;
        at = to;
    }
    Ok(Row {
        backend: "acceld (direct)",
        runs,
        stop_us,
        verdict: finish(&mut cur)?,
    })
}

fn bench_qsd(dir: &Path, o: &MigBenchOpts) -> Result<Row> {
    let img = dir.join("qsd.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let socks = [dir.join("qsd-a.sock"), dir.join("qsd-b.sock")];
    let qo = QsdOptions {
        queues: 2,
        ..Default::default()
    };
    let mut qsds = [
        Qsd::start(&img, &socks[0], &qo)?,
        Qsd::start(&img, &socks[1], &qo)?,
    ];
    let script = writer_script("/dev/vda", o.writers, 64);
    let mut cur = Instance::boot(
        &qsd_args(&socks[0]),
        &dir.join("q-side0.sock"),
        &[],
        &script,
    )?;
    cur.guest.wait_for("READY", Duration::from_secs(180))?;
    let mut runs = Vec::new();
    let mut at = 0;
    for n in 1..=o.rounds {
        let to = 1 - at;
        let mig = dir.join(format!("q-mig{n}.sock"));
        let dst = Instance::boot(
            &qsd_args(&socks[to]),
            &dir.join(format!("q-side{n}.sock")),
            &["-incoming".into(), format!("unix:{}", mig.display())],
            &script,
        )?;
        cur.guest.wait_for("progress=", Duration::from_secs(60))?;
        runs.push(migrate(&cur, &dst, &format!("unix:{}", mig.display()))?);
        let _ = cur.side.cmd("quit", serde_json::Value::Null);
        cur.guest.wait_exit(Duration::from_secs(30))?;
        // QSD serves one frontend per socket and its state after one: a fresh export for
        // the next migration back to this side.
        qsds[at] = Qsd::start(&img, &socks[at], &qo)?;
        cur = dst;
        at = to;
    }
    Ok(Row {
        backend: "qemu-storage-daemon",
        runs,
        stop_us: Vec::new(),
        verdict: finish(&mut cur)?,
    })
}

pub fn migration_bench(o: &MigBenchOpts) -> Result<()> {
    let tmp;
    let dir = match &o.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("accel-migbench")
                .tempdir_in("/var/tmp")?;
            tmp.path().to_path_buf()
        }
    };
    println!(
        "live migration, 256 MiB TCG guest, {} verifying writers, {} migrations per backend, shared raw image, unix socket",
        o.writers, o.rounds
    );
    let rows = [bench_acceld(&dir, o)?, bench_qsd(&dir, o)?];
    println!(
        "{:<22} {:>16} {:>16} {:>22} {:>18}  guest",
        "backend",
        "total ms p50/max",
        "downtime p50/max",
        "completed->running ms",
        "ring stop us p50"
    );
    for r in &rows {
        let (t50, tmax) = p50_max(r.runs.iter().map(|m| m.total_ms as f64).collect());
        let (d50, dmax) = p50_max(r.runs.iter().map(|m| m.downtime_ms as f64).collect());
        let (c50, cmax) = p50_max(
            r.runs
                .iter()
                .map(|m| m.to_running.as_secs_f64() * 1e3)
                .collect(),
        );
        let stop = if r.stop_us.is_empty() {
            "-".to_string()
        } else {
            format!(
                "{:.0}",
                p50_max(r.stop_us.iter().map(|&u| u as f64).collect()).0
            )
        };
        println!(
            "{:<22} {:>16} {:>16} {:>22} {:>18}  {}",
            r.backend,
            format!("{t50:.0}/{tmax:.0}"),
            format!("{d50:.0}/{dmax:.0}"),
            format!("{c50:.1}/{cmax:.1}"),
            stop,
            r.verdict
        );
        println!(
            "  per migration: total {:?} ms, downtime {:?} ms",
            r.runs.iter().map(|m| m.total_ms).collect::<Vec<_>>(),
            r.runs.iter().map(|m| m.downtime_ms).collect::<Vec<_>>()
        );
    }
    if rows.iter().any(|r| !r.verdict.starts_with("PASS")) {
        bail!("a guest saw wrong data");
    }
    Ok(())
}
