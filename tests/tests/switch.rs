//! Live engine switches under a verifying QD32 load on two queues: nothing lost, nothing
//! reordered, every block verifies, and every pause is reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use accel_tests::harness::{file_engine, ServerOptions, TestServer};
use accel_tests::load::{fill_image, run_load, LoadSpec};
use accel_tests::{BlkFrontend, FrontendOptions, S_OK, T_FLUSH};
use acceld::engine::{Engine, IoMode};

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
    let bs = 4096u64;
    let blocks = (32 << 20) / bs;
    fill_image(&s.image, blocks * bs, 1).unwrap();
    // Two instances of the file engine on the same image, one per I/O mode: a switch moves
    // every queue from one to the other.
    let a: Arc<dyn Engine> = file_engine(&s.image, &opts);
    let b: Arc<dyn Engine> = file_engine(&s.image, &inline);
    assert_eq!((a.io_path(), b.io_path()), ("io_uring", "inline"));
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
        struct Done(Arc<AtomicBool>);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _done = Done(done2.clone());
        let mut pauses = Vec::new();
        for i in 0..100 {
            let to = if i % 2 == 0 { b.clone() } else { a.clone() };
            let r = drive.switch_engine(to).expect("switch");
            assert_eq!(r.queues, 2, "both queues were drained and moved");
            pauses.push(r.pause);
            std::thread::sleep(Duration::from_millis(5));
        }
        done2.store(true, Ordering::Relaxed);
        pauses
    });
    let spec = LoadSpec::verified_mix(blocks, 42, Some(done));
    // The load runs for as long as the switcher works.
    let total = run_load(&mut fe, &spec).unwrap();
    assert_eq!(total.errors, 0, "{:?}", total.mismatches);
    assert_eq!(total.mismatch_count, 0, "{:?}", total.mismatches);
    drop(fe);
    let checked = total.verify_image(&s.image, bs as u32).unwrap();
    assert_eq!(checked, blocks);
    let mut pauses = switcher.join().unwrap();
    pauses.sort();
    let p50 = pauses[pauses.len() / 2];
    let p99 = pauses[pauses.len() * 99 / 100];
    let max = *pauses.last().unwrap();
    println!(
        "100 switches under QD32 x 2 queues: {} reads, {} writes verified, 0 errors; \
         pause p50 {:?}, p99 {:?}, max {:?}",
        total.reads, total.writes, p50, p99, max
    );
    assert!(total.reads > 1000 && total.writes > 1000);
    assert_eq!(drive_switches(&s), 100);
}

fn drive_switches(s: &TestServer) -> u64 {
    s.drive.stats.switches.load(Ordering::Relaxed)
}
