//! The supervisor with real QEMU 10 (TCG): `acceld run` + `accelctl`, a tiny guest doing
//! verified random writes from 32 writers, and every move the product makes under it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel_integration::supervised::{boot_registered, writer_script, AcceldRun, SideQmp};
use accel_integration::{create_qcow2, guest_value, host_md5, qcow2_md5, Guest};
use anyhow::{bail, Result};
use serde_json::{json, Value};

const CONFIG: &str = "quiet-period-ms = 300\npoll-interval-ms = 200\n";

fn workdir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("accel-{tag}"))
        .tempdir_in("/var/tmp")
        .unwrap()
}

fn boot(acc: &AcceldRun, vm: &str, test_qmp: &Path, script: &str) -> Result<Guest> {
    boot_registered(acc, vm, "256M", test_qmp, script)
}

fn register(acc: &AcceldRun, vm: &str, qmp: &Path, drive: &str) -> Result<()> {
    acc.register(vm, qmp, drive, &["--cont"])
}

/// `acceld run` with VM vm1 registered (raw drive d0 of 64 MiB, 2 queues) and booted with 32
/// verifying writers (`writer_script`) and a test QMP monitor.
struct WriterVm {
    dir: tempfile::TempDir,
    img: PathBuf,
    tq: PathBuf,
    acc: AcceldRun,
    g: Guest,
}

fn writer_vm(tag: &str) -> Result<WriterVm> {
    let dir = workdir(tag);
    let run = dir.path().join("run");
    let img = dir.path().join("d0.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let qmp = dir.path().join("qmp.sock");
    let tq = dir.path().join("test-qmp.sock");
    let acc = AcceldRun::start(&run, CONFIG)?;
    register(
        &acc,
        "vm1",
        &qmp,
        &format!("id=d0,image={},queues=2", img.display()),
    )?;
    let g = boot(&acc, "vm1", &tq, &writer_script("/dev/vda", 32, 64))?;
    Ok(WriterVm {
        dir,
        img,
        tq,
        acc,
        g,
    })
}

fn pct(v: &Value, k: &str) -> String {
    format!(
        "n={} p50={}us p99={}us max={}us",
        v[k]["count"], v[k]["p50_us"], v[k]["p99_us"], v[k]["max_us"]
    )
}

fn finish_guest(g: &mut Guest, acc: &AcceldRun) -> Result<Vec<String>> {
    g.send_line("STOP")?;
    let out = g
        .wait_exit(Duration::from_secs(180))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log (end):\n{}", acc.log_tail(300)))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}", out.join("\n"));
    }
    Ok(out)
}

/// The whole story on one raw drive: direct at start, throttle -> qemu engine with QEMU's
/// filter, clear -> direct, 20 switches each way, direct snapshot/mirror of the node refused,
/// acceld SIGTERM restart; the guest verifies throughout and at the end, the host checks the
/// image.
#[test]
fn raw_drive_story_under_guest_writes() -> Result<()> {
    let WriterVm {
        dir,
        img,
        tq,
        mut acc,
        mut g,
    } = writer_vm("story")?;
    g.wait_for("READY", Duration::from_secs(120))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", acc.log_text()))?;
    let d = acc.drive("vm1", "d0")?;
    assert_eq!(d["engine"], "direct", "{d}");
    let t = SideQmp::connect(&tq)?;

    // While direct, QEMU has no node for the drive: a snapshot or mirror fails cleanly.
    let snap = t.cmd(
        "blockdev-snapshot-sync",
        json!({"node-name": "d0", "snapshot-file": dir.path().join("s.qcow2"), "format": "qcow2"}),
    );
    let e = snap.expect_err("snapshot of an accelerated drive must fail");
    println!("direct snapshot refused: {e}");
    let mirror = t.cmd(
        "drive-mirror",
        json!({"device": "d0", "target": dir.path().join("m.raw"), "format": "raw", "sync": "full", "job-id": "m0"}),
    );
    let e = mirror.expect_err("mirror of an accelerated drive must fail");
    println!("direct mirror refused: {e}");
    // And QEMU cannot open the image for writing behind acceld's back (image locks).
    let add = t.cmd(
        "blockdev-add",
        json!({"driver": "file", "node-name": "intruder", "filename": img}),
    );
    if add.is_ok() {
        let ex = t.cmd(
            "block-export-add",
            json!({"type": "nbd", "id": "intr", "node-name": "intruder", "writable": true}),
        );
        assert!(ex.is_err(), "QEMU got a writable export of the image");
        let _ = t.cmd("blockdev-del", json!({"node-name": "intruder"}));
    }

    // Throttle: qemu engine within a second, with the reason and QEMU's filter.
    let t0 = Instant::now();
    acc.ctl_ok(&["throttle", "vm1", "d0", "--iops-total", "400"])?;
    let took = acc.wait_engine("vm1", "d0", "qemu", Duration::from_secs(5))? + t0.elapsed();
    let d = acc.drive("vm1", "d0")?;
    assert!(d["reasons"].to_string().contains("throttle"), "{d}");
    let nodes = t.cmd("query-named-block-nodes", json!({"flat": true}))?;
    let filter = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["drv"] == "throttle")
        .cloned()
        .expect("QEMU has a throttle filter node");
    let group = t.cmd(
        "qom-get",
        json!({"path": "accel-tg-d0", "property": "limits"}),
    )?;
    assert_eq!(group["iops-total"], 400, "{group}");
    println!(
        "throttle -> qemu engine in {took:?}; filter {} group limits {group}",
        filter["node-name"]
    );
    let explain = acc.ctl_ok(&["explain", "vm1", "d0"])?;
    assert!(explain.contains("throttle"), "{explain}");
    std::thread::sleep(Duration::from_secs(2));
    let d = acc.drive("vm1", "d0")?;
    println!("throttled: iops {} (limit 400)", d["io"]["iops"]);

    let t0 = Instant::now();
    acc.ctl_ok(&["throttle", "vm1", "d0", "--clear"])?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    println!("clear -> direct in {:?}", t0.elapsed());
    let nodes = t.cmd("query-named-block-nodes", json!({"flat": true}))?;
    assert!(
        !nodes.to_string().contains("\"throttle\""),
        "filter removed: {nodes}"
    );

    // 20 switches each way.
    for i in 0..20 {
        acc.ctl_ok(&["handback", "vm1", "d0"])?;
        assert_eq!(acc.drive("vm1", "d0")?["engine"], "qemu", "handback {i}");
        acc.ctl_ok(&["accelerate", "vm1", "d0"])?;
        assert_eq!(
            acc.drive("vm1", "d0")?["engine"],
            "direct",
            "accelerate {i}"
        );
    }
    let d = acc.drive("vm1", "d0")?;
    println!(
        "pauses to qemu: {}; to direct: {}; failed switches {}",
        pct(&d["switch"], "to_qemu"),
        pct(&d["switch"], "to_direct"),
        d["switch"]["failed"]
    );
    assert_eq!(d["switch"]["failed"], 0, "{d}");
    assert!(d["switch"]["to_qemu"]["count"].as_u64().unwrap() >= 21);
    assert!(d["switch"]["to_direct"]["count"].as_u64().unwrap() >= 21);

    // A block job on the drive's node keeps it in QEMU while it runs; when the job ends the
    // drive goes back to direct by itself (events + quiet period).
    acc.ctl_ok(&["handback", "vm1", "d0"])?;
    // This QEMU has the test's monitor beside acceld's, and the mirror goes there, around
    // the QMP proxy: the drive (relay by default) serves over NBD, or the mirror's drain
    // would meet relayed requests, which QEMU 10.0.2's vhost-user-blk export does not
    // survive.
    let d = acc.drive("vm1", "d0")?;
    assert_eq!(
        (&d["engine"], &d["io_path"]),
        (&json!("qemu"), &json!("nbd")),
        "{d}"
    );
    assert!(
        acc.log_text().contains("QEMU has monitors beside acceld's"),
        "{}",
        acc.log_text()
    );
    t.cmd(
        "drive-mirror",
        json!({"device": "d0", "target": dir.path().join("m.raw"), "format": "raw",
               "sync": "full", "job-id": "m1", "speed": 65536}),
    )?;
    acc.ctl_ok(&["accelerate", "vm1", "d0"])?;
    std::thread::sleep(Duration::from_millis(800));
    let d = acc.drive("vm1", "d0")?;
    assert_eq!(
        d["engine"], "qemu",
        "a running mirror keeps the drive in QEMU: {d}"
    );
    assert!(d["reasons"].to_string().contains("block-job"), "{d}");
    assert!(
        d["reasons"].to_string().contains("filter:mirror_top"),
        "{d}"
    );
    println!("mirror running: reasons {}", d["reasons"]);
    t.cmd("block-job-cancel", json!({"device": "m1", "force": true}))?;
    let took = acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    println!("mirror cancelled -> direct again in {took:?}");

    // A migration freezes engine moves: a handback asked during one waits for its end (a
    // move would add nodes and an export mid-migration, which fails its completion).
    t.cmd("migrate-set-parameters", json!({"max-bandwidth": 1 << 20}))?;
    t.cmd("migrate", json!({"uri": "exec:cat > /dev/null"}))?;
    acc.ctl_ok(&["handback", "vm1", "d0"])?;
    std::thread::sleep(Duration::from_millis(600));
    let m = t.cmd("query-migrate", Value::Null)?;
    assert_eq!(m["status"], "active", "{m}");
    let d = acc.drive("vm1", "d0")?;
    assert_eq!(d["engine"], "direct", "no engine move while migrating: {d}");
    assert!(
        d["reasons"].to_string().contains("migration-in-progress"),
        "{d}"
    );
    t.cmd("migrate_cancel", Value::Null)?;
    let took = acc.wait_engine("vm1", "d0", "qemu", Duration::from_secs(10))?;
    println!("migration cancelled: the handback asked during it ran {took:?} later");
    acc.ctl_ok(&["accelerate", "vm1", "d0"])?;
    assert_eq!(acc.drive("vm1", "d0")?["engine"], "direct");
    t.cmd(
        "migrate-set-parameters",
        json!({"max-bandwidth": 134217728}),
    )?;

    // acceld restart under the running guest.
    let took = acc.restart()?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    let att = acc.wait_attached("vm1", Duration::from_secs(10))?;
    println!("acceld SIGTERM + restart: {took:?}, drive direct again, re-attached {att:?} later");
    // Both ways once more after the restart, so re-attach is proven; and a restart while the
    // drive is on the qemu engine (a persistent pin): held until re-attach, then qemu again.
    acc.ctl_ok(&["handback", "vm1", "d0", "--pin"])?;
    assert_eq!(acc.drive("vm1", "d0")?["engine"], "qemu");
    let took = acc.restart()?;
    let back = acc.wait_engine("vm1", "d0", "qemu", Duration::from_secs(10))?;
    acc.wait_attached("vm1", Duration::from_secs(10))?;
    println!("restart on the qemu engine: {took:?}, qemu again {back:?} later");
    acc.ctl_ok(&["accelerate", "vm1", "d0"])?;
    assert_eq!(acc.drive("vm1", "d0")?["engine"], "direct");
    std::thread::sleep(Duration::from_secs(2));

    let out = finish_guest(&mut g, &acc)?;
    let md5 = guest_value(&out, "md5")?;
    let iters = guest_value(&out, "iterations")?;
    assert_eq!(
        host_md5(&img, 32 * 64 * 4096)?,
        md5,
        "host sees what the guest wrote"
    );
    let d = acc.drive("vm1", "d0");
    println!("guest: {iters} verified write+read iterations, 0 errors; host md5 matches");
    // The VM went away: acceld detaches it and removes its sockets.
    let t0 = Instant::now();
    while acc.status()?["vms"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["vm"] == "vm1")
    {
        if t0.elapsed() > Duration::from_secs(15) {
            bail!("VM not detached after exit: {d:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!acc.run_dir.join("vm1").join("d0.sock").exists());
    Ok(())
}

/// A qcow2 drive runs on the qemu engine from the start, and its data lands in the qcow2.
#[test]
fn qcow2_drive_is_served_by_qemu() -> Result<()> {
    let dir = workdir("qcow2");
    let run = dir.path().join("run");
    let img = dir.path().join("d1.qcow2");
    create_qcow2(&img, "32M")?;
    let qmp = dir.path().join("qmp.sock");
    let tq = dir.path().join("test-qmp.sock");
    let acc = AcceldRun::start(&run, CONFIG)?;
    register(
        &acc,
        "vm2",
        &qmp,
        &format!("id=d1,image={},format=qcow2", img.display()),
    )?;
    let mut g = boot(&acc, "vm2", &tq, &writer_script("/dev/vda", 8, 32))?;
    g.wait_for("READY", Duration::from_secs(120))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", acc.log_text()))?;
    let d = acc.drive("vm2", "d1")?;
    assert_eq!(d["engine"], "qemu", "{d}");
    assert!(d["reasons"].to_string().contains("format:qcow2"), "{d}");
    // accelerate cannot override the format.
    acc.ctl_ok(&["accelerate", "vm2", "d1"])?;
    assert_eq!(acc.drive("vm2", "d1")?["engine"], "qemu");
    std::thread::sleep(Duration::from_secs(3));
    let out = finish_guest(&mut g, &acc)?;
    let md5 = guest_value(&out, "md5")?;
    assert_eq!(
        qcow2_md5(&img, 8 * 32 * 4096)?,
        md5,
        "data is in the qcow2 file"
    );
    let _ = PathBuf::new();
    Ok(())
}

/// accelctl's errors and exit codes, against a live acceld (no VM needed).
#[test]
fn accelctl_errors_and_exit_codes() -> Result<()> {
    let dir = workdir("ctl");
    let run = dir.path().join("run");
    let img = dir.path().join("x.raw");
    std::fs::File::create(&img)?.set_len(1 << 20)?;
    let mut acc = AcceldRun::start(&run, CONFIG)?;
    let qmp = dir.path().join("nobody.qmp");
    let q = qmp.to_str().unwrap();
    let drive = format!("id=x0,image={}", img.display());
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["explain", "nope", "d0"], 3, "no VM named nope"),
        (
            vec!["register", "--vm", "v", "--qmp", q, "--drive", "id=x0"],
            2,
            "missing image=",
        ),
        (
            vec![
                "register",
                "--vm",
                "v",
                "--qmp",
                q,
                "--drive",
                "id=x0,image=/no/such.raw",
            ],
            2,
            "does not exist",
        ),
        (
            vec![
                "register", "--vm", "bad name", "--qmp", q, "--drive", &drive,
            ],
            2,
            "not a valid name",
        ),
        (vec!["throttle", "v", "x0"], 2, "at least one limit"),
        (vec!["qemu-args", "--vm", "nope"], 3, "no VM named"),
    ];
    for (args, code, text) in &cases {
        let (c, _, err) = acc.ctl(args)?;
        assert_eq!(c, *code, "{args:?}: {err}");
        assert!(err.contains(text), "{args:?}: {err}");
    }
    acc.ctl_ok(&["register", "--vm", "v", "--qmp", q, "--drive", &drive])?;
    assert!(run.join("v").join("x0.sock").exists());
    let (c, _, err) = acc.ctl(&["register", "--vm", "v", "--qmp", q, "--drive", &drive])?;
    assert_eq!(c, 4, "{err}");
    // Not attached (no QEMU): operations that need QMP fail with 1 and say why.
    let (c, _, err) = acc.ctl(&["handback", "v", "x0"])?;
    assert_eq!(c, 1, "{err}");
    assert!(err.contains("not attached"), "{err}");
    let (c, _, err) = acc.ctl(&["explain", "v", "nope"])?;
    assert_eq!(c, 3, "{err}");
    let table = acc.ctl_ok(&["status"])?;
    assert!(table.contains("x0") && table.contains("held"), "{table}");
    acc.ctl_ok(&["unregister", "v"])?;
    assert!(!run.join("v").join("x0.sock").exists(), "socket removed");
    acc.terminate()?;
    let (c, _, err) = acc.ctl(&["status"])?;
    assert_eq!(c, 5, "{err}");
    assert!(err.contains("cannot reach acceld"), "{err}");
    Ok(())
}

/// `acceld run` SIGKILLed 20 times while 32 guest writers (queue depth up to 32) write and
/// verify: each time a new acceld restores the registry, serves the direct drive at once,
/// resubmits what was in flight (INFLIGHT_SHMFD) and re-attaches; the next kill waits until
/// the guest's I/O resumed. The guest sees no error; the host's data matches.
#[test]
fn acceld_run_sigkilled_twenty_times_under_guest_writes() -> Result<()> {
    // The temp dir lives as long as the test.
    let WriterVm {
        dir: _dir,
        img,
        mut acc,
        mut g,
        ..
    } = writer_vm("kill")?;
    g.wait_for("READY", Duration::from_secs(120))?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(30))?;
    let mut at = g.progress()?;
    let kills = 20;
    let mut attach = Vec::new();
    for k in 0..kills {
        acc.kill_and_start()?;
        attach.push(acc.wait_attached("vm1", Duration::from_secs(60))?);
        at = g
            .progress_beyond(at)
            .map_err(|e| anyhow::anyhow!("after {} kills: {e}", k + 1))?;
    }
    let d = acc.drive("vm1", "d0")?;
    assert_eq!(d["engine"], "direct", "{d}");
    let out = finish_guest(&mut g, &acc)?;
    assert_eq!(guest_value(&out, "errors").unwrap(), "0", "{out:?}");
    assert_eq!(guest_value(&out, "kernel_errors").unwrap(), "0", "{out:?}");
    let md5 = guest_value(&out, "md5").unwrap();
    assert_eq!(host_md5(&img, 32 * 64 * 4096)?, md5);
    attach.sort();
    let log = acc.log_text();
    println!(
        "acceld run: {kills} SIGKILLs, re-attached in p50 {:?} max {:?}; {} restarts resubmitted requests; {} guest iterations",
        attach[attach.len() / 2],
        attach[attach.len() - 1],
        log.matches("resubmitting").count(),
        guest_value(&out, "iterations").unwrap_or_default()
    );
    acc.terminate()?;
    Ok(())
}

/// QEMU 10.0.2 can hang in its exit when its main loop ends in the middle of a QMP command
/// (see daemon/src/supervisor/exit_watch.rs): a monitor that asks as fast as it can while the
/// guest powers off makes about one exit in two wait forever in `monitor_cleanup`. acceld
/// sees the SHUTDOWN on its own monitor and wakes a QEMU still there after 5 s. Six guests
/// power off under such a monitor (with OOB, as management tools negotiate it); every QEMU
/// exits, with status 0.
#[test]
fn qemu_exits_though_a_monitor_keeps_asking() -> Result<()> {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;

    const ROUNDS: usize = 6;
    let dir = workdir("exit");
    let run = dir.path().join("run");
    let acc = AcceldRun::start(&run, CONFIG)?;
    let mut asked = Vec::new();
    let mut took = Vec::new();
    for r in 0..ROUNDS {
        let vm = format!("vm{r}");
        let img = dir.path().join(format!("{vm}.raw"));
        std::fs::File::create(&img)?.set_len(16 << 20)?;
        let qmp = dir.path().join(format!("{vm}-qmp.sock"));
        let tq = dir.path().join(format!("{vm}-test-qmp.sock"));
        register(&acc, &vm, &qmp, &format!("id=d0,image={}", img.display()))?;
        // The guest waits for a line on its console, then powers off at once.
        let mut g = boot(
            &acc,
            &vm,
            &tq,
            "exec 3</dev/ttyS0; echo WAITING; read -r go <&3",
        )?;
        let mut s = None;
        for _ in 0..200 {
            match UnixStream::connect(&tq) {
                Ok(c) => {
                    s = Some(c);
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(25)),
            }
        }
        let Some(s) = s else {
            bail!("no test monitor at {}", tq.display())
        };
        let mut w = s.try_clone()?;
        let mut rd = BufReader::new(s);
        let mut line = String::new();
        rd.read_line(&mut line)?; // greeting
        w.write_all(b"{\"execute\":\"qmp_capabilities\",\"arguments\":{\"enable\":[\"oob\"]}}\n")?;
        line.clear();
        rd.read_line(&mut line)?;
        assert!(line.contains("return"), "{line}");
        acc.wait_engine(&vm, "d0", "direct", Duration::from_secs(60))?;
        // The guest's drivers are up before the monitor starts asking: the subject is the exit.
        g.wait_for("WAITING", Duration::from_secs(60))?;
        // Ask, read the answer, ask again, until QEMU closes the monitor.
        let asker = std::thread::spawn(move || {
            let mut n = 0u64;
            let mut line = String::new();
            loop {
                if w.write_all(b"{\"execute\":\"query-status\"}\n").is_err() {
                    return n;
                }
                loop {
                    line.clear();
                    match rd.read_line(&mut line) {
                        Ok(0) | Err(_) => return n,
                        Ok(_) if line.contains("\"return\"") || line.contains("\"error\"") => break,
                        Ok(_) => {}
                    }
                }
                n += 1;
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        let t0 = Instant::now();
        g.send_line("go")?;
        g.wait_exit(Duration::from_secs(60))
            .map_err(|e| anyhow::anyhow!("{e}\nacceld log:\n{}", acc.log_tail(40)))?;
        took.push(t0.elapsed());
        let status = g.exit_status()?;
        assert!(status.success(), "QEMU of {vm} exited with {status}");
        asked.push(asker.join().expect("the asking thread"));
    }
    let woken = acc.log_text().matches("SIGTERM wakes it").count();
    println!(
        "{ROUNDS} guests powered off under a monitor asking as fast as it can ({asked:?} \
         commands); QEMU exited after {took:?}; acceld woke {woken} of them"
    );
    assert!(asked.iter().all(|n| *n > 0), "{asked:?}");
    Ok(())
}
