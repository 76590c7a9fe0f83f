//! Dirty logging for live migration (VHOST_F_LOG_ALL + LOG_SHMFD), driven by the test frontend
//! in QEMU's message order, no QEMU: what the device marks under a QD32 verified load (every
//! page it wrote, and nothing else), LOG_ALL off, a log resize, the reconnect order, a bad log,
//! two devices on one log, and the image hand-off at the switchover's last ring stop.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use accel_dataplane::engine::nbd::NbdEngine;
use accel_dataplane::engine::relay::RelayEngine;
use accel_dataplane::engine::{FileEngine, FileEngineConfig, IoMode};
use accel_tests::harness::{Qsd, QsdNbd, QsdOptions, ServerOptions, TestServer};
use accel_tests::{
    check_pattern, header, pattern, BlkFrontend, Buf, FrontendOptions, Used, S_OK, T_GET_ID, T_IN,
    T_OUT, VHOST_F_LOG_ALL,
};

const PAGE: u64 = 4096;
const BLOCK: u64 = 4096;
const BLOCKS: u64 = 2048; // an 8 MiB disk

/// A sealed-size memfd like QEMU's "vhost-log".
fn log_memfd(bytes: u64) -> File {
    let name = std::ffi::CString::new("vhost-log").unwrap();
    // SAFETY: a valid C string; the descriptor is owned by the File below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(bytes).unwrap();
    f
}

/// Pages whose bit is set in the log file.
fn marked(log: &File) -> BTreeSet<u64> {
    let mut bytes = vec![0u8; log.metadata().unwrap().len() as usize];
    log.read_exact_at(&mut bytes, 0).expect("read log");
    let mut out = BTreeSet::new();
    for (i, b) in bytes.iter().enumerate() {
        for bit in 0..8 {
            if b & (1 << bit) != 0 {
                out.insert(i as u64 * 8 + bit);
            }
        }
    }
    out
}

fn clear(log: &File) {
    let len = log.metadata().unwrap().len();
    log.write_all_at(&vec![0u8; len as usize], 0).unwrap();
}

fn pages(addr: u64, len: u64, into: &mut BTreeSet<u64>) {
    if len > 0 {
        into.extend(addr / PAGE..=(addr + len - 1) / PAGE);
    }
}

/// Bytes of a log that covers the test frontend's guest memory.
fn log_bytes(fe: &BlkFrontend) -> u64 {
    (fe.mem.len() as u64 / PAGE).div_ceil(8).next_multiple_of(8)
}

/// A one-queue server on a sparse image of the test's disk size.
fn small_server() -> TestServer {
    TestServer::start(&ServerOptions {
        size: BLOCKS * BLOCK,
        ..Default::default()
    })
}

/// A temp dir with a sparse image of the test's disk size, for servers on other engines.
fn image_dir(prefix: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .unwrap();
    let image = dir.path().join("disk.raw");
    File::create(&image)
        .unwrap()
        .set_len(BLOCKS * BLOCK)
        .unwrap();
    (dir, image)
}

fn connect(s: &TestServer, queues: usize) -> BlkFrontend {
    BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues,
            queue_size: 128,
            max_data: 64 * 1024,
            event_idx: true,
            inflight: false,
        },
    )
    .expect("connect")
}

/// Runs `n` requests at queue depth 32 on every queue (a verified mix: each block written with
/// a known pattern, then read back and checked; a GET_ID now and then) and returns the pages
/// the device was allowed and obliged to write: the data pages of reads and GET_IDs, the
/// status pages, the used rings.
#[allow(clippy::needless_range_loop)] // q indexes the frontend and the tag lists alike
fn verified_load(fe: &mut BlkFrontend, n: usize, seed: u64) -> BTreeSet<u64> {
    let mut expect = BTreeSet::new();
    let queues = fe.queues();
    let mut written: Vec<Option<u64>> = vec![None; BLOCKS as usize];
    // Requests in flight per block: a block is read or written by one request at a time, so
    // every read has one right answer.
    let mut busy = vec![false; BLOCKS as usize];
    let mut rng = accel_tests::load::Rng::new(seed);
    for q in 0..queues {
        let (used, len) = fe.used_ring(q);
        pages(used, len, &mut expect);
    }
    let mut issued = 0;
    // Per queue: tag -> (head, what it does).
    struct Req {
        q: usize,
        tag: u16,
        head: u16,
        kind: u32,
        block: u64,
        len: u64,
        seed: u64,
    }
    let mut inflight: Vec<Req> = Vec::new();
    let mut free: Vec<Vec<u16>> = (0..queues).map(|_| (0..32).rev().collect()).collect();
    let mut done = 0;
    while done < n {
        for q in 0..queues {
            while issued < n {
                let Some(tag) = free[q].pop() else { break };
                let s = fe.slot(q, tag);
                let nblk = 1 + rng.below(4);
                let block = loop {
                    let b = rng.below(BLOCKS - 4);
                    if !busy[b as usize..(b + nblk) as usize].iter().any(|&x| x) {
                        break b;
                    }
                };
                busy[block as usize..(block + nblk) as usize].fill(true);
                let len = nblk * BLOCK;
                let r = rng.below(10);
                let (kind, seed) = if r == 0 {
                    (T_GET_ID, 0)
                } else if r < 5
                    || written[block as usize..(block + nblk) as usize]
                        .iter()
                        .any(Option::is_none)
                {
                    (T_OUT, rng.next_u64())
                } else {
                    (T_IN, 0)
                };
                fe.mem.write(s.header, &header(kind, block * BLOCK / 512));
                fe.mem.write(s.status, &[0xff]);
                let mut bufs = vec![Buf::r(s.header, 16)];
                match kind {
                    T_OUT => {
                        let mut d = vec![0u8; len as usize];
                        pattern(block * BLOCK, seed, &mut d);
                        fe.mem.write(s.data, &d);
                        bufs.push(Buf::r(s.data, len as u32));
                    }
                    T_IN => bufs.push(Buf::w(s.data, len as u32)),
                    _ => bufs.push(Buf::w(s.data, 20)),
                }
                bufs.push(Buf::w(s.status, 1));
                let head = fe.queue_chain(q, &bufs).expect("queue");
                inflight.push(Req {
                    q,
                    tag,
                    head,
                    kind,
                    block,
                    len,
                    seed,
                });
                issued += 1;
            }
            fe.kick(q);
        }
        let mut got = 0;
        for pass in 0..2 {
            for q in 0..queues {
                let mut used: Vec<Used> = Vec::new();
                fe.poll_used(q, &mut used);
                if used.is_empty() && pass == 1 && got == 0 && inflight.iter().any(|r| r.q == q) {
                    fe.wait_used(q, &mut used, Duration::from_secs(10))
                        .expect("completion");
                }
                got += used.len();
                for u in used {
                    let i = inflight
                        .iter()
                        .position(|r| r.q == q && r.head == u.head)
                        .expect("a request of ours");
                    let r = inflight.swap_remove(i);
                    let s = fe.slot(q, r.tag);
                    let mut st = [0u8];
                    fe.mem.read(s.status, &mut st);
                    assert_eq!(st[0], S_OK, "request type {} failed", r.kind);
                    pages(s.status, 1, &mut expect);
                    match r.kind {
                        T_OUT => {
                            for b in 0..r.len / BLOCK {
                                written[(r.block + b) as usize] = Some(r.seed);
                            }
                        }
                        T_IN => {
                            pages(s.data, r.len, &mut expect);
                            let mut d = vec![0u8; r.len as usize];
                            fe.mem.read(s.data, &mut d);
                            for b in 0..r.len / BLOCK {
                                let at = (b * BLOCK) as usize;
                                let chunk = &d[at..at + BLOCK as usize];
                                let off = (r.block + b) * BLOCK;
                                match written[(r.block + b) as usize] {
                                    Some(seed) => {
                                        check_pattern(off, seed, chunk).unwrap_or_else(|i| {
                                            panic!("block at {off}: wrong byte {i}")
                                        })
                                    }
                                    None => assert!(
                                        chunk.iter().all(|&x| x == 0),
                                        "never-written block at {off} is not zero"
                                    ),
                                }
                            }
                        }
                        _ => pages(s.data, 20, &mut expect),
                    }
                    busy[r.block as usize..(r.block + r.len / BLOCK) as usize].fill(false);
                    free[q].push(r.tag);
                    done += 1;
                }
            }
        }
    }
    expect
}

fn start_logging(fe: &mut BlkFrontend, log: &File) {
    // QEMU's order when a migration starts: SET_LOG_BASE, SET_FEATURES + LOG_ALL, then
    // SET_VRING_ADDR with F_LOG for every started ring.
    fe.set_log_base(log, log_bytes(fe)).expect("SET_LOG_BASE");
    fe.set_log_all(true).expect("LOG_ALL");
    for q in 0..fe.queues() {
        fe.set_used_log(q, true).expect("F_LOG");
    }
}

fn exactly_what_was_written_on(o: &ServerOptions, s: &TestServer) {
    let mut fe = connect(s, usize::from(o.queues));
    assert_ne!(
        fe.negotiated.features & VHOST_F_LOG_ALL,
        0,
        "LOG_ALL offered"
    );
    // Some I/O before the migration starts: not logged.
    verified_load(&mut fe, 64, 1);
    let log = log_memfd(log_bytes(&fe));
    start_logging(&mut fe, &log);
    assert!(marked(&log).is_empty(), "nothing marked before any I/O");
    let expect = verified_load(&mut fe, 600, 2);
    let got = marked(&log);
    let missing: Vec<_> = expect.difference(&got).collect();
    let extra: Vec<_> = got.difference(&expect).collect();
    assert!(
        missing.is_empty(),
        "pages written and not marked: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "pages marked and never written: {extra:?}"
    );

    // LOG_ALL off (the migration ended or was cancelled): nothing more is marked.
    fe.set_log_all(false).expect("LOG_ALL off");
    clear(&log);
    verified_load(&mut fe, 200, 3);
    assert!(marked(&log).is_empty(), "marks after LOG_ALL was cleared");
}

#[test]
fn marks_every_page_the_device_writes_and_nothing_else() {
    for (mode, o) in ServerOptions::modes() {
        let o = ServerOptions {
            queues: 2,
            size: BLOCKS * BLOCK,
            ..o
        };
        eprintln!("mode {mode}");
        let s = TestServer::start(&o);
        exactly_what_was_written_on(&o, &s);
    }
}

#[test]
fn marks_what_the_nbd_engine_reads_into_guest_memory() {
    let (dir, image) = image_dir("accel-mig-nbd");
    let qsd = QsdNbd::start(&image, "raw", &dir.path().join("nbd.sock")).unwrap();
    let engine = Arc::new(NbdEngine::connect(&qsd.socket, &qsd.export).unwrap());
    let o = ServerOptions {
        queues: 1,
        size: BLOCKS * BLOCK,
        ..Default::default()
    };
    let s = TestServer::serve_engine(dir, image, engine, BLOCKS * BLOCK, &o);
    exactly_what_was_written_on(&o, &s);
}

/// The relay: QEMU's export writes the guest pages, and never gets QEMU's log (its log code
/// would assert on acceld's own region); acceld marks at completion exactly what it marks on
/// every other engine.
#[test]
fn marks_what_the_relay_has_the_export_write_into_guest_memory() {
    let (dir, image) = image_dir("accel-mig-relay");
    let sock = dir.path().join("export.sock");
    let _qsd = Qsd::start(&image, &sock, &QsdOptions::default()).unwrap();
    let engine = Arc::new(RelayEngine::connect(&sock, None, 1).unwrap());
    let o = ServerOptions {
        queues: 1,
        size: BLOCKS * BLOCK,
        ..Default::default()
    };
    let s = TestServer::serve_engine(dir, image, engine.clone(), BLOCKS * BLOCK, &o);
    exactly_what_was_written_on(&o, &s);
    assert!(
        engine
            .stats()
            .posted
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(engine.failure().is_none());
}

#[test]
fn a_resize_moves_marking_to_the_new_log() {
    let s = small_server();
    let mut fe = connect(&s, 1);
    let old = log_memfd(log_bytes(&fe));
    start_logging(&mut fe, &old);
    verified_load(&mut fe, 100, 4);
    assert!(!marked(&old).is_empty());
    // A resize: a new memfd, one more SET_LOG_BASE; after its reply, the old log gets nothing.
    let new = log_memfd(log_bytes(&fe) + 4096);
    fe.set_log_base(&new, log_bytes(&fe) + 4096)
        .expect("resize");
    clear(&old);
    let expect = verified_load(&mut fe, 300, 5);
    assert!(
        marked(&old).is_empty(),
        "the old log was marked after the resize"
    );
    assert_eq!(marked(&new), expect);
}

#[test]
fn log_all_and_f_log_before_the_log_base_are_accepted() {
    // The order of QEMU's vhost_dev_start when logging is already on (a reconnect during a
    // migration): SET_FEATURES(+LOG_ALL), the rings with F_LOG, then SET_LOG_BASE.
    let s = small_server();
    let mut fe = connect(&s, 1);
    fe.set_log_all(true).expect("LOG_ALL without a log");
    fe.set_used_log(0, true).expect("F_LOG without a log");
    verified_load(&mut fe, 100, 6);
    let log = log_memfd(log_bytes(&fe));
    fe.set_log_base(&log, log_bytes(&fe)).expect("SET_LOG_BASE");
    let expect = verified_load(&mut fe, 300, 7);
    assert_eq!(marked(&log), expect);
}

#[test]
fn a_log_that_cannot_be_mapped_closes_the_connection() {
    let s = small_server();
    let mut fe = connect(&s, 1);
    let log = log_memfd(4096);
    // Claims more than the file holds: mapping it would SIGBUS on the first mark.
    let r = fe.set_log_base(&log, 1 << 20);
    assert!(r.is_err(), "no reply for a bad log: the connection closed");
    assert!(fe.get_vring_base(0).is_err(), "the connection is closed");
    // The server serves the next frontend.
    let mut fe2 = connect(&s, 1);
    let mut d = vec![0u8; 4096];
    pattern(0, 9, &mut d);
    assert_eq!(fe2.request(0, T_OUT, 0, &d, 0).unwrap().0, S_OK);
}

#[test]
fn two_devices_mark_one_shared_log() {
    let (a, b) = (small_server(), small_server());
    let mut fa = connect(&a, 1);
    let mut fb = connect(&b, 1);
    let log = log_memfd(log_bytes(&fa).max(log_bytes(&fb)));
    start_logging(&mut fa, &log);
    start_logging(&mut fb, &log);
    let ea = verified_load(&mut fa, 200, 10);
    assert_eq!(marked(&log), ea, "device A's marks");
    clear(&log);
    let eb = verified_load(&mut fb, 200, 11);
    assert_eq!(marked(&log), eb, "device B's marks, in the same memfd");
    // Both at once: the union.
    clear(&log);
    let t = std::thread::spawn(move || {
        let e = verified_load(&mut fa, 300, 12);
        (fa, e)
    });
    let mut all = verified_load(&mut fb, 300, 13);
    let (_fa, e) = t.join().unwrap();
    all.extend(e);
    assert_eq!(marked(&log), all);
}

/// Whether any process holds an OFD or POSIX lock on `path` (QEMU-style image locks).
fn locked(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(path).unwrap().ino();
    std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .any(|l| {
            l.split_whitespace()
                .nth(5)
                .and_then(|f| f.rsplit(':').next())
                .and_then(|i| i.parse::<u64>().ok())
                == Some(ino)
        })
}

#[test]
fn the_last_ring_stop_while_logging_hands_the_image_off() {
    let (dir, image) = image_dir("accel-mig-lock");
    let engine = Arc::new(
        FileEngine::open(FileEngineConfig {
            path: image.clone(),
            read_only: false,
            direct: false,
            logical_block_size: 512,
            lock: true,
            io: IoMode::Uring,
            identity: None,
        })
        .unwrap(),
    );
    let o = ServerOptions {
        queues: 2,
        size: BLOCKS * BLOCK,
        ..Default::default()
    };
    let s = TestServer::serve_engine(dir, image.clone(), engine, BLOCKS * BLOCK, &o);
    let mut fe = connect(&s, 2);
    assert!(locked(&image), "the direct engine holds QEMU-style locks");

    // A stop without logging (a guest reboot, a `stop`) keeps the image.
    let b0 = fe.get_vring_base(0).unwrap();
    let b1 = fe.get_vring_base(1).unwrap();
    assert!(locked(&image));
    fe.restart_queue(0, b0 as u16).unwrap();
    fe.restart_queue(1, b1 as u16).unwrap();
    assert_eq!(fe.request(1, T_IN, 0, &[], 4096).unwrap().0, S_OK);

    let log = log_memfd(log_bytes(&fe));
    start_logging(&mut fe, &log);
    verified_load(&mut fe, 200, 20);
    // Switchover: SET_VRING_ENABLE(0) is sent by QEMU first; GET_VRING_BASE drains.
    let b0 = fe.get_vring_base(0).unwrap();
    assert!(locked(&image), "one ring still runs: the image stays");
    let b1 = fe.get_vring_base(1).unwrap();
    assert!(!locked(&image), "the last stop released the locks");
    assert!(s.drive.image_handed_off());
    // The migration fails: logging off, the rings start again, the image comes back.
    fe.set_log_all(false).unwrap();
    fe.restart_queue(0, b0 as u16).unwrap();
    fe.restart_queue(1, b1 as u16).unwrap();
    let mut d = vec![0u8; 4096];
    pattern(0, 21, &mut d);
    assert_eq!(fe.request(0, T_OUT, 0, &d, 0).unwrap().0, S_OK);
    assert!(
        locked(&image),
        "the image is taken back when the rings restart"
    );
    assert!(!s.drive.image_handed_off());
    let (st, back, _) = fe.request(1, T_IN, 0, &[], 4096).unwrap();
    assert_eq!(st, S_OK);
    assert_eq!(back, d);
}
