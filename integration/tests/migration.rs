//! Live migration with real QEMU 10 (TCG): two `acceld run` instances with their own run dirs
//! (two hosts sharing storage), a guest doing verified writes from 32 writers through round
//! trips of plain QMP `migrate`, the drive on the direct engine throughout.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel_integration::migration::{
    accelctl_migrate, has_open, holds_lock, migrate, wait_migration_end, Instance,
};
use accel_integration::supervised::{writer_script, AcceldRun};
use accel_integration::{create_qcow2, guest_value, host_md5, qcow2_md5, Guest};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

const CONFIG: &str = "quiet-period-ms = 300\npoll-interval-ms = 200\n";
const WORKERS: u32 = 32;
const BLOCKS: u32 = 64;

/// Each test runs two QEMUs and two accelds: one test at a time keeps the 2-core machine's
/// TCG guests responsive (the tests of this file take about 2 minutes in a row).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

fn workdir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("accel-{tag}"))
        // ACCEL_KEEP=1 keeps the images, sockets and acceld logs for a look afterwards.
        .disable_cleanup(std::env::var_os("ACCEL_KEEP").is_some())
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// Two hosts sharing storage: a work dir with drive d0's 64 MiB raw image, and an `acceld run`
/// for each host.
struct Hosts {
    dir: tempfile::TempDir,
    img: PathBuf,
    drive: String,
    a: AcceldRun,
    b: AcceldRun,
}

fn two_hosts(tag: &str) -> Result<Hosts> {
    let dir = workdir(tag);
    let img = dir.path().join("d0.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let drive = format!("id=d0,image={},queues=2", img.display());
    let a = AcceldRun::start(&dir.path().join("run-a"), CONFIG)?;
    let b = AcceldRun::start(&dir.path().join("run-b"), CONFIG)?;
    Ok(Hosts {
        dir,
        img,
        drive,
        a,
        b,
    })
}

/// One side: an acceld and the QEMU it serves now (if any).
struct Side {
    name: &'static str,
    acc: AcceldRun,
}

fn boot(acc: &AcceldRun, side: &Path, extra: &[String], script: &str) -> Result<Instance> {
    Instance::boot_registered(acc, "vm1", side, extra, script)
}

fn status_of(i: &Instance) -> Result<String> {
    i.status()
}

fn register(acc: &AcceldRun, qmp: &Path, drive: &str, incoming: bool) -> Result<()> {
    let flags: &[&str] = if incoming {
        &["--cont", "--incoming"]
    } else {
        &["--cont"]
    };
    acc.register("vm1", qmp, drive, flags)
}

/// Migrations in a row of [`direct_drive_migrates_round_trips_under_guest_writes`]: five round
/// trips.
const HOPS: u32 = 10;

/// Five round trips (ten migrations) of a guest writing and verifying through each; 0 guest
/// errors, the host's md5 equals the guest's, and only the running side holds the image.
/// After the last hop the guest's writes must go on completing for 60 s (issue 29: between
/// two hosts a converted domain's guest once stopped 0-50 s after its last migration with every
/// request complete in its ring and no interrupt taken, a lost completion interrupt).
#[test]
fn direct_drive_migrates_round_trips_under_guest_writes() -> Result<()> {
    let _one = one_at_a_time();
    let Hosts {
        dir,
        img,
        drive,
        a,
        b,
    } = two_hosts("mig")?;
    let sides = [Side { name: "a", acc: a }, Side { name: "b", acc: b }];
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
    for n in 1..=HOPS {
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
            sd["migration"]["image_released"], true,
            "source released the image: {sd}"
        );
        assert_eq!(
            sd["engine"], "held",
            "nothing serves the drive on the source: {sd}"
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
    // The guest goes on writing on the last destination: no stall for 60 s (a stalled
    // guest still prints its figure every 2 s, the same one; 20 s without a completed write
    // is a stall on this machine, where a TCG guest completes several a second).
    let figures = cur
        .guest
        .keeps_writing(Duration::from_secs(60), Duration::from_secs(20))
        .map_err(|e| {
            let drive = sides[at]
                .acc
                .drive("vm1", "d0")
                .map_or_else(|e| e.to_string(), |d| d.to_string());
            anyhow::anyhow!("{e}\nthe drive on the last destination: {drive}")
        })?;
    println!(
        "after the last of {HOPS} migrations the guest's writes went on for 60 s: {} -> {} completed",
        figures[0],
        figures.last().unwrap()
    );
    // Now it verifies everything.
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
        "{HOPS} migrations: total ms {total:?}, downtime ms {down:?}; guest {iters} verified iterations, 0 errors, host md5 matches"
    );
    // Ten normal migrations and QEMU quitting after each: nothing in either acceld's log is a
    // warning (a source's QEMU ending after its migration completed is an expected end).
    for s in &sides {
        let log = s.acc.log_text();
        let warns: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        assert!(warns.is_empty(), "acceld {}: {warns:#?}", s.name);
    }
    Ok(())
}

/// Boots vm1 on `acc` with the writer guest, waits until it writes on the direct engine.
fn writer_on(acc: &AcceldRun, dir: &Path, tag: &str, drive: &str) -> Result<Instance> {
    writer_on_with(acc, dir, tag, drive, "")
}

/// Like [`writer_on`], the guest running `first` (shell) before its writers.
fn writer_on_with(
    acc: &AcceldRun,
    dir: &Path,
    tag: &str,
    drive: &str,
    first: &str,
) -> Result<Instance> {
    let qmp = dir.join(format!("qmp-{tag}.sock"));
    register(acc, &qmp, drive, false)?;
    let mut i = boot(
        acc,
        &dir.join(format!("side-{tag}.sock")),
        &[],
        &format!("{first}{}", writer_script("/dev/vda", WORKERS, BLOCKS)),
    )?;
    i.guest
        .wait_for("READY", Duration::from_secs(120))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", acc.log_text()))?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    Ok(i)
}

/// Stops the writers and checks the guest's verdict and the image.
fn verify_guest(i: &mut Instance, img: &Path) -> Result<String> {
    i.guest.wait_for("progress=", Duration::from_secs(60))?;
    i.guest.send_line("STOP")?;
    let out = i.guest.wait_exit(Duration::from_secs(180))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}", out.join("\n"));
    }
    assert_eq!(guest_value(&out, "errors")?, "0");
    assert_eq!(guest_value(&out, "kernel_errors")?, "0");
    let md5 = guest_value(&out, "md5")?;
    assert_eq!(
        host_md5(img, u64::from(WORKERS * BLOCKS) * 4096)?,
        md5,
        "the host sees what the guest wrote"
    );
    guest_value(&out, "iterations")
}

/// A throttled drive (qemu engine, relayed through QEMU's vhost-user-blk export of its
/// throttle filter, the default) migrates with `accelctl migrate`: acceld pauses the
/// migration at pre-switchover, removes its exports so QEMU can inactivate the node,
/// continues; the destination takes the same limits.
#[test]
fn throttled_drive_migrates_with_accelctl_migrate() -> Result<()> {
    // relay=on: the tests' QEMU has a monitor beside acceld's, where acceld would not relay
    // by default.
    throttled_migration("mig-thr", ",relay=on")
}

/// The same over NBD only (`nbd=on`).
#[test]
fn throttled_drive_over_nbd_migrates_with_accelctl_migrate() -> Result<()> {
    throttled_migration("mig-nbd", ",nbd=on")
}

fn throttled_migration(tag: &str, spec_extra: &str) -> Result<()> {
    let _one = one_at_a_time();
    let Hosts {
        dir,
        img,
        drive,
        a,
        b,
    } = two_hosts(tag)?;
    let drive = format!("{drive}{spec_extra}");
    // The relay: the source's requests go through QEMU's vhost-user-blk export of the
    // throttle filter while acceld logs the guest pages they wrote (the export never sees
    // QEMU's dirty log); at pre-switchover that export goes too, and the destination relays
    // through its own.
    let relay = !spec_extra.contains("nbd=on");
    // The guest turns its write cache off (CONFIG_WCE): runtime state the destination must
    // show it too, since QEMU takes the config from the destination backend.
    let mut src = writer_on_with(
        &a,
        dir.path(),
        "a",
        &drive,
        "echo 'write through' > /sys/block/vda/cache_type\necho cache=$(cat /sys/block/vda/cache_type)\n",
    )?;
    assert_eq!(
        a.drive("vm1", "d0")?["writeback"],
        false,
        "the guest set write-through"
    );
    a.ctl_ok(&["throttle", "vm1", "d0", "--iops-total", "3000"])?;
    a.wait_engine("vm1", "d0", "qemu", Duration::from_secs(10))?;
    src.guest.wait_for("progress=", Duration::from_secs(60))?;
    let path = if relay { "vhost-user" } else { "nbd" };
    assert_eq!(a.drive("vm1", "d0")?["io_path"], path);

    let (text, mut dst) = accelctl_migrate(
        &a,
        &b,
        "vm1",
        dir.path(),
        &writer_script("/dev/vda", WORKERS, BLOCKS),
        &[],
    )?;
    println!("accelctl migrate:\n{}", text.trim());
    assert!(text.contains("migrated: total"), "{text}");
    let d = b.drive("vm1", "d0")?;
    assert_eq!(d["throttle"]["iops-total"], 3000, "limits handed over: {d}");
    assert_eq!(
        d["writeback"], false,
        "the write cache bit handed over: {d}"
    );
    // The source quit; the destination serves the drive on its qemu engine with the limits.
    src.guest.wait_exit(Duration::from_secs(30))?;
    b.wait_engine("vm1", "d0", "qemu", Duration::from_secs(10))?;
    assert_eq!(b.drive("vm1", "d0")?["io_path"], path);
    assert_eq!(status_of(&dst)?, "running");
    assert!(
        dst.side
            .throttle_filters()?
            .iter()
            .any(|f| f.contains("d0")),
        "QEMU's throttle filter on the destination"
    );
    // The limits cleared there: back to direct, with the image's locks on the destination.
    b.ctl_ok(&["throttle", "vm1", "d0", "--clear"])?;
    b.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    assert!(holds_lock(b.pid(), &img));
    let iters = verify_guest(&mut dst, &img)?;
    println!("throttled drive ({path}) migrated; guest {iters} verified iterations, 0 errors");
    Ok(())
}

/// A qcow2 drive (qemu engine, relayed through QEMU's vhost-user-blk export of its node, the
/// default) migrates under guest writes with `accelctl migrate`: acceld marks the guest pages
/// the export wrote (dirty logging on this path, no NBD during the migration), removes its
/// exports at pre-switchover, and the destination relays through its own export. The guest
/// verifies every block; the image holds what it wrote.
#[test]
fn relayed_qcow2_drive_migrates_with_accelctl_migrate() -> Result<()> {
    let _one = one_at_a_time();
    let dir = workdir("mig-qcow2");
    let img = dir.path().join("d0.qcow2");
    create_qcow2(&img, "64M")?;
    let drive = format!(
        "id=d0,image={},format=qcow2,queues=2,relay=on",
        img.display()
    );
    let a = AcceldRun::start(&dir.path().join("run-a"), CONFIG)?;
    let b = AcceldRun::start(&dir.path().join("run-b"), CONFIG)?;
    register(&a, &dir.path().join("qmp-a.sock"), &drive, false)?;
    let mut src = boot(
        &a,
        &dir.path().join("side-a.sock"),
        &[],
        &writer_script("/dev/vda", WORKERS, BLOCKS),
    )?;
    src.guest
        .wait_for("READY", Duration::from_secs(120))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", a.log_text()))?;
    a.wait_engine("vm1", "d0", "qemu", Duration::from_secs(20))?;
    let relayed = |acc: &AcceldRun| -> Result<()> {
        let t0 = Instant::now();
        while acc.drive("vm1", "d0")?["io_path"] != "vhost-user" {
            if t0.elapsed() > Duration::from_secs(20) {
                bail!("not relayed within 20 s\n{}", acc.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    relayed(&a)?;
    src.guest.wait_for("progress=", Duration::from_secs(60))?;

    let (text, mut dst) = accelctl_migrate(
        &a,
        &b,
        "vm1",
        dir.path(),
        &writer_script("/dev/vda", WORKERS, BLOCKS),
        &[],
    )?;
    println!("accelctl migrate:\n{}", text.trim());
    assert!(text.contains("migrated: total"), "{text}");
    src.guest.wait_exit(Duration::from_secs(30))?;
    b.wait_engine("vm1", "d0", "qemu", Duration::from_secs(20))?;
    relayed(&b)?;
    assert_eq!(status_of(&dst)?, "running");
    dst.guest.wait_for("progress=", Duration::from_secs(60))?;
    dst.guest.send_line("STOP")?;
    let out = dst.guest.wait_exit(Duration::from_secs(180))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}\n{}", out.join("\n"), b.log_text());
    }
    assert_eq!(guest_value(&out, "errors")?, "0");
    assert_eq!(guest_value(&out, "kernel_errors")?, "0");
    assert_eq!(
        qcow2_md5(&img, u64::from(WORKERS * BLOCKS) * 4096)?,
        guest_value(&out, "md5")?,
        "the image holds what the guest wrote"
    );
    Ok(())
}

/// `migrate_cancel` mid-migration: the source keeps running and owns the image, the
/// destination QEMU exits, the guest verifies.
#[test]
fn cancelled_migration_leaves_the_source_running() -> Result<()> {
    let _one = one_at_a_time();
    let Hosts {
        dir,
        img,
        drive,
        a,
        b,
    } = two_hosts("mig-cancel")?;
    let mut src = writer_on(&a, dir.path(), "a", &drive)?;
    register(&b, &dir.path().join("qmp-b.sock"), &drive, true)?;
    let mig = dir.path().join("mig.sock");
    let dst = boot(
        &b,
        &dir.path().join("side-b.sock"),
        &["-incoming".to_string(), format!("unix:{}", mig.display())],
        &writer_script("/dev/vda", WORKERS, BLOCKS),
    )?;
    b.wait_attached("vm1", Duration::from_secs(10))?;
    // Slow enough to still be running when cancelled.
    src.side
        .cmd("migrate-set-parameters", json!({"max-bandwidth": 4 << 20}))?;
    src.side
        .cmd("migrate", json!({"uri": format!("unix:{}", mig.display())}))?;
    std::thread::sleep(Duration::from_millis(500));
    let m = src.side.cmd("query-migrate", Value::Null)?;
    assert_eq!(m["status"], "active", "{m}");
    src.side.cmd("migrate_cancel", Value::Null)?;
    let t0 = Instant::now();
    loop {
        let m = src.side.cmd("query-migrate", Value::Null)?;
        if m["status"] == "cancelled" {
            break;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("not cancelled: {m}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status_of(&src)?, "running");
    let d = a.drive("vm1", "d0")?;
    assert_eq!(d["engine"], "direct", "{d}");
    assert_eq!(d["migration"]["image_released"], false, "{d}");
    assert!(holds_lock(a.pid(), &img), "the source still owns the image");
    assert!(!has_open(b.pid(), &img));
    drop(dst);
    // The guest goes on and verifies on the source.
    src.guest.wait_for("progress=", Duration::from_secs(60))?;
    let iters = verify_guest(&mut src, &img)?;
    println!(
        "cancelled migration: source kept running; guest {iters} verified iterations, 0 errors"
    );
    Ok(())
}

/// A destination QEMU with no acceld serving its socket does not start; the source is not
/// affected.
#[test]
fn no_destination_acceld_means_no_destination() -> Result<()> {
    let _one = one_at_a_time();
    let Hosts {
        dir,
        img,
        drive,
        a,
        mut b,
    } = two_hosts("mig-nodst")?;
    let mut src = writer_on(&a, dir.path(), "a", &drive)?;
    // The destination's contract names sockets nobody serves (its acceld, stopped).
    register(&b, &dir.path().join("qmp-b.sock"), &drive, true)?;
    let contract: Vec<String> = b
        .ctl_ok(&["qemu-args", "--vm", "vm1", "--memory", "256M"])?
        .lines()
        .map(String::from)
        .collect();
    b.terminate()?;
    let mig = dir.path().join("mig.sock");
    let mut g = Guest::boot_contract(
        &contract,
        &["-incoming".to_string(), format!("unix:{}", mig.display())],
        "true",
    )?;
    // QEMU retries the vhost-user socket (reconnect-ms) at realize and never gets to listen
    // for the migration: there is no destination to migrate to.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !mig.exists(),
        "the destination QEMU listens without its disks"
    );
    let r = src
        .side
        .cmd("migrate", json!({"uri": format!("unix:{}", mig.display())}));
    let failed = match r {
        Err(e) => format!("migrate refused: {e}"),
        Ok(_) => {
            let t0 = Instant::now();
            loop {
                let m = src.side.cmd("query-migrate", Value::Null)?;
                if m["status"] == "failed" {
                    break format!("migration failed: {}", m["error-desc"]);
                }
                if t0.elapsed() > Duration::from_secs(30) {
                    bail!("migration to nowhere did not fail: {m}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let out = g.kill()?;
    let qemu: Vec<_> = out
        .iter()
        .filter(|l| l.starts_with("qemu:"))
        .cloned()
        .collect();
    assert!(
        qemu.iter().any(|l| l.contains("Unable to connect")),
        "{qemu:?}"
    );
    println!(
        "no destination acceld: {failed}; destination QEMU: {}",
        qemu.join(" | ")
    );
    assert_eq!(status_of(&src)?, "running");
    assert_eq!(a.drive("vm1", "d0")?["engine"], "direct");
    let iters = verify_guest(&mut src, &img)?;
    println!("source unaffected; guest {iters} verified iterations, 0 errors");
    Ok(())
}

/// Copy-storage (non-shared storage): the destination has a blank image of its own; accelctl
/// mirrors the running drive into it through QEMU's block layer, migrates, and the
/// destination acceld serves the new image directly. The guest verifies there, and the new
/// image holds what it wrote.
#[test]
fn copy_storage_to_a_blank_image() -> Result<()> {
    let _one = one_at_a_time();
    let Hosts {
        dir,
        img,
        drive,
        a,
        b,
    } = two_hosts("mig-copy")?;
    // relay=on: the mirror starts from a relayed drive (acceld moves it to NBD first).
    let drive = format!("{drive},relay=on");
    let new = dir.path().join("d0-dest.raw");
    std::fs::File::create(&new)?.set_len(64 << 20)?;
    let mut src = writer_on(&a, dir.path(), "a", &drive)?;
    src.guest.wait_for("progress=", Duration::from_secs(60))?;
    let dest_image = format!("d0={}", new.display());
    let (text, mut dst) = accelctl_migrate(
        &a,
        &b,
        "vm1",
        dir.path(),
        &writer_script("/dev/vda", WORKERS, BLOCKS),
        &["--copy-storage", "--dest-image", &dest_image],
    )?;
    println!("accelctl migrate --copy-storage:\n{}", text.trim());
    assert!(text.contains("in sync"), "{text}");
    src.guest.wait_exit(Duration::from_secs(30))?;
    b.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    let d = b.drive("vm1", "d0")?;
    assert_eq!(d["image"], new.to_str().unwrap(), "{d}");
    assert!(
        holds_lock(b.pid(), &new),
        "the destination serves the new image"
    );
    assert!(
        !has_open(b.pid(), &img),
        "the destination does not touch the old image"
    );
    let iters = verify_guest(&mut dst, &new)?;
    println!("copy-storage: guest {iters} verified iterations on the new image, 0 errors, its md5 matches");
    Ok(())
}

/// What libvirt does, through acceld's QMP proxy: management sets `pause-before-switchover`,
/// migrates a drive that is on QEMU's block layer (throttled through the proxy), waits for the
/// `pre-switchover` event and sends `migrate-continue`. The proxy passes the event on only
/// when acceld's export is off the node, so the migration completes; the guest verifies.
#[test]
fn management_migrates_through_the_proxy_with_its_own_pause() -> Result<()> {
    let _one = one_at_a_time();
    let Hosts {
        dir,
        img,
        drive,
        a,
        b,
    } = two_hosts("mig-proxy")?;
    let src = writer_on(&a, dir.path(), "a", &drive)?;
    let proxy = accel_integration::supervised::SideQmp::connect(
        &a.run_dir.join("vm1").join("monitor.sock"),
    )?;
    proxy.cmd(
        "block_set_io_throttle",
        json!({"id": "/machine/peripheral/d0/virtio-backend", "bps": 0, "bps_rd": 0,
               "bps_wr": 0, "iops": 2000, "iops_rd": 0, "iops_wr": 0}),
    )?;
    assert_eq!(a.drive("vm1", "d0")?["engine"], "qemu");
    let mut src = src;
    src.guest.wait_for("progress=", Duration::from_secs(60))?;
    // The destination, as libvirt would start it on the other host.
    let dqmp = dir.path().join("qmp-b.sock");
    register(&b, &dqmp, &drive, true)?;
    let mig = dir.path().join("mig.sock");
    let uri = format!("unix:{}", mig.display());
    let mut dst = boot(
        &b,
        &dir.path().join("side-b.sock"),
        &["-incoming".to_string(), uri.clone()],
        &writer_script("/dev/vda", WORKERS, BLOCKS),
    )?;
    dst.wait_status("inmigrate", Duration::from_secs(60))?;
    proxy.cmd(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "events", "state": true},
                                {"capability": "pause-before-switchover", "state": true}]}),
    )?;
    let mut events = proxy.subscribe();
    proxy.cmd("migrate", json!({ "uri": uri }))?;
    proxy.wait_event(
        &mut events,
        "MIGRATION",
        |d| d["status"] == "pre-switchover",
        Duration::from_secs(120),
    )?;
    // By now acceld's export is off the node (the proxy held the event back until then).
    let exports = src.side.cmd("query-block-exports", Value::Null)?;
    assert!(
        !exports
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["id"] == "accel-d0"),
        "acceld's export is gone at pre-switchover: {exports}"
    );
    proxy.cmd("migrate-continue", json!({"state": "pre-switchover"}))?;
    let m = wait_migration_end(&proxy, &mut events, Duration::from_secs(60))?;
    dst.wait_status("running", Duration::from_secs(30))?;
    b.wait_engine("vm1", "d0", "direct", Duration::from_secs(20))?;
    proxy.cmd("quit", Value::Null)?;
    src.guest.wait_exit(Duration::from_secs(30))?;
    let iters = verify_guest(&mut dst, &img)?;
    println!(
        "management migrated through the proxy (downtime {} ms); guest {iters} verified iterations, 0 errors",
        m["downtime"]
    );
    Ok(())
}
