//! libvirt 11.3 with real libvirtd and virsh: a TCG domain whose raw file disk is converted by
//! `accelctl libvirt convert`, run through the emulator wrapper (`accel-qemu`) and the hook,
//! with 16 verifying writers in the guest throughout. Every virsh command a host operator
//! uses on the disk: start, domblklist, dumpxml, domblkstat, domblkinfo, blkdeviotune,
//! snapshot-create-as --disk-only, blockcommit --active --pivot, blockresize, domblkthreshold,
//! save, restore,
//! a libvirtd restart, an acceld restart, the guest's own poweroff; with QEMU as root (the
//! domain's DAC label) and as libvirt-qemu (qemu.conf's). CI starts virtlogd and libvirtd (`.ci/run`);
//! `ACCEL_LIBVIRT_TESTS=0` leaves the test out on a machine without them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use accel_integration::domain::{domain_xml_of, DomainSpec};
use accel_integration::serial::Serial;
use accel_integration::supervised::{accelctl_bin, writer_script, AcceldRun};
use accel_integration::{acceld_bin, ensure_guest, host_md5};
use anyhow::{anyhow, bail, Context, Result};

const CONFIG: &str = "quiet-period-ms = 300\npoll-interval-ms = 200\n";
const DOM: &str = "accel-lv-test";
const DRIVE: &str = "virtio-disk0";

fn virsh(args: &[&str]) -> Result<String> {
    let out = Command::new("virsh")
        .args(["-c", "qemu:///system"])
        .args(args)
        .output()
        .context("running virsh (apt-get install libvirt-clients)")?;
    if !out.status.success() {
        bail!(
            "virsh {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Restarts libvirtd (no systemd: `libvirtd -d`); returns once virsh answers.
fn restart_libvirtd() -> Result<()> {
    if let Ok(pid) = std::fs::read_to_string("/run/libvirtd.pid") {
        let pid = pid.trim().to_string();
        let _ = Command::new("kill").arg(&pid).status();
        let t0 = Instant::now();
        while Path::new(&format!("/proc/{pid}")).exists() {
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("libvirtd {pid} did not stop within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let st = Command::new("libvirtd").arg("-d").status()?;
    if !st.success() {
        bail!("libvirtd -d failed: {st}");
    }
    let t0 = Instant::now();
    while virsh(&["version"]).is_err() {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("libvirtd did not answer within 60 s of its start");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// `virsh blkdeviotune DOM vda --total-iops-sec N --live` (0 clears the limit).
fn iotune(iops: u64) -> Result<String> {
    virsh(&[
        "blkdeviotune",
        DOM,
        "vda",
        "--total-iops-sec",
        &iops.to_string(),
        "--live",
    ])
}

fn stat(dom: &str, key: &str) -> Result<u64> {
    let out = virsh(&["domblkstat", dom, "vda"])?;
    out.lines()
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("vda") && w.next() == Some(key))
                .then(|| w.next().and_then(|v| v.parse().ok()))
                .flatten()
        })
        .ok_or_else(|| anyhow!("no {key} in domblkstat: {out}"))
}

fn ops(dom: &str) -> Result<u64> {
    Ok(stat(dom, "rd_req")? + stat(dom, "wr_req")?)
}

/// QEMU's user for a scenario: `libvirt-qemu` (qemu.conf's, Debian's default; libvirt-up.sh
/// keeps it), or root through the domain's own DAC label.
#[derive(Clone, Copy)]
struct QemuUser {
    uid: u32,
    gid: u32,
}

/// Waits until the domain's drive is relayed (the qemu engine through QEMU's vhost-user-blk
/// export); returns its status.
fn wait_relayed(acc: &AcceldRun) -> Result<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        let d = acc.drive(DOM, DRIVE)?;
        if d["engine"] == "qemu" && d["io_path"] == "vhost-user" {
            return Ok(d);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            bail!(
                "the drive is not relayed within 30 s: {d}\n{}",
                acc.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn libvirt_qemu() -> Result<QemuUser> {
    let id = |flag: &str| -> Result<u32> {
        let out = Command::new("id").args([flag, "libvirt-qemu"]).output()?;
        if !out.status.success() {
            bail!("no user libvirt-qemu (libvirt-daemon-system makes it)");
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok(QemuUser {
        uid: id("-u")?,
        gid: id("-g")?,
    })
}

/// The uid QEMU of `dom` runs as (libvirt's pid file).
fn qemu_uid(dom: &str) -> Result<u32> {
    let pid = std::fs::read_to_string(format!("/run/libvirt/qemu/{dom}.pid"))?;
    let st = std::fs::read_to_string(format!("/proc/{}/status", pid.trim()))?;
    st.lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1)?.parse().ok())
        .ok_or_else(|| anyhow!("no effective Uid in /proc/{}/status", pid.trim()))
}

fn domain_xml(
    dir: &Path,
    img: &Path,
    kernel: &Path,
    initrd: &Path,
    user: Option<QemuUser>,
) -> String {
    let script = writer_script("/dev/vda", 16, 64);
    domain_xml_of(
        &DomainSpec {
            name: DOM,
            uuid: "0b6f2f9e-5a1c-4e7e-9d1e-acce1d000001".into(),
            vcpus: 1,
            script: &script,
            img,
            driver_extra: "",
            serial: &dir.join("serial.sock"),
            qemu_as_root: user.is_none(),
        },
        kernel,
        initrd,
    )
}

/// `accelctl libvirt convert XML --emulator WRAPPER`, which must succeed: the converted XML
/// and the changes it lists (its stderr).
fn convert(xml: &Path, wrapper: &Path) -> Result<(Vec<u8>, String)> {
    let out = Command::new(accelctl_bin()?)
        .args(["libvirt", "convert"])
        .arg(xml)
        .arg("--emulator")
        .arg(wrapper)
        .output()?;
    let changes = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "convert: {changes}");
    Ok((out.stdout, changes))
}

/// Undefines the domain and removes the hook whatever happens.
struct Cleanup {
    hooks: PathBuf,
    conf: PathBuf,
    doms: &'static [&'static str],
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for dom in self.doms {
            let _ = virsh(&["destroy", dom]);
            let _ = virsh(&["undefine", dom]);
        }
        if let Ok(ctl) = accelctl_bin() {
            let _ = Command::new(ctl)
                .args(["libvirt", "uninstall", "--hooks-dir"])
                .arg(&self.hooks)
                .arg("--conf")
                .arg(&self.conf)
                .status();
        }
    }
}

/// acceld on `d/run`, the wrapper and its config in `d/bin`, the hook installed in
/// libvirt's hook directory and libvirtd restarted to see it; `doms` undefined first. The
/// guard undefines `doms` and removes the hook.
fn with_hook(d: &Path, doms: &'static [&'static str]) -> Result<(AcceldRun, PathBuf, Cleanup)> {
    let acc = AcceldRun::start(&d.join("run"), CONFIG)?;
    let bin = d.join("bin");
    std::fs::create_dir_all(&bin)?;
    let wrapper = bin.join("accel-qemu");
    std::os::unix::fs::symlink(acceld_bin()?.with_file_name("accel-qemu"), &wrapper)?;
    let conf = bin.join("accel-qemu.conf");
    let hooks = PathBuf::from("/etc/libvirt/hooks");
    let cleanup = Cleanup {
        hooks: hooks.clone(),
        conf: conf.clone(),
        doms,
    };
    for dom in doms {
        let _ = virsh(&["destroy", dom]);
        let _ = virsh(&["undefine", dom]);
    }
    acc.ctl_ok(&[
        "libvirt",
        "install",
        "--hooks-dir",
        hooks.to_str().unwrap(),
        "--conf",
        conf.to_str().unwrap(),
    ])?;
    restart_libvirtd()?;
    Ok((acc, wrapper, cleanup))
}

fn state(dom: &str) -> String {
    virsh(&["domstate", dom])
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn wait_state(dom: &str, want: &str, timeout: Duration) -> Result<()> {
    let t0 = Instant::now();
    while state(dom) != want {
        if t0.elapsed() > timeout {
            bail!("{dom} is '{}', not '{want}', after {timeout:?}", state(dom));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// The VM's directory is gone (what is left in it, and acceld's log, if not).
fn assert_gone(dir: &Path, acc: &AcceldRun) {
    if dir.exists() {
        let left: Vec<String> = std::fs::read_dir(dir)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        panic!(
            "the VM's directory is left, holding {left:?}\nacceld log:\n{}",
            acc.log_text()
        );
    }
}

fn vm_known(acc: &AcceldRun) -> Result<bool> {
    Ok(acc.status()?["vms"]
        .as_array()
        .is_some_and(|v| v.iter().any(|x| x["vm"] == DOM)))
}

/// The scenarios share libvirtd, the hook and the domain's name: one at a time.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn virsh_manages_an_accelerated_domain() -> Result<()> {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    scenario(None)
}

/// The same with QEMU as `libvirt-qemu` (qemu.conf's user, Debian's default): the hook's
/// permit lets the wrapper register, the VM's sockets are that user's.
#[test]
fn virsh_manages_an_accelerated_domain_whose_qemu_is_not_root() -> Result<()> {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    if std::env::var("ACCEL_LIBVIRT_TESTS").as_deref() == Ok("0") {
        eprintln!("ACCEL_LIBVIRT_TESTS=0: libvirt test left out");
        return Ok(());
    }
    scenario(Some(libvirt_qemu()?))
}

fn scenario(user: Option<QemuUser>) -> Result<()> {
    if std::env::var("ACCEL_LIBVIRT_TESTS").as_deref() == Ok("0") {
        eprintln!("ACCEL_LIBVIRT_TESTS=0: libvirt test left out");
        return Ok(());
    }
    virsh(&["version"]).context("libvirtd must run (virtlogd -d; libvirtd -d), as .ci/run does")?;
    let (mut kernel, mut initrd) = ensure_guest()?;
    let dir = tempfile::Builder::new()
        .prefix("accel-libvirt")
        .tempdir_in("/var/tmp")?;
    let d = dir.path();
    if let Some(u) = user {
        // QEMU's user makes its serial socket here and reads its own copy of the guest
        // (libvirt relabels what the domain names; the shared build stays root's).
        std::os::unix::fs::chown(d, Some(u.uid), Some(u.gid))?;
        for f in [&mut kernel, &mut initrd] {
            let to = d.join(f.file_name().unwrap());
            std::fs::copy(&*f, &to)?;
            *f = to;
        }
    }
    let img = d.join("disk.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let run = d.join("run");
    let (mut acc, wrapper, _cleanup) = with_hook(d, &[DOM])?;

    // Convert: the emulator and shared memfd memory, nothing else.
    let plain = d.join("plain.xml");
    std::fs::write(&plain, domain_xml(d, &img, &kernel, &initrd, user))?;
    let (conv_xml, changes) = convert(&plain, &wrapper)?;
    assert_eq!(changes.lines().count(), 3, "{changes}");
    assert!(
        changes.contains("<emulator>") && changes.contains("memfd"),
        "{changes}"
    );
    let conv = d.join("conv.xml");
    std::fs::write(&conv, conv_xml)?;
    virsh(&["define", conv.to_str().unwrap()])?;

    // virsh start: served on the direct engine; libvirt sees an ordinary file disk.
    virsh(&["start", DOM])?;
    let mut serial = Serial::connect(&d.join("serial.sock"))?;
    serial.wait_for("READY", Duration::from_secs(120))?;
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(60))?;
    if let Some(u) = user {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(qemu_uid(DOM)?, u.uid, "QEMU's user");
        for s in [format!("{DRIVE}.sock"), "monitor.sock".into()] {
            let m = std::fs::metadata(run.join(DOM).join(&s))?;
            assert_eq!((m.uid(), m.mode() & 0o777), (u.uid, 0o600), "{s}");
        }
    } else {
        assert_eq!(qemu_uid(DOM)?, 0, "QEMU's user");
    }
    let list = virsh(&["domblklist", DOM])?;
    assert!(
        list.contains("vda") && list.contains(img.to_str().unwrap()),
        "{list}"
    );
    let xml = virsh(&["dumpxml", DOM])?;
    assert!(xml.contains("<disk type='file' device='disk'>"), "{xml}");
    assert!(!xml.contains("vhostuser"), "{xml}");
    let info = virsh(&["domblkinfo", DOM, "vda"])?;
    assert!(
        info.contains(&format!("Capacity:       {}", 64u64 << 20)),
        "{info}"
    );
    let w0 = stat(DOM, "wr_req")?;
    std::thread::sleep(Duration::from_secs(2));
    let w1 = stat(DOM, "wr_req")?;
    assert!(w1 > w0, "domblkstat wr_req does not grow: {w0} -> {w1}");
    let t0 = Instant::now();
    let o0 = ops(DOM)?;
    std::thread::sleep(Duration::from_secs(3));
    let free_rate = (ops(DOM)? - o0) as f64 / t0.elapsed().as_secs_f64();

    // blkdeviotune: QEMU's block layer with the limit; cleared: direct again.
    iotune(10)?;
    let dr = acc.drive(DOM, DRIVE)?;
    assert_eq!(dr["engine"], "qemu", "{dr}");
    assert!(dr["reasons"].to_string().contains("throttle"), "{dr}");
    let q = virsh(&["blkdeviotune", DOM, "vda"])?;
    assert!(q.contains("total_iops_sec : 10"), "{q}");
    // The qemu engine's default path: relayed through QEMU's vhost-user-blk export of the
    // throttle filter, and libvirt's statistics still count every request.
    let dr = wait_relayed(&acc)?;
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    let o0 = ops(DOM)?;
    std::thread::sleep(Duration::from_secs(5));
    let limited = (ops(DOM)? - o0) as f64 / t0.elapsed().as_secs_f64();
    eprintln!(
        "guest ops/s: {free_rate:.1} unlimited, {limited:.1} with total-iops-sec 10 (relayed)"
    );
    assert!(
        limited <= 10.0 * 1.3,
        "the limit does not hold: {limited:.1} ops/s"
    );
    assert!(limited > 0.0, "domblkstat stands still on the relay: {dr}");
    iotune(0)?;
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(30))?;

    // A disk-only snapshot: the overlay is QEMU's; an active commit with pivot: direct again.
    let overlay = d.join("s1.qcow2");
    virsh(&[
        "snapshot-create-as",
        DOM,
        "s1",
        "--disk-only",
        "--atomic",
        "--no-metadata",
        "--diskspec",
        &format!("vda,file={}", overlay.display()),
    ])?;
    let dr = acc.drive(DOM, DRIVE)?;
    assert_eq!(dr["engine"], "qemu", "{dr}");
    assert!(virsh(&["domblklist", DOM])?.contains(overlay.to_str().unwrap()));
    // On the overlay the drive is relayed again; the commit's command and its job move it
    // to NBD (QEMU 10.0.2's export aborts when its node is drained under I/O).
    wait_relayed(&acc)?;
    let w0 = stat(DOM, "wr_req")?;
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        stat(DOM, "wr_req")? > w0,
        "domblkstat wr_req does not grow on the relay"
    );
    virsh(&["blockcommit", DOM, "vda", "--active", "--pivot", "--wait"])?;
    assert!(virsh(&["domblklist", DOM])?.contains(img.to_str().unwrap()));
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(30))?;

    // blockcopy --pivot to a raw file: the mirror is QEMU's; after the pivot the drive is
    // served directly from the copy (opened as QEMU's user); and back the same way.
    let copy = d.join("copy.raw");
    for (to, reuse) in [(&copy, false), (&img, true)] {
        let to_s = to.to_str().unwrap();
        let mut args = vec![
            "blockcopy",
            DOM,
            "vda",
            to_s,
            "--wait",
            "--pivot",
            "--transient-job",
            "--format",
            "raw",
        ];
        if reuse {
            args.push("--reuse-external");
        }
        virsh(&args)?;
        assert!(virsh(&["domblklist", DOM])?.contains(to_s));
        acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(30))?;
        let dr = acc.drive(DOM, DRIVE)?;
        assert_eq!(dr["image"], to_s, "the direct engine serves the copy: {dr}");
        let w0 = stat(DOM, "wr_req")?;
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            stat(DOM, "wr_req")? > w0,
            "no writes after the pivot to {to_s}"
        );
    }

    // blockresize: the guest sees the new size.
    virsh(&["blockresize", DOM, "vda", "80M"])?;
    let info = virsh(&["domblkinfo", DOM, "vda"])?;
    assert!(
        info.contains(&format!("Capacity:       {}", 80u64 << 20)),
        "{info}"
    );
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(30))?;

    // domblkthreshold: QEMU's block layer raises the event, so the drive stays there while
    // the threshold is armed; disarmed, direct again.
    virsh(&["domblkthreshold", DOM, "vda", "70M"])?;
    let dr = acc
        .wait_engine(DOM, DRIVE, "qemu", Duration::from_secs(30))
        .and(acc.drive(DOM, DRIVE))?;
    assert!(
        dr["reasons"].to_string().contains("write-threshold"),
        "{dr}"
    );
    let st = virsh(&["domstats", DOM, "--block"])?;
    assert!(
        st.contains(&format!("block.0.threshold={}", 70u64 << 20)),
        "{st}"
    );
    virsh(&["domblkthreshold", DOM, "vda", "0"])?;
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(30))?;

    // save: QEMU ends, acceld forgets the VM; restore: served again (QEMU -incoming).
    let saved = d.join("save.img");
    virsh(&["save", DOM, saved.to_str().unwrap()])?;
    assert_eq!(state(DOM), "shut off");
    assert!(!vm_known(&acc)?, "acceld still serves the saved VM");
    assert_gone(&run.join(DOM), &acc);
    let log_path = Path::new("/var/log/libvirt/qemu").join(format!("{DOM}.log"));
    let log_before = std::fs::metadata(&log_path).map_or(0, |m| m.len());
    virsh(&["restore", saved.to_str().unwrap()])?;
    // The hook printed nothing: libvirt took the XML as unchanged and did not taint the
    // domain (it does, `hook-script`, for any output of a `restore` hook).
    let log = std::fs::read(&log_path)?;
    let new = String::from_utf8_lossy(&log[(log_before as usize).min(log.len())..]);
    assert!(
        !new.contains("hook-script"),
        "the restored domain is tainted by the hook:\n{new}"
    );
    let mut serial = Serial::connect(&d.join("serial.sock"))?;
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(60))?;
    let w0 = stat(DOM, "wr_req")?;
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        stat(DOM, "wr_req")? > w0,
        "the restored guest does not write"
    );

    // A libvirtd restart while the VM runs: libvirt reconnects to the proxy.
    restart_libvirtd()?;
    assert_eq!(state(DOM), "running");
    let w0 = stat(DOM, "wr_req")?;
    std::thread::sleep(Duration::from_secs(2));
    assert!(stat(DOM, "wr_req")? > w0);

    // An acceld restart while the VM runs: libvirt's monitor connection stays (the relay
    // reconnects to the new acceld's proxy), the disk is served again.
    acc.restart()?;
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(60))?;
    assert_eq!(state(DOM), "running");
    let w0 = stat(DOM, "wr_req")?;
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        stat(DOM, "wr_req")? > w0,
        "no stats or no writes after an acceld restart"
    );
    iotune(500)?;
    assert_eq!(acc.drive(DOM, DRIVE)?["engine"], "qemu");
    iotune(0)?;
    acc.wait_engine(DOM, DRIVE, "direct", Duration::from_secs(30))?;

    // The guest checks everything it wrote, then powers off: libvirt ends the domain and
    // acceld forgets it.
    serial.send_line("STOP")?;
    let errors = serial.value("errors")?;
    let kernel_errors = serial.value("kernel_errors")?;
    let sectors = serial.value("sectors")?;
    let md5 = serial.value("md5")?;
    serial.wait_for("RESULT: PASS", Duration::from_secs(60))?;
    assert_eq!((errors.as_str(), kernel_errors.as_str()), ("0", "0"));
    assert_eq!(sectors, (80u64 << 20 >> 9).to_string());
    wait_state(DOM, "shut off", Duration::from_secs(60))?;
    assert_eq!(md5, host_md5(&img, 16 * 64 * 4096)?, "host data differs");
    let t0 = Instant::now();
    while vm_known(&acc)? {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("acceld still serves the VM after it shut off");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_gone(&run.join(DOM), &acc);
    Ok(())
}

const TWINS: [&str; 2] = ["accel-twin-plain", "accel-twin-conv"];

/// What the guest sees of its disk, one `view KEY=VALUE` line each, then `VIEW-END`; the
/// guest then powers off. (The tiny guest has no udev: `by-id` is empty in both, and the
/// serial is what udev's `virtio-SERIAL` link would be made of.)
const VIEW_SCRIPT: &str = r#"d=/sys/block/vda
q=$d/queue
for k in size ro; do echo "view $k=$(cat $d/$k)"; done
echo "view serial=$(cat $d/serial 2>/dev/null)"
echo "view queues=$(ls $d/mq | wc -l)"
echo "view features=$(cat $d/device/features 2>/dev/null)"
for k in logical_block_size physical_block_size minimum_io_size optimal_io_size discard_granularity discard_max_hw_bytes write_zeroes_max_bytes max_hw_sectors_kb max_segments max_segment_size rotational write_cache nr_requests; do echo "view $k=$(cat $q/$k 2>/dev/null)"; done
echo "view by-id=$(ls /dev/disk/by-id 2>/dev/null | tr '\n' ' ')"
echo VIEW-END
"#;

fn twin_xml(name: &str, uuid_tail: u32, dir: &Path, kernel: &Path, initrd: &Path) -> String {
    domain_xml_of(
        &DomainSpec {
            name,
            uuid: format!("0b6f2f9e-5a1c-4e7e-9d1e-acce1d0001{uuid_tail:02}"),
            vcpus: 2,
            script: VIEW_SCRIPT,
            img: &dir.join(format!("{name}.raw")),
            driver_extra: " discard='unmap'",
            serial: &dir.join(format!("{name}.serial")),
            qemu_as_root: true,
        },
        kernel,
        initrd,
    )
}

/// The taint flags libvirt logged for `dom` past `from` bytes of its log.
fn taints_since(dom: &str, from: u64) -> Result<Vec<String>> {
    let log = std::fs::read(format!("/var/log/libvirt/qemu/{dom}.log"))?;
    let new = String::from_utf8_lossy(&log[(from as usize).min(log.len())..]).into_owned();
    let mut t: Vec<String> = new
        .lines()
        .filter_map(|l| {
            l.split_once("is tainted: ")
                .map(|(_, f)| f.trim().to_string())
        })
        .collect();
    t.sort();
    Ok(t)
}

fn log_len(dom: &str) -> u64 {
    std::fs::metadata(format!("/var/log/libvirt/qemu/{dom}.log")).map_or(0, |m| m.len())
}

/// A plain domain and its `accelctl libvirt convert` twin, one after the other under real
/// libvirt: the guest's view of its disk (size, serial, queues, negotiated virtio features,
/// block limits, discard and write-zeroes, write cache, queue depth) and libvirt's taint
/// flags are the same, but for RING_RESET (acceld does not offer it: QEMU's vhost-user-blk
/// would pass it on but never tells its back-end of a guest's ring reset).
#[test]
fn a_converted_domain_looks_like_its_plain_twin() -> Result<()> {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    if std::env::var("ACCEL_LIBVIRT_TESTS").as_deref() == Ok("0") {
        eprintln!("ACCEL_LIBVIRT_TESTS=0: libvirt test left out");
        return Ok(());
    }
    virsh(&["version"]).context("libvirtd must run (virtlogd -d; libvirtd -d), as .ci/run does")?;
    let (kernel, initrd) = ensure_guest()?;
    let dir = tempfile::Builder::new()
        .prefix("accel-twins")
        .tempdir_in("/var/tmp")?;
    let d = dir.path();
    let (_acc, wrapper, _cleanup) = with_hook(d, &TWINS)?;
    let mut seen = Vec::new();
    for (i, name) in TWINS.into_iter().enumerate() {
        std::fs::File::create(d.join(format!("{name}.raw")))?.set_len(64 << 20)?;
        let xml = d.join(format!("{name}.xml"));
        std::fs::write(&xml, twin_xml(name, i as u32, d, &kernel, &initrd))?;
        if i == 1 {
            let (xml_out, _) = convert(&xml, &wrapper)?;
            std::fs::write(&xml, xml_out)?;
        }
        virsh(&["define", xml.to_str().unwrap()])?;
        let from = log_len(name);
        virsh(&["start", name])?;
        let mut serial = Serial::connect(&d.join(format!("{name}.serial")))?;
        serial.wait_for("VIEW-END", Duration::from_secs(120))?;
        wait_state(name, "shut off", Duration::from_secs(60))?;
        let view: Vec<String> = serial
            .seen
            .iter()
            .filter_map(|l| l.trim().strip_prefix("view ").map(str::to_string))
            .collect();
        let taints = taints_since(name, from)?;
        println!("{name}: taints {taints:?}");
        for l in &view {
            println!("{name}: {l}");
        }
        virsh(&["undefine", name])?;
        seen.push((view, taints));
    }
    let (plain, conv) = (&seen[0], &seen[1]);
    assert!(
        plain.0.len() > 10,
        "the guest printed its view: {:?}",
        plain.0
    );
    assert_eq!(plain.0.len(), conv.0.len(), "{:?}\n{:?}", plain.0, conv.0);
    // The one thing the guest can still tell (docs/libvirt.md, "What the guest can tell"):
    // VIRTIO_F_RING_RESET (feature bit 40), which QEMU's virtio-blk offers and acceld does
    // not: QEMU's vhost-user-blk device passes the bit on but not a guest's ring reset, so a
    // guest resetting a queue would find acceld serving its old ring. Everything else must be
    // the same.
    const RING_RESET: usize = 40;
    let mut differ = Vec::new();
    for (a, b) in plain.0.iter().zip(conv.0.iter()) {
        println!("plain | converted: {a} | {b}");
        let same = match (a.strip_prefix("features="), b.strip_prefix("features=")) {
            (Some(fa), Some(fb)) => {
                let (mut fa, mut fb) = (fa.as_bytes().to_vec(), fb.as_bytes().to_vec());
                assert_eq!(
                    (fa.get(RING_RESET), fb.get(RING_RESET)),
                    (Some(&b'1'), Some(&b'0')),
                    "RING_RESET: {a} | {b}"
                );
                fa[RING_RESET] = b'0';
                fb[RING_RESET] = b'0';
                fa == fb
            }
            _ => a == b,
        };
        if !same {
            differ.push(format!("{a} | {b}"));
        }
    }
    assert!(
        differ.is_empty(),
        "the guest tells the twins apart (plain | converted): {differ:#?}"
    );
    assert_eq!(
        plain.1, conv.1,
        "libvirt's taint flags differ (plain, converted)"
    );
    Ok(())
}

const HP_TWINS: [&str; 2] = ["accel-hp-plain", "accel-hp-conv"];

/// The hot-plug guest: for each of two disks plugged as vdb, one after the other, what it
/// sees of it (`hpN …`), 1 MiB written (O_DIRECT) and read back, `hpN DONE`; then `hpN GONE`
/// once the disk is unplugged; `HP-END` after a line on its console.
const HOTPLUG_SCRIPT: &str = r#"hp() {
  while [ ! -b /dev/vdb ]; do sleep 0.1; done
  d=/sys/block/vdb
  echo "hp$1 view size=$(cat $d/size) ro=$(cat $d/ro) serial=$(cat $d/serial 2>/dev/null) queues=$(ls $d/mq | wc -l) lbs=$(cat $d/queue/logical_block_size) wc=$(cat $d/queue/write_cache) dmax=$(cat $d/queue/discard_max_hw_bytes) depth=$(cat $d/queue/nr_requests)"
  echo "hp$1 features=$(cat $d/device/features 2>/dev/null)"
  dd if=/dev/urandom of=/tmp/p bs=64k count=16 2>/dev/null
  dd if=/tmp/p of=/dev/vdb bs=64k count=16 oflag=direct conv=notrunc 2>/dev/null || echo "hp$1 write-failed"
  echo "hp$1 md5 wrote=$(md5sum < /tmp/p | cut -d' ' -f1) read=$(dd if=/dev/vdb bs=64k count=16 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)"
  echo "hp$1 DONE"
  while [ -b /dev/vdb ]; do sleep 0.1; done
  echo "hp$1 GONE"
}
echo READY
hp 1
hp 2
read x
echo HP-END
"#;

/// The value of `key=` in `line`.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// libvirt's monitor command (through acceld's QMP proxy on the converted domain).
fn monitor(dom: &str, cmd: &str) -> Result<serde_json::Value> {
    Ok(serde_json::from_str(&virsh(&[
        "qemu-monitor-command",
        dom,
        cmd,
    ])?)?)
}

/// The acceld drives of `dom` other than its boot disk.
fn plugged_drives(acc: &AcceldRun, dom: &str) -> Result<Vec<serde_json::Value>> {
    let st = acc.status()?;
    Ok(st["vms"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["vm"] == dom)
        .flat_map(|v| v["drives"].as_array().cloned().unwrap_or_default())
        .filter(|d| d["drive"] != DRIVE)
        .collect())
}

fn wait_plugged(
    acc: &AcceldRun,
    dom: &str,
    engine: Option<&str>,
) -> Result<Vec<serde_json::Value>> {
    let t0 = Instant::now();
    loop {
        let p = plugged_drives(acc, dom)?;
        let done = match engine {
            Some(e) => p.len() == 1 && p[0]["engine"] == e,
            None => p.is_empty(),
        };
        if done {
            return Ok(p);
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!(
                "{dom}: hot-plugged drives {p:?}, wanted {engine:?}\n{}",
                acc.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `virsh attach-disk --live` and `detach-disk --live` on a converted domain (QEMU as
/// libvirt-qemu) and on its plain twin: a raw disk and then a qcow2 disk, each plugged while
/// the guest runs, written and read back by the guest, and unplugged. On the converted
/// domain acceld serves the raw disk on the direct engine and the qcow2 disk on the qemu
/// engine, and after the unplug nothing of it is left (no drive, socket, chardev or node);
/// the guest's view of each disk, virsh's answers and `domblklist` are the plain twin's. An
/// acceld restart while the raw disk is plugged serves it again, and its unplug works.
/// Between the two disks, an attack through libvirt's monitor: a node on a file QEMU's user
/// owns, the file swapped for a link to a root-only one, then `device_add` on that node:
/// acceld must not serve it (it opens as QEMU's user), and the answer is QEMU's own.
#[test]
fn a_disk_hot_plugged_into_a_converted_domain_is_served_by_acceld() -> Result<()> {
    let _g = ONE.lock().unwrap_or_else(|p| p.into_inner());
    if std::env::var("ACCEL_LIBVIRT_TESTS").as_deref() == Ok("0") {
        eprintln!("ACCEL_LIBVIRT_TESTS=0: libvirt test left out");
        return Ok(());
    }
    virsh(&["version"]).context("libvirtd must run (virtlogd -d; libvirtd -d), as .ci/run does")?;
    let user = libvirt_qemu()?;
    let (mut kernel, mut initrd) = ensure_guest()?;
    let dir = tempfile::Builder::new()
        .prefix("accel-hotplug")
        .tempdir_in("/var/tmp")?;
    let d = dir.path();
    std::os::unix::fs::chown(d, Some(user.uid), Some(user.gid))?;
    for f in [&mut kernel, &mut initrd] {
        let to = d.join(f.file_name().unwrap());
        std::fs::copy(&*f, &to)?;
        *f = to;
    }
    let (mut acc, wrapper, _cleanup) = with_hook(d, &HP_TWINS)?;
    let mut seen = Vec::new();
    let mut one = |acc: &mut AcceldRun, i: usize, name: &str| -> Result<()> {
        let conv = i == 1;
        std::fs::File::create(d.join(format!("{name}.raw")))?.set_len(64 << 20)?;
        let xml = d.join(format!("{name}.xml"));
        let text = domain_xml_of(
            &DomainSpec {
                name,
                uuid: format!("0b6f2f9e-5a1c-4e7e-9d1e-acce1d0002{i:02}"),
                vcpus: 2,
                script: HOTPLUG_SCRIPT,
                img: &d.join(format!("{name}.raw")),
                driver_extra: " discard='unmap'",
                serial: &d.join(format!("{name}.serial")),
                qemu_as_root: false,
            },
            &kernel,
            &initrd,
        )
        // Free PCIe root ports: q35 plugs devices into them.
        .replace(
            "<memballoon model='none'/>",
            "<controller type='pci' index='0' model='pcie-root'/>\n    <controller type='pci' index='1' model='pcie-root-port'/>\n    <controller type='pci' index='2' model='pcie-root-port'/>\n    <controller type='pci' index='3' model='pcie-root-port'/>\n    <memballoon model='none'/>",
        );
        std::fs::write(&xml, text)?;
        if conv {
            let (xml_out, _) = convert(&xml, &wrapper)?;
            std::fs::write(&xml, xml_out)?;
        }
        virsh(&["define", xml.to_str().unwrap()])?;
        virsh(&["start", name])?;
        let mut serial = Serial::connect(&d.join(format!("{name}.serial")))?;
        serial.wait_for("READY", Duration::from_secs(120))?;
        let mut answers = Vec::new();

        // A raw disk with a serial.
        let raw = d.join(format!("{name}-hp.raw"));
        std::fs::File::create(&raw)?.set_len(32 << 20)?;
        let t0 = Instant::now();
        answers.push(virsh(&[
            "attach-disk",
            name,
            raw.to_str().unwrap(),
            "vdb",
            "--live",
            "--targetbus",
            "virtio",
            "--driver",
            "qemu",
            "--subdriver",
            "raw",
            "--cache",
            "none",
            "--serial",
            "HP-SERIAL-1",
        ])?);
        let attach = t0.elapsed();
        answers.push(virsh(&["domblklist", name])?);
        serial.wait_for("hp1 DONE", Duration::from_secs(60))?;
        let raw_drive = if conv {
            let p = wait_plugged(acc, name, Some("direct"))?;
            let id = p[0]["drive"].as_str().unwrap_or_default().to_string();
            assert!(d.join("run").join(name).join(format!("{id}.sock")).exists());
            Some(id)
        } else {
            None
        };
        let md5 = serial
            .seen
            .iter()
            .rev()
            .find(|l| l.contains("hp1 md5"))
            .cloned()
            .unwrap_or_default();
        let wrote = field(&md5, "wrote").unwrap_or_default().to_string();
        assert_eq!(Some(wrote.as_str()), field(&md5, "read"), "{md5}");
        assert_eq!(
            host_md5(&raw, 1 << 20)?,
            wrote,
            "the host's image holds the guest's data"
        );
        if conv {
            // An acceld restart: the hot-plugged drive is in its state file, served again
            // on the direct engine, and its unplug works after it.
            let took = acc.restart()?;
            wait_plugged(acc, name, Some("direct"))?;
            println!("{name}: acceld restarted in {took:?}; the hot-plugged disk is direct again");
        }
        let t0 = Instant::now();
        answers.push(virsh(&["detach-disk", name, "vdb", "--live"])?);
        serial.wait_for("hp1 GONE", Duration::from_secs(60))?;
        let detach = t0.elapsed();
        answers.push(virsh(&["domblklist", name])?);
        println!("{name}: raw disk attach {attach:?}, detach until the guest lost it {detach:?}");
        if let Some(id) = &raw_drive {
            wait_plugged(acc, name, None)?;
            assert!(!d.join("run").join(name).join(format!("{id}.sock")).exists());
            let nodes = monitor(name, r#"{"execute":"query-named-block-nodes"}"#)?;
            assert!(
                !nodes.to_string().contains(raw.to_str().unwrap()),
                "a node of the unplugged disk is left: {nodes}"
            );
            let ch = monitor(name, r#"{"execute":"query-chardev"}"#)?;
            assert!(!ch.to_string().contains(&format!("{id}-sock")), "{ch}");

            // The attack: a node on a file QEMU's user may open, swapped for a link to one
            // it may not; acceld opens what the device names as QEMU's user, or nothing.
            let evil = d.join("evil.raw");
            std::fs::File::create(&evil)?.set_len(1 << 20)?;
            std::os::unix::fs::chown(&evil, Some(user.uid), Some(user.gid))?;
            let secret = d.join("secret.raw");
            std::fs::write(&secret, vec![0x5a; 1 << 20])?;
            std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            monitor(
                name,
                &format!(
                    r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","filename":"{}","node-name":"evil-storage"}}}}"#,
                    evil.display()
                ),
            )?;
            std::fs::remove_file(&evil)?;
            std::os::unix::fs::symlink(&secret, &evil)?;
            // On the root bus, which takes no hot-plug: QEMU's plain device fails too.
            let r = virsh(&[
                "qemu-monitor-command",
                name,
                r#"{"execute":"device_add","arguments":{"driver":"virtio-blk-pci","drive":"evil-storage","id":"evil0","bus":"pcie.0"}}"#,
            ]);
            println!("{name}: device_add on the swapped node: {r:?}");
            assert!(
                plugged_drives(acc, name)?.is_empty(),
                "acceld serves the swapped node"
            );
            assert!(
                acc.log_text().contains("QEMU's user cannot open"),
                "acceld's log says why:\n{}",
                acc.log_text()
            );
            monitor(
                name,
                r#"{"execute":"blockdev-del","arguments":{"node-name":"evil-storage"}}"#,
            )?;
        }

        // A qcow2 disk without a serial.
        let qcow = d.join(format!("{name}-hp.qcow2"));
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&qcow)
            .arg("32M")
            .status()?;
        assert!(st.success());
        answers.push(virsh(&[
            "attach-disk",
            name,
            qcow.to_str().unwrap(),
            "vdb",
            "--live",
            "--targetbus",
            "virtio",
            "--driver",
            "qemu",
            "--subdriver",
            "qcow2",
        ])?);
        serial.wait_for("hp2 DONE", Duration::from_secs(60))?;
        if conv {
            wait_plugged(acc, name, Some("qemu"))?;
        }
        let md5 = serial
            .seen
            .iter()
            .rev()
            .find(|l| l.contains("hp2 md5"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(field(&md5, "wrote"), field(&md5, "read"), "{md5}");
        answers.push(virsh(&["detach-disk", name, "vdb", "--live"])?);
        serial.wait_for("hp2 GONE", Duration::from_secs(60))?;
        if conv {
            wait_plugged(acc, name, None)?;
            let nodes = monitor(name, r#"{"execute":"query-named-block-nodes"}"#)?;
            assert!(
                !nodes.to_string().contains(qcow.to_str().unwrap()),
                "{nodes}"
            );
            // The boot disk goes on on the direct engine.
            assert_eq!(acc.drive(name, DRIVE)?["engine"], "direct");
        }
        serial.send_line("END")?;
        serial.wait_for("HP-END", Duration::from_secs(30))?;
        wait_state(name, "shut off", Duration::from_secs(60))?;
        assert!(
            !serial.seen.iter().any(|l| l.contains("write-failed")),
            "{:?}",
            serial.seen
        );
        let view: Vec<String> = serial
            .seen
            .iter()
            .filter(|l| l.starts_with("hp") && (l.contains(" view ") || l.contains("features=")))
            .map(|l| l.trim().to_string())
            .collect();
        for l in view.iter().chain(answers.iter()) {
            println!("{name}: {}", l.trim());
        }
        virsh(&["undefine", name])?;
        seen.push((view, answers));
        Ok(())
    };
    for (i, name) in HP_TWINS.into_iter().enumerate() {
        // acceld's log with the error: the temporary directory goes with the test.
        one(&mut acc, i, name)
            .map_err(|e| anyhow!("{name}: {e:#}\nacceld log:\n{}", acc.log_text()))?;
    }
    // How long each DEVICE_DELETED waited for acceld (the drive's end).
    for l in acc
        .log_text()
        .lines()
        .filter(|l| l.contains("device deleted"))
    {
        println!("acceld: {l}");
    }
    let (plain, conv) = (&seen[0], &seen[1]);
    assert_eq!(plain.0.len(), 4, "{:?}", plain.0);
    // As for the boot disk: the one difference is RING_RESET (bit 40), which acceld does
    // not offer (see a_converted_domain_looks_like_its_plain_twin).
    let mask = |l: &str| -> String {
        match l.split_once("features=") {
            Some((a, f)) => {
                let mut f = f.as_bytes().to_vec();
                if let Some(b) = f.get_mut(40) {
                    *b = b'0';
                }
                format!("{a}features={}", String::from_utf8_lossy(&f))
            }
            None => l.to_string(),
        }
    };
    let pv: Vec<String> = plain.0.iter().map(|l| mask(l)).collect();
    let cv: Vec<String> = conv.0.iter().map(|l| mask(l)).collect();
    assert_eq!(
        pv, cv,
        "the guest tells the hot-plugged disks apart (plain, converted)"
    );
    // virsh's answers, with each twin's own name taken out (and so the width of
    // domblklist's rule).
    let norm = |s: &str, name: &str| {
        let mut out = String::new();
        for c in s.replace(name, "DOM").chars() {
            if !(c == '-' && out.ends_with('-')) {
                out.push(c);
            }
        }
        out
    };
    let pa: Vec<String> = plain.1.iter().map(|s| norm(s, HP_TWINS[0])).collect();
    let ca: Vec<String> = conv.1.iter().map(|s| norm(s, HP_TWINS[1])).collect();
    assert_eq!(pa, ca, "virsh answers differ (plain, converted)");
    Ok(())
}
