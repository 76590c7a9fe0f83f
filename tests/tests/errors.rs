//! QEMU's werror/rerror policies on acceld: a disk that runs out of space holds the guest's
//! writes (werror=enospc, the default) until space is freed, with no error and nothing lost;
//! werror=report gives IOERR; an EIO from the storage is IOERR and counted.
//!
//! The out-of-space tests mount a small tmpfs (root, as CI runs) and grow it with
//! `mount -o remount,size=`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use accel_dataplane::drive::ErrorPolicy;
use accel_dataplane::engine::relay::RelayEngine;
use accel_dataplane::engine::IoMode;
use accel_tests::harness::{Qsd, QsdOptions, ServerOptions, TestServer};
use accel_tests::hostile_nbd::{Behaviour, HostileNbd};
use accel_tests::{header, pattern, BlkFrontend, Buf, FrontendOptions, S_IOERR, S_OK, T_IN, T_OUT};

struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::Builder::new()
            .prefix("accel-enospc")
            .tempdir_in("/var/tmp")
            .unwrap()
            .keep();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs (these tests run as root)");
        Tmpfs { dir }
    }

    fn resize(&self, size: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.dir)
            .status()
            .unwrap();
        assert!(st.success());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Grows the file system back to 16 MiB when dropped.
struct GrowOnDrop<'a>(&'a Tmpfs);

impl Drop for GrowOnDrop<'_> {
    fn drop(&mut self) {
        self.0.resize("16m");
    }
}

const CHUNK: usize = 64 << 10;
const CHUNKS: usize = 40;

fn serve_on(fs: &Tmpfs, o: &ServerOptions) -> TestServer {
    let dir = tempfile::Builder::new()
        .prefix("d")
        .tempdir_in(&fs.dir)
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(o.size)
        .unwrap();
    TestServer::serve(dir, image, o)
}

fn connect(s: &TestServer) -> BlkFrontend {
    BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues: 1,
            queue_size: 128,
            max_data: CHUNK,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Submits CHUNKS writes of CHUNK bytes at once (more than the file system holds) and returns
/// the statuses of those that completed within `wait`.
fn write_all(fe: &mut BlkFrontend, wait: Duration) -> Vec<(u16, u8)> {
    let mut heads = Vec::new();
    for i in 0..CHUNKS {
        let sl = fe.slot(0, i as u16);
        let mut data = vec![0u8; CHUNK];
        pattern((i * CHUNK) as u64, 11, &mut data);
        fe.mem
            .write(sl.header, &header(T_OUT, (i * CHUNK / 512) as u64));
        fe.mem.write(sl.data, &data);
        fe.mem.write(sl.status, &[0xff]);
        let head = fe
            .submit_chain(
                0,
                &[
                    Buf::r(sl.header, 16),
                    Buf::r(sl.data, CHUNK as u32),
                    Buf::w(sl.status, 1),
                ],
                None,
            )
            .unwrap();
        heads.push((head, sl.status));
    }
    let mut used = Vec::new();
    let deadline = std::time::Instant::now() + wait;
    while used.len() < CHUNKS && std::time::Instant::now() < deadline {
        let _ = fe.wait_used(0, &mut used, Duration::from_millis(200));
    }
    used.iter()
        .map(|u| {
            let status = heads
                .iter()
                .find(|(h, _)| *h == u.head)
                .map(|&(_, st)| {
                    let mut b = [0u8];
                    fe.mem.read(st, &mut b);
                    b[0]
                })
                .unwrap_or(0xff);
            (u.head, status)
        })
        .collect()
}

fn verify(fe: &mut BlkFrontend) {
    for i in 0..CHUNKS {
        let (st, got, _) = fe
            .request(0, T_IN, (i * CHUNK / 512) as u64, &[], CHUNK)
            .unwrap();
        assert_eq!(st, S_OK);
        let mut want = vec![0u8; CHUNK];
        pattern((i * CHUNK) as u64, 11, &mut want);
        assert!(got == want, "chunk {i} differs");
    }
}

#[test]
fn out_of_space_holds_writes_until_space_is_freed() {
    for (mode, io, poll_us) in [
        ("io_uring", IoMode::Uring, 0),
        ("inline+poll", IoMode::Inline, 50),
    ] {
        println!("mode {mode}");
        let fs = Tmpfs::mount("1m");
        let s = serve_on(
            &fs,
            &ServerOptions {
                size: (CHUNKS * CHUNK) as u64,
                direct: false,
                io,
                poll_us,
                ..Default::default()
            },
        );
        let stats = &s.drive.stats;
        let mut fe = connect(&s);
        // 2.5 MiB of writes on 1 MiB of space: some complete, the rest wait. No error.
        let done = write_all(&mut fe, Duration::from_secs(1));
        println!(
            "{mode}: {} of {CHUNKS} writes completed before the disk filled",
            done.len()
        );
        assert!(
            done.iter().all(|&(_, st)| st == S_OK),
            "{mode}: an error reached the guest"
        );
        assert!(done.len() < CHUNKS, "{mode}: the file system did not fill");
        assert!(
            stats.held_requests.load(Ordering::Relaxed) > 0,
            "{mode}: nothing held"
        );
        assert!(stats.nospace_events.load(Ordering::Relaxed) > 0);
        assert_eq!(stats.io_errors.load(Ordering::Relaxed), 0);
        // Space comes back: the held writes and the ones queued behind them complete.
        fs.resize("16m");
        let mut used = Vec::new();
        while done.len() + used.len() < CHUNKS {
            fe.wait_used(0, &mut used, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("{mode}: writes still held after the resize: {e}"));
        }
        assert_eq!(stats.held_requests.load(Ordering::Relaxed), 0);
        assert_eq!(stats.io_errors.load(Ordering::Relaxed), 0);
        verify(&mut fe);
        let c = stats.acct.counters();
        assert_eq!(c.failed_wr_operations, 0);
        assert_eq!(c.wr_operations, CHUNKS as u64);
    }
}

/// The relay: QEMU's vhost-user-blk export answers IOERR for every failure, ENOSPC too; the
/// image's file system tells the two apart, so `werror=enospc` holds the writes exactly as on
/// the direct engine, and they complete once space comes back.
#[test]
fn the_relay_holds_writes_the_export_failed_for_lack_of_space() {
    let fs = Tmpfs::mount("1m");
    let size = (CHUNKS * CHUNK) as u64;
    let dir = tempfile::Builder::new()
        .prefix("d")
        .tempdir_in(&fs.dir)
        .unwrap();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(size)
        .unwrap();
    let export = dir.path().join("export.sock");
    let _qsd = Qsd::start(&image, &export, &QsdOptions::default()).expect("qemu-storage-daemon");
    let relay = Arc::new(RelayEngine::connect(&export, None, 1).unwrap());
    relay.set_image(image.clone());
    let s = TestServer::serve_engine(
        dir,
        image,
        relay.clone(),
        size,
        &ServerOptions {
            size,
            ..Default::default()
        },
    );
    let stats = &s.drive.stats;
    let mut fe = connect(&s);
    // Space comes back however the test ends: a failed assertion must not leave the server's
    // drop waiting for writes held on a full disk.
    let _grow = GrowOnDrop(&fs);
    let done = write_all(&mut fe, Duration::from_secs(1));
    // The export writes behind acceld, so on a busy host its first failure may come after
    // the window above: wait for the hold itself (bounded).
    let t0 = std::time::Instant::now();
    while stats.held_requests.load(Ordering::Relaxed) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "nothing held within 30 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "relay: {} of {CHUNKS} writes completed before the disk filled",
        done.len()
    );
    assert!(
        done.iter().all(|&(_, st)| st == S_OK),
        "an error reached the guest"
    );
    assert!(done.len() < CHUNKS, "the file system did not fill");
    assert_eq!(stats.io_errors.load(Ordering::Relaxed), 0);
    fs.resize("16m");
    let mut used = Vec::new();
    while done.len() + used.len() < CHUNKS {
        fe.wait_used(0, &mut used, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("writes still held after the resize: {e}"));
    }
    assert_eq!(stats.held_requests.load(Ordering::Relaxed), 0);
    assert_eq!(stats.io_errors.load(Ordering::Relaxed), 0);
    verify(&mut fe);
    assert!(relay.failure().is_none());
}

#[test]
fn an_operator_resume_retries_at_once() {
    let fs = Tmpfs::mount("1m");
    let s = serve_on(
        &fs,
        &ServerOptions {
            size: (CHUNKS * CHUNK) as u64,
            direct: false,
            io: IoMode::Inline,
            ..Default::default()
        },
    );
    let mut fe = connect(&s);
    let done = write_all(&mut fe, Duration::from_secs(1));
    assert!(done.len() < CHUNKS);
    fs.resize("16m");
    assert!(s.drive.retry_held() > 0, "held requests to retry");
    let mut used = Vec::new();
    while done.len() + used.len() < CHUNKS {
        fe.wait_used(0, &mut used, Duration::from_secs(10)).unwrap();
    }
    verify(&mut fe);
}

#[test]
fn werror_report_gives_ioerr_when_out_of_space() {
    let fs = Tmpfs::mount("1m");
    let s = serve_on(
        &fs,
        &ServerOptions {
            size: (CHUNKS * CHUNK) as u64,
            direct: false,
            io: IoMode::Inline,
            werror: ErrorPolicy::Report,
            ..Default::default()
        },
    );
    let mut fe = connect(&s);
    let done = write_all(&mut fe, Duration::from_secs(10));
    assert_eq!(done.len(), CHUNKS, "nothing is held with werror=report");
    let errors = done.iter().filter(|&&(_, st)| st == S_IOERR).count();
    assert!(errors > 0, "some writes failed");
    assert_eq!(s.drive.stats.held_requests.load(Ordering::Relaxed), 0);
    assert_eq!(
        s.drive.stats.acct.counters().failed_wr_operations,
        errors as u64
    );
}

#[test]
fn an_eio_reaches_the_guest_as_ioerr_and_is_counted() {
    let dir = tempfile::Builder::new()
        .prefix("accel-eio")
        .tempdir_in("/var/tmp")
        .unwrap();
    let size = 8u64 << 20;
    let nbd = HostileNbd::start(&dir.path().join("nbd.sock"), size, Behaviour::Eio).unwrap();
    let engine = Arc::new(
        accel_dataplane::engine::nbd::NbdEngine::connect(&nbd.socket, &nbd.export).unwrap(),
    );
    let image: PathBuf = Path::new("/dev/null").into();
    let s = TestServer::serve_engine(dir, image, engine, size, &ServerOptions::default());
    let mut fe = connect(&s);
    // werror=enospc holds only ENOSPC: EIO is reported, for writes and reads.
    assert_eq!(fe.request(0, T_OUT, 0, &[1u8; 4096], 0).unwrap().0, S_IOERR);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().0, S_IOERR);
    let st = &s.drive.stats;
    assert_eq!(st.io_errors.load(Ordering::Relaxed), 2);
    assert_eq!(st.held_requests.load(Ordering::Relaxed), 0);
    let c = st.acct.counters();
    assert_eq!((c.failed_wr_operations, c.failed_rd_operations), (1, 1));
}
