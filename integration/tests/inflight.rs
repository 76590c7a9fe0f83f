//! Inflight tracking (INFLIGHT_SHMFD): acceld is SIGKILLed with requests in flight that
//! completed out of order; a new back-end on the same socket resubmits exactly the unfinished
//! ones, and none that completed: at once on a direct engine, and on a drive that starts held
//! (a qemu-engine drive before the supervisor has attached) once it gets an engine.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use accel_dataplane::engine::{Engine, HeldEngine};
use accel_integration::Acceld;
use accel_tests::harness::{file_engine, ServerOptions, TestServer};
use accel_tests::hostile_nbd::start_holding_odd_writes;
use accel_tests::{header, pattern, BlkFrontend, Buf, FrontendOptions, Used, S_OK, T_IN, T_OUT};

const BLOCKS: u64 = 32;
const SIZE: u64 = 16 << 20;

fn wait_for(fe: &mut BlkFrontend, used: &mut Vec<Used>, n: usize) {
    while used.len() < n {
        fe.wait_used(0, used, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{} of {n} completions: {e}", used.len()));
    }
}

/// What the first acceld left: the front-end, its requests (head, block, status address) and
/// the blocks that completed before the kill.
struct Killed {
    fe: BlkFrontend,
    heads: Vec<(u16, u64, u64)>,
    first_done: BTreeSet<u64>,
}

impl Killed {
    fn block_of(&self, head: u16) -> u64 {
        self.heads
            .iter()
            .find(|x| x.0 == head)
            .map(|x| x.1)
            .unwrap()
    }

    /// Waits for the 16 unfinished requests to complete again: exactly the odd blocks.
    fn wait_unfinished_run(&mut self, what: &str) {
        let mut again = Vec::new();
        wait_for(&mut self.fe, &mut again, (BLOCKS / 2) as usize);
        let resubmitted: BTreeSet<u64> = again.iter().map(|u| self.block_of(u.head)).collect();
        let odd: BTreeSet<u64> = (0..BLOCKS).filter(|b| b % 2 == 1).collect();
        assert_eq!(resubmitted, odd, "{what}");
    }

    /// Every request ended OK and every block holds what the guest wrote.
    fn assert_all_written(&mut self) {
        for &(_, b, status) in &self.heads {
            let mut st = [0u8];
            self.fe.mem.read(status, &mut st);
            assert_eq!(st[0], S_OK, "block {b}");
        }
        for b in 0..BLOCKS {
            let (st, got, _) = self.fe.request(0, T_IN, b * 8, &[], 4096).unwrap();
            assert_eq!(st, S_OK);
            let mut want = vec![0u8; 4096];
            pattern(b * 4096, 5, &mut want);
            assert!(
                got == want,
                "block {b} holds the data written before the kill"
            );
        }
    }
}

/// A directory in /var/tmp holding an empty image of SIZE bytes.
fn work_dir(prefix: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    (dir, image)
}

/// Serves `sock` with an acceld whose NBD export completes even blocks' writes and never the
/// odd ones, writes each of 32 blocks (16 complete, out of order) and SIGKILLs it with 16
/// requests in flight.
fn kill_with_odd_writes_in_flight(dir: &Path, sock: &Path, image: &Path) -> Killed {
    let nbd = start_holding_odd_writes(&dir.join("nbd.sock"), image).unwrap();
    let mut first = Acceld::serve(
        sock,
        &[
            "--nbd-socket",
            nbd.socket.to_str().unwrap(),
            "--nbd-export",
            &nbd.export,
        ],
        &dir.join("acceld-first.log"),
    )
    .unwrap();
    let mut fe = BlkFrontend::connect(
        sock,
        FrontendOptions {
            queues: 1,
            queue_size: 128,
            max_data: 4096,
            inflight: true,
            ..Default::default()
        },
    )
    .unwrap();
    let mut heads = Vec::new();
    for b in 0..BLOCKS {
        let sl = fe.slot(0, b as u16);
        let mut data = vec![0u8; 4096];
        pattern(b * 4096, 5, &mut data);
        fe.mem.write(sl.header, &header(T_OUT, b * 8));
        fe.mem.write(sl.data, &data);
        fe.mem.write(sl.status, &[0xff]);
        let h = fe
            .submit_chain(
                0,
                &[
                    Buf::r(sl.header, 16),
                    Buf::r(sl.data, 4096),
                    Buf::w(sl.status, 1),
                ],
                None,
            )
            .unwrap();
        heads.push((h, b, sl.status));
    }
    let mut used = Vec::new();
    wait_for(&mut fe, &mut used, (BLOCKS / 2) as usize);
    let mut k = Killed {
        fe,
        heads,
        first_done: BTreeSet::new(),
    };
    k.first_done = used.iter().map(|u| k.block_of(u.head)).collect();
    assert!(
        k.first_done.iter().all(|b| b % 2 == 0),
        "only even blocks complete: {:?}",
        k.first_done
    );
    // SIGKILL: no drain, 16 requests in flight.
    first.kill().unwrap();
    k
}

#[test]
fn a_killed_acceld_is_replaced_and_only_unfinished_requests_run_again() {
    let (dir, image) = work_dir("accel-inflight");
    let sock = dir.path().join("d.sock");
    let log = dir.path().join("acceld.log");
    let mut k = kill_with_odd_writes_in_flight(dir.path(), &sock, &image);
    // A new acceld on the same socket, on the image itself; the frontend reconnects with the
    // same inflight region, its ring base at the used index (as QEMU does after a crash).
    let _second = Acceld::serve(&sock, &["--image", image.to_str().unwrap()], &log).unwrap();
    k.fe.reconnect().unwrap();
    k.wait_unfinished_run("exactly the unfinished requests ran again");
    // Nothing more: no completed request was replayed.
    let mut extra = Vec::new();
    let _ = k.fe.wait_used(0, &mut extra, Duration::from_millis(300));
    assert!(extra.is_empty(), "replayed: {extra:?}");
    k.assert_all_written();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("resubmitting"), "{text}");
}

/// After a SIGKILL, a qemu-engine drive comes back held (no engine until the supervisor has
/// attached to its VM): its queue starts paused on a null context, and the unfinished
/// requests must wait for the engine, not fail on the null context (they did: EIO to the
/// guest for every request in flight at the kill).
#[test]
fn requests_in_flight_at_a_kill_wait_for_a_held_drive_engine() {
    let (dir, image) = work_dir("accel-inflight-held");
    // TestServer serves DIR/vhost.sock.
    let sock = dir.path().join("vhost.sock");
    let mut k = kill_with_odd_writes_in_flight(dir.path(), &sock, &image);
    let opts = ServerOptions {
        size: SIZE,
        queues: 1,
        ..Default::default()
    };
    let held: Arc<dyn Engine> = Arc::new(HeldEngine);
    let server = TestServer::serve_engine(dir, image.clone(), held, SIZE, &opts);
    k.fe.reconnect().unwrap();
    // The queue runs (paused, held) before the engine comes: the case of a restart.
    assert!(
        server.drive.wait_running_queues(1, Duration::from_secs(10)),
        "the queue's worker did not start"
    );
    let mut early = Vec::new();
    let _ = k.fe.wait_used(0, &mut early, Duration::from_millis(200));
    assert!(
        early.is_empty(),
        "a held drive completed requests: {early:?}"
    );
    let direct: Arc<dyn Engine> = file_engine(&image, &opts);
    server.drive.switch_engine(direct).expect("switch");
    k.wait_unfinished_run("exactly the unfinished requests ran, once the engine came");
    k.assert_all_written();
}
