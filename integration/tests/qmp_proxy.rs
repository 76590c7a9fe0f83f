//! acceld's QMP proxy with QEMU's own Python client (`qemu.qmp`): the same sequences against
//! the proxy of an accelerated VM and against a reference VM whose same-size image is a
//! virtio-blk-pci drive, replies compared field by field (`integration/qmp/proxy_check.py`);
//! many clients at once; a guest verifying its writes through all of it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use accel_integration::migration::Instance;
use accel_integration::supervised::{writer_script, AcceldRun};
use accel_integration::{crate_dir, guest_value, Guest};
use anyhow::{bail, Result};

fn python() -> Result<PathBuf> {
    let p = std::env::var_os("ACCEL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate_dir().join(".venv/bin/python3"));
    let ok = Command::new(&p)
        .args(["-c", "import qemu.qmp"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bail!(
            "{} cannot import qemu.qmp: run integration/setup.sh (it makes the venv)",
            p.display()
        );
    }
    Ok(p)
}

/// The reference: the same kind of image as a virtio-blk-pci drive named like acceld's drive.
fn reference_vm(dir: &Path, drive: &str) -> Result<(Guest, PathBuf)> {
    let img = dir.join("ref.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let sock = dir.join("ref-qmp.sock");
    let args: Vec<String> = [
        "-m",
        "128M",
        "-qmp",
        &format!("unix:{},server=on,wait=off", sock.display()),
        "-blockdev",
        &format!(
            "driver=file,filename={},node-name={drive}-file,cache.direct=on,discard=unmap",
            img.display()
        ),
        "-blockdev",
        &format!("driver=raw,file={drive}-file,node-name={drive},cache.direct=on,discard=unmap"),
        "-device",
        &format!("virtio-blk-pci,id={drive},drive={drive}"),
        "-S",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let g = Guest::boot_contract(&args, &[], "true")?;
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("the reference QEMU did not open its monitor");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((g, sock))
}

#[test]
fn proxy_answers_as_qemu_does_for_a_virtio_blk_drive() -> Result<()> {
    let py = python()?;
    let dir = tempfile::Builder::new()
        .prefix("accel-qmpproxy")
        .tempdir_in("/var/tmp")?;
    let img = dir.path().join("d0.raw");
    std::fs::File::create(&img)?.set_len(64 << 20)?;
    let acc = AcceldRun::start(
        &dir.path().join("run"),
        "quiet-period-ms = 300\npoll-interval-ms = 200\n",
    )?;
    let qmp = dir.path().join("qmp.sock");
    acc.register(
        "vm1",
        &qmp,
        // relay=on: relayed whenever on the qemu engine, despite the test's own monitor, so
        // that every command the proxy forwards meets a relayed drive.
        &format!("id=d0,image={},queues=2,relay=on", img.display()),
        &["--cont"],
    )?;
    let proxy = acc.run_dir.join("vm1").join("monitor.sock");
    let mut vm = Instance::boot_registered(
        &acc,
        "vm1",
        &dir.path().join("side.sock"),
        &[],
        &writer_script("/dev/vda", 16, 64),
    )?;
    vm.guest.wait_for("READY", Duration::from_secs(120))?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(10))?;
    vm.guest.wait_for("progress=", Duration::from_secs(60))?;
    let (_reference, ref_sock) = reference_vm(dir.path(), "d0")?;
    let scratch = dir.path().join("scratch");
    std::fs::create_dir_all(&scratch)?;
    let accelctl = format!(
        "{} --run-dir {}",
        accel_integration::supervised::accelctl_bin()?.display(),
        acc.run_dir.display()
    );
    let out = Command::new(&py)
        .arg(accel_integration::crate_dir().join("qmp/proxy_check.py"))
        .arg(&proxy)
        .arg(&ref_sock)
        .arg("d0")
        .arg(&scratch)
        .env("ACCELCTL", accelctl)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!(
            "the proxy differs from QEMU:\n{text}\nacceld log:\n{}",
            acc.log_text()
        );
    }
    // The guest wrote and verified through the throttle switches.
    vm.guest.send_line("STOP")?;
    let out = vm.guest.wait_exit(Duration::from_secs(180))?;
    if !out.iter().any(|l| l.contains("RESULT: PASS")) {
        bail!("guest failed:\n{}", out.join("\n"));
    }
    assert_eq!(guest_value(&out, "errors")?, "0");
    // block_resize through the proxy reached the guest (a config interrupt): 96 MiB.
    assert_eq!(
        guest_value(&out, "sectors")?,
        (96u64 << 20 >> 9).to_string()
    );
    Ok(())
}

/// `block_resize` through the proxy while the VM is still in prelaunch (the guest's driver has
/// not started the device): QEMU drops the config-change message then and keeps the config
/// it read at connect, so acceld has it read the config again (`device-sync-config`); the
/// guest boots seeing the new size, and writes and reads past the old end.
#[test]
fn resize_before_the_guest_runs_is_seen_at_boot() -> Result<()> {
    let py = python()?;
    let dir = tempfile::Builder::new()
        .prefix("accel-qmpresize")
        .tempdir_in("/var/tmp")?;
    let img = dir.path().join("d0.raw");
    std::fs::File::create(&img)?.set_len(32 << 20)?;
    let acc = AcceldRun::start(&dir.path().join("run"), "poll-interval-ms = 200\n")?;
    let qmp = dir.path().join("qmp.sock");
    acc.register("vm1", &qmp, &format!("id=d0,image={}", img.display()), &[])?;
    let proxy = acc.run_dir.join("vm1").join("monitor.sock");
    // The guest writes 40 MiB: past the old end, inside the new one.
    let mut vm = Instance::boot_registered(
        &acc,
        "vm1",
        &dir.path().join("side.sock"),
        &[],
        &accel_integration::report_and_verify_script(40),
    )?;
    acc.wait_attached("vm1", Duration::from_secs(30))?;
    let script = r#"
import asyncio, sys
from qemu.qmp import QMPClient
async def main():
    q = QMPClient("mgmt")
    await q.connect(sys.argv[1])
    assert (await q.execute("query-status"))["status"] == "prelaunch"
    print("resize:", await q.execute("block_resize", {"node-name": "d0", "size": 48 << 20}))
    await q.disconnect()
asyncio.run(main())
"#;
    let out = Command::new(&py)
        .args(["-c", script])
        .arg(&proxy)
        .output()?;
    if !out.status.success() {
        bail!(
            "management's client failed: {}{}\nacceld log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            acc.log_text()
        );
    }
    // `cont`: QEMU sends RESUME before its reply, and so must the proxy (libvirt's restore
    // relies on the same order for `migrate-incoming` and its MIGRATION event).
    {
        use std::io::{BufRead, BufReader, Write};
        let s = std::os::unix::net::UnixStream::connect(&proxy)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut r = BufReader::new(s.try_clone()?);
        let mut line = String::new();
        r.read_line(&mut line)?;
        (&s).write_all(b"{\"execute\": \"qmp_capabilities\", \"id\": 1}\r\n")?;
        line.clear();
        r.read_line(&mut line)?;
        (&s).write_all(b"{\"execute\": \"cont\", \"id\": 2}\r\n")?;
        let mut seen = Vec::new();
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                bail!("the proxy closed; seen {seen:?}");
            }
            let v: serde_json::Value = serde_json::from_str(&line)?;
            if v["id"] == 2 {
                break;
            }
            seen.push(v["event"].as_str().unwrap_or("").to_string());
        }
        assert!(
            seen.iter().any(|e| e == "RESUME"),
            "RESUME after cont's reply: {seen:?}"
        );
    }
    let out = vm.guest.wait_exit(Duration::from_secs(180))?;
    assert_eq!(guest_value(&out, "size")?, (48u64 << 20 >> 9).to_string());
    assert_eq!(guest_value(&out, "verify")?, "ok");
    // Registered without `serial=`: no serial, as QEMU's virtio-blk without one.
    assert_eq!(guest_value(&out, "serial")?, "");
    assert_eq!(std::fs::metadata(&img)?.len(), 48 << 20);
    Ok(())
}

/// The hot-plug guest: waits for /dev/vdb, shows its serial, writes 1 MiB (O_DIRECT) and
/// reads it back, waits for the disk to go, then for a line on its console.
const HOTPLUG_GUEST: &str = r#"while [ ! -b /dev/vdb ]; do sleep 0.1; done
echo "serial=$(cat /sys/block/vdb/serial)"
dd if=/dev/urandom of=/tmp/p bs=64k count=16 2>/dev/null
dd if=/tmp/p of=/dev/vdb bs=64k count=16 oflag=direct conv=notrunc 2>/dev/null && echo wrote=ok
dd if=/dev/vdb of=/tmp/q bs=64k count=16 iflag=direct 2>/dev/null
cmp /tmp/p /tmp/q && echo same=yes
while [ -b /dev/vdb ]; do sleep 0.1; done
echo gone=yes
read x
"#;

/// A disk hot-plugged and unplugged by QMP (`blockdev-add` ×2, `device_add`, `device_del`,
/// `DEVICE_DELETED`, `blockdev-del` ×2: what libvirt and Proxmox send) through the proxy of
/// an accelerated VM and on a plain VM, with QEMU's Python client
/// (`integration/qmp/hotplug_check.py`): the same answers and events; acceld serves the
/// disk on the direct engine and forgets it after; both guests see the serial and their data.
#[test]
fn a_disk_hot_plugged_through_the_proxy_is_served_as_qemu_would() -> Result<()> {
    let py = python()?;
    let dir = tempfile::Builder::new()
        .prefix("accel-qmphotplug")
        .tempdir_in("/var/tmp")?;
    let img = dir.path().join("d0.raw");
    std::fs::File::create(&img)?.set_len(32 << 20)?;
    let acc = AcceldRun::start(&dir.path().join("run"), "poll-interval-ms = 200\n")?;
    let qmp = dir.path().join("qmp.sock");
    acc.register(
        "vm1",
        &qmp,
        &format!("id=d0,image={}", img.display()),
        &["--cont"],
    )?;
    let port = [
        "-device".to_string(),
        "pcie-root-port,id=hp1,chassis=1".to_string(),
    ];
    let mut vm = Instance::boot_registered(
        &acc,
        "vm1",
        &dir.path().join("side.sock"),
        &port,
        HOTPLUG_GUEST,
    )?;
    let ref_img = dir.path().join("ref.raw");
    std::fs::File::create(&ref_img)?.set_len(32 << 20)?;
    let ref_sock = dir.path().join("ref-qmp.sock");
    let args: Vec<String> = [
        "-m".to_string(),
        "256M".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", ref_sock.display()),
        "-blockdev".into(),
        format!(
            "driver=file,filename={},node-name=d0-file,cache.direct=on",
            ref_img.display()
        ),
        "-blockdev".into(),
        "driver=raw,file=d0-file,node-name=d0".into(),
        "-device".into(),
        "virtio-blk-pci,id=d0,drive=d0".into(),
    ]
    .into_iter()
    .chain(port.iter().cloned())
    .collect();
    let mut reference = Guest::boot_contract(&args, &[], HOTPLUG_GUEST)?;
    acc.wait_engine("vm1", "d0", "direct", Duration::from_secs(60))?;
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&ref_sock).is_err() {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("the reference QEMU did not open its monitor");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let scratch = dir.path().join("scratch");
    std::fs::create_dir_all(&scratch)?;
    let accelctl = format!(
        "{} --run-dir {}",
        accel_integration::supervised::accelctl_bin()?.display(),
        acc.run_dir.display()
    );
    let out = Command::new(&py)
        .arg(accel_integration::crate_dir().join("qmp/hotplug_check.py"))
        .arg(acc.run_dir.join("vm1").join("monitor.sock"))
        .arg(&ref_sock)
        .arg(&scratch)
        .env("ACCELCTL", accelctl)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!(
            "hot-plug through the proxy differs from QEMU:\n{text}\nacceld log:\n{}",
            acc.log_text()
        );
    }
    // The boot disk went on on the direct engine throughout.
    assert_eq!(acc.drive("vm1", "d0")?["engine"], "direct");
    for (what, g) in [
        ("accelerated", &mut vm.guest),
        ("reference", &mut reference),
    ] {
        g.send_line("STOP")?;
        let out = g
            .wait_exit(Duration::from_secs(120))
            .map_err(|e| anyhow::anyhow!("{what} guest: {e:#}\nacceld log:\n{}", acc.log_text()))?;
        for (k, v) in [
            ("serial", "HP-QMP-1"),
            ("wrote", "ok"),
            ("same", "yes"),
            ("gone", "yes"),
        ] {
            assert_eq!(guest_value(&out, k)?, v, "{what} guest: {out:?}");
        }
    }
    Ok(())
}
