//! Two libvirt hosts on one machine (`integration/two-hosts.sh`: namespaces, a veth pair,
//! shared storage): `virsh migrate --live` of a converted domain back and forth under a
//! guest verifying its writes, next to the same domain unconverted.
//!
//! Real libvirt 11.3 and QEMU 10 (TCG) on both hosts, each with its own acceld and the hook
//! installed. `ACCEL_LIBVIRT_TESTS=0` leaves these out; `ACCEL_KEEP=1` keeps both hosts up
//! afterwards (`two-hosts.sh exec A virsh list`, `two-hosts.sh down`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use accel_integration::domain::{domain_xml_of, DomainSpec};
use accel_integration::migration::{wait_migration_end, Instance};
use accel_integration::serial::Serial;
use accel_integration::supervised::{accelctl_bin, writer_script, SideQmp};
use accel_integration::two_hosts::{Host, TwoHosts};
use accel_integration::{
    create_qcow2, ensure_guest, guest_value, host_md5, keeps_progressing, qcow2_md5,
};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

const WORKERS: u32 = 32;
const BLOCKS: u32 = 64;
const DRIVE: &str = "virtio-disk0";

/// The tests share the two hosts' directory: one at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

/// A test's two hosts (up) and the guest's kernel and initramfs, one test at a time.
struct Setup {
    _one: std::sync::MutexGuard<'static, ()>,
    hosts: TwoHosts,
    kernel: PathBuf,
    initrd: PathBuf,
}

/// None when the two-host tests are left out.
fn setup() -> Result<Option<Setup>> {
    let one = one_at_a_time();
    if skip() {
        return Ok(None);
    }
    let (kernel, initrd) = ensure_guest()?;
    Ok(Some(Setup {
        _one: one,
        hosts: TwoHosts::up()?,
        kernel,
        initrd,
    }))
}

fn skip() -> bool {
    if std::env::var("ACCEL_LIBVIRT_TESTS").as_deref() == Ok("0") {
        eprintln!("ACCEL_LIBVIRT_TESTS=0: two-host test left out");
        return true;
    }
    false
}

/// One domain of the test: its XML (converted or not) defined on host A.
struct Dom {
    name: &'static str,
    /// Its image's path on the hosts: on the shared storage, or host-private (each host has
    /// its own file at that path).
    img: PathBuf,
    private: bool,
    serial: PathBuf,
    converted: bool,
    qcow2: bool,
    /// The engine the destination's acceld must serve the disk on after a hop.
    engine: std::cell::Cell<&'static str>,
    /// The IOPS limit `blkdeviotune` must read on the destination after a hop.
    throttle: std::cell::Cell<Option<u64>>,
}

impl Dom {
    fn define(
        hosts: &TwoHosts,
        name: &'static str,
        uuid_tail: u32,
        converted: bool,
        private: bool,
        kernel: &Path,
        initrd: &Path,
    ) -> Result<Dom> {
        Dom::define_with(
            hosts, name, uuid_tail, converted, private, false, kernel, initrd,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn define_with(
        hosts: &TwoHosts,
        name: &'static str,
        uuid_tail: u32,
        converted: bool,
        private: bool,
        qcow2: bool,
        kernel: &Path,
        initrd: &Path,
    ) -> Result<Dom> {
        let shared = hosts.shared();
        let img = if private {
            // Each host's own /var/lib/libvirt: a blank image of the same size on both
            // (libvirt's copy-storage needs the destination's to exist).
            let img = PathBuf::from(format!("/var/lib/libvirt/images/{name}.raw"));
            for h in [Host::A, Host::B] {
                std::fs::File::create(hosts.root(h)?.join(img.strip_prefix("/")?))?
                    .set_len(64 << 20)?;
            }
            img
        } else if qcow2 {
            let img = shared.join(format!("{name}.qcow2"));
            create_qcow2(&img, "64M")?;
            img
        } else {
            let img = shared.join(format!("{name}.raw"));
            std::fs::File::create(&img)?.set_len(64 << 20)?;
            img
        };
        // The console in the host's private /run: each host's QEMU binds its own.
        let serial = PathBuf::from(format!("/run/accel-serial/{name}.sock"));
        let script = writer_script("/dev/vda", WORKERS, BLOCKS);
        let mut xml = domain_xml_of(
            &DomainSpec {
                name,
                uuid: format!("0b6f2f9e-5a1c-4e7e-9d1e-acce1d0002{uuid_tail:02}"),
                vcpus: 1,
                script: &script,
                img: &img,
                driver_extra: "",
                serial: &serial,
                qemu_as_root: true,
            },
            kernel,
            initrd,
        );
        if qcow2 {
            xml = xml.replace("type='raw'", "type='qcow2'");
        }
        let path = shared.join(format!("{name}.xml"));
        if converted {
            std::fs::write(&path, &xml)?;
            let wrapper = accelctl_bin()?.with_file_name("accel-qemu");
            let out = Command::new(accelctl_bin()?)
                .args(["libvirt", "convert"])
                .arg(&path)
                .arg("--emulator")
                .arg(&wrapper)
                .output()?;
            if !out.status.success() {
                bail!("convert: {}", String::from_utf8_lossy(&out.stderr));
            }
            xml = String::from_utf8(out.stdout)?;
        }
        std::fs::write(&path, &xml)?;
        hosts.virsh(Host::A, &["define", path.to_str().unwrap()])?;
        Ok(Dom {
            name,
            img,
            private,
            serial,
            converted,
            qcow2,
            // A qcow2 image is QEMU's to read: the qemu engine.
            engine: std::cell::Cell::new(if qcow2 { "qemu" } else { "direct" }),
            throttle: std::cell::Cell::new(None),
        })
    }

    /// Its image on host `h`, as seen from here.
    fn image_on(&self, hosts: &TwoHosts, h: Host) -> Result<PathBuf> {
        Ok(if self.private {
            hosts.root(h)?.join(self.img.strip_prefix("/")?)
        } else {
            self.img.clone()
        })
    }
}

/// One hop's figures.
struct Hop {
    wall_ms: u128,
    downtime_ms: u64,
}

/// `virsh migrate --live` from `src` to its other host (client-driven: this virsh talks to
/// both libvirtds), then the checks that hold after every hop.
fn hop(hosts: &TwoHosts, d: &Dom, src: Host, flags: &[&str]) -> Result<Hop> {
    let dst = src.other();
    let t0 = Instant::now();
    let uri = dst.uri();
    let mut args = vec!["migrate", "--live"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&[d.name, &uri]);
    hosts.virsh(src, &args).with_context(|| {
        format!(
            "migrate {} {} -> {}\nsource acceld:\n{}\ndestination acceld:\n{}",
            d.name,
            src.name(),
            dst.name(),
            hosts.acceld_log(src),
            hosts.acceld_log(dst)
        )
    })?;
    let wall_ms = t0.elapsed().as_millis();
    let state = hosts.virsh(dst, &["domstate", d.name])?;
    assert_eq!(state.trim(), "running", "{} on {}", d.name, dst.name());
    if d.converted {
        // The destination's acceld serves the disk (on the direct engine unless QEMU's block
        // layer is needed); the source's has forgotten the VM.
        hosts.wait_engine(dst, d.name, DRIVE, d.engine.get(), Duration::from_secs(20))?;
        hosts.wait_forgotten(src, d.name, Duration::from_secs(20))?;
    }
    if let Some(iops) = d.throttle.get() {
        let tune = hosts.virsh(dst, &["blkdeviotune", d.name, "vda"])?;
        assert!(
            tune.lines().any(|l| {
                l.split_once(':').is_some_and(|(k, v)| {
                    k.trim() == "total_iops_sec" && v.trim() == iops.to_string()
                })
            }),
            "the throttle on {}: {tune}",
            dst.name()
        );
    }
    let info = hosts.virsh(dst, &["domjobinfo", d.name, "--completed"])?;
    let downtime_ms = info
        .lines()
        .find_map(|l| l.strip_prefix("Total downtime:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no downtime in domjobinfo:\n{info}"))?;
    Ok(Hop {
        wall_ms,
        downtime_ms,
    })
}

/// Boots `d` on A, migrates it `hops` times (A -> B -> A ...) under its writers, then watches
/// its writes go on for `watch` and has the guest verify everything. Returns the hops.
fn run(hosts: &TwoHosts, d: &Dom, hops: u32, flags: &[&str], watch: Duration) -> Result<Vec<Hop>> {
    run_then(hosts, d, hops, flags, watch, |_| Ok(()), |_, _| Ok(()))
}

/// [`run`], with `first` run once the guest writes on A and `last` on the last host before
/// the guest verifies.
fn run_then(
    hosts: &TwoHosts,
    d: &Dom,
    hops: u32,
    flags: &[&str],
    watch: Duration,
    first: impl FnOnce(&TwoHosts) -> Result<()>,
    last: impl FnOnce(&TwoHosts, Host) -> Result<()>,
) -> Result<Vec<Hop>> {
    hosts.virsh(Host::A, &["start", d.name])?;
    let mut at = Host::A;
    let mut serial = hosts.serial(at, &d.serial)?;
    serial.wait_for("READY", Duration::from_secs(180))?;
    first(hosts)?;
    if d.converted {
        hosts.wait_engine(at, d.name, DRIVE, d.engine.get(), Duration::from_secs(20))?;
    }
    let mut out = Vec::new();
    for n in 1..=hops {
        // Some writes on this side first.
        let p = serial.progress()?;
        while serial.progress()? <= p {}
        let h = hop(hosts, d, at, flags).with_context(|| format!("hop {n} of {}", d.name))?;
        println!(
            "{} hop {n} {} -> {}: virsh migrate {} ms, downtime {} ms",
            d.name,
            at.name(),
            at.other().name(),
            h.wall_ms,
            h.downtime_ms
        );
        out.push(h);
        at = at.other();
        serial = hosts.serial(at, &d.serial)?;
    }
    if !watch.is_zero() {
        let figures = keeps_progressing(watch, Duration::from_secs(20), || serial.progress())
            .with_context(|| {
                format!(
                    "{} on {} after its last migration; its drive: {:?}",
                    d.name,
                    at.name(),
                    hosts.drive(at, d.name, DRIVE).ok()
                )
            })?;
        println!(
            "{}: after the last of {hops} migrations the guest's writes went on for {watch:?}: {} -> {} completed",
            d.name,
            figures[0],
            figures.last().unwrap()
        );
    }
    last(hosts, at)?;
    verify_as(&mut serial, &d.image_on(hosts, at)?, d.qcow2)?;
    hosts.virsh(at, &["destroy", d.name]).ok();
    Ok(out)
}

/// Stops the writers; the guest's verdict and the image on the shared storage.
fn verify(serial: &mut Serial, img: &Path) -> Result<()> {
    verify_as(serial, img, false)
}

fn verify_as(serial: &mut Serial, img: &Path, qcow2: bool) -> Result<()> {
    serial.send_line("STOP")?;
    let verdict = serial.wait_for("RESULT:", Duration::from_secs(300))?;
    let seen = serial.seen.join("\n");
    if !verdict.contains("PASS") {
        bail!("guest failed:\n{seen}");
    }
    let value = |k: &str| {
        serial
            .seen
            .iter()
            .rev()
            .find_map(|l| l.trim().strip_prefix(&format!("{k}=")).map(str::to_string))
            .unwrap_or_default()
    };
    assert_eq!(value("errors"), "0", "{seen}");
    assert_eq!(value("kernel_errors"), "0", "{seen}");
    let len = u64::from(WORKERS * BLOCKS) * 4096;
    assert_eq!(
        if qcow2 {
            qcow2_md5(img, len)?
        } else {
            host_md5(img, len)?
        },
        value("md5"),
        "the shared image holds what the guest wrote"
    );
    Ok(())
}

/// Neither host's acceld logged a WARN or an ERROR.
fn no_acceld_warnings(hosts: &TwoHosts) {
    for h in [Host::A, Host::B] {
        let w = hosts.acceld_warnings(h);
        assert!(w.is_empty(), "acceld on {}: {w:#?}", h.name());
    }
}

fn median(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// A converted domain migrates with `virsh migrate --live` on shared storage A -> B -> A ...
/// (six hops) under 32 verifying writers: after each hop the destination's acceld serves the
/// disk on the direct engine and the source's has forgotten the VM; after the last the
/// guest's writes go on completing for 60 s (issue 29's stall); the guest sees 0 errors, the
/// image matches, neither acceld logged a warning, libvirt tainted neither domain. Its plain
/// twin does the same first (two hops) in the same harness, for the downtime next to it.
#[test]
fn virsh_migrate_live_moves_a_converted_domain_between_hosts() -> Result<()> {
    let Some(t) = setup()? else { return Ok(()) };
    let (hosts, kernel, initrd) = (&t.hosts, &t.kernel, &t.initrd);
    let plain = Dom::define(hosts, "xhost-plain", 1, false, false, kernel, initrd)?;
    let conv = Dom::define(hosts, "xhost-accel", 2, true, false, kernel, initrd)?;
    let p = run(hosts, &plain, 2, &[], Duration::ZERO)?;
    let c = run(hosts, &conv, 6, &[], Duration::from_secs(60))?;
    let down = |v: &[Hop]| v.iter().map(|h| h.downtime_ms).collect::<Vec<_>>();
    let wall = |v: &[Hop]| v.iter().map(|h| h.wall_ms as u64).collect::<Vec<_>>();
    println!(
        "downtime ms: plain {:?} (median {}), converted {:?} (median {}); virsh migrate ms: plain {:?}, converted {:?}",
        down(&p),
        median(&down(&p)),
        down(&c),
        median(&down(&c)),
        wall(&p),
        wall(&c)
    );
    for h in [Host::A, Host::B] {
        let w = hosts.acceld_warnings(h);
        assert!(w.is_empty(), "acceld on {}: {w:#?}", h.name());
        for d in [plain.name, conv.name] {
            let log = hosts.domain_log(h, d);
            let taints: Vec<&str> = log.lines().filter(|l| l.contains("is tainted")).collect();
            assert!(taints.is_empty(), "{d} on {}: {taints:#?}", h.name());
        }
    }
    Ok(())
}

/// A converted domain whose image is host-private migrates with `virsh migrate --live
/// --copy-storage-all` A -> B -> A under 32 verifying writers (libvirt's flow: the
/// destination's QEMU exports its blank image over NBD, through the destination's proxy,
/// while its drive is held; the source mirrors into it, its drive on the qemu engine): the
/// destination's acceld serves the copy on the direct engine once libvirt removed its export,
/// the guest sees 0 errors and the last host's own image holds what the guest wrote.
#[test]
fn virsh_migrate_copy_storage_moves_a_converted_domain_with_its_disk() -> Result<()> {
    let Some(t) = setup()? else { return Ok(()) };
    let (hosts, kernel, initrd) = (&t.hosts, &t.kernel, &t.initrd);
    let d = Dom::define(hosts, "xhost-copy", 3, true, true, kernel, initrd)?;
    let hops = run(
        hosts,
        &d,
        2,
        &["--copy-storage-all"],
        Duration::from_secs(30),
    )?;
    println!(
        "copy-storage downtime ms {:?}, virsh migrate ms {:?}",
        hops.iter().map(|h| h.downtime_ms).collect::<Vec<_>>(),
        hops.iter().map(|h| h.wall_ms).collect::<Vec<_>>()
    );
    no_acceld_warnings(hosts);
    Ok(())
}

/// Migrations that fail leave the domain running on its source, still accelerated, its
/// guest writing: the destination's acceld down (its hook refuses the incoming domain), then
/// the destination's libvirtd refusing (a different domain of that name defined there). Then
/// `virsh migrate --live --p2p` (the source's libvirtd drives the destination's) moves it:
/// direct on the destination, forgotten on the source, 0 guest errors.
#[test]
fn failed_migrations_leave_the_domain_on_its_source_and_p2p_moves_it() -> Result<()> {
    let Some(t) = setup()? else { return Ok(()) };
    let (hosts, kernel, initrd) = (&t.hosts, &t.kernel, &t.initrd);
    let d = Dom::define(hosts, "xhost-fail", 4, true, false, kernel, initrd)?;
    hosts.virsh(Host::A, &["start", d.name])?;
    let mut serial = hosts.serial(Host::A, &d.serial)?;
    serial.wait_for("READY", Duration::from_secs(180))?;
    hosts.wait_engine(Host::A, d.name, DRIVE, "direct", Duration::from_secs(20))?;
    let still_on_a = |serial: &mut Serial, what: &str| -> Result<()> {
        let state = hosts.virsh(Host::A, &["domstate", d.name])?;
        assert_eq!(state.trim(), "running", "after {what}");
        let dr = hosts.drive(Host::A, d.name, DRIVE)?;
        assert_eq!(dr["engine"], "direct", "after {what}: {dr}");
        let on_b = hosts.virsh(Host::B, &["list", "--name"])?;
        assert!(!on_b.contains(d.name), "after {what}, B runs {on_b}");
        let p = serial.progress()?;
        while serial.progress()? <= p {}
        Ok(())
    };
    // 1. No acceld on the destination.
    hosts.set_acceld(Host::B, false)?;
    let e = hosts
        .virsh(Host::A, &["migrate", "--live", d.name, &Host::B.uri()])
        .expect_err("a migration to a host without acceld succeeded");
    println!("destination acceld down: {e}");
    still_on_a(&mut serial, "a migration to a host without acceld")?;
    hosts.set_acceld(Host::B, true)?;
    // 2. The destination's libvirtd refuses: another domain of that name is defined there.
    let other = hosts.shared().join("other.xml");
    std::fs::write(
        &other,
        std::fs::read_to_string(hosts.shared().join(format!("{}.xml", d.name)))?.replace(
            "<uuid>0b6f2f9e-5a1c-4e7e-9d1e-acce1d000204</uuid>",
            "<uuid>0b6f2f9e-5a1c-4e7e-9d1e-acce1d0002ff</uuid>",
        ),
    )?;
    hosts.virsh(Host::B, &["define", other.to_str().unwrap()])?;
    let e = hosts
        .virsh(Host::A, &["migrate", "--live", d.name, &Host::B.uri()])
        .expect_err("a migration onto a conflicting definition succeeded");
    println!("destination libvirtd refusing: {e}");
    still_on_a(&mut serial, "a migration the destination refused")?;
    hosts.virsh(Host::B, &["undefine", d.name])?;
    // 3. Peer to peer.
    let h = hop(hosts, &d, Host::A, &["--p2p"])?;
    println!(
        "--p2p: virsh migrate {} ms, downtime {} ms",
        h.wall_ms, h.downtime_ms
    );
    let mut serial = hosts.serial(Host::B, &d.serial)?;
    let p = serial.progress()?;
    while serial.progress()? <= p {}
    verify(&mut serial, &d.img)?;
    for h in [Host::A, Host::B] {
        for w in hosts.acceld_warnings(h) {
            println!("acceld on {}: {w}", h.name());
        }
    }
    Ok(())
}

/// A qcow2 disk (the qemu engine: QEMU's block layer reads the format) and a raw disk
/// throttled with `virsh blkdeviotune` (the qemu engine: QEMU's throttling) migrate on shared
/// storage A -> B -> A: on each destination acceld serves the disk on the qemu engine, the
/// throttle travels with the domain (`blkdeviotune` on the destination reads it back); once
/// cleared on the last host the raw disk goes back to direct. 0 guest errors, images match.
#[test]
fn qcow2_and_throttled_disks_migrate_on_the_qemu_engine() -> Result<()> {
    let Some(t) = setup()? else { return Ok(()) };
    let (hosts, kernel, initrd) = (&t.hosts, &t.kernel, &t.initrd);
    let q = Dom::define_with(hosts, "xhost-qcow2", 5, true, false, true, kernel, initrd)?;
    run(hosts, &q, 2, &[], Duration::ZERO)?;
    let t = Dom::define(hosts, "xhost-throttled", 6, true, false, kernel, initrd)?;
    t.engine.set("qemu");
    let iotune = |h: Host, extra: &[&str]| {
        let mut a = vec!["blkdeviotune", t.name, "vda"];
        a.extend_from_slice(extra);
        hosts.virsh(h, &a)
    };
    // Both hops under the throttle, then cleared on A: the disk goes direct again.
    run_then(
        hosts,
        &t,
        2,
        &[],
        Duration::ZERO,
        |hosts| {
            iotune(Host::A, &["--total-iops-sec", "400", "--live"])?;
            hosts.wait_engine(Host::A, t.name, DRIVE, "qemu", Duration::from_secs(20))?;
            t.throttle.set(Some(400));
            Ok(())
        },
        |hosts, at| {
            iotune(at, &["--total-iops-sec", "0", "--live"])?;
            hosts.wait_engine(at, t.name, DRIVE, "direct", Duration::from_secs(30))?;
            Ok(())
        },
    )?;
    Ok(())
}

// ---- Management without libvirt (Proxmox style): plain QMP across the two hosts ----

/// The QMP socket QEMU serves to acceld, in each host's private /run.
const VM_QMP: &str = "/run/accel-qemu/vm1-qmp.sock";
const DRIVE_ID: &str = "d0";

/// `accelctl register` of vm1 inside host `h` (the drive on the shared image).
fn register_on(hosts: &TwoHosts, h: Host, img: &Path, incoming: bool) -> Result<()> {
    hosts.exec(h, &["mkdir", "-p", "/run/accel-qemu"])?;
    let drive = format!("id={DRIVE_ID},image={},queues=2", img.display());
    let mut a = vec![
        "register", "--vm", "vm1", "--qmp", VM_QMP, "--drive", &drive, "--cont",
    ];
    if incoming {
        a.push("--incoming");
    }
    hosts.accelctl(h, &a)?;
    Ok(())
}

/// vm1's QEMU inside host `h`, with the VM contract of `h`'s acceld and a side monitor on the
/// shared storage (the test's own look at QEMU).
fn boot_on(hosts: &TwoHosts, h: Host, extra: &[String]) -> Result<Instance> {
    let contract: Vec<String> = hosts
        .accelctl(h, &["qemu-args", "--vm", "vm1", "--memory", "256M"])?
        .lines()
        .map(String::from)
        .collect();
    let script = crate_script();
    let prefix = TwoHosts::exec_prefix(h);
    let prefix: Vec<&str> = prefix.iter().map(String::as_str).collect();
    Instance::boot_in(
        &prefix,
        &contract,
        &hosts.shared().join(format!("side-{}.sock", h.name())),
        extra,
        &script,
    )
}

fn crate_script() -> String {
    writer_script("/dev/vda", WORKERS, BLOCKS)
}

/// The guest's verdict through QEMU's stdio (the destination QEMU's).
fn verify_instance(i: &mut Instance, img: &Path) -> Result<()> {
    i.guest.wait_for("progress=", Duration::from_secs(60))?;
    i.guest.send_line("STOP")?;
    let out = i.guest.wait_exit(Duration::from_secs(300))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}", out.join("\n"));
    }
    assert_eq!(guest_value(&out, "errors")?, "0");
    assert_eq!(guest_value(&out, "kernel_errors")?, "0");
    assert_eq!(
        host_md5(img, u64::from(WORKERS * BLOCKS) * 4096)?,
        guest_value(&out, "md5")?,
        "the shared image holds what the guest wrote"
    );
    Ok(())
}

/// vm1 running on A on the direct engine, its writers going; the shared image.
fn vm_on_a(hosts: &TwoHosts) -> Result<(Instance, PathBuf)> {
    let img = hosts.shared().join("vm1-d0.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    register_on(hosts, Host::A, &img, false)?;
    let mut src = boot_on(hosts, Host::A, &[])?;
    src.guest
        .wait_for("READY", Duration::from_secs(180))
        .map_err(|e| anyhow::anyhow!("{e}\nacceld on A:\n{}", hosts.acceld_log(Host::A)))?;
    hosts.wait_engine(Host::A, "vm1", DRIVE_ID, "direct", Duration::from_secs(20))?;
    Ok((src, img))
}

/// The destination, as management starts it on B: registered `--incoming`, its QEMU waiting
/// on TCP.
fn destination_on_b(hosts: &TwoHosts, img: &Path) -> Result<(Instance, String)> {
    register_on(hosts, Host::B, img, true)?;
    let dst = boot_on(
        hosts,
        Host::B,
        &["-incoming".into(), "tcp:10.77.0.2:4444".into()],
    )?;
    dst.wait_status("inmigrate", Duration::from_secs(60))?;
    Ok((dst, "tcp:10.77.0.2:4444".into()))
}

/// Proxmox-style management migrates vm1 from A to B over TCP with plain QMP: on B it
/// registers the VM `--incoming` and starts QEMU with `-incoming tcp:…`; on A it sends
/// `migrate` (and later `quit`) through acceld's QMP proxy, as it would to QEMU. B's acceld
/// then serves the disk on the direct engine, A's forgets the VM; the guest sees 0 errors.
#[test]
fn plain_qmp_migration_across_hosts_through_the_proxy() -> Result<()> {
    let Some(t) = setup()? else { return Ok(()) };
    let hosts = &t.hosts;
    let (mut src, img) = vm_on_a(hosts)?;
    src.guest.wait_for("progress=", Duration::from_secs(60))?;
    let (mut dst, uri) = destination_on_b(hosts, &img)?;
    hosts.wait_engine(Host::B, "vm1", DRIVE_ID, "held", Duration::from_secs(20))?;
    // Management's QMP on A: acceld's proxy for vm1.
    let proxy = SideQmp::connect(&hosts.root(Host::A)?.join("run/accel/vm1/monitor.sock"))?;
    proxy.cmd(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "events", "state": true}]}),
    )?;
    let mut events = proxy.subscribe();
    proxy.cmd("migrate", json!({ "uri": uri }))?;
    let m = wait_migration_end(&proxy, &mut events, Duration::from_secs(120))?;
    dst.wait_status("running", Duration::from_secs(30))?;
    hosts.wait_engine(Host::B, "vm1", DRIVE_ID, "direct", Duration::from_secs(20))?;
    proxy.cmd("quit", Value::Null)?;
    src.guest.wait_exit(Duration::from_secs(30))?;
    hosts.wait_forgotten(Host::A, "vm1", Duration::from_secs(20))?;
    println!(
        "plain QMP migration A -> B over TCP through A's proxy: downtime {} ms, total {} ms",
        m["downtime"], m["total-time"]
    );
    verify_instance(&mut dst, &img)?;
    no_acceld_warnings(hosts);
    Ok(())
}

/// `accelctl migrate` to another host's acceld: its control socket reached by another path
/// (here `/proc/PID/root/…` of the host; between machines an `ssh -L` unix-socket forward),
/// given as `--to`; the destination QEMU started on B once accelctl registered the VM there.
#[test]
fn accelctl_migrate_reaches_another_hosts_acceld() -> Result<()> {
    let Some(t) = setup()? else { return Ok(()) };
    let hosts = &t.hosts;
    let (mut src, img) = vm_on_a(hosts)?;
    src.guest.wait_for("progress=", Duration::from_secs(60))?;
    let (ra, rb) = (
        hosts.root(Host::A)?.join("run/accel"),
        hosts.root(Host::B)?.join("run/accel"),
    );
    let mut mig = Command::new(accelctl_bin()?)
        .arg("--run-dir")
        .arg(&ra)
        .args(["migrate", "vm1", "--to"])
        .arg(&rb)
        .args(["--dest-qmp", VM_QMP, "--uri", "tcp:10.77.0.2:4444"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // accelctl registers vm1 on B (incoming) and waits for its QEMU: start it.
    let t0 = Instant::now();
    while !hosts.vms(Host::B)?.iter().any(|v| v == "vm1") {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = mig.kill();
            bail!("accelctl migrate did not register vm1 on B");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    hosts.exec(Host::B, &["mkdir", "-p", "/run/accel-qemu"])?;
    let mut dst = boot_on(
        hosts,
        Host::B,
        &["-incoming".into(), "tcp:10.77.0.2:4444".into()],
    )?;
    let out = mig.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "accelctl migrate: {said}");
    println!("{said}");
    hosts.wait_engine(Host::B, "vm1", DRIVE_ID, "direct", Duration::from_secs(20))?;
    src.guest.wait_exit(Duration::from_secs(30))?;
    hosts.wait_forgotten(Host::A, "vm1", Duration::from_secs(20))?;
    verify_instance(&mut dst, &img)?;
    Ok(())
}
