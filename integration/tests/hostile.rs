//! acceld as its own process against hostile peers: a frontend that corrupts its rings over
//! and over, and NBD servers that lie or hang. acceld answers or marks the queue broken, its
//! log stays small, its memory bounded, and SIGTERM still ends it within its bound.

use std::time::{Duration, Instant};

use accel_integration::Acceld;
use accel_tests::hostile_nbd::{Behaviour, HostileNbd};
use accel_tests::{header, BlkFrontend, Buf, FrontendOptions, S_IOERR, S_OK, T_IN, T_OUT};

fn workdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("accel-hostile")
        .tempdir_in("/var/tmp")
        .unwrap()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn cpu_ms(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let f: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    (t(11) + t(12)) * 1000 / hz
}

#[test]
fn a_frontend_that_breaks_its_rings_again_and_again() {
    let dir = workdir();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let sock = dir.path().join("d.sock");
    let log = dir.path().join("acceld.log");
    let mut d = Acceld::serve(
        &sock,
        &["--image", image.to_str().unwrap(), "--queues", "2"],
        &log,
    )
    .unwrap();
    let opts = FrontendOptions {
        queues: 2,
        ..Default::default()
    };
    let rounds = 40;
    for round in 0..rounds {
        let mut fe = BlkFrontend::connect(&sock, opts.clone()).unwrap();
        let data = vec![round as u8; 4096];
        if round % 2 == 0 {
            fe.corrupt_avail_idx(0, fe.queue_size() + 1 + round as u16);
        } else {
            fe.publish_head(0, fe.queue_size() + round as u16);
        }
        assert!(
            fe.wait_err(0, Duration::from_secs(10)),
            "round {round}: error eventfd"
        );
        assert_eq!(fe.request(1, T_OUT, 8, &data, 0).unwrap().0, S_OK);
        assert_eq!(fe.request(1, T_IN, 8, &[], 4096).unwrap().1, data);
    }
    // The broken queues of the last round stay broken: acceld sits idle, it does not spin.
    let pid = d.pid();
    let cpu0 = cpu_ms(pid);
    let mut fe = BlkFrontend::connect(&sock, opts).unwrap();
    fe.corrupt_avail_idx(0, 1000);
    assert!(fe.wait_err(0, Duration::from_secs(10)));
    let data = vec![7u8; 4096];
    for i in 0..500 {
        assert_eq!(
            fe.request(1, T_OUT, 8 * (i % 32), &data, 0).unwrap().0,
            S_OK
        );
    }
    let cpu = cpu_ms(pid) - cpu0;
    let t0 = Instant::now();
    let st = d.terminate().unwrap();
    println!(
        "{rounds} broken rings: acceld used {cpu} ms of CPU for 500 requests after the last; SIGTERM took {:?}",
        t0.elapsed()
    );
    assert!(st.success(), "acceld exit: {st}");
    let text = d.log_text();
    let broken_lines = text.lines().filter(|l| l.contains("ring broken")).count();
    println!(
        "log: {} bytes, {} lines, {broken_lines} 'ring broken' lines",
        text.len(),
        text.lines().count()
    );
    assert!(
        broken_lines <= 10,
        "ring errors are rate-limited: {broken_lines}"
    );
    assert!(text.len() < 32 << 10, "log grew to {} bytes", text.len());
    assert!(cpu < 2000, "acceld spins: {cpu} ms of CPU");
}

#[test]
fn hostile_nbd_servers_give_ioerr_and_a_hung_one_does_not_block_sigterm() {
    for how in Behaviour::ALL {
        let dir = workdir();
        let nbd = dir.path().join("nbd.sock");
        let size = 16u64 << 20;
        let server = HostileNbd::start(&nbd, size, how).unwrap();
        let sock = dir.path().join("d.sock");
        let log = dir.path().join("acceld.log");
        let mut d = Acceld::serve(
            &sock,
            &[
                "--nbd-socket",
                server.socket.to_str().unwrap(),
                "--nbd-export",
                &server.export,
                "--shutdown-timeout-ms",
                "1000",
            ],
            &log,
        )
        .unwrap();
        let mut fe = BlkFrontend::connect(&sock, FrontendOptions::default()).unwrap();
        let rss0 = rss_kib(d.pid());
        if how == Behaviour::Silent {
            // Requests wait for an export that never answers: SIGTERM ends acceld anyway.
            for i in 0..4 {
                let s2 = fe.slot(0, 2 + i);
                fe.mem.write(s2.header, &header(T_IN, 8 * u64::from(i)));
                fe.submit_chain(
                    0,
                    &[
                        Buf::r(s2.header, 16),
                        Buf::w(s2.data, 4096),
                        Buf::w(s2.status, 1),
                    ],
                    None,
                )
                .unwrap();
            }
        } else if how == Behaviour::DataForWrite {
            for i in 0..20 {
                let d = vec![0x11u8; 4096];
                let (st, _, _) = fe.request(0, T_OUT, 8 * i, &d, 0).unwrap();
                assert_eq!(st, S_IOERR, "{how:?}: request {i}");
            }
        } else {
            for i in 0..20 {
                let (st, _, _) = fe.request(0, T_IN, 8 * i, &[], 4096).unwrap();
                assert_eq!(st, S_IOERR, "{how:?}: request {i}");
            }
        }
        let rss = rss_kib(d.pid());
        let t0 = Instant::now();
        let st = d.terminate().unwrap();
        let took = t0.elapsed();
        let text = d.log_text();
        println!(
            "{how:?}: SIGTERM took {took:?}; RSS {rss0} -> {rss} KiB; log {} bytes",
            text.len()
        );
        assert!(st.success(), "{how:?}: acceld exit {st}: {text}");
        assert!(rss < rss0 + 64 * 1024, "{how:?}: memory grew to {rss} KiB");
        assert!(
            text.len() < 32 << 10,
            "{how:?}: log grew to {} bytes",
            text.len()
        );
        drop(fe);
    }
}
