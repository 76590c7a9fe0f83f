//! Lending a drive's rings to QEMU's own vhost-user-blk export (`drive::lend`), against a real
//! `qemu-storage-daemon` serving one node twice (its vhost-user-blk export and the NBD export
//! the qemu engine uses), from one iothread as in a VM's QEMU: a verifying load on two queues
//! goes on across lends and take-backs with nothing lost or replayed, and a front-end's ring
//! stop while lent takes the rings back with the exact base.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_dataplane::engine::nbd::NbdEngine;
use accel_dataplane::engine::Engine;
use accel_tests::harness::{Qsd, QsdOptions, ServerOptions, TestServer};
use accel_tests::load::{fill_image, run_load, LoadSpec, SetOnDrop};
use accel_tests::{BlkFrontend, FrontendOptions, S_OK, T_FLUSH, T_IN, T_OUT};

const BS: u64 = 4096;
const SIZE: u64 = 32 << 20;

struct Setup {
    s: TestServer,
    export: std::path::PathBuf,
    _qsd: Qsd,
}

/// One image, QEMU's two exports of it, and acceld serving it on the qemu engine (NBD).
fn setup(queues: u16) -> Setup {
    let dir = tempfile::Builder::new()
        .prefix("accel-lend")
        .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    fill_image(&image, SIZE, 1).unwrap();
    let export = dir.path().join("export.sock");
    let nbd = dir.path().join("nbd.sock");
    // Qsd::start returns once the daemon wrote its pid file: its exports and NBD server are
    // up (no probe connection, no retry).
    let qsd = Qsd::start(
        &image,
        &export,
        &QsdOptions {
            queues,
            iothread: true,
            nbd: Some(nbd.clone()),
            ..Default::default()
        },
    )
    .expect("qemu-storage-daemon");
    let engine = NbdEngine::connect_ahead(&nbd, "disk0", usize::from(queues))
        .expect("qemu-storage-daemon's NBD export");
    let size = engine.info().size;
    let engine: Arc<dyn Engine> = Arc::new(engine);
    let s = TestServer::serve_engine(
        dir,
        image,
        engine,
        size,
        &ServerOptions {
            queues,
            size,
            ..Default::default()
        },
    );
    Setup {
        s,
        export,
        _qsd: qsd,
    }
}

fn frontend(s: &TestServer, queues: usize) -> BlkFrontend {
    let mut fe = BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues,
            queue_size: 128,
            max_data: 4096,
            event_idx: true,
            inflight: false,
        },
    )
    .unwrap();
    // One request per queue: every worker runs before the first lend.
    for q in 0..queues {
        assert_eq!(fe.request(q, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
    }
    fe
}

fn served_by_acceld(s: &TestServer) -> u64 {
    let c = s.drive.stats.acct.counters();
    c.reads() + c.writes()
}

#[test]
fn twenty_lends_and_take_backs_under_a_verifying_qd32_load() {
    let su = setup(2);
    let s = &su.s;
    let mut fe = frontend(s, 2);
    let done = Arc::new(AtomicBool::new(false));
    let (drive, export, done2) = (s.drive.clone(), su.export.clone(), done.clone());
    let lender = std::thread::spawn(move || {
        let _done = SetOnDrop(done2);
        let mut pauses = Vec::new();
        for _ in 0..20 {
            let r = drive.lend_rings(&export, None).expect("lend");
            assert_eq!(r.queues, 2);
            assert!(drive.rings_lent());
            std::thread::sleep(Duration::from_millis(30));
            let back = drive.reclaim_rings().expect("rings were lent");
            assert!(!drive.rings_lent());
            pauses.push((r.pause, back.pause));
            std::thread::sleep(Duration::from_millis(10));
        }
        pauses
    });
    let spec = LoadSpec::verified_mix(SIZE / BS, 7, Some(done));
    let total = run_load(&mut fe, &spec).unwrap();
    let pauses = lender.join().unwrap();
    assert_eq!(total.errors, 0, "{:?}", total.mismatches);
    assert_eq!(total.mismatch_count, 0, "{:?}", total.mismatches);
    drop(fe);
    assert_eq!(total.verify_image(&s.image, BS as u32).unwrap(), SIZE / BS);
    assert_eq!(s.drive.stats.lends.load(Ordering::Relaxed), 20);
    // QEMU's export served part of the load: acceld saw fewer requests than completed.
    let acceld = served_by_acceld(s);
    assert!(
        acceld < total.reads + total.writes,
        "acceld served {acceld} of {} requests",
        total.reads + total.writes
    );
    assert!(
        total.reads > 500 && total.writes > 500,
        "{}",
        total.summary()
    );
    let worst = pauses.iter().map(|p| p.0.max(p.1)).max().unwrap();
    println!(
        "20 lends under QD32 x 2: {}; acceld served {acceld}; worst lend or take-back pause {worst:?}",
        total.summary()
    );
}

#[test]
fn a_ring_stop_while_lent_takes_the_rings_back_at_the_exact_base() {
    let su = setup(1);
    let s = &su.s;
    let mut fe = frontend(s, 1);
    s.drive.lend_rings(&su.export, None).expect("lend");
    let before = served_by_acceld(s);
    // 50 writes and reads through the lent ring: QEMU's export serves them, acceld sees none.
    for i in 0..25u64 {
        let data = vec![i as u8 + 1; 4096];
        assert_eq!(fe.request(0, T_OUT, i * 8, &data, 0).unwrap().0, S_OK);
        let (st, got, _) = fe.request(0, T_IN, i * 8, &[], 4096).unwrap();
        assert_eq!((st, got), (S_OK, data));
    }
    assert_eq!(served_by_acceld(s), before);
    assert!(s.drive.rings_lent());
    // QEMU's front-end stops the ring: acceld takes it back first and answers with the base
    // after every request (1 flush before the lend, 50 through the export).
    let base = fe.get_vring_base(0).unwrap();
    assert_eq!(base, 51);
    assert!(!s.drive.rings_lent());
    fe.restart_queue(0, base as u16).unwrap();
    let data = vec![0x5a; 4096];
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().1, data);
    assert_eq!(served_by_acceld(s), before + 2, "acceld serves again");
}

#[test]
fn a_lender_lends_again_after_a_front_end_took_the_rings_back() {
    let su = setup(1);
    let s = &su.s;
    let mut fe = frontend(s, 1);
    let lender = s.drive.spawn_lender(su.export.clone(), None).unwrap();
    let wait_lent = |n: u64| {
        let t0 = Instant::now();
        while s.drive.stats.lends.load(Ordering::Relaxed) < n || !s.drive.rings_lent() {
            assert!(t0.elapsed() < Duration::from_secs(10), "not lent again");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_lent(1);
    let base = fe.get_vring_base(0).unwrap();
    assert_eq!(base, 1);
    fe.restart_queue(0, base as u16).unwrap();
    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
    wait_lent(2);
    let before = served_by_acceld(s);
    let data = vec![0xa5; 4096];
    assert_eq!(fe.request(0, T_OUT, 8, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 8, &[], 4096).unwrap().1, data);
    assert_eq!(served_by_acceld(s), before, "the export served them");
    drop(lender);
    assert!(
        !s.drive.rings_lent(),
        "dropping the lender takes the rings back"
    );
    assert_eq!(fe.request(0, T_IN, 8, &[], 4096).unwrap().1, data);
    assert_eq!(served_by_acceld(s), before + 1);
}

/// What a hostile or broken export does.
#[derive(Clone, Copy)]
enum Fake {
    /// Refuses SET_VRING_KICK (non-zero acknowledgement): a ring had reached it already.
    RefuseKick,
    /// Answers SET_MEM_TABLE with a reply to another request.
    WrongReply,
    /// Accepts everything (and, as every variant, answers GET_VRING_BASE with a base of its
    /// own invention).
    LyingBase,
}

/// A vhost-user "export" on `path` that acts as `how`, for one session at a time.
fn fake_export(path: &std::path::Path, how: Fake) -> std::thread::JoinHandle<()> {
    use std::io::{Read, Write};
    let l = std::os::unix::net::UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            loop {
                let mut h = [0u8; 12];
                if s.read_exact(&mut h).is_err() {
                    break;
                }
                let req = u32::from_le_bytes(h[0..4].try_into().unwrap());
                let flags = u32::from_le_bytes(h[4..8].try_into().unwrap());
                let size = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
                let mut p = vec![0u8; size];
                if s.read_exact(&mut p).is_err() {
                    break;
                }
                let reply = |s: &mut std::os::unix::net::UnixStream, req: u32, body: &[u8]| {
                    let mut m = Vec::new();
                    m.extend_from_slice(&req.to_le_bytes());
                    m.extend_from_slice(&(0x1u32 | 0x4).to_le_bytes());
                    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
                    m.extend_from_slice(body);
                    let _ = s.write_all(&m);
                };
                match (req, how) {
                    // GET_FEATURES, GET_PROTOCOL_FEATURES: everything; GET_QUEUE_NUM: 8.
                    (1 | 15, _) => reply(&mut s, req, &u64::MAX.to_le_bytes()),
                    (17, _) => reply(&mut s, req, &8u64.to_le_bytes()),
                    // GET_VRING_BASE: a base of its own invention.
                    (11, _) => {
                        let mut b = p[0..4].to_vec();
                        b.extend_from_slice(&7777u32.to_le_bytes());
                        reply(&mut s, req, &b)
                    }
                    (5, Fake::WrongReply) => reply(&mut s, 3, &0u64.to_le_bytes()),
                    (12, Fake::RefuseKick) if flags & 0x8 != 0 && p[1] & 1 == 0 => {
                        reply(&mut s, req, &1u64.to_le_bytes())
                    }
                    _ if flags & 0x8 != 0 => reply(&mut s, req, &0u64.to_le_bytes()),
                    _ => {}
                }
            }
        }
    })
}

/// An export that refuses the rings, answers out of turn or lies about where it stopped:
/// the lend fails or the take-back resumes where the ring really is; acceld serves every
/// request again, nothing is replayed or lost.
#[test]
fn a_broken_or_lying_export_costs_nothing() {
    let su = setup(1);
    let s = &su.s;
    let mut fe = frontend(s, 1);
    let mut sent = 1u32; // the flush of `frontend`
    for (i, how) in [Fake::RefuseKick, Fake::WrongReply, Fake::LyingBase]
        .into_iter()
        .enumerate()
    {
        let path = s.dir.path().join(format!("fake{i}.sock"));
        let _t = fake_export(&path, how);
        let r = s.drive.lend_rings(&path, None);
        match how {
            Fake::LyingBase => {
                r.expect("this one accepts the rings");
                assert!(s.drive.rings_lent());
                // It pops nothing: the take-back resumes at acceld's own position.
                s.drive.reclaim_rings().expect("lent");
            }
            _ => {
                let e = r.expect_err("the lend must fail");
                println!(
                    "refused as expected: {}",
                    accel_dataplane::util::error_chain(&e)
                );
            }
        }
        assert!(!s.drive.rings_lent());
        let before = served_by_acceld(s);
        let data = vec![i as u8 + 0x10; 4096];
        assert_eq!(fe.request(0, T_OUT, 64, &data, 0).unwrap().0, S_OK);
        assert_eq!(fe.request(0, T_IN, 64, &[], 4096).unwrap().1, data);
        sent += 2;
        assert_eq!(served_by_acceld(s), before + 2, "acceld serves");
    }
    // The ring is exactly where the guest's requests put it.
    assert_eq!(fe.get_vring_base(0).unwrap(), sent);
}

#[test]
fn a_driver_without_event_idx_is_not_lent() {
    let su = setup(1);
    let s = &su.s;
    let mut fe = BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues: 1,
            queue_size: 128,
            max_data: 4096,
            event_idx: false,
            inflight: false,
        },
    )
    .unwrap();
    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
    let e = s
        .drive
        .lend_rings(&su.export, None)
        .expect_err("no EVENT_IDX");
    assert!(e.to_string().contains("EVENT_IDX"), "{e}");
    assert!(!s.drive.rings_lent());
    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
}

/// A guest that writes its own used ring while lent (the ring then never looks idle): the
/// take-back does not hang or trust it; after a bounded wait it takes the export's word that
/// its session drained (a new session is answered only then) and resumes where the export's
/// pops stopped.
#[test]
fn a_used_ring_forged_by_the_guest_does_not_hang_the_take_back() {
    let su = setup(1);
    let s = &su.s;
    let mut fe = frontend(s, 1);
    s.drive.lend_rings(&su.export, None).expect("lend");
    let (used, _) = fe.used_ring(0);
    let mut idx = [0u8; 2];
    fe.mem.read(used + 2, &mut idx);
    let real = u16::from_le_bytes(idx);
    fe.mem.write(used + 2, &real.wrapping_add(3).to_le_bytes());
    let t0 = Instant::now();
    s.drive.reclaim_rings().expect("lent");
    let took = t0.elapsed();
    assert!(!s.drive.rings_lent());
    assert!(took < Duration::from_secs(30), "take-back took {took:?}");
    // The guest's own ring says where it is: one request before the lend, none since.
    fe.mem.write(used + 2, &real.to_le_bytes());
    assert_eq!(fe.get_vring_base(0).unwrap(), 1);
    println!("take-back with a forged used index: {took:?}");
}
