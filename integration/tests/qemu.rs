//! Real QEMU 10 (TCG) booting the tiny guest with its disk served by acceld.

use std::time::Duration;

use accel_integration::{
    guest_value, host_md5, report_and_verify_script, Acceld, Guest, GuestDisk, GuestSpec,
};

fn workdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("accel-qemu")
        .tempdir_in("/var/tmp")
        .unwrap()
}

#[test]
fn guest_writes_verifies_and_sees_the_configured_disk() {
    let dir = workdir();
    let image = dir.path().join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(96 << 20)
        .unwrap();
    let sock = dir.path().join("vdisk0.sock");
    let _d = Acceld::serve(
        &sock,
        &[
            "--image",
            image.to_str().unwrap(),
            "--queues",
            "2",
            "--serial",
            "ACCEL-SERIAL-1",
        ],
        &dir.path().join("acceld.log"),
    )
    .unwrap();
    let mut g = Guest::boot(&GuestSpec {
        disks: &[GuestDisk {
            socket: sock,
            queues: 2,
        }],
        script: &report_and_verify_script(8),
        mem_mb: 256,
        timeout: Duration::from_secs(120),
    })
    .unwrap();
    let out = g.wait_exit(Duration::from_secs(120)).unwrap();
    assert_eq!(
        guest_value(&out, "size").unwrap(),
        ((96u64 << 20) / 512).to_string()
    );
    assert_eq!(guest_value(&out, "serial").unwrap(), "ACCEL-SERIAL-1");
    assert_eq!(guest_value(&out, "queues").unwrap(), "2");
    assert_eq!(
        guest_value(&out, "discard_max").unwrap(),
        (32768u64 * 512).to_string()
    );
    assert_eq!(guest_value(&out, "logical_block").unwrap(), "512");
    assert_eq!(guest_value(&out, "ro").unwrap(), "0");
    assert_eq!(guest_value(&out, "verify").unwrap(), "ok", "{out:?}");
    // The host sees exactly what the guest wrote.
    let md5 = guest_value(&out, "md5").unwrap();
    assert_eq!(host_md5(&image, 8 << 20).unwrap(), md5);
    assert!(!out.iter().any(|l| l.contains("I/O error")), "{out:?}");
}

/// A 64 MiB raw image served by `acceld serve` (2 queues) to a guest running `script`.
struct ServedGuest {
    /// Kept alive: the image, socket and log live in it.
    _dir: tempfile::TempDir,
    image: std::path::PathBuf,
    socket: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl ServedGuest {
    fn boot(script: &str, timeout: Duration) -> (ServedGuest, Acceld, Guest) {
        let dir = workdir();
        let image = dir.path().join("disk.raw");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let sg = ServedGuest {
            socket: dir.path().join("vdisk0.sock"),
            log: dir.path().join("acceld.log"),
            image,
            _dir: dir,
        };
        let acceld = sg.serve();
        let guest = Guest::boot(&GuestSpec {
            disks: &[GuestDisk {
                socket: sg.socket.clone(),
                queues: 2,
            }],
            script,
            mem_mb: 256,
            timeout,
        })
        .unwrap();
        (sg, acceld, guest)
    }

    /// acceld on the image and socket (the previous one must be gone).
    fn serve(&self) -> Acceld {
        let args = ["--image", self.image.to_str().unwrap(), "--queues", "2"];
        Acceld::serve(&self.socket, &args, &self.log).unwrap()
    }
}

/// Two writers (queue depth 2+) write, read back and compare 256 KiB blocks in a loop while
/// acceld is stopped with SIGTERM and started again on the same socket.
const RESTART_SCRIPT: &str = r#"
worker() {
  w=$1; errs=0; i=0
  while [ $i -lt 80 ]; do
    off=$(( w * 64 + i % 32 ))
    dd if=/dev/urandom of=/tmp/p$w bs=256k count=1 2>/dev/null
    dd if=/tmp/p$w of=/dev/vda bs=256k seek=$off oflag=direct conv=notrunc 2>/dev/null || errs=$((errs+1))
    dd if=/dev/vda of=/tmp/r$w bs=256k skip=$off count=1 iflag=direct 2>/dev/null || errs=$((errs+1))
    cmp -s /tmp/p$w /tmp/r$w || errs=$((errs+1))
    echo "iter=$w.$i"
    i=$((i+1))
  done
  echo "errors$w=$errs"
}
worker 0 & worker 1 & wait
echo kernel_io_errors=$(dmesg | grep -ci 'i/o error')
"#;

#[test]
fn acceld_restart_under_guest_io_loses_nothing() {
    let (sg, mut d, mut g) = ServedGuest::boot(RESTART_SCRIPT, Duration::from_secs(180));
    g.wait_for("iter=0.10", Duration::from_secs(120)).unwrap();
    let st = d.terminate().unwrap();
    assert!(st.success(), "acceld exits 0 on SIGTERM: {st}");
    let restart_at = g.output.len();
    let _d2 = sg.serve();
    let out = g.wait_exit(Duration::from_secs(180)).unwrap();
    let after = out[restart_at..]
        .iter()
        .filter(|l| l.contains("iter="))
        .count();
    assert!(
        after > 20,
        "the guest kept going after the restart: {out:?}"
    );
    assert_eq!(guest_value(&out, "errors0").unwrap(), "0", "{out:?}");
    assert_eq!(guest_value(&out, "errors1").unwrap(), "0", "{out:?}");
    assert_eq!(
        guest_value(&out, "kernel_io_errors").unwrap(),
        "0",
        "{out:?}"
    );
    let log = std::fs::read_to_string(&sg.log).unwrap();
    assert_eq!(log.matches("drained, exiting").count(), 1, "{log}");
}

/// Two guest writers write and verify 256 KiB blocks over 24 MiB of a disk whose image lives
/// on an 8 MiB tmpfs: the disk fills up. With werror=enospc (the default, as QEMU's) the
/// guest's writes stall without an error; the test grows the tmpfs and the writes complete.
const ENOSPC_SCRIPT: &str = r#"
worker() {
  w=$1; errs=0; i=0
  while [ $i -lt 48 ]; do
    off=$(( w * 48 + i ))
    dd if=/dev/urandom of=/tmp/p$w bs=256k count=1 2>/dev/null
    dd if=/tmp/p$w of=/dev/vda bs=256k seek=$off oflag=direct conv=notrunc 2>/dev/null || errs=$((errs+1))
    dd if=/dev/vda of=/tmp/r$w bs=256k skip=$off count=1 iflag=direct 2>/dev/null || errs=$((errs+1))
    cmp -s /tmp/p$w /tmp/r$w || errs=$((errs+1))
    echo "iter=$w.$i"
    i=$((i+1))
  done
  echo "errors$w=$errs"
}
worker 0 & worker 1 & wait
echo kernel_io_errors=$(dmesg | grep -ci 'i/o error')
"#;

#[test]
fn a_full_disk_stalls_the_guest_without_an_error_until_space_comes_back() {
    let dir = workdir();
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let mount = |args: &[&str]| {
        let st = std::process::Command::new("mount")
            .args(args)
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(st.success(), "mount {args:?} (the test runs as root)");
    };
    mount(&["-t", "tmpfs", "-o", "size=8m", "tmpfs"]);
    struct Umount(std::path::PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _u = Umount(mnt.clone());
    let image = mnt.join("disk.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let sock = dir.path().join("vdisk0.sock");
    let log = dir.path().join("acceld.log");
    let _d = Acceld::serve(
        &sock,
        &["--image", image.to_str().unwrap(), "--queues", "2"],
        &log,
    )
    .unwrap();
    let mut g = Guest::boot(&GuestSpec {
        disks: &[GuestDisk {
            socket: sock,
            queues: 2,
        }],
        script: ENOSPC_SCRIPT,
        mem_mb: 256,
        timeout: Duration::from_secs(240),
    })
    .unwrap();
    // acceld says when it starts holding writes.
    let t0 = std::time::Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("requests held")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "the disk never filled: {:?}",
            g.output
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "the disk filled after {:?}; growing the tmpfs",
        t0.elapsed()
    );
    mount(&["-o", "remount,size=64m"]);
    let out = g.wait_exit(Duration::from_secs(240)).unwrap();
    let iters = out.iter().filter(|l| l.contains("iter=")).count();
    assert_eq!(iters, 96, "every write completed: {out:?}");
    assert_eq!(guest_value(&out, "errors0").unwrap(), "0", "{out:?}");
    assert_eq!(guest_value(&out, "errors1").unwrap(), "0", "{out:?}");
    assert_eq!(
        guest_value(&out, "kernel_io_errors").unwrap(),
        "0",
        "{out:?}"
    );
}

/// The guest's progress counter (sectors written, from `progress=N` lines of accel-writer).
fn next_progress(g: &mut Guest) -> u64 {
    let l = g.wait_for("progress=", Duration::from_secs(120)).unwrap();
    l.rsplit('=').next().unwrap().trim().parse().unwrap_or(0)
}

/// SIGKILL (no drain) of acceld 20 times while 32 guest writers (queue depth up to 32) write
/// random blocks and verify them, each kill after the guest's I/O resumed on the previous
/// acceld: with inflight tracking the new acceld resubmits what was in flight and replays
/// nothing, so the guest sees no error and its data is whole.
#[test]
fn acceld_sigkilled_twenty_times_under_guest_io_loses_nothing() {
    let (sg, mut d, mut g) = ServedGuest::boot(
        &accel_integration::supervised::writer_script("/dev/vda", 32, 64),
        Duration::from_secs(400),
    );
    g.wait_for("READY", Duration::from_secs(120)).unwrap();
    let kills = 20;
    let mut at_kill = next_progress(&mut g);
    for k in 0..kills {
        d.kill().unwrap();
        d = sg.serve();
        // The guest's I/O resumed on the new acceld before the next kill (the guest prints
        // its progress every 2 s, stuck or not: bound the wait in time).
        let t0 = std::time::Instant::now();
        loop {
            let p = next_progress(&mut g);
            if p > at_kill {
                at_kill = p;
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "after {k} kills the guest's I/O did not resume within 120 s"
            );
        }
    }
    g.send_line("STOP").unwrap();
    let out = g.wait_exit(Duration::from_secs(300)).unwrap();
    assert_eq!(guest_value(&out, "errors").unwrap(), "0", "{out:?}");
    assert_eq!(guest_value(&out, "kernel_errors").unwrap(), "0", "{out:?}");
    assert!(out.iter().any(|l| l.contains("RESULT: PASS")), "{out:?}");
    let md5 = guest_value(&out, "md5").unwrap();
    assert_eq!(
        host_md5(&sg.image, 32 * 64 * 4096).unwrap(),
        md5,
        "the host sees what the guest wrote"
    );
    let text = std::fs::read_to_string(&sg.log).unwrap();
    assert!(
        text.contains("inflight region set"),
        "QEMU tracks requests in flight with acceld: {text}"
    );
    let mut qemu: Vec<&String> = out.iter().filter(|l| l.starts_with("qemu: ")).collect();
    qemu.sort();
    qemu.dedup();
    println!(
        "{kills} SIGKILLs survived, {} guest iterations; {} restarts resubmitted requests; QEMU said: {qemu:?}",
        guest_value(&out, "iterations").unwrap_or_default(),
        text.matches("resubmitting").count()
    );
}
