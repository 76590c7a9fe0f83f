//! Inflight tracking (INFLIGHT_SHMFD): acceld is SIGKILLed with requests in flight that
//! completed out of order; a new acceld on the same socket resubmits exactly the unfinished
//! ones, and none that completed.

use std::collections::BTreeSet;
use std::time::Duration;

use accel_integration::Acceld;
use accel_tests::hostile_nbd::start_holding_odd_writes;
use accel_tests::{header, pattern, BlkFrontend, Buf, FrontendOptions, Used, S_OK, T_IN, T_OUT};

const BLOCKS: u64 = 32;

fn wait_for(fe: &mut BlkFrontend, used: &mut Vec<Used>, n: usize) {
    while used.len() < n {
        fe.wait_used(0, used, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{} of {n} completions: {e}", used.len()));
    }
}

#[test]
fn a_killed_acceld_is_replaced_and_only_unfinished_requests_run_again() {
    let dir = tempfile::Builder::new()
        .prefix("accel-inflight")
        .tempdir_in("/var/tmp")
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let nbd = start_holding_odd_writes(&dir.path().join("nbd.sock"), &image).unwrap();
    let sock = dir.path().join("d.sock");
    let log = dir.path().join("acceld.log");
    // The first acceld serves through an NBD export that completes even blocks' writes and
    // never the odd ones: 32 requests in flight, 16 of them complete, out of order.
    let mut first = Acceld::serve(
        &sock,
        &[
            "--nbd-socket",
            nbd.socket.to_str().unwrap(),
            "--nbd-export",
            &nbd.export,
        ],
        &log,
    )
    .unwrap();
    let mut fe = BlkFrontend::connect(
        &sock,
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
    let block_of = |h: u16| heads.iter().find(|x| x.0 == h).map(|x| x.1).unwrap();
    let first_done: BTreeSet<u64> = used.iter().map(|u| block_of(u.head)).collect();
    assert!(
        first_done.iter().all(|b| b % 2 == 0),
        "only even blocks complete: {first_done:?}"
    );
    // SIGKILL: no drain, 16 requests in flight.
    first.kill().unwrap();
    // A new acceld on the same socket, on the image itself; the frontend reconnects with the
    // same inflight region, its ring base at the used index (as QEMU does after a crash).
    let _second = Acceld::serve(&sock, &["--image", image.to_str().unwrap()], &log).unwrap();
    fe.reconnect().unwrap();
    let mut again = Vec::new();
    wait_for(&mut fe, &mut again, (BLOCKS / 2) as usize);
    let resubmitted: BTreeSet<u64> = again.iter().map(|u| block_of(u.head)).collect();
    let odd: BTreeSet<u64> = (0..BLOCKS).filter(|b| b % 2 == 1).collect();
    assert_eq!(
        resubmitted, odd,
        "exactly the unfinished requests ran again"
    );
    // Nothing more: no completed request was replayed.
    let mut extra = Vec::new();
    let _ = fe.wait_used(0, &mut extra, Duration::from_millis(300));
    assert!(extra.is_empty(), "replayed: {extra:?}");
    for &(_, b, status) in &heads {
        let mut st = [0u8];
        fe.mem.read(status, &mut st);
        assert_eq!(st[0], S_OK, "block {b}");
    }
    for b in 0..BLOCKS {
        let (st, got, _) = fe.request(0, T_IN, b * 8, &[], 4096).unwrap();
        assert_eq!(st, S_OK);
        let mut want = vec![0u8; 4096];
        pattern(b * 4096, 5, &mut want);
        assert!(
            got == want,
            "block {b} holds the data written before the kill"
        );
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("resubmitting"), "{text}");
}
