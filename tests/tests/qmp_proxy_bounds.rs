//! The QMP proxy against untrusted management clients, hermetic (the scripted QMP fake for
//! QEMU): a cap on clients per VM, backpressure on `exec-oob`, a client that does not read
//! its events dropped, and fd names of other clients out of reach. None of them stalls the
//! proxy for another client.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_tests::fake_qemu::FakeQemu;
use acceld::control::DriveSpec;
use acceld::supervisor::Supervisor;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

struct Env {
    _dir: tempfile::TempDir,
    fake: Arc<FakeQemu>,
    _sup: Arc<Supervisor>,
    monitor: PathBuf,
}

async fn setup(oob: bool) -> Env {
    accel_tests::harness::init_logs();
    let dir = tempfile::Builder::new()
        .prefix("accel-proxyb")
        .tempdir_in("/var/tmp")
        .unwrap();
    let image = dir.path().join("d0.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let run = dir.path().join("run");
    let socket = run.join("vm").join("d0.sock");
    let fake = FakeQemu::start(dir.path(), "d0", &image, &socket);
    fake.set_oob(oob);
    let spec = DriveSpec::parse(&format!("id=d0,image={},queues=1", image.display())).unwrap();
    let sup = fake.supervise(&run, spec);
    let monitor = sup.monitor_socket("vm");
    tokio::spawn(acceld::qmp_proxy::serve(sup.clone(), "vm".into()));
    let t0 = Instant::now();
    while UnixStream::connect(&monitor).await.is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no proxy socket");
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Env {
        _dir: dir,
        fake,
        _sup: sup,
        monitor,
    }
}

struct Client {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
}

impl Client {
    async fn connect(p: &std::path::Path) -> (Client, Value) {
        let (r, w) = UnixStream::connect(p).await.unwrap().into_split();
        let mut c = Client {
            r: BufReader::new(r),
            w,
        };
        let g = c.recv().await.expect("a first message");
        (c, g)
    }

    /// The next message, None at EOF; panics after 20 s.
    async fn recv(&mut self) -> Option<Value> {
        let mut l = String::new();
        let n = tokio::time::timeout(Duration::from_secs(20), self.r.read_line(&mut l))
            .await
            .expect("a message or EOF within 20 s")
            .unwrap_or(0);
        (n > 0).then(|| serde_json::from_str(&l).unwrap())
    }

    async fn send(&mut self, v: Value) {
        self.w.write_all(format!("{v}\n").as_bytes()).await.unwrap();
    }

    async fn cmd(&mut self, v: Value) -> Value {
        self.send(v).await;
        loop {
            let m = self.recv().await.expect("a reply");
            if m.get("event").is_none() {
                return m;
            }
        }
    }

    async fn negotiated(p: &std::path::Path, oob: bool) -> Client {
        let (mut c, g) = Client::connect(p).await;
        assert!(g.get("QMP").is_some(), "{g}");
        let mut m = json!({"execute": "qmp_capabilities", "id": "neg"});
        if oob {
            m["arguments"] = json!({"enable": ["oob"]});
        }
        assert_eq!(c.cmd(m).await["return"], json!({}));
        c
    }
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_over_the_cap_are_refused() {
    let env = setup(false).await;
    let mut clients = Vec::new();
    for _ in 0..acceld::qmp_proxy::MAX_CLIENTS {
        clients.push(Client::negotiated(&env.monitor, false).await);
    }
    let (mut extra, first) = Client::connect(&env.monitor).await;
    assert_eq!(first["error"]["class"], "GenericError", "{first}");
    assert!(
        first["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("too many clients"),
        "{first}"
    );
    assert_eq!(extra.recv().await, None, "closed after the error");
    // The clients in are served as before.
    let r = clients[3]
        .cmd(json!({"execute": "query-status", "id": 1}))
        .await;
    assert_eq!(r["return"]["status"], "running", "{r}");
    // One leaves: its place is free again.
    drop(clients.pop());
    let t0 = Instant::now();
    loop {
        let (_c, first) = Client::connect(&env.monitor).await;
        if first.get("QMP").is_some() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no slot freed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_oob_in_flight_is_bounded_per_client() {
    let env = setup(true).await;
    env.fake.hold_oob(true);
    let mut a = Client::negotiated(&env.monitor, true).await;
    let mut b = Client::negotiated(&env.monitor, false).await;
    let n = 100;
    for i in 0..n {
        a.send(json!({"exec-oob": "migrate-pause", "id": i})).await;
    }
    let max = acceld::qmp_proxy::MAX_OOB_INFLIGHT;
    let fake = env.fake.clone();
    wait_until("the first exec-oob reach QEMU", || fake.oob_seen() >= max).await;
    // Another client is served meanwhile.
    let r = b.cmd(json!({"execute": "query-status", "id": "b"})).await;
    assert_eq!(r["return"]["status"], "running", "{r}");
    assert_eq!(
        env.fake.oob_seen(),
        max,
        "no more than {max} exec-oob of one client in flight"
    );
    env.fake.release_oob();
    let mut ids = Vec::new();
    while ids.len() < n {
        let m = a.recv().await.expect("a reply");
        assert_eq!(m["return"], json!({}), "{m}");
        ids.push(m["id"].as_u64().unwrap());
    }
    ids.sort();
    assert_eq!(ids, (0..n as u64).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_events_is_dropped() {
    let env = setup(false).await;
    let mut sleeper = Client::negotiated(&env.monitor, false).await;
    let mut reader = Client::negotiated(&env.monitor, false).await;
    let pad = "x".repeat(1000);
    // In batches the reading client keeps up with; the other one reads nothing.
    for batch in 0..8 {
        for i in 0..500 {
            env.fake
                .emit("TEST_EVENT", &json!({"batch": batch, "i": i, "pad": pad}));
        }
        loop {
            let m = reader.recv().await.expect("the reading client stays");
            if m["data"]["batch"] == batch && m["data"]["i"] == 499 {
                break;
            }
        }
    }
    let r = reader
        .cmd(json!({"execute": "query-status", "id": 1}))
        .await;
    assert_eq!(r["return"]["status"], "running", "{r}");
    // The sleeper's socket holds what was sent before it was dropped; then EOF.
    let mut got = 0;
    while let Some(m) = sleeper.recv().await {
        assert_eq!(m["event"], "TEST_EVENT");
        got += 1;
    }
    assert!(got < 4000, "dropped before all its events: {got}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_name_another_clients_fd() {
    let env = setup(false).await;
    let mut a = Client::negotiated(&env.monitor, false).await;
    let mut b = Client::negotiated(&env.monitor, false).await;
    let r = a
        .cmd(json!({"execute": "getfd", "arguments": {"fdname": "mig"}, "id": 1}))
        .await;
    assert_eq!(r["return"], json!({}), "{r}");
    // b spells a's name as QEMU knows it (client 0's), in every place a name goes.
    let theirs = "acceld.fd.0.mig";
    for args in [
        json!({"uri": format!("fd:{theirs}")}),
        json!({"channels": [{"channel-type": "main", "addr": {"transport": "socket", "type": "fd", "str": theirs}}]}),
        json!({"fdname": theirs}),
    ] {
        let r = b
            .cmd(json!({"execute": "migrate", "arguments": args, "id": 2}))
            .await;
        assert_eq!(r["error"]["class"], "GenericError", "{r}");
        assert!(
            r["error"]["desc"].as_str().unwrap().contains("reserved"),
            "{r}"
        );
    }
    let r = b
        .cmd(json!({"execute": "human-monitor-command",
                    "arguments": {"command-line": format!("migrate fd:{theirs}")}, "id": 3}))
        .await;
    assert!(r.get("error").is_some(), "{r}");
    assert!(
        !env.fake
            .log()
            .iter()
            .any(|c| c == "migrate" || c == "human-monitor-command"),
        "a command naming another client's fd reached QEMU: {:?}",
        env.fake.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn management_nbd_server_cannot_take_acceld_sockets() {
    let env = setup(false).await;
    let mut c = Client::negotiated(&env.monitor, false).await;
    let vm_dir = env.monitor.parent().unwrap().to_path_buf();
    let run_dir = vm_dir.parent().unwrap().to_path_buf();
    let start = |path: String| {
        json!({"execute": "nbd-server-start",
               "arguments": {"addr": {"type": "unix", "data": {"path": path}}}, "id": 1})
    };
    // acceld's own upstream (started by the first nbd-server-start if no drive needed it).
    let r = c
        .cmd(start(vm_dir.join("nbd.sock").display().to_string()))
        .await;
    assert_eq!(r["error"]["class"], "GenericError", "{r}");
    assert!(vm_dir.join("nbd.sock").exists(), "acceld's socket stays");
    std::os::unix::fs::symlink(vm_dir.join("d0.sock"), vm_dir.join("link.sock")).unwrap();
    std::fs::write(vm_dir.join("file.sock"), b"x").unwrap();
    let spelled = format!("{}/../vm/monitor.sock", vm_dir.display());
    for p in [
        vm_dir.join("monitor.sock").display().to_string(),
        vm_dir.join("d0.sock").display().to_string(),
        vm_dir.join("control.sock").display().to_string(),
        vm_dir.join("qemu-qmp.sock").display().to_string(),
        vm_dir.join("link.sock").display().to_string(),
        vm_dir.join("file.sock").display().to_string(),
        run_dir.join("acceld.sock").display().to_string(),
        env.fake.qmp_path.display().to_string(),
        spelled,
    ] {
        let r = c.cmd(start(p.clone())).await;
        assert_eq!(r["error"]["class"], "GenericError", "{p}: {r}");
        let desc = r["error"]["desc"].as_str().unwrap();
        assert!(desc.starts_with("Failed to bind socket to"), "{p}: {desc}");
    }
    assert_eq!(std::fs::read(vm_dir.join("file.sock")).unwrap(), b"x");
    assert!(std::fs::symlink_metadata(vm_dir.join("link.sock"))
        .unwrap()
        .file_type()
        .is_symlink());
    // The drive and the proxy still work: their sockets were not taken.
    assert!(std::os::unix::net::UnixStream::connect(vm_dir.join("d0.sock")).is_ok());
    let (_c2, g) = Client::connect(&env.monitor).await;
    assert!(g.get("QMP").is_some(), "{g}");
    // Management's own path in the VM's directory is fine.
    let r = c
        .cmd(start(vm_dir.join("mgmt.sock").display().to_string()))
        .await;
    assert_eq!(r["return"], json!({}), "{r}");
}
