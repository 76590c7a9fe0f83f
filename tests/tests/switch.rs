//! Live engine switches under a verifying QD32 load on two queues: nothing lost, nothing
//! reordered, every block verifies, and every pause is reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use accel_dataplane::drive::Drive;
use accel_dataplane::engine::{Engine, IoMode};
use accel_tests::harness::{file_engine, ServerOptions, TestServer};
use accel_tests::load::{fill_image, run_load, LoadReport, LoadSpec, SetOnDrop};
use accel_tests::{BlkFrontend, FrontendOptions, S_OK, T_FLUSH};

#[test]
fn hundred_switches_under_qd32_verified_load() {
    // The workers poll (adaptively) and the switches alternate between the two I/O modes
    // of the file engine, so a drain also catches a polling worker, and a queue moves between
    // io_uring and inline I/O with requests waiting.
    let opts = ServerOptions {
        queues: 2,
        size: 32 << 20,
        poll_us: 50,
        io: IoMode::Uring,
        ..Default::default()
    };
    let inline = ServerOptions {
        io: IoMode::Inline,
        ..Default::default()
    };
    let s = TestServer::start(&ServerOptions {
        queues: 2,
        size: 32 << 20,
        poll_us: 50,
        io: IoMode::Uring,
        ..Default::default()
    });
    // Two instances of the file engine on the same image, one per I/O mode: a switch moves
    // every queue from one to the other.
    let a: Arc<dyn Engine> = file_engine(&s.image, &opts);
    let b: Arc<dyn Engine> = file_engine(&s.image, &inline);
    assert_eq!((a.io_path(), b.io_path()), ("io_uring", "inline"));
    let (total, mut pauses) = switches_under_load(&s, a, b, 42, |drive, to| {
        let r = drive.switch_engine(to).expect("switch");
        assert_eq!(r.queues, 2, "both queues were drained and moved");
        r.pause
    });
    pauses.sort();
    let p50 = pauses[pauses.len() / 2];
    let p99 = pauses[pauses.len() * 99 / 100];
    let max = *pauses.last().unwrap();
    println!(
        "100 switches under QD32 x 2 queues: {} reads, {} writes verified, 0 errors; \
         pause p50 {:?}, p99 {:?}, max {:?}",
        total.reads, total.writes, p50, p99, max
    );
}

/// Runs the verifying QD32 load (seed `seed`) on both queues of `s` while a thread switches
/// the drive 100 times, alternately to `b` and `a`, 5 ms apart, through `switch`; checks that
/// nothing failed or mismatched and that every block verifies on the image. Returns the
/// load's report and what each switch returned.
fn switches_under_load<T: Send + 'static>(
    s: &TestServer,
    a: Arc<dyn Engine>,
    b: Arc<dyn Engine>,
    seed: u64,
    switch: impl Fn(&Arc<Drive>, Arc<dyn Engine>) -> T + Send + 'static,
) -> (LoadReport, Vec<T>) {
    let bs = 4096u64;
    let blocks = (32 << 20) / bs;
    fill_image(&s.image, blocks * bs, 1).unwrap();
    let mut fe = BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues: 2,
            queue_size: 128,
            max_data: 4096,
            event_idx: true,
            inflight: false,
        },
    )
    .unwrap();
    // One request per queue first: both workers run before the first switch (the frontend
    // does not wait for the backend to act on its vring messages).
    for q in 0..2 {
        assert_eq!(fe.request(q, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
    }
    let done = Arc::new(AtomicBool::new(false));
    let drive = s.drive.clone();
    let done2 = done.clone();
    let switcher = std::thread::spawn(move || {
        // The load stops with the switcher, even when a switch fails.
        let _done = SetOnDrop(done2);
        let mut out = Vec::new();
        for i in 0..100 {
            let to = if i % 2 == 0 { b.clone() } else { a.clone() };
            out.push(switch(&drive, to));
            std::thread::sleep(Duration::from_millis(5));
        }
        out
    });
    let spec = LoadSpec::verified_mix(blocks, seed, Some(done));
    // The load runs for as long as the switcher works.
    let total = run_load(&mut fe, &spec).unwrap();
    assert_eq!(total.errors, 0, "{:?}", total.mismatches);
    assert_eq!(total.mismatch_count, 0, "{:?}", total.mismatches);
    drop(fe);
    assert_eq!(total.verify_image(&s.image, bs as u32).unwrap(), blocks);
    let out = switcher.join().unwrap();
    assert!(total.reads > 1000 && total.writes > 1000);
    assert_eq!(drive_switches(s), 100);
    (total, out)
}

fn drive_switches(s: &TestServer) -> u64 {
    s.drive.stats.switches.load(Ordering::Relaxed)
}

/// Overlapped switches (`Drive::swap_engine`) under the same verifying load: new requests go
/// to the new engine at once, the ones in flight finish on the old one; nothing lost, nothing
/// reordered, every block verifies.
#[test]
fn hundred_overlapped_switches_under_qd32_verified_load() {
    let opts = ServerOptions {
        queues: 2,
        size: 32 << 20,
        poll_us: 50,
        io: IoMode::Uring,
        ..Default::default()
    };
    let s = TestServer::start(&opts);
    // Two io_uring engines on the same image: requests stay in flight across each swap.
    let a: Arc<dyn Engine> = file_engine(&s.image, &opts);
    let b: Arc<dyn Engine> = file_engine(&s.image, &opts);
    switches_under_load(&s, a, b, 43, |drive, to| {
        let ahead = drive.open_contexts(to.as_ref()).expect("contexts");
        let (r, draining) = drive.swap_engine(to, ahead).map_err(|e| e.1).expect("swap");
        assert_eq!(r.queues, 2);
        assert!(
            draining.wait(Duration::from_secs(10)).is_ok(),
            "old engine drained"
        );
    });
    let overlapped = s.drive.stats.overlapped.load(Ordering::Relaxed);
    println!("100 overlapped switches x 2 queues: {overlapped} queue swaps had requests in flight");
    assert!(overlapped > 0, "no swap found a request in flight");
}

/// The same between the direct engine and the relay (QEMU's vhost-user-blk export of the same
/// image, in qemu-storage-daemon): each swap leaves requests in flight on the engine left,
/// and a queue that comes back to the relay goes on where its shadow ring stood.
#[test]
fn hundred_overlapped_switches_between_direct_and_the_relay_under_qd32_verified_load() {
    use accel_dataplane::engine::relay::RelayEngine;
    use accel_tests::harness::{Qsd, QsdOptions};
    let opts = ServerOptions {
        queues: 2,
        size: 32 << 20,
        poll_us: 50,
        io: IoMode::Uring,
        ..Default::default()
    };
    let s = TestServer::start(&opts);
    let export = s.dir.path().join("export.sock");
    let _qsd = Qsd::start(
        &s.image,
        &export,
        &QsdOptions {
            queues: 2,
            iothread: true,
            ..Default::default()
        },
    )
    .expect("qemu-storage-daemon");
    let relay = Arc::new(RelayEngine::connect(&export, None, 2).unwrap());
    let a: Arc<dyn Engine> = file_engine(&s.image, &opts);
    let b: Arc<dyn Engine> = relay.clone();
    switches_under_load(&s, a, b, 44, |drive, to| {
        let ahead = drive.open_contexts(to.as_ref()).expect("contexts");
        let (r, draining) = drive.swap_engine(to, ahead).map_err(|e| e.1).expect("swap");
        assert_eq!(r.queues, 2);
        assert!(
            draining.wait(Duration::from_secs(10)).is_ok(),
            "old engine drained"
        );
    });
    let overlapped = s.drive.stats.overlapped.load(Ordering::Relaxed);
    let posted = relay
        .stats()
        .posted
        .load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "100 overlapped direct <-> relay switches x 2 queues: {overlapped} queue swaps had \
         requests in flight, {posted} requests through the relay"
    );
    assert!(overlapped > 0, "no swap found a request in flight");
    assert!(posted > 1000, "the relay served {posted}");
    assert!(relay.failure().is_none(), "{:?}", relay.failure());
}

/// An overlapped switch does not wait for the old engine: with a write held by the old
/// engine's server (an NBD server that answers it only when told), requests after the swap
/// complete on the new engine; the held one completes on the old engine once answered, and
/// only then is the old engine drained. Both writes are on the image.
#[test]
fn an_overlapped_switch_leaves_a_held_request_on_the_old_engine() {
    use accel_dataplane::engine::nbd::NbdEngine;
    use accel_tests::{header, Buf, Used, T_OUT};
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixListener;
    let s = TestServer::start(&ServerOptions {
        size: 8 << 20,
        ..Default::default()
    });
    let size = 8u64 << 20;
    let held_at = 4096 * 100;
    // The old engine: NBD to a server on the same image that holds the write at `held_at`
    // until `release` says so.
    let sock = s.dir.path().join("gate.sock");
    let l = UnixListener::bind(&sock).unwrap();
    let (held_tx, held_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(release_rx));
    let image = s.image.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let (held_tx, release_rx) = (held_tx.clone(), release_rx.clone());
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&image)
                .unwrap();
            std::thread::spawn(move || {
                if accel_tests::nbd_server::handshake(&mut c, size, 1 | 4, false, &|_| true)
                    .is_err()
                {
                    return;
                }
                // The hold hook blocks until the test releases the write, which is then
                // performed and answered.
                let _ = accel_tests::nbd_server::serve_file(&mut c, &f, |off| {
                    if off == held_at {
                        held_tx.send(()).unwrap();
                        release_rx.lock().unwrap().recv().unwrap();
                    }
                    false
                });
            });
        }
    });
    let old: Arc<dyn Engine> = Arc::new(NbdEngine::connect(&sock, "").unwrap());
    s.drive.switch_engine(old).expect("to the NBD engine");
    let mut fe = BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues: 1,
            queue_size: 128,
            max_data: 4096,
            event_idx: true,
            inflight: false,
        },
    )
    .unwrap();
    // The write the old engine's server holds, in slot 1.
    let slot = fe.slot(0, 1);
    fe.mem.write(slot.header, &header(T_OUT, held_at / 512));
    fe.mem.fill(slot.data, 4096, 0xa1);
    fe.mem.write(slot.status, &[0xff]);
    let head = fe
        .submit_chain(
            0,
            &[
                Buf::r(slot.header, 16),
                Buf::r(slot.data, 4096),
                Buf::w(slot.status, 1),
            ],
            None,
        )
        .unwrap();
    held_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the write reached the old engine's server");

    let new: Arc<dyn Engine> = file_engine(&s.image, &ServerOptions::default());
    let ahead = s.drive.open_contexts(new.as_ref()).unwrap();
    let (rep, draining) = s
        .drive
        .swap_engine(new, ahead)
        .map_err(|e| e.1)
        .expect("swap");
    assert_eq!(rep.to, "io_uring");
    // On the new engine while the old one still holds its write.
    let other = vec![0xb2u8; 4096];
    assert_eq!(fe.request(0, T_OUT, 8, &other, 0).unwrap().0, S_OK);
    let (st, data, _) = fe.request(0, accel_tests::T_IN, 8, &[], 4096).unwrap();
    assert_eq!((st, data), (S_OK, other.clone()));
    let mut used: Vec<Used> = Vec::new();
    fe.poll_used(0, &mut used);
    assert!(
        used.iter().all(|u| u.head != head),
        "the held write completed before its server answered"
    );
    // The server answers: the old engine completes the write, and only then is it drained.
    release_tx.send(()).unwrap();
    let t0 = std::time::Instant::now();
    while !used.iter().any(|u| u.head == head) {
        fe.wait_used(0, &mut used, Duration::from_secs(10)).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(20));
    }
    let mut st = [0u8];
    fe.mem.read(slot.status, &mut st);
    assert_eq!(st[0], S_OK);
    assert!(
        draining.wait(Duration::from_secs(10)).is_ok(),
        "old engine drained"
    );
    let f = std::fs::File::open(&s.image).unwrap();
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, held_at).unwrap();
    assert!(
        b.iter().all(|&x| x == 0xa1),
        "the held write is on the image"
    );
    f.read_exact_at(&mut b, 8 * 512).unwrap();
    assert_eq!(b, other);
    // Another switch may start now.
    let back: Arc<dyn Engine> = file_engine(&s.image, &ServerOptions::default());
    s.drive
        .switch_engine(back)
        .expect("a switch after the drain");
}
