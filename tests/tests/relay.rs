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
fn write_zeroes_and_discard_of_40_mib_reach_the_image_in_parts() {
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

/// With a supervisor's fallback (`hold_when_lost`), the export's end holds requests instead
/// of failing them, whatever the error policy, and an overlapped switch to another engine
/// takes them (the old path is lost, so held requests do not stop the swap): they complete
/// there, on the image, and the old engine drains without them.
#[test]
fn a_lost_export_holds_requests_until_another_engine_takes_them() {
    use std::os::unix::fs::FileExt;
    let mut su = setup(
        1,
        ServerOptions {
            werror: ErrorPolicy::Report,
            rerror: ErrorPolicy::Report,
            ..Default::default()
        },
    );
    su.relay.hold_when_lost(true);
    let mut fe = frontend(&su.s, 1);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().0, S_OK);
    su.qsd.kill();
    assert!(su
        .relay
        .wait_failed(std::time::Duration::from_secs(10))
        .is_some());
    assert!(su.relay.lost());
    // A write after the end: held, not answered.
    let at = 4096 * 77;
    let slot = fe.slot(0, 1);
    fe.mem
        .write(slot.header, &accel_tests::header(T_OUT, at / 512));
    fe.mem.fill(slot.data, 4096, 0xc3);
    fe.mem.write(slot.status, &[0xff]);
    let head = fe
        .submit_chain(
            0,
            &[
                accel_tests::Buf::r(slot.header, 16),
                accel_tests::Buf::r(slot.data, 4096),
                accel_tests::Buf::w(slot.status, 1),
            ],
            None,
        )
        .unwrap();
    let stats = &su.s.drive.stats;
    let t0 = std::time::Instant::now();
    while stats.held_requests.load(Ordering::Relaxed) == 0 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "not held"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut used = Vec::new();
    fe.poll_used(0, &mut used);
    assert!(
        used.iter().all(|u: &accel_tests::Used| u.head != head),
        "answered while held"
    );

    let new: Arc<dyn Engine> =
        accel_tests::harness::file_engine(&su.s.image, &ServerOptions::default());
    let ahead = su.s.drive.open_contexts(new.as_ref()).unwrap();
    let (rep, draining) = match su.s.drive.swap_engine(new, ahead) {
        Ok(r) => r,
        Err((_, e)) => {
            // The held write fails at its next retry, so the server's drop does not wait
            // for it.
            su.relay.hold_when_lost(false);
            panic!("no overlapped swap off a lost path with a request held: {e}");
        }
    };
    assert_eq!(
        (rep.from.as_str(), rep.to.as_str()),
        ("vhost-user", "io_uring")
    );
    let t0 = std::time::Instant::now();
    while !used.iter().any(|u| u.head == head) {
        fe.wait_used(0, &mut used, std::time::Duration::from_secs(10))
            .unwrap();
        assert!(t0.elapsed() < std::time::Duration::from_secs(20));
    }
    let mut st = [0u8];
    fe.mem.read(slot.status, &mut st);
    assert_eq!(st[0], S_OK, "the held write went through on the new engine");
    assert!(draining.wait(std::time::Duration::from_secs(10)).is_ok());
    assert_eq!(stats.io_errors.load(Ordering::Relaxed), 0);
    assert_eq!(stats.held_requests.load(Ordering::Relaxed), 0);
    let mut b = vec![0u8; 4096];
    std::fs::File::open(&su.s.image)
        .unwrap()
        .read_exact_at(&mut b, at)
        .unwrap();
    assert!(b.iter().all(|&x| x == 0xc3), "the write is on the image");
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().0, S_OK);
}

/// How a hostile export answers the first request it is kicked for.
#[derive(Clone, Copy, Debug)]
enum Lie {
    /// A used id it was never given.
    UnknownId,
    /// The right head, twice.
    Twice,
    /// A used index 100 ahead of what was posted.
    Runaway,
    /// A config space whose capacity overflows a byte count.
    HugeCapacity,
    /// A config space with a block size of 3 bytes (it offers BLK_SIZE).
    OddBlockSize,
    /// A reply of 4 bytes where 8 belong.
    ShortReply,
}

/// A vhost-user "export" that negotiates what the relay needs, maps acceld's shadow region
/// and, at the first kick, writes `lie` into the used ring and calls.
fn hostile_export(path: &std::path::Path, lie: Lie) -> std::thread::JoinHandle<()> {
    use accel_dataplane::engine::relay::shadow::{
        AVAIL_OFF, SLOT_LEN, SLOT_OFF, SLOT_STATUS, USED_OFF,
    };
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let l = std::os::unix::net::UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut shadow: Option<(*mut u8, usize)> = None;
        let mut call: Option<std::os::fd::OwnedFd> = None;
        loop {
            // One message: its header (with any descriptors sent along), then its payload.
            let mut h = [0u8; 12];
            let Ok((n, fds)) = accel_api::fdpass::recv(s.as_raw_fd(), &mut h) else {
                return;
            };
            if n < 12 && std::io::Read::read_exact(&mut s, &mut h[n..]).is_err() {
                return;
            }
            let mut msg = h.to_vec();
            msg.resize(12 + pending_size(&h), 0);
            if std::io::Read::read_exact(&mut s, &mut msg[12..]).is_err() {
                return;
            }
            let pending = &msg;
            for fd in fds {
                let req = u32::from_le_bytes(pending[0..4].try_into().unwrap());
                match req {
                    // ADD_MEM_REG: the shadow region is the one at 1 << 62.
                    37 => {
                        let gpa = u64::from_le_bytes(pending[20..28].try_into().unwrap());
                        let size = u64::from_le_bytes(pending[28..36].try_into().unwrap());
                        if gpa == 1 << 62 {
                            // SAFETY: a shared mapping of the memfd acceld sent, of its
                            // size; the test process only reads and writes the rings.
                            let p = unsafe {
                                libc::mmap(
                                    std::ptr::null_mut(),
                                    size as usize,
                                    libc::PROT_READ | libc::PROT_WRITE,
                                    libc::MAP_SHARED,
                                    fd.as_raw_fd(),
                                    0,
                                )
                            };
                            assert_ne!(p, libc::MAP_FAILED);
                            shadow = Some((p.cast(), size as usize));
                        }
                    }
                    13 => call = Some(fd),
                    12 => {
                        let (base, _) = shadow.expect("the shadow region came first");
                        let call = call.take().expect("the call eventfd came first");
                        let kick = fd;
                        let base = base as usize;
                        std::thread::spawn(move || {
                            let base = base as *mut u8;
                            let mut b = [0u8; 8];
                            let mut pfd = libc::pollfd {
                                fd: kick.as_raw_fd(),
                                events: libc::POLLIN,
                                revents: 0,
                            };
                            // SAFETY: one valid pollfd; wait for acceld's first kick (the
                            // eventfd is non-blocking).
                            unsafe { libc::poll(&mut pfd, 1, 10_000) };
                            // SAFETY: reading the kick eventfd acceld gave.
                            let _ =
                                unsafe { libc::read(kick.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
                            // SAFETY: inside queue 0's part of the mapped region.
                            let head = unsafe {
                                (base.wrapping_add(AVAIL_OFF + 4) as *const u16).read_volatile()
                            };
                            let put = |slot: usize, id: u32| {
                                // SAFETY: the used ring's entry `slot` of queue 0.
                                unsafe {
                                    (base.wrapping_add(USED_OFF + 4 + 8 * slot) as *mut u32)
                                        .write_volatile(id)
                                };
                            };
                            let set_idx = |idx: u16| {
                                // SAFETY: used->idx of queue 0.
                                unsafe {
                                    (base.wrapping_add(USED_OFF + 2) as *mut u16)
                                        .write_volatile(idx)
                                };
                                let one = 1u64.to_ne_bytes();
                                // SAFETY: writing the call eventfd acceld gave.
                                let _ = unsafe {
                                    libc::write(call.as_raw_fd(), one.as_ptr().cast(), 8)
                                };
                            };
                            match lie {
                                Lie::UnknownId => {
                                    put(0, 4000);
                                    set_idx(1);
                                }
                                Lie::Twice => {
                                    // The head, done (status 0, as acceld reads it) ...
                                    let st = base.wrapping_add(
                                        SLOT_OFF + SLOT_LEN * usize::from(head) + SLOT_STATUS,
                                    );
                                    // SAFETY: the head's status byte in queue 0's slots.
                                    unsafe { st.write_volatile(0) };
                                    put(0, u32::from(head));
                                    set_idx(1);
                                    // ... and once acceld read it (its used_event moved to 1),
                                    // the same head again.
                                    let used_event =
                                        base.wrapping_add(AVAIL_OFF + 4 + 2 * 1024) as *const u16;
                                    let t0 = std::time::Instant::now();
                                    // SAFETY: avail->used_event of queue 0.
                                    while unsafe { used_event.read_volatile() } != 1 {
                                        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
                                        std::hint::spin_loop();
                                    }
                                    put(1, u32::from(head));
                                    set_idx(2);
                                }
                                Lie::Runaway => set_idx(100),
                                _ => {}
                            }
                        });
                    }
                    _ => {}
                }
            }
            let req = u32::from_le_bytes(msg[0..4].try_into().unwrap());
            let flags = u32::from_le_bytes(msg[4..8].try_into().unwrap());
            let reply = |s: &mut std::os::unix::net::UnixStream, body: &[u8]| {
                let mut m = Vec::new();
                m.extend_from_slice(&req.to_le_bytes());
                m.extend_from_slice(&(0x1u32 | 0x4).to_le_bytes());
                m.extend_from_slice(&(body.len() as u32).to_le_bytes());
                m.extend_from_slice(body);
                let _ = s.write_all(&m);
            };
            let blk_size = if matches!(lie, Lie::OddBlockSize) {
                1 << 6
            } else {
                0
            };
            let features: u64 = (1 << 32) | (1 << 28) | (1 << 29) | (1 << 30) | (1 << 9) | blk_size;
            match req {
                1 if matches!(lie, Lie::ShortReply) => reply(&mut s, &[0xff; 4]),
                1 => reply(&mut s, &features.to_le_bytes()),
                // REPLY_ACK, CONFIG, CONFIGURE_MEM_SLOTS.
                15 => reply(&mut s, &((1u64 << 3) | (1 << 9) | (1 << 15)).to_le_bytes()),
                17 => reply(&mut s, &1u64.to_le_bytes()),
                36 => reply(&mut s, &509u64.to_le_bytes()),
                24 => {
                    let mut b = msg[12..].to_vec();
                    let cap = if matches!(lie, Lie::HugeCapacity) {
                        u64::MAX
                    } else {
                        SIZE / 512
                    };
                    b[12..20].copy_from_slice(&cap.to_le_bytes());
                    // blk_size, at config offset 20.
                    b[32..36].copy_from_slice(&3u32.to_le_bytes());
                    reply(&mut s, &b)
                }
                _ if flags & 0x8 != 0 => reply(&mut s, &0u64.to_le_bytes()),
                _ => {}
            }
        }
    })
}

fn pending_size(p: &[u8]) -> usize {
    if p.len() < 12 {
        return 0;
    }
    u32::from_le_bytes(p[8..12].try_into().unwrap()) as usize
}

/// An export that lies in its used ring (an id it never got, a head completed twice, an index
/// past what was posted) ends its session: the request fails (IOERR), later ones fail at once,
/// nothing hangs or panics, and GET_ID (acceld's) still answers.
#[test]
fn an_export_that_lies_in_its_used_ring_ends_the_session() {
    for lie in [Lie::UnknownId, Lie::Twice, Lie::Runaway] {
        let dir = tempfile::Builder::new()
            .prefix("accel-relay-lie")
            .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
            .unwrap();
        let export = dir.path().join("export.sock");
        let _t = hostile_export(&export, lie);
        let relay = Arc::new(RelayEngine::connect(&export, None, 1).unwrap());
        let image = dir.path().join("unused.raw");
        let s = TestServer::serve_engine(
            dir,
            image,
            relay.clone(),
            SIZE,
            &ServerOptions {
                size: SIZE,
                werror: ErrorPolicy::Report,
                rerror: ErrorPolicy::Report,
                ..Default::default()
            },
        );
        let mut fe = frontend(&s, 1);
        let (st, _, _) = fe.request(0, T_IN, 0, &[], 4096).unwrap();
        let why = relay.failure();
        println!("{lie:?}: status {st}, session: {why:?}");
        // A head used twice completes its request once (the first time is true), then ends
        // the session.
        match lie {
            Lie::Twice => assert_eq!(st, S_OK),
            _ => assert_eq!(st, S_IOERR, "{lie:?}"),
        }
        let why = relay
            .wait_failed(std::time::Duration::from_secs(5))
            .expect("the session ended");
        // The second use of a head with nothing else in flight is past what was posted; with
        // other requests in flight it would be an id not in flight.
        let want: &[&str] = match lie {
            Lie::UnknownId => &["used id 4000"],
            Lie::Twice => &["moved by 1 with 0 posted", "not in flight"],
            Lie::Runaway => &["used index moved by 100"],
            _ => unreachable!("set-up lies are refused at connect"),
        };
        assert!(want.iter().any(|w| why.contains(w)), "{lie:?}: {why}");
        assert_eq!(fe.request(0, T_IN, 8, &[], 4096).unwrap().0, S_IOERR);
        assert_eq!(fe.request(0, T_GET_ID, 0, &[], 20).unwrap().0, S_OK);
    }
}

/// An export whose set-up answers are wrong (a capacity that overflows, a 3-byte block size, a
/// short reply) is refused at connect with the reason, never taken in.
#[test]
fn an_export_with_a_lying_config_is_refused_at_connect() {
    for (lie, want) in [
        (Lie::HugeCapacity, "capacity"),
        (Lie::OddBlockSize, "block size 3"),
        (
            Lie::ShortReply,
            "reply to GET_FEATURES is malformed: 4 bytes, 8 expected",
        ),
    ] {
        let dir = tempfile::Builder::new()
            .prefix("accel-relay-cfg")
            .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
            .unwrap();
        let export = dir.path().join("export.sock");
        let _t = hostile_export(&export, lie);
        let e = match RelayEngine::connect(&export, None, 1) {
            Ok(_) => panic!("{lie:?}: the export was taken"),
            Err(e) => accel_dataplane::util::error_chain(&e),
        };
        println!("{lie:?}: {e}");
        assert!(e.contains(want), "{lie:?}: {e}");
    }
}
