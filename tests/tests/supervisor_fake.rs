//! The supervisor's per-drive state machine against a scripted QMP fake and a fake NBD server,
//! with the real engines and a verifying QD32 load on two queues running throughout: every
//! switch, and the rollback of each failing step (export, node re-creation, NBD connect, node
//! removal, export removal, and a failed rollback that holds the drive).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_tests::fake_qemu::FakeQemu;
use accel_tests::load::{fill_image, run_load, LoadSpec};
use accel_tests::{BlkFrontend, FrontendOptions};
use acceld::control::{DriveSpec, ThrottleLimits};
use acceld::supervisor::Supervisor;
use policy::Pin;
use serde_json::Value;

/// Reads and writes acceld completed (successful or failed).
fn served(d: &Value) -> u64 {
    let c: accel_api::status::IoCounters =
        serde_json::from_value(d["io"]["counters"].clone()).expect("the drive's counters");
    c.reads() + c.writes()
}

fn drive(sup: &Supervisor) -> Value {
    serde_json::to_value(sup.status()).unwrap()["vms"][0]["drives"][0].clone()
}

async fn wait_engine(sup: &Supervisor, engine: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let d = drive(sup);
        if d["engine"] == engine {
            return d;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "not {engine}: {d}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A filled raw image of `size` bytes served as drive d0 (two queues) of a VM whose QEMU is
/// the fake: the directory, the image, the drive's socket, the fake and its supervisor.
fn supervised(
    prefix: &str,
    size: u64,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    Arc<FakeQemu>,
    Arc<Supervisor>,
) {
    accel_tests::harness::init_logs();
    let (dir, image) = accel_tests::harness::temp_image(prefix, size);
    fill_image(&image, size, 1).unwrap();
    let run = dir.path().join("run");
    let socket = run.join("vm").join("d0.sock");
    let fake = FakeQemu::start(dir.path(), "d0", &image, &socket);
    let spec = DriveSpec::parse(&format!("id=d0,image={},queues=2", image.display())).unwrap();
    let sup = fake.supervise(&run, spec);
    (dir, image, socket, fake, sup)
}

/// The guest: a verifying QD32 mix on two queues of the drive on `socket`, until `stop`.
fn guest_load(
    socket: &std::path::Path,
    size: u64,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<accel_tests::load::LoadReport> {
    let socket = socket.to_path_buf();
    std::thread::spawn(move || {
        let mut fe = BlkFrontend::connect(
            &socket,
            FrontendOptions {
                queues: 2,
                queue_size: 128,
                max_data: 4096,
                event_idx: true,
                inflight: false,
            },
        )
        .unwrap();
        let r = run_load(
            &mut fe,
            &LoadSpec::verified_mix(size / 4096, 11, Some(stop)),
        )
        .unwrap();
        drop(fe);
        r
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_and_rollbacks_under_verified_load() {
    let size = 16u64 << 20;
    let (_dir, image, socket, fake, sup) = supervised("accel-sup", size);
    let d = wait_engine(&sup, "direct").await;
    assert_eq!(d["device"], "vdisk", "{d}");
    assert!(
        !fake.has_node("d0") && !fake.has_node("d0-file"),
        "nodes removed while direct"
    );

    // The guest: QD32 on two queues, verified, for as long as the steps run.
    let stop = Arc::new(AtomicBool::new(false));
    let load = guest_load(&socket, size, stop.clone());
    let pause = || tokio::time::sleep(Duration::from_millis(100));
    pause().await;

    // Both ways.
    sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap();
    assert_eq!(drive(&sup)["engine"], "qemu");
    assert!(
        fake.has_node("d0") && fake.has_node("d0-file"),
        "nodes re-created"
    );
    assert_eq!(fake.exports(), vec!["accel-d0"]);
    pause().await;
    sup.set_pin("vm", "d0", None, false).await.unwrap();
    assert_eq!(drive(&sup)["engine"], "direct");
    assert!(fake.exports().is_empty() && !fake.has_node("d0"));
    pause().await;

    // Each failing step of direct -> qemu rolls back to direct.
    let mut failed = 0;
    for (cmd, desc) in [
        ("block-export-add", "injected: export refused"),
        ("blockdev-add", "injected: cannot open"),
        ("nbd-server-start", "injected: address in use"),
    ] {
        fake.fail_next(cmd, desc);
        // QEMU has one NBD server: a start fails for real only while it is not serving
        // (acceld goes on when its own server greets).
        fake.set_nbd_up(cmd != "nbd-server-start");
        let e = sup
            .set_pin("vm", "d0", Some(Pin::Qemu), false)
            .await
            .unwrap_err();
        fake.set_nbd_up(true);
        failed += 1;
        assert!(e.chain().contains("injected"), "{cmd}: {}", e.chain());
        let d = drive(&sup);
        assert_eq!(d["engine"], "direct", "{cmd} rolled back: {d}");
        assert_eq!(d["switch"]["failed"], failed);
        assert!(
            fake.exports().is_empty() && !fake.has_node("d0"),
            "{cmd}: clean"
        );
        sup.set_pin("vm", "d0", None, false).await.unwrap();
        pause().await;
    }
    // The NBD export refuses connections: rollback to direct, export removed.
    fake.set_nbd_up(false);
    let e = sup
        .set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap_err();
    failed += 1;
    println!("NBD down: {}", e.chain());
    assert_eq!(drive(&sup)["engine"], "direct");
    assert!(fake.exports().is_empty());
    fake.set_nbd_up(true);
    sup.set_pin("vm", "d0", None, false).await.unwrap();
    pause().await;

    // Each failing step of qemu -> direct rolls back to qemu.
    sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap();
    for (cmd, desc) in [
        ("blockdev-del", "injected: node busy"),
        ("block-export-del", "injected: export busy"),
    ] {
        fake.fail_next(cmd, desc);
        let e = sup.set_pin("vm", "d0", None, false).await.unwrap_err();
        failed += 1;
        assert!(e.chain().contains("injected"), "{cmd}: {}", e.chain());
        let d = drive(&sup);
        assert_eq!(d["engine"], "qemu", "{cmd} rolled back: {d}");
        assert_eq!(fake.exports(), vec!["accel-d0"], "{cmd}: export back");
        sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
            .await
            .unwrap();
        pause().await;
    }

    // A switch to direct whose pause fails (another pause holds the drive): the image acceld
    // opened before the pause closes, and the qemu engine keeps serving on its export.
    let dh = sup.drive_handle("vm", "d0").unwrap();
    let other = tokio::task::block_in_place(|| dh.pause()).unwrap();
    let e = sup.set_pin("vm", "d0", None, false).await.unwrap_err();
    println!("pause refused: {}", e.chain());
    assert_eq!(drive(&sup)["engine"], "qemu");
    assert_eq!(
        fake.exports(),
        vec!["accel-d0"],
        "the qemu engine's export stays"
    );
    drop(other);
    pause().await;

    // Throttle: a filter and a group on top, the export on the filter; clear: direct after
    // the quiet period, filter and group gone.
    sup.set_pin("vm", "d0", None, false).await.unwrap();
    let limits = ThrottleLimits {
        iops_total: Some(100_000),
        ..Default::default()
    };
    let d =
        serde_json::to_value(sup.set_throttle("vm", "d0", Some(limits)).await.unwrap()).unwrap();
    assert_eq!(d["engine"], "qemu");
    assert_eq!(d["reasons"][0], "throttle");
    assert!(fake.has_node("accel-throttle-d0"));
    assert!(fake.objects().contains(&"accel-tg-d0".to_string()));
    pause().await;
    let d = serde_json::to_value(sup.set_throttle("vm", "d0", None).await.unwrap()).unwrap();
    assert_eq!(d["engine"], "qemu", "clear waits for the quiet period");
    tokio::time::sleep(Duration::from_millis(150)).await;
    sup.set_pin("vm", "d0", None, false).await.unwrap();
    assert_eq!(drive(&sup)["engine"], "direct");
    assert!(!fake.has_node("accel-throttle-d0"));
    assert!(!fake.objects().contains(&"accel-tg-d0".to_string()));

    // A switch to the qemu engine prepared before the pause fails, and so does its undo: the
    // drive never paused, so it stays direct and serves on; the next attempt works.
    fake.fail_next("block-export-add", "injected: export refused");
    fake.fail_next("blockdev-del", "injected: node busy");
    let e = sup
        .set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap_err();
    failed += 1;
    println!("failed prepare, failed undo: {}", e.chain());
    assert_eq!(drive(&sup)["engine"], "direct");
    sup.set_pin("vm", "d0", None, false).await.unwrap();
    pause().await;
    // A switch to direct whose clean-up of QEMU's export fails after the resume goes back to
    // the qemu engine; when that fails too, the drive is held (requests wait in the vring,
    // none lost), and the next attempt serves them.
    sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap();
    pause().await;
    fake.fail_next("block-export-del", "injected: export busy");
    fake.fail_next("block-export-add", "injected: export refused");
    let e = sup.set_pin("vm", "d0", None, false).await.unwrap_err();
    failed += 1;
    println!("double failure: {}", e.chain());
    let d = drive(&sup);
    assert_eq!(d["engine"], "held", "{d}");
    let before = served(&d);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let d = drive(&sup);
    let after = served(&d);
    assert_eq!(before, after, "held: nothing served");
    sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap();
    assert_eq!(drive(&sup)["engine"], "qemu");
    pause().await;
    sup.set_pin("vm", "d0", None, false).await.unwrap();
    assert_eq!(drive(&sup)["engine"], "direct");
    pause().await;

    stop.store(true, Ordering::Relaxed);
    let r = tokio::task::spawn_blocking(move || load.join().unwrap())
        .await
        .unwrap();
    assert_eq!(r.errors, 0, "the guest saw no I/O error");
    assert_eq!(r.mismatch_count, 0, "{:?}", r.mismatches);
    assert_eq!(r.verify_image(&image, 4096).unwrap(), size / 4096);
    let d = drive(&sup);
    assert_eq!(d["switch"]["failed"], failed);
    println!(
        "{}; switches {} ({} failed: rolled back, or held once and then served); pauses to qemu {} / to direct {}",
        r.summary(),
        d["switch"]["count"],
        failed,
        d["switch"]["to_qemu"],
        d["switch"]["to_direct"]
    );
    let m = sup.metrics();
    assert!(
        m.contains("accel_drive_switches_total{vm=\"vm\",drive=\"d0\",engine=\"direct\"}"),
        "{m}"
    );
    sup.shutdown();
}

/// A status taken at any moment shows a drive before a switch or after it, never between:
/// its engine and its count of completed switches (each switch's pause) change in one step (`ManagedDrive::commit`). A poller reads status as fast as it can
/// while the drive switches 20 times each way under a verifying guest load; from direct,
/// an even count of completed switches must show direct and an odd one qemu.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_never_shows_half_a_switch() {
    let size = 16u64 << 20;
    let (_dir, image, socket, _fake, sup) = supervised("accel-status", size);
    wait_engine(&sup, "direct").await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = guest_load(&socket, size, stop.clone());

    // The poller: every status it reads is checked; the first half-applied one is kept.
    let polling = Arc::new(AtomicBool::new(true));
    let poller = {
        let (sup, polling) = (sup.clone(), polling.clone());
        std::thread::spawn(move || {
            let (mut reads, mut seen_qemu, mut bad) = (0u64, 0u64, None::<String>);
            while polling.load(Ordering::Relaxed) {
                let d = drive(&sup);
                reads += 1;
                let n = d["switch"]["to_direct"]["count"].as_u64().unwrap()
                    + d["switch"]["to_qemu"]["count"].as_u64().unwrap();
                let want = if n % 2 == 0 { "direct" } else { "qemu" };
                if d["engine"] == "qemu" {
                    seen_qemu += 1;
                }
                if bad.is_none() && d["engine"] != want {
                    bad = Some(format!("{n} switches done, engine {}: {d}", d["engine"]));
                }
            }
            (reads, seen_qemu, bad)
        })
    };
    let rounds = 20;
    for _ in 0..rounds {
        sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
            .await
            .unwrap();
        sup.set_pin("vm", "d0", None, false).await.unwrap();
    }
    polling.store(false, Ordering::Relaxed);
    let (reads, seen_qemu, bad) = tokio::task::spawn_blocking(move || poller.join().unwrap())
        .await
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    let r = tokio::task::spawn_blocking(move || load.join().unwrap())
        .await
        .unwrap();
    let d = drive(&sup);
    println!(
        "{reads} status reads ({seen_qemu} on qemu) over {} switches; {}",
        2 * rounds,
        r.summary()
    );
    assert_eq!(bad, None, "a status showed half a switch");
    assert!(
        seen_qemu > 0,
        "the poller saw the drive on qemu at least once"
    );
    assert_eq!(d["engine"], "direct", "{d}");
    assert_eq!(d["switch"]["to_qemu"]["count"], rounds, "{d}");
    assert_eq!(d["switch"]["to_direct"]["count"], rounds, "{d}");
    assert_eq!(d["switch"]["failed"], 0, "{d}");
    assert_eq!(r.errors, 0, "the guest saw no I/O error");
    assert_eq!(r.mismatch_count, 0, "{:?}", r.mismatches);
    assert_eq!(r.verify_image(&image, 4096).unwrap(), size / 4096);
    sup.shutdown();
}

/// A drive registered without `serial=` has none, as QEMU's virtio-blk without one: GET_ID
/// answers an empty id (all NULs) on the direct engine and on the qemu engine, and status
/// shows no serial. With `serial=`, GET_ID answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_serial_unless_configured() {
    use accel_tests::{S_OK, T_GET_ID};
    accel_tests::harness::init_logs();
    for (serial, want) in [("", &b""[..]), (",serial=SN-42", &b"SN-42"[..])] {
        let (dir, image) = accel_tests::harness::temp_image("accel-serial", 1 << 20);
        let run = dir.path().join("run");
        let socket = run.join("vm").join("d0.sock");
        let fake = FakeQemu::start(dir.path(), "d0", &image, &socket);
        let spec = DriveSpec::parse(&format!("id=d0,image={}{serial}", image.display())).unwrap();
        let sup = fake.supervise(&run, spec);
        wait_engine(&sup, "direct").await;
        let sock = socket.clone();
        let mut fe = tokio::task::spawn_blocking(move || {
            BlkFrontend::connect(&sock, FrontendOptions::default()).unwrap()
        })
        .await
        .unwrap();
        let mut expect = [0u8; 20];
        expect[..want.len()].copy_from_slice(want);
        for engine in ["direct", "qemu"] {
            if engine == "qemu" {
                sup.set_throttle(
                    "vm",
                    "d0",
                    Some(ThrottleLimits {
                        iops_total: Some(100_000),
                        ..Default::default()
                    }),
                )
                .await
                .unwrap();
                wait_engine(&sup, "qemu").await;
            }
            let (st, id, _) =
                tokio::task::block_in_place(|| fe.request(0, T_GET_ID, 0, &[], 20)).unwrap();
            assert_eq!(st, S_OK);
            assert_eq!(
                id, expect,
                "GET_ID on the {engine} engine (serial{serial:?})"
            );
        }
        let d = drive(&sup);
        assert_eq!(
            d["serial"].as_str().unwrap_or(""),
            std::str::from_utf8(want).unwrap(),
            "{d}"
        );
        drop(fe);
        let _ = sup.unregister("vm", false).await;
    }
}

/// The state file changes with the registry only: reconciles that change nothing leave it as
/// it is (acceld rewrote it on every reconcile of every VM, once a second each), and a switch
/// writes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_file_is_written_only_when_the_registry_changes() {
    use std::os::unix::fs::MetadataExt;
    accel_tests::harness::init_logs();
    let size = 4u64 << 20;
    let (dir, image) = accel_tests::harness::temp_image("accel-state", size);
    let run = dir.path().join("run");
    let socket = run.join("vm").join("d0.sock");
    let fake = FakeQemu::start(dir.path(), "d0", &image, &socket);
    let spec = DriveSpec::parse(&format!("id=d0,image={}", image.display())).unwrap();
    let sup = fake.supervise_polling(&run, spec, 20);
    wait_engine(&sup, "direct").await;
    let state = run.join("state.json");
    let saved_engine = || -> Value {
        let v: Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        v["vms"][0]["drives"][0]["engine"].clone()
    };
    let reconciles = || {
        fake.log()
            .iter()
            .filter(|c| c.as_str() == "query-migrate")
            .count()
    };
    // Each reconcile asks query-migrate just before it saves: the 11th after this point
    // means 10 whole reconciles (and their saves) came and went.
    let wait_reconciles = |n: usize| {
        let from = reconciles();
        async move {
            let t0 = Instant::now();
            while reconciles() < from + n + 1 {
                assert!(t0.elapsed() < Duration::from_secs(20), "no reconcile");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    // A second name for the file as it is now: a write renames a new file over the name, so
    // the name then leaves the link (which also keeps the old inode's number from reuse).
    let keep = run.join("state.keep");
    let same_file = || {
        let (a, b) = (
            std::fs::metadata(&state).unwrap(),
            std::fs::metadata(&keep).unwrap(),
        );
        (a.dev(), a.ino()) == (b.dev(), b.ino())
    };
    wait_reconciles(1).await;
    std::fs::hard_link(&state, &keep).unwrap();
    assert_eq!(saved_engine(), "direct");
    wait_reconciles(10).await;
    assert!(
        same_file(),
        "10 reconciles that changed nothing rewrote the state file"
    );

    // A switch changes the registry: the file follows, once.
    sup.set_pin("vm", "d0", Some(Pin::Qemu), false)
        .await
        .unwrap();
    assert_eq!(saved_engine(), "qemu");
    assert!(!same_file(), "the switch was not saved");
    std::fs::remove_file(&keep).unwrap();
    std::fs::hard_link(&state, &keep).unwrap();
    wait_reconciles(10).await;
    assert!(
        same_file(),
        "reconciles after the switch rewrote the state file"
    );
    assert_eq!(saved_engine(), "qemu");
    let _ = sup.unregister("vm", false).await;
}
