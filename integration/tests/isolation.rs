//! One VM wedged by its compromised QEMU never delays another (issue 25, "isolation").
//!
//! Two VMs are wedged in the ways a QEMU controls: each one's drive is on the qemu engine,
//! whose NBD export (the VM's own QEMU's) takes a write and never answers it, so the request
//! stays in flight; one VM's QMP then stops answering altogether, the other is detached (no
//! QMP at all). Both are unregistered at once, through acceld's control socket: the teardown
//! of a drive with a request in flight is what used to join the drive's threads on the async
//! runtime — two of them held both its threads, and every VM's control requests, proxy and
//! switches stopped. Meanwhile the neighbour, a real QEMU 10 guest writing to its
//! accelerated disk, is asked what management asks — status, a registration, a command
//! through its QMP proxy, an engine switch each way — and each answer must come within
//! 100 ms. Then the wedged VMs' unregisters must end (bounded), their sockets gone.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_integration::supervised::{boot_registered, writer_script, AcceldRun};
use accel_tests::fake_qemu::FakeQemu;
use accel_tests::{BlkFrontend, Buf, FrontendOptions, S_OK, T_OUT};
use acceld::control::{DriveSpec, Request, ThrottleLimits};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

const CONFIG: &str = "quiet-period-ms = 300\npoll-interval-ms = 200\n";
/// What "answered at once" means here, for every request of the neighbour.
const BOUND: Duration = Duration::from_millis(100);

/// One request on acceld's control socket: the reply and how long it took.
fn ask(run: &Path, req: &Request) -> Result<(Value, Duration)> {
    let t0 = Instant::now();
    let mut s = UnixStream::connect(run.join("acceld.sock"))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    writeln!(s, "{}", serde_json::to_string(req)?)?;
    let mut line = String::new();
    BufReader::new(&s)
        .read_line(&mut line)
        .with_context(|| format!("no answer to {req:?} within 120 s"))?;
    let took = t0.elapsed();
    let v: Value = serde_json::from_str(&line).with_context(|| format!("reply {line:?}"))?;
    Ok((v, took))
}

fn ask_ok(run: &Path, req: &Request) -> Result<Duration> {
    let (v, took) = ask(run, req)?;
    if v["ok"] != true {
        bail!("{req:?} failed: {v}");
    }
    Ok(took)
}

/// A VM whose drive `w0` is on the qemu engine over its fake QEMU's NBD export, with one
/// write in flight that the export never answers.
struct Wedged {
    name: String,
    fake: Arc<FakeQemu>,
    _fe: BlkFrontend,
}

fn wedged(acc: &AcceldRun, dir: &Path, name: &str) -> Result<Wedged> {
    let wdir = dir.join(name);
    std::fs::create_dir_all(&wdir)?;
    let img = wdir.join("w0.raw");
    std::fs::File::create(&img)?.set_len(16 << 20)?;
    let sock = acc.run_dir.join(name).join("w0.sock");
    let fake = FakeQemu::start(&wdir, "w0", &img, &sock);
    acc.register(
        name,
        &fake.qmp_path,
        &format!("id=w0,image={}", img.display()),
        &[],
    )?;
    acc.wait_engine(name, "w0", "direct", Duration::from_secs(30))?;
    let mut fe = BlkFrontend::connect(&sock, FrontendOptions::default())?;
    assert_eq!(fe.request(0, T_OUT, 0, &[1u8; 512], 0)?.0, S_OK);
    ask_ok(
        &acc.run_dir,
        &Request::Throttle {
            vm: name.into(),
            drive: "w0".into(),
            limits: Some(ThrottleLimits {
                iops_total: Some(100_000),
                ..Default::default()
            }),
        },
    )?;
    acc.wait_engine(name, "w0", "qemu", Duration::from_secs(30))?;
    assert_eq!(fe.request(0, T_OUT, 8, &[2u8; 512], 0)?.0, S_OK);
    // From now on the export swallows writes: this one stays in flight.
    fake.hold_nbd_writes(true);
    let s = fe.slot(0, 1);
    fe.mem.write(s.header, &accel_tests::header(T_OUT, 16));
    fe.mem.fill(s.data, 512, 3);
    let bufs = [
        Buf::r(s.header, 16),
        Buf::r(s.data, 512),
        Buf::w(s.status, 1),
    ];
    fe.queue_chain(0, &bufs)?;
    fe.kick(0);
    Ok(Wedged {
        name: name.into(),
        fake,
        _fe: fe,
    })
}

/// The in-flight request is really held: acceld's status counts it.
fn in_flight(acc: &AcceldRun, vm: &str) -> Result<u64> {
    let d = acc.drive(vm, "w0")?;
    Ok(d["io"]["in_flight"].as_u64().unwrap_or(0))
}

/// The neighbour's QMP proxy: greeting and capabilities done; `cmd` timed.
struct Proxy(BufReader<UnixStream>);

impl Proxy {
    fn connect(path: &Path) -> Result<Self> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut p = Proxy(BufReader::new(s));
        p.line()?;
        p.cmd("qmp_capabilities")?;
        Ok(p)
    }

    fn line(&mut self) -> Result<Value> {
        let mut l = String::new();
        self.0
            .read_line(&mut l)
            .context("no answer from the QMP proxy within 30 s")?;
        Ok(serde_json::from_str(&l)?)
    }

    fn cmd(&mut self, name: &str) -> Result<(Value, Duration)> {
        let t0 = Instant::now();
        writeln!(self.0.get_mut(), "{}", json!({"execute": name, "id": 7}))?;
        loop {
            let v = self.line()?;
            if v.get("event").is_none() {
                return Ok((v, t0.elapsed()));
            }
        }
    }
}

fn throttle(vm: &str, iops: Option<u64>) -> Request {
    Request::Throttle {
        vm: vm.into(),
        drive: "d0".into(),
        limits: iops.map(|n| ThrottleLimits {
            iops_total: Some(n),
            ..Default::default()
        }),
    }
}

/// The neighbour's answers, timed: (what, how long).
fn neighbour_round(
    acc: &AcceldRun,
    proxy: &mut Proxy,
    late: &Path,
    round: usize,
) -> Result<Vec<(String, Duration)>> {
    let run = &acc.run_dir;
    let mut took = Vec::new();
    took.push(("status".into(), ask_ok(run, &Request::Status)?));
    let (v, t) = proxy.cmd("query-status")?;
    if v["return"]["running"] != true {
        bail!("query-status through the proxy: {v}");
    }
    took.push(("proxy query-status".into(), t));
    let vm = format!("late{round}");
    let spec = DriveSpec::parse(&format!("id=l0,image={}", late.display()))?;
    took.push((
        "register".into(),
        ask_ok(
            run,
            &Request::Register {
                vm: vm.clone(),
                qmp: late.with_extension("qmp"),
                drives: vec![spec],
                cont: false,
                incoming: false,
            },
        )?,
    ));
    ask_ok(run, &Request::Unregister { vm })?;
    took.push((
        "switch to qemu".into(),
        ask_ok(run, &throttle("nb", Some(100_000)))?,
    ));
    acc.wait_engine("nb", "d0", "qemu", Duration::from_secs(30))?;
    took.push((
        "switch back (throttle off)".into(),
        ask_ok(run, &throttle("nb", None))?,
    ));
    acc.wait_engine("nb", "d0", "direct", Duration::from_secs(30))?;
    Ok(took)
}

#[test]
fn a_wedged_vm_never_delays_its_neighbour() -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("accel-isolation")
        .tempdir_in("/var/tmp")?;
    let run = dir.path().join("run");
    let acc = AcceldRun::start(&run, CONFIG)?;
    let img = dir.path().join("nb.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let late = dir.path().join("late.raw");
    std::fs::File::create(&late)?.set_len(1 << 20)?;
    acc.register(
        "nb",
        &dir.path().join("nb-qmp.sock"),
        &format!("id=d0,image={}", img.display()),
        &["--cont"],
    )?;
    let mut g = boot_registered(
        &acc,
        "nb",
        "256M",
        &dir.path().join("nb-test-qmp.sock"),
        &writer_script("/dev/vda", 4, 64),
    )?;
    g.wait_for("READY", Duration::from_secs(120))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", acc.log_text()))?;
    acc.wait_engine("nb", "d0", "direct", Duration::from_secs(60))?;
    let mut proxy = Proxy::connect(&run.join("nb").join("monitor.sock"))?;
    let before = neighbour_round(&acc, &mut proxy, &late, 0)?;

    let w1 = wedged(&acc, dir.path(), "w1")?;
    let w2 = wedged(&acc, dir.path(), "w2")?;
    for w in [&w1, &w2] {
        let t0 = Instant::now();
        while in_flight(&acc, &w.name)? == 0 {
            if t0.elapsed() > Duration::from_secs(10) {
                bail!(
                    "{}'s write is not in flight: {}",
                    w.name,
                    acc.drive(&w.name, "w0")?
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // w1: no QMP (detached); w2: a QMP that never answers.
    ask_ok(&run, &Request::Detach { vm: "w1".into() })?;
    w2.fake.silence_qmp(true);
    let unregisters: Vec<_> = ["w1", "w2"]
        .into_iter()
        .map(|vm| {
            let run = run.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let r = ask(&run, &Request::Unregister { vm: vm.into() });
                (vm, r, t0.elapsed())
            })
        })
        .collect();

    // While both unregisters wedge (or have ended), the neighbour is answered at once, again
    // and again.
    let mut during = Vec::new();
    for round in 1..=3 {
        during.extend(neighbour_round(&acc, &mut proxy, &late, round)?);
    }
    for (what, t) in &before {
        println!("neighbour, nothing wedged: {what}: {} us", t.as_micros());
    }
    let mut worst = Duration::ZERO;
    for (what, t) in &during {
        println!("neighbour, two VMs wedged: {what}: {} us", t.as_micros());
        worst = worst.max(*t);
    }
    // Status, a registration and a proxy command touch nothing of QEMU's but the proxy's one
    // round trip: each answer counts. A switch is a dozen QMP round trips to a QEMU whose
    // vCPUs (TCG, on two host cores) compete with it: its median over the rounds counts.
    for (what, t) in during.iter().filter(|(w, _)| !w.starts_with("switch")) {
        assert!(
            *t < BOUND,
            "{what} took {t:?} with two VMs wedged (before: {before:?})\nacceld log:\n{}",
            acc.log_text()
        );
    }
    for kind in ["switch to qemu", "switch back (throttle off)"] {
        let mut ts: Vec<Duration> = during
            .iter()
            .filter(|(w, _)| w == kind)
            .map(|(_, t)| *t)
            .collect();
        ts.sort();
        let median = ts[ts.len() / 2];
        assert!(
            median < BOUND,
            "{kind}: median {median:?} of {ts:?} with two VMs wedged (before: {before:?})"
        );
    }
    println!(
        "neighbour's slowest answer with two VMs wedged: {} us",
        worst.as_micros()
    );

    // The wedged VMs' own unregisters end too, within their bound, and leave nothing.
    for h in unregisters {
        let (vm, r, took) = h.join().expect("unregister thread");
        let (v, _) = r?;
        println!("unregister {vm} (wedged): {} ms: {v}", took.as_millis());
        assert!(
            took < Duration::from_secs(60),
            "unregister {vm} took {took:?}"
        );
        let st = acc.status()?;
        assert!(
            !st["vms"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x["vm"] == vm)),
            "{vm} is still served: {st}"
        );
        assert!(
            !run.join(vm).join("w0.sock").exists(),
            "{vm}'s socket is left"
        );
    }
    drop((w1, w2));

    // The neighbour's guest verifies everything it wrote.
    g.send_line("STOP")?;
    let out = g.wait_exit(Duration::from_secs(180))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}", out.join("\n"));
    }
    Ok(())
}
