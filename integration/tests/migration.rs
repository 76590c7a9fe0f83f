//! Live migration with real QEMU 10 (TCG): two `acceld run` instances with their own run dirs
//! (two hosts sharing storage), a guest doing verified writes from 32 writers through round
//! trips of plain QMP `migrate`, the drive on the direct engine throughout.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel_integration::supervised::{writer_script, AcceldRun, SideQmp};
use accel_integration::{guest_value, host_md5, Guest};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

const CONFIG: &str = "quiet-period-ms = 300\npoll-interval-ms = 200\n";
const WORKERS: u32 = 32;
const BLOCKS: u32 = 64;

fn workdir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("accel-{tag}"))
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// One side: an acceld and the QEMU it serves now (if any).
struct Side {
    name: &'static str,
    acc: AcceldRun,
}

/// A running QEMU of the VM: the guest process, its side monitor.
struct Instance {
    guest: Guest,
    side: SideQmp,
    side_path: PathBuf,
}

fn register(acc: &AcceldRun, qmp: &Path, drive: &str, incoming: bool) -> Result<()> {
    let mut args = vec![
        "register",
        "--vm",
        "vm1",
        "--qmp",
        qmp.to_str().unwrap(),
        "--drive",
        drive,
        "--cont",
    ];
    if incoming {
        args.push("--incoming");
    }
    acc.ctl_ok(&args)?;
    Ok(())
}

fn boot(acc: &AcceldRun, side: &Path, extra: &[String], script: &str) -> Result<Instance> {
    let contract: Vec<String> = acc
        .ctl_ok(&["qemu-args", "--vm", "vm1", "--memory", "256M"])?
        .lines()
        .map(String::from)
        .collect();
    let mut x = vec![
        "-qmp".to_string(),
        format!("unix:{},server=on,wait=off", side.display()),
    ];
    x.extend_from_slice(extra);
    let guest = Guest::boot_contract(&contract, &x, script)?;
    let side_qmp = SideQmp::connect(side)?;
    Ok(Instance {
        guest,
        side: side_qmp,
        side_path: side.to_path_buf(),
    })
}

fn status_of(i: &Instance) -> Result<String> {
    Ok(i.side.cmd("query-status", Value::Null)?["status"]
        .as_str()
        .unwrap_or("")
        .to_string())
}

fn wait_status(i: &Instance, want: &str, timeout: Duration) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        let s = status_of(i)?;
        if s == want {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > timeout {
            bail!("QEMU is {s}, not {want}, after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` has the image open with a lock on it (QEMU-style OFD locks show in
/// the fd's fdinfo).
fn holds_lock(pid: u32, image: &Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|t| t == image)
            && std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .is_ok_and(|i| i.contains("lock:"))
    })
}

fn has_open(pid: u32, image: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == image))
        })
        .unwrap_or(false)
}

struct Migrated {
    total_ms: u64,
    downtime_ms: u64,
    /// From the source's `completed` to the destination running.
    to_running: Duration,
}

/// Migrates with a plain QMP `migrate` on the source's monitor, as any management tool would.
fn migrate(src: &Instance, dst: &Instance, uri: &str) -> Result<Migrated> {
    src.side.cmd(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "events", "state": true}]}),
    )?;
    src.side.cmd("migrate", json!({ "uri": uri }))?;
    let t0 = Instant::now();
    let info = loop {
        let m = src.side.cmd("query-migrate", Value::Null)?;
        match m["status"].as_str().unwrap_or("") {
            "completed" => break m,
            s @ ("failed" | "cancelled") => bail!("migration {s}: {m}"),
            _ => {}
        }
        if t0.elapsed() > Duration::from_secs(90) {
            bail!("migration not completed after 90 s: {m}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let tc = Instant::now();
    wait_status(dst, "running", Duration::from_secs(30))?;
    Ok(Migrated {
        total_ms: info["total-time"].as_u64().unwrap_or(0),
        downtime_ms: info["downtime"].as_u64().unwrap_or(0),
        to_running: tc.elapsed(),
    })
}

/// Three round trips (six migrations) of a guest writing and verifying through each; 0 guest
/// errors, the host's md5 equals the guest's, and only the running side holds the image.
#[test]
fn direct_drive_migrates_round_trips_under_guest_writes() -> Result<()> {
    let dir = workdir("mig");
    let img = dir.path().join("d0.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let drive = format!("id=d0,image={},queues=2", img.display());
    let sides = [
        Side {
            name: "a",
            acc: AcceldRun::start(&dir.path().join("run-a"), CONFIG)?,
        },
        Side {
            name: "b",
            acc: AcceldRun::start(&dir.path().join("run-b"), CONFIG)?,
        },
    ];
    let qmp0 = dir.path().join("qmp-a0.sock");
    register(&sides[0].acc, &qmp0, &drive, false)?;
    let mut cur = boot(
        &sides[0].acc,
        &dir.path().join("side-a0.sock"),
        &[],
        &writer_script("/dev/vda", WORKERS, BLOCKS),
    )?;
    cur.guest
        .wait_for("READY", Duration::from_secs(120))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", sides[0].acc.log_text()))?;
    sides[0]
        .acc
        .wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    let mut at = 0;
    let mut results = Vec::new();
    for n in 1..=6 {
        let to = 1 - at;
        let (src_acc, dst_acc) = (&sides[at].acc, &sides[to].acc);
        let name = sides[to].name;
        // The destination: registered incoming, its QEMU waiting with -incoming.
        let qmp = dir.path().join(format!("qmp-{name}{n}.sock"));
        register(dst_acc, &qmp, &drive, true)?;
        let mig = dir.path().join(format!("mig{n}.sock"));
        let dst = boot(
            dst_acc,
            &dir.path().join(format!("side-{name}{n}.sock")),
            &["-incoming".to_string(), format!("unix:{}", mig.display())],
            &writer_script("/dev/vda", WORKERS, BLOCKS),
        )?;
        dst_acc.wait_attached("vm1", Duration::from_secs(10))?;
        assert_eq!(status_of(&dst)?, "inmigrate");
        let d = dst_acc.drive("vm1", "d0")?;
        assert_eq!(d["engine"], "held", "the destination opens nothing: {d}");
        assert!(
            !has_open(dst_acc.pid(), &img),
            "destination acceld has the image open"
        );
        // Let the guest write a while on this side.
        cur.guest.wait_for("progress=", Duration::from_secs(60))?;
        let r = migrate(&cur, &dst, &format!("unix:{}", mig.display()))
            .map_err(|e| {
                anyhow::anyhow!(
                    "{e}\nsource acceld:\n{}\ndestination acceld:\n{}",
                    src_acc.log_text(),
                    dst_acc.log_text()
                )
            })
            .with_context(|| format!("migration {n}"))?;
        assert_eq!(status_of(&cur)?, "postmigrate");
        dst_acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
        let sd = src_acc.drive("vm1", "d0")?;
        assert_eq!(
            sd["image_released"], true,
            "source released the image: {sd}"
        );
        assert!(
            !has_open(src_acc.pid(), &img),
            "the source acceld still has the image open"
        );
        assert!(
            holds_lock(dst_acc.pid(), &img),
            "destination holds the image locks"
        );
        println!(
            "migration {n} ({}->{name}): total {} ms, downtime {} ms, destination running {:?} after completed",
            sides[at].name, r.total_ms, r.downtime_ms, r.to_running
        );
        results.push(r);
        // The source QEMU goes; its acceld forgets the VM and removes its sockets.
        let _ = cur.side.cmd("quit", Value::Null);
        cur.guest.wait_exit(Duration::from_secs(30))?;
        let t0 = Instant::now();
        while src_acc.status()?["vms"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["vm"] == "vm1")
        {
            if t0.elapsed() > Duration::from_secs(15) {
                bail!("source acceld kept vm1 after its QEMU quit");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::remove_file(&cur.side_path);
        cur = dst;
        at = to;
    }
    // The guest went on writing on the last destination; now it verifies everything.
    cur.guest.wait_for("progress=", Duration::from_secs(60))?;
    cur.guest.send_line("STOP")?;
    let out = cur.guest.wait_exit(Duration::from_secs(180))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}", out.join("\n"));
    }
    assert_eq!(guest_value(&out, "errors")?, "0");
    assert_eq!(guest_value(&out, "kernel_errors")?, "0");
    let md5 = guest_value(&out, "md5")?;
    assert_eq!(
        host_md5(&img, u64::from(WORKERS * BLOCKS) * 4096)?,
        md5,
        "the host sees what the guest wrote"
    );
    let iters = guest_value(&out, "iterations")?;
    let total: Vec<u64> = results.iter().map(|r| r.total_ms).collect();
    let down: Vec<u64> = results.iter().map(|r| r.downtime_ms).collect();
    println!(
        "6 migrations: total ms {total:?}, downtime ms {down:?}; guest {iters} verified iterations, 0 errors, host md5 matches"
    );
    Ok(())
}
