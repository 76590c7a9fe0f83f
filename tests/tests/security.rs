//! acceld against a compromised QEMU on the vhost-user socket (no QEMU: the tests play the
//! front-end): descriptor floods, memory that shrinks under acceld, call fds that are not
//! eventfds or cannot take a write. Each costs the attacker's own connection, never the
//! process. docs/security.md lists each attack with its test.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use accel_tests::acceld_run::AcceldRun;
use accel_tests::harness::{ServerOptions, TestServer};
use accel_tests::{BlkFrontend, FrontendOptions, S_OK, T_IN, T_OUT};

/// How many of this process's descriptors name the same file as `fd` (`/proc/self/fd`).
fn copies_of(fd: RawFd) -> usize {
    let me = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| *l == me)
        .count()
}

/// Sends one vhost-user message (header only) with `fds` attached.
fn send_with_fds(sock: &UnixStream, request: u32, fds: &[RawFd]) -> std::io::Result<()> {
    let mut hdr = [0u8; 12];
    hdr[0..4].copy_from_slice(&request.to_le_bytes());
    hdr[4..8].copy_from_slice(&1u32.to_le_bytes());
    let mut iov = libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: hdr.len(),
    };
    let mut cbuf = vec![0u64; 64];
    // SAFETY: msghdr is plain old data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a length.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    assert!(space <= cbuf.len() * 8);
    msg.msg_controllen = space;
    // SAFETY: msg_control points at cbuf, big enough for one header and the fds (above).
    let c = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
    // SAFETY: CMSG_LEN only computes a length.
    let clen = unsafe { libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) } as usize;
    // SAFETY: c points at the first cmsghdr inside cbuf (zeroed, large enough).
    let h = unsafe { &mut *c };
    h.cmsg_level = libc::SOL_SOCKET;
    h.cmsg_type = libc::SCM_RIGHTS;
    h.cmsg_len = clen;
    // SAFETY: c is a valid cmsghdr; CMSG_DATA points at its payload inside cbuf.
    let data = unsafe { libc::CMSG_DATA(c) }.cast::<RawFd>();
    for (i, fd) in fds.iter().enumerate() {
        // Pointer arithmetic only: i < fds.len() keeps it inside the payload.
        let p = data.wrapping_add(i);
        // SAFETY: the payload has room for fds.len() descriptors (CMSG_SPACE above);
        // unaligned, as the payload has no alignment guarantee.
        unsafe { p.write_unaligned(*fd) };
    }
    // SAFETY: msg points at live buffers of the lengths given.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A front-end that attaches 28 descriptors to each of 50 `SET_BACKEND_REQ_FD` messages (and
/// to other messages) leaves no descriptor open in acceld: before the fix, the peek at that
/// message kept 20 of each 28 (1,000 here), and 50 such messages ran a default process out
/// of descriptors.
#[test]
fn a_flood_of_descriptors_leaves_none_open() {
    let s = TestServer::start(&ServerOptions::default());
    let (r, w) = {
        let mut p = [0; 2];
        // SAFETY: p has room for the two descriptors pipe2 writes.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        (p[0], p[1])
    };
    let before = copies_of(r);
    assert_eq!(before, 2, "the pipe's two ends");
    let sock = UnixStream::connect(&s.socket).unwrap();
    let fds = [r; 28];
    for _ in 0..50 {
        send_with_fds(&sock, 21, &fds).unwrap();
    }
    // Then messages that take one descriptor or none (the server may close the connection
    // at the first of them).
    for req in [13, 14, 1, 3] {
        if send_with_fds(&sock, req, &fds).is_err() {
            break;
        }
    }
    // The server serves one front-end at a time: a second one's request completes only
    // after the first connection's handler is gone.
    drop(sock);
    let mut fe = s.frontend(1);
    assert_eq!(fe.request(0, T_OUT, 0, &[7u8; 512], 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 512).unwrap().1, vec![7u8; 512]);
    let after = copies_of(r);
    drop(fe);
    for fd in [r, w] {
        // SAFETY: the test's own descriptors, closed once.
        unsafe { libc::close(fd) };
    }
    assert_eq!(after, before, "descriptors acceld received were left open");
}

/// A listener that never accepts, with its backlog full: what QEMU's user can plant at a
/// drive's socket path in the VM's directory (acceld binds there at registration and at
/// every restart). Before the fix `Server::bind` tried a blocking `connect` and hung there,
/// during restore before the control socket served anyone.
fn plant_full_listener(path: &std::path::Path) -> (std::os::fd::OwnedFd, Vec<RawFd>) {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: socket() has no memory preconditions; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: fd is new and owned here.
    let listener = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain old data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: addr is valid for the call; fd is a socket.
    assert_eq!(unsafe { libc::bind(fd, (&raw const addr).cast(), len) }, 0);
    // SAFETY: fd is a bound socket.
    assert_eq!(unsafe { libc::listen(fd, 0) }, 0);
    // Fill the backlog with non-blocking connections until the next one would wait.
    let mut held = Vec::new();
    loop {
        // SAFETY: as above.
        let c = unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        assert!(c >= 0);
        // SAFETY: addr is valid for the call.
        let r = unsafe { libc::connect(c, (&raw const addr).cast(), len) };
        if r != 0 {
            // SAFETY: c is ours.
            unsafe { libc::close(c) };
            break;
        }
        held.push(c);
        assert!(held.len() < 64, "the backlog never filled");
    }
    (listener, held)
}

#[test]
fn a_planted_socket_that_never_accepts_does_not_hold_bind() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("disk0.sock");
    let (_listener, held) = plant_full_listener(&sock);
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let o = ServerOptions::default();
    let engine = accel_tests::harness::file_engine(&image, &o);
    let drive = accel_dataplane::drive::Drive::new(o.drive_config(1 << 20), engine);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = accel_dataplane::vhost::Server::bind(&sock, drive).map(|_| ());
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("Server::bind hung on a planted socket");
    let e = r.expect_err("bound over a live listener");
    assert!(e.contains("in use"), "{e}");
    for c in held {
        // SAFETY: the test's own descriptors.
        unsafe { libc::close(c) };
    }
}

fn status_drive(sup: &acceld::supervisor::Supervisor) -> serde_json::Value {
    serde_json::to_value(sup.status()).unwrap()["vms"][0]["drives"][0].clone()
}

/// QEMU reports its drive's file through a link in a directory it controls; while acceld
/// waits for the answer to `blockdev-del` (before it opens the image for the direct engine),
/// QEMU points the link at another file. Before the fix acceld (root) opened the link's new
/// target read-write, for a root VM unchecked, and gave the guest that file. Now it opens the
/// registered image by identity, whatever the link says; a file other than the registered
/// one is never opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_swapped_during_the_switch_never_opens_another_file() {
    use accel_tests::fake_qemu::FakeQemu;
    use acceld::control::DriveSpec;
    accel_tests::harness::init_logs();
    let dir = tempfile::Builder::new()
        .prefix("accel-sec")
        .tempdir_in("/var/tmp")
        .unwrap();
    let size = 1u64 << 20;
    let image = dir.path().join("d0.raw");
    let secret = dir.path().join("secret.raw");
    std::fs::write(&image, vec![0x11u8; size as usize]).unwrap();
    std::fs::write(&secret, vec![0x5eu8; size as usize]).unwrap();
    // QEMU's directory: the link QEMU names, first at the drive's image.
    let qdir = dir.path().join("qemu");
    std::fs::create_dir(&qdir).unwrap();
    let link = qdir.join("disk");
    std::os::unix::fs::symlink(&image, &link).unwrap();
    let run = dir.path().join("run");
    let socket = run.join("vm").join("d0.sock");
    let fake = FakeQemu::start(dir.path(), "d0", &link, &socket);
    let (l2, s2) = (link.clone(), secret.clone());
    fake.before_reply("blockdev-del", move || {
        let tmp = l2.with_extension("new");
        std::os::unix::fs::symlink(&s2, &tmp).unwrap();
        std::fs::rename(&tmp, &l2).unwrap();
    });
    let spec = DriveSpec::parse(&format!("id=d0,image={}", image.display())).unwrap();
    let sup = fake.supervise(&run, spec);
    let t0 = std::time::Instant::now();
    while status_drive(&sup)["engine"] != "direct" {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{}",
            status_drive(&sup)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        std::fs::read_link(&link).unwrap() == secret,
        "the link was swapped"
    );
    // The guest reads and writes the registered image, not the link's target.
    let sock = socket.clone();
    let (read, wrote) = tokio::task::spawn_blocking(move || {
        let mut fe = BlkFrontend::connect(&sock, FrontendOptions::default()).unwrap();
        let read = fe.request(0, T_IN, 0, &[], 512).unwrap().1;
        let wrote = fe.request(0, T_OUT, 8, &[0x77u8; 512], 0).unwrap().0;
        (read, wrote)
    })
    .await
    .unwrap();
    assert!(
        read.len() == 512 && read.iter().all(|b| *b == 0x11),
        "the guest read another file"
    );
    assert_eq!(wrote, S_OK);
    let got = std::fs::read(&secret).unwrap();
    assert!(
        got.iter().all(|b| *b == 0x5e),
        "acceld wrote the file the link was swapped to"
    );
    let img = std::fs::read(&image).unwrap();
    assert_eq!(&img[4096..4096 + 512], &[0x77u8; 512][..]);
    let s = sup.clone();
    let _ = s.unregister("vm", false).await;
}

/// A call (or kick, or error) descriptor that is no eventfd is refused: a pipe whose reader
/// never reads fills up, and before the fix the worker's interrupt `write` then blocked for
/// good (holding the call lock), and so did every stop of that worker and whoever waited
/// for it. After the refusal the connection still works.
#[test]
fn a_call_descriptor_that_is_not_an_eventfd_is_refused() {
    use std::os::fd::FromRawFd;
    use vhost::vhost_user::message::VhostUserHeaderFlag;
    use vhost::VhostBackend;
    let s = TestServer::start(&ServerOptions::default());
    let (fe, _) = accel_tests::handshake(&s.socket, 1).unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    let mut p = [0; 2];
    // SAFETY: p has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: p[1] is this test's own descriptor, owned once by the wrapper (which only
    // sends it: the type is what the crate's API takes).
    let not_an_eventfd = unsafe { vmm_sys_util::eventfd::EventFd::from_raw_fd(p[1]) };
    for (what, r) in [
        ("call", fe.set_vring_call(0, &not_an_eventfd)),
        ("kick", fe.set_vring_kick(0, &not_an_eventfd)),
        ("err", fe.set_vring_err(0, &not_an_eventfd)),
    ] {
        assert!(r.is_err(), "a pipe was taken as the {what} eventfd");
    }
    drop(fe);
    // SAFETY: p[0] is ours.
    unsafe { libc::close(p[0]) };
    let mut fe = s.frontend(1);
    assert_eq!(fe.request(0, T_OUT, 0, &[3u8; 512], 0).unwrap().0, S_OK);
}

use accel_tests::harness::NOBODY;

/// The front-end of [`unsealed_memory_from_a_user_front_end_is_refused`], run as `nobody` in
/// a child process: a memory table of an unsealed memfd must be refused (its owner could
/// truncate it under acceld: SIGBUS, the end of every VM's drives), a sealed one taken.
#[test]
#[ignore = "run as a child process by unsealed_memory_from_a_user_front_end_is_refused"]
fn child_front_end_as_nobody() {
    use vhost::vhost_user::message::VhostUserHeaderFlag;
    use vhost::{VhostBackend, VhostUserMemoryRegionInfo};
    let Some(sock) = std::env::var_os("ACCEL_SECURITY_SOCKET") else {
        return;
    };
    assert_eq!(
        // SAFETY: getuid has no preconditions.
        unsafe { libc::getuid() },
        NOBODY
    );
    let table = |mem: &accel_tests::GuestMem| VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: mem.len() as u64,
        userspace_addr: mem.host_addr(),
        mmap_offset: 0,
        mmap_handle: mem.file.as_raw_fd(),
    };
    let (fe, _) = accel_tests::handshake(std::path::Path::new(&sock), 1).unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    let unsealed = accel_tests::GuestMem::new_unsealed(1 << 20).unwrap();
    assert!(
        fe.set_mem_table(&[table(&unsealed)]).is_err(),
        "unsealed memory was mapped"
    );
    let sealed = accel_tests::GuestMem::new(1 << 20).unwrap();
    fe.set_mem_table(&[table(&sealed)])
        .expect("sealed memory refused");
    println!("CHILD-OK");
}

#[test]
fn unsealed_memory_from_a_user_front_end_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let s = TestServer::start(&ServerOptions::default());
    std::fs::set_permissions(s.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&s.socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = s.socket.to_string_lossy().into_owned();
    let (ok, text) = accel_tests::harness::run_child_test_as_nobody(
        s.dir.path(),
        "child_front_end_as_nobody",
        &[("ACCEL_SECURITY_SOCKET", &sock)],
    );
    assert!(ok && text.contains("CHILD-OK"), "{text}");
    // A root front-end (QEMU as root) may still use any shared memory it maps.
    let (fe, _) = accel_tests::handshake(&s.socket, 1).unwrap();
    fe.set_hdr_flags(vhost::vhost_user::message::VhostUserHeaderFlag::NEED_REPLY);
    let unsealed = accel_tests::GuestMem::new_unsealed(1 << 20).unwrap();
    use vhost::VhostBackend;
    fe.set_mem_table(&[vhost::VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: unsealed.len() as u64,
        userspace_addr: unsealed.host_addr(),
        mmap_offset: 0,
        mmap_handle: unsealed.file.as_raw_fd(),
    }])
    .expect("root's memory table");
}

/// A local port nobody listens on now (the metrics endpoint's, for one test).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` on `addr`: the whole answer (acceld closes after it).
fn get_metrics(s: &mut std::net::TcpStream) -> String {
    use std::io::{Read, Write};
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp
}

/// CPU time (user + system) of process `pid` so far, in clock ticks (`/proc/PID/stat`).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Any local user can reach the metrics endpoint. 16 connections that send nothing take
/// every slot: a 17th `GET /metrics` waits in the backlog and is answered once the first
/// silent one times out (5 s), not before and not much later; each silent one is closed at
/// its timeout; acceld neither spins meanwhile nor stops answering its control socket.
#[test]
fn silent_metrics_clients_hold_a_slot_for_five_seconds_at_most() {
    use std::io::Read;
    use std::net::TcpStream;
    use std::time::Instant;
    let port = free_port();
    let a = AcceldRun::start(
        "acceld_run_child",
        &format!("metrics-addr = \"127.0.0.1:{port}\"\n"),
    );
    a.wait_ready();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let first = get_metrics(&mut TcpStream::connect(addr).unwrap());
    assert!(first.starts_with("HTTP/1.0 200 OK"), "{first}");

    let t0 = Instant::now();
    let cpu0 = cpu_ticks(a.pid());
    let silent: Vec<TcpStream> = (0..16).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let mut next = TcpStream::connect(addr).unwrap();
    next.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // Meanwhile the control socket answers at once.
    let t = Instant::now();
    let st = a.status(Duration::from_secs(5));
    assert!(st.ok, "{st:?}");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "status took {:?} while the metrics slots were taken",
        t.elapsed()
    );
    let resp = get_metrics(&mut next);
    let waited = t0.elapsed();
    assert!(resp.starts_with("HTTP/1.0 200 OK"), "{resp}");
    assert!(
        waited >= Duration::from_millis(4900),
        "answered after {waited:?}: the 16 silent clients did not hold the 16 slots"
    );
    assert!(
        waited < Duration::from_secs(7),
        "answered only after {waited:?}: a silent client held its slot past its timeout"
    );
    // Five seconds of acceld waiting: well under a second of CPU (a spin takes them all).
    let ticks = cpu_ticks(a.pid()) - cpu0;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    assert!(
        ticks < hz / 2,
        "acceld used {ticks} ticks of {hz}/s while it waited"
    );
    for mut s in silent {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(0) => {}
            Ok(n) => panic!("a silent client got {n} bytes"),
            Err(e) => panic!("a silent client was not closed at its timeout: {e}"),
        }
    }
}

#[test]
#[ignore = "the child of AcceldRun::start (acceld run)"]
fn acceld_run_child() {
    accel_tests::acceld_run::child_main();
}

/// Out of descriptors, acceld's accept loops wait instead of spinning: a connection they
/// cannot accept stays in the listener's backlog, so a loop that retries at once takes a
/// whole core and writes a log line per try. acceld runs with 128 descriptors; root's
/// control clients take them all; a metrics client comes on top. Then acceld must stay
/// nearly idle with few log lines, and serve both waiting clients once descriptors are free.
#[test]
fn out_of_descriptors_the_accept_loops_wait_instead_of_spinning() {
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpStream;
    use std::os::unix::net::UnixStream;
    let port = free_port();
    let wrapper = ["prlimit", "--nofile=128:128", "--"].map(String::from);
    let a = AcceldRun::start_under(
        &wrapper,
        "acceld_run_child",
        &format!("metrics-addr = \"127.0.0.1:{port}\"\n"),
    );
    a.wait_ready();
    let status = |s: &UnixStream, wait: Duration| -> bool {
        s.set_read_timeout(Some(wait)).unwrap();
        (&*s).write_all(b"{\"op\":\"status\"}\n").unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).is_ok_and(|n| n > 0)
    };
    // Control clients until one is not accepted: each answered one holds a descriptor of
    // acceld's.
    let mut held = Vec::new();
    let pending = loop {
        let s = UnixStream::connect(a.control_socket()).unwrap();
        if !status(&s, Duration::from_millis(500)) {
            break s;
        }
        held.push(s);
        assert!(held.len() < 200, "acceld never ran out of descriptors");
    };
    let mut metrics = TcpStream::connect(("127.0.0.1", port)).unwrap();
    metrics
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let lines_before = a.log().lines().count();
    let cpu0 = cpu_ticks(a.pid());
    // A measurement window: no event marks the absence of a spin.
    std::thread::sleep(Duration::from_secs(2));
    let ticks = cpu_ticks(a.pid()) - cpu0;
    let lines = a.log().lines().count() - lines_before;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    assert!(
        ticks < hz / 2,
        "acceld used {ticks} ticks of {hz}/s in 2 s out of descriptors"
    );
    assert!(lines < 20, "{lines} log lines in 2 s out of descriptors");
    // Descriptors back: both waiting clients are served.
    held.truncate(held.len() - 8);
    let mut line = String::new();
    pending
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    BufReader::new(&pending).read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");
    let resp = get_metrics(&mut metrics);
    assert!(resp.starts_with("HTTP/1.0 200 OK"), "{resp}");
    drop(held);
}

/// The qemu engine connects to `RUN_DIR/VM/nbd.sock`, in the directory QEMU's user owns: a
/// listener planted there that never accepts, its backlog full, held `UnixStream::connect`
/// (and the switch, or the graph probe, that waited on it) for ever. Now the connect gives
/// up after 5 s, inside the handshake's 30 s, with a timeout error.
#[test]
fn a_planted_nbd_socket_that_never_accepts_fails_the_connect_in_time() {
    use accel_dataplane::engine::nbd::{self, NbdEngine, NbdError};
    use std::time::Instant;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let (_listener, held) = plant_full_listener(&sock);
    let (tx, rx) = std::sync::mpsc::channel();
    let p = sock;
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = NbdEngine::connect(&p, "accel-d0").map(|_| ());
        let engine = (r, t0.elapsed());
        let t0 = Instant::now();
        let greets = (nbd::greets(&p, Duration::from_secs(2)), t0.elapsed());
        let _ = tx.send((engine, greets));
    });
    let ((r, took), (greets, greets_took)) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the NBD connect hung on a planted socket");
    match r {
        Err(NbdError::Connect { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}")
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(10),
        "the connect gave up after {took:?}"
    );
    assert!(!greets, "a listener that never accepts greets");
    assert!(
        greets_took < Duration::from_secs(4),
        "greets waited {greets_took:?} for a 2 s probe"
    );
    for c in held {
        // SAFETY: the test's own descriptors.
        unsafe { libc::close(c) };
    }
}

/// A front-end that sends half a message header and then nothing: the vhost crate reads
/// the rest of a header in a loop that retries on EAGAIN, so the socket's 10 s receive
/// timeout never ended that wait, and the drive's server thread stayed in it for ever: no
/// other front-end served, and a shutdown of the drive (unregister, acceld's stop) waited
/// for ever too. Now the server waits for a whole header first, at most 10 s, and a
/// shutdown ends that wait.
#[test]
fn half_a_header_does_not_hold_the_drives_server() {
    use std::io::Write;
    let mut s = TestServer::start(&ServerOptions::default());
    let mut sock = UnixStream::connect(&s.socket).unwrap();
    // A whole VHOST_USER_GET_FEATURES and its reply: the server has taken the connection.
    sock.write_all(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
        .unwrap();
    let mut reply = [0u8; 20];
    std::io::Read::read_exact(&mut sock, &mut reply).unwrap();
    // Then 6 of the next header's 12 bytes, and time for the server to start reading them
    // (nothing outside it marks that moment).
    sock.write_all(&[1, 0, 0, 0, 1, 0]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        s.stop();
        let _ = tx.send(t0.elapsed());
    });
    let took = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the drive's server never stopped: held by half a header");
    assert!(took < Duration::from_secs(5), "the stop took {took:?}");
    drop(sock);

    // And without a shutdown, the connection ends at the message timeout (10 s in the
    // server; here a session of 300 ms on a socket pair).
    let (fe, be) = UnixStream::pair().unwrap();
    let image = tempfile::NamedTempFile::new().unwrap();
    image.as_file().set_len(1 << 20).unwrap();
    let o = ServerOptions::default();
    let drive = accel_dataplane::drive::Drive::new(
        o.drive_config(1 << 20),
        accel_tests::harness::file_engine(image.path(), &o),
    );
    let mut session =
        accel_dataplane::vhost::Session::from_stream(be, drive, Duration::from_millis(300));
    let never = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
    (&fe).write_all(&[1, 0, 0, 0, 1, 0]).unwrap();
    let t0 = std::time::Instant::now();
    assert_eq!(
        session.serve_next(never.as_raw_fd()),
        accel_dataplane::vhost::Served::Closed
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "closed after {took:?}"
    );
}

/// A permitted VM's QEMU keeps its QMP socket in the VM's directory. One QEMU left behind
/// (SIGKILLed, as libvirt does to a QEMU slow to end after `virsh save`) no longer keeps the
/// directory when the permit ends; one that still listens stays.
#[test]
fn a_stale_qemu_socket_does_not_keep_the_vm_directory() {
    use acceld::control::PermitImage;
    use acceld::supervisor::{Config, Owner, Supervisor};
    let (dir, image) = accel_tests::harness::temp_image("accel-stale", 1 << 20);
    let run = dir.path().join("run");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let sup = Supervisor::new(Config {
        run_dir: run.clone(),
        ..Config::default()
    });
    let owner = Owner {
        uid: accel_tests::harness::NOBODY,
        gid: accel_tests::harness::NOBODY,
    };
    for live in [false, true] {
        sup.permit("vm", owner, &[PermitImage::Path(image.clone())])
            .unwrap();
        let qmp = run.join("vm").join("qemu-qmp.sock");
        let listener = std::os::unix::net::UnixListener::bind(&qmp).unwrap();
        if !live {
            // QEMU gone without removing its socket: the file stays, nobody listens.
            drop(listener);
            sup.end_permit("vm");
            assert!(!run.join("vm").exists(), "the VM's directory is left");
        } else {
            sup.end_permit("vm");
            assert!(qmp.exists(), "a live QEMU's QMP socket was removed");
            drop(listener);
        }
    }
}
