//! The relay (`engine::relay`): acceld serves the guest's rings and posts each request on a
//! shadow ring of its own in QEMU's vhost-user-blk export, here a real `qemu-storage-daemon`
//! serving one node from an iothread as in a VM's QEMU. What the guest sees is acceld's
//! device: its serial, its counters, its checks; what reaches the image is the export's work.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use accel_dataplane::drive::ErrorPolicy;
use accel_dataplane::engine::relay::RelayEngine;
use accel_dataplane::engine::Engine;
use accel_tests::harness::{Qsd, QsdOptions, ServerOptions, TestServer};
use accel_tests::load::{fill_image, run_load, LoadSpec};
use accel_tests::{
    BlkFrontend, FrontendOptions, S_IOERR, S_OK, T_DISCARD, T_FLUSH, T_GET_ID, T_IN, T_OUT,
    T_WRITE_ZEROES,
};

const BS: u64 = 4096;
const SIZE: u64 = 32 << 20;

struct Setup {
    s: TestServer,
    relay: Arc<RelayEngine>,
    qsd: Qsd,
}

/// One image, QEMU's vhost-user-blk export of it, and acceld serving it through the relay.
fn setup(queues: u16, o: ServerOptions) -> Setup {
    let dir = tempfile::Builder::new()
        .prefix("accel-relay")
        .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    fill_image(&image, SIZE, 1).unwrap();
    let export = dir.path().join("export.sock");
    let qsd = Qsd::start(
        &image,
        &export,
        &QsdOptions {
            queues,
            iothread: true,
            ..Default::default()
        },
    )
    .expect("qemu-storage-daemon");
    let relay = Arc::new(RelayEngine::connect(&export, None, usize::from(queues)).unwrap());
    assert_eq!(relay.config().capacity, SIZE);
    assert_eq!(relay.io_path(), "vhost-user");
    let engine: Arc<dyn Engine> = relay.clone();
    let s = TestServer::serve_engine(
        dir,
        image,
        engine,
        SIZE,
        &ServerOptions {
            queues,
            size: SIZE,
            ..o
        },
    );
    Setup { s, relay, qsd }
}

fn frontend(s: &TestServer, queues: usize) -> BlkFrontend {
    BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues,
            queue_size: 128,
            max_data: 1 << 20,
            event_idx: true,
            inflight: false,
        },
    )
    .unwrap()
}

#[test]
fn a_verifying_qd32_load_on_two_queues_goes_through_the_export() {
    let su = setup(2, ServerOptions::default());
    let s = &su.s;
    let mut fe = frontend(s, 2);
    let mut spec = LoadSpec::verified_mix(SIZE / BS, 11, None);
    spec.duration = None;
    spec.requests = Some(20_000);
    let total = run_load(&mut fe, &spec).unwrap();
    assert_eq!(total.errors, 0, "{:?}", total.mismatches);
    assert_eq!(total.mismatch_count, 0, "{:?}", total.mismatches);
    assert!(
        total.reads > 5000 && total.writes > 5000,
        "{}",
        total.summary()
    );
    // Every request was acceld's to count, and every data request went to the export.
    let c = s.drive.stats.acct.counters();
    assert_eq!(c.reads() + c.writes(), total.reads + total.writes);
    let posted = su.relay.stats().posted.load(Ordering::Relaxed);
    assert!(
        posted >= total.reads + total.writes,
        "{posted} posted for {} requests",
        total.reads + total.writes
    );
    assert!(su.relay.failure().is_none());
    drop(fe);
    // What the export wrote is in the image.
    assert_eq!(total.verify_image(&s.image, BS as u32).unwrap(), SIZE / BS);
    let kicks = su.relay.stats().kicks.load(Ordering::Relaxed);
    println!(
        "relay QD32 x 2: {}; {posted} posted, {kicks} kicks",
        total.summary()
    );
}

#[test]
fn the_guest_reads_acceld_s_serial_and_acceld_s_counters_grow() {
    let su = setup(
        1,
        ServerOptions {
            serial: "relay-serial-01".into(),
            ..Default::default()
        },
    );
    let s = &su.s;
    let mut fe = frontend(s, 1);
    let (st, id, _) = fe.request(0, T_GET_ID, 0, &[], 20).unwrap();
    assert_eq!(st, S_OK);
    assert_eq!(
        &id[..15],
        b"relay-serial-01",
        "{:?}",
        String::from_utf8_lossy(&id)
    );
    let before = s.drive.stats.acct.counters();
    let data = vec![0x5au8; 8192];
    assert_eq!(fe.request(0, T_OUT, 8, &data, 0).unwrap().0, S_OK);
    let (st, back, _) = fe.request(0, T_IN, 8, &[], 8192).unwrap();
    assert_eq!(st, S_OK);
    assert_eq!(back, data);
    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
    let after = s.drive.stats.acct.counters();
    assert_eq!(after.reads() - before.reads(), 1);
    assert_eq!(after.writes() - before.writes(), 1);
    assert_eq!(after.rd_bytes - before.rd_bytes, 8192);
    assert_eq!(after.wr_bytes - before.wr_bytes, 8192);
    // A request past the end is acceld's to refuse: the export never sees it.
    let posted = su.relay.stats().posted.load(Ordering::Relaxed);
    let (st, _, _) = fe.request(0, T_IN, SIZE / 512, &[], 4096).unwrap();
    assert_eq!(st, S_IOERR);
    assert_eq!(su.relay.stats().posted.load(Ordering::Relaxed), posted);
    // The image holds the write (read back past acceld).
    let img = std::fs::read(&s.image).unwrap();
    assert_eq!(&img[4096..4096 + 8192], &data[..]);
}

/// Discards and write-zeroes longer than the export takes in one segment (a guest of QEMU's
/// virtio-blk device may send up to 4 GiB) are split.
#[test]
fn write_zeroes_and_discard_of_64_mib_reach_the_image_in_parts() {
    const BIG: u64 = 64 << 20;
    let dir = tempfile::Builder::new()
        .prefix("accel-relay")
        .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image).unwrap().set_len(BIG).unwrap();
    fill_image(&image, BIG, 3).unwrap();
    let export = dir.path().join("export.sock");
    let _qsd = Qsd::start(&image, &export, &QsdOptions::default()).expect("qsd");
    let relay = Arc::new(RelayEngine::connect(&export, None, 1).unwrap());
    let s = TestServer::serve_engine(
        dir,
        image,
        relay.clone(),
        BIG,
        &ServerOptions {
            size: BIG,
            werror: ErrorPolicy::Report,
            // QEMU's virtio-blk device: discards and write-zeroes up to 4 GiB.
            model: accel_dataplane::drive::DeviceModel::VirtioBlk,
            ..Default::default()
        },
    );
    let mut fe = frontend(&s, 1);
    // Zero [1 MiB, 41 MiB): 81920 sectors, three parts of at most 32768.
    let mut seg = Vec::new();
    seg.extend_from_slice(&2048u64.to_le_bytes());
    seg.extend_from_slice(&81920u32.to_le_bytes());
    seg.extend_from_slice(&0u32.to_le_bytes());
    let before = relay.stats().posted.load(Ordering::Relaxed);
    assert_eq!(fe.request(0, T_WRITE_ZEROES, 0, &seg, 0).unwrap().0, S_OK);
    assert_eq!(relay.stats().posted.load(Ordering::Relaxed) - before, 3);
    let (st, z, _) = fe.request(0, T_IN, 2048 + 81920 - 8, &[], 4096).unwrap();
    assert_eq!(st, S_OK);
    assert!(z.iter().all(|&b| b == 0));
    let (st, nz, _) = fe.request(0, T_IN, 2048 + 81920, &[], 4096).unwrap();
    assert_eq!(st, S_OK);
    assert!(nz.iter().any(|&b| b != 0), "the zeroing stopped at its end");
    // A discard is a hint; it succeeds.
    assert_eq!(fe.request(0, T_DISCARD, 0, &seg, 0).unwrap().0, S_OK);
    drop(fe);
    let img = std::fs::read(&s.image).unwrap();
    assert!(img[(1 << 20)..(41 << 20)].iter().all(|&b| b == 0));
}

#[test]
fn an_export_that_goes_away_fails_requests_and_hangs_nothing() {
    let mut su = setup(
        1,
        ServerOptions {
            werror: ErrorPolicy::Report,
            rerror: ErrorPolicy::Report,
            ..Default::default()
        },
    );
    let mut fe = frontend(&su.s, 1);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().0, S_OK);
    su.qsd.kill();
    // The session thread sees the end; requests then fail at once instead of waiting.
    let why = su.relay.wait_failed(std::time::Duration::from_secs(10));
    assert!(why.is_some_and(|w| w.contains("closed the session")));
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().0, S_IOERR);
    assert_eq!(fe.request(0, T_OUT, 0, &[0u8; 4096], 0).unwrap().0, S_IOERR);
    // GET_ID is acceld's, and still answered.
    assert_eq!(fe.request(0, T_GET_ID, 0, &[], 20).unwrap().0, S_OK);
}
