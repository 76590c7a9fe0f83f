//! `accel-integration switch-bench`: live switches of one drive between the direct and the
//! qemu engine under a guest's verifying writers (`accelctl handback`, then `accelctl
//! accelerate`, N rounds), and the pause of each direction as acceld records it (from the
//! first pause request to the resume: p50, p99, max). Build in release first for the numbers
//! that count: `cargo build --release -p acceld -p accelctl -p accel-integration`.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::guest_value;
use crate::migration::Instance;
use crate::supervised::{writer_script, AcceldRun};

#[derive(clap::Args, Debug)]
pub struct SwitchBenchOpts {
    /// Round trips (one switch to the qemu engine and one back each).
    #[arg(long, default_value_t = 50)]
    pub rounds: u32,
    /// Writers in the guest (each owns 256 KiB).
    #[arg(long, default_value_t = 16)]
    pub writers: u32,
    /// Where to put the image, sockets and logs (default: a new temp dir).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Register the drive with `lend=on`: on the qemu engine its rings are lent to QEMU's
    /// vhost-user-blk export; each round waits for the lend, and the lend and take-back
    /// pauses are reported too.
    #[arg(long)]
    pub lend: bool,
    /// Register the drive with `nbd=on`: the qemu engine serves over NBD instead of relaying
    /// through QEMU's vhost-user-blk export (the default).
    #[arg(long, conflicts_with = "lend")]
    pub nbd: bool,
}

pub fn switch_bench(o: &SwitchBenchOpts) -> Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("accel-switchbench")
        .tempdir_in("/var/tmp")?;
    let dir = o.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir)?;
    let img = dir.join("d0.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    // A long quiet period: the policy never switches on its own during the rounds.
    let acc = AcceldRun::start(
        &dir.join("run"),
        "quiet-period-ms = 600000\npoll-interval-ms = 200\n",
    )?;
    let qmp = dir.join("qmp.sock");
    acc.register(
        "vm1",
        &qmp,
        &format!(
            "id=d0,image={},queues=2{}",
            img.display(),
            if o.lend {
                ",lend=on"
            } else if o.nbd {
                ",nbd=on"
            } else {
                ""
            }
        ),
        &["--cont"],
    )?;
    let mut vm = Instance::boot_registered(
        &acc,
        "vm1",
        &dir.join("side.sock"),
        &[],
        &writer_script("/dev/vda", o.writers, 64),
    )?;
    vm.guest.wait_for("READY", Duration::from_secs(180))?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(30))?;
    vm.guest.wait_for("progress=", Duration::from_secs(60))?;
    let t0 = Instant::now();
    // The I/O path each switch to the qemu engine landed on.
    let mut paths = std::collections::BTreeMap::<String, u32>::new();
    for _ in 0..o.rounds {
        acc.ctl_ok(&["handback", "vm1", "d0"])?;
        acc.wait_engine("vm1", "d0", "qemu", Duration::from_secs(30))?;
        let p = acc.drive("vm1", "d0")?["io_path"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        *paths.entry(p).or_default() += 1;
        if o.lend {
            let t = Instant::now();
            while acc.drive("vm1", "d0")?["lend"]["lent"] != true {
                if t.elapsed() > Duration::from_secs(30) {
                    bail!("the rings were not lent within 30 s:\n{}", acc.log_text());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        acc.ctl_ok(&["accelerate", "vm1", "d0"])?;
        acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(30))?;
    }
    let took = t0.elapsed();
    let d = acc.drive("vm1", "d0")?;
    vm.guest.send_line("STOP")?;
    let out = vm.guest.wait_exit(Duration::from_secs(180))?;
    let pass = out.iter().any(|l| l.contains("RESULT: PASS"));
    let errors = guest_value(&out, "errors").unwrap_or_default();
    let row = |name: &str, section: &str, key: &str| {
        let p = &d[section][key];
        println!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} |",
            p["count"],
            p["p50_us"].as_u64().unwrap_or(0) as f64 / 1000.0,
            p["p99_us"].as_u64().unwrap_or(0) as f64 / 1000.0,
            p["max_us"].as_u64().unwrap_or(0) as f64 / 1000.0
        );
    };
    println!(
        "switch-bench: {} round trips in {:.1} s under {} verifying writers (TCG guest, 2 queues, raw image{})",
        o.rounds,
        took.as_secs_f64(),
        o.writers,
        if o.lend {
            ", lend=on"
        } else if o.nbd {
            ", nbd=on"
        } else {
            ""
        }
    );
    let paths: Vec<String> = paths.iter().map(|(p, n)| format!("{p} x{n}")).collect();
    println!(
        "qemu engine's I/O path after each switch: {}",
        paths.join(", ")
    );
    println!("| direction | switches | pause p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    row("direct -> qemu", "switch", "to_qemu");
    row("qemu -> direct", "switch", "to_direct");
    if o.lend {
        row("lend (qemu engine -> QEMU's export)", "lend", "pauses");
        row(
            "take back (QEMU's export -> qemu engine)",
            "lend",
            "take_back_pauses",
        );
    }
    println!(
        "guest: {}, errors={errors}",
        if pass { "RESULT: PASS" } else { "RESULT: FAIL" }
    );
    if !pass || errors != "0" {
        bail!("the guest failed:\n{}", out.join("\n"));
    }
    Ok(())
}
