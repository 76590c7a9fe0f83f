//! Permits (QEMU not running as root): root's `permit` gives QEMU's user the VM's own control
//! socket, through which that user may register the VM (only with the permitted images and
//! its own QMP socket), unregister it and see its status, and nothing else; the VM's sockets
//! are then that user's, across an acceld restart. Real acceld, real sockets, a real client
//! of another uid (python3 run as `nobody`).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use accel_integration::supervised::AcceldRun;
use acceld::control::{self, DriveSpec, ErrorKind, PermitImage, Reply, Request};
use anyhow::{bail, Context, Result};

const NOBODY: u32 = 65534;
const CALL: Duration = Duration::from_secs(20);

/// Sends one request line to `sock` as `uid` (a python3 client) and answers its reply, or
/// `Err` with the connect error's errno.
fn call_as(uid: u32, sock: &Path, req: &Request) -> Result<std::result::Result<Reply, i32>> {
    const CLIENT: &str = "import socket,sys\n\
s=socket.socket(socket.AF_UNIX)\n\
try:\n    s.connect(sys.argv[1])\n\
except OSError as e:\n    print('connect-error', e.errno); sys.exit(0)\n\
s.sendall(sys.argv[2].encode()+b'\\n')\n\
print(s.makefile().readline().strip())\n";
    let out = Command::new("python3")
        .arg("-c")
        .arg(CLIENT)
        .arg(sock)
        .arg(serde_json::to_string(req)?)
        .uid(uid)
        .gid(uid)
        .output()
        .context("python3")?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        bail!("client failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    if let Some(e) = text.strip_prefix("connect-error ") {
        return Ok(Err(e.parse()?));
    }
    Ok(Ok(
        serde_json::from_str(&text).with_context(|| text.clone())?
    ))
}

fn drive(image: &Path) -> DriveSpec {
    DriveSpec::parse(&format!("id=d0,image={}", image.display())).unwrap()
}

fn register(run: &Path, vm: &str, image: &Path) -> Request {
    Request::Register {
        vm: vm.into(),
        qmp: run.join(vm).join("qemu-qmp.sock"),
        drives: vec![drive(image)],
        cont: false,
        incoming: false,
    }
}

fn owner_mode(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.uid(), m.mode() & 0o7777)
}

fn wait_exists(p: &Path) -> Result<()> {
    let t0 = Instant::now();
    while !p.exists() {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("{} did not appear", p.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn denied(r: &Reply) -> bool {
    !r.ok && r.kind == Some(ErrorKind::Denied)
}

#[test]
fn a_permit_lets_qemus_user_register_its_vm_and_nothing_else() -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("accel-permit")
        .tempdir_in("/var/tmp")?;
    let d = dir.path();
    // Only traversable: the run dir's VM directory is where nobody's client goes.
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711))?;
    let img = d.join("disk.raw");
    let other = d.join("other.raw");
    for p in [&img, &other] {
        std::fs::File::create(p)?.set_len(1 << 20)?;
    }
    let run = d.join("run");
    let mut acc = AcceldRun::start(&run, "")?;
    let root_sock = run.join("acceld.sock");
    assert_eq!(owner_mode(&run), (0, 0o711), "the run dir");
    assert_eq!(owner_mode(&root_sock), (0, 0o600), "acceld's own socket");

    // Root permits uid nobody; the VM directory and its control socket are nobody's alone.
    let permit = |images: Vec<PathBuf>, uid: u32| Request::Permit {
        vm: "pv".into(),
        uid,
        gid: uid,
        images: images.into_iter().map(Into::into).collect(),
    };
    let r = control::call(&root_sock, &permit(vec![img.clone()], 0), CALL)?;
    assert!(!r.ok && r.kind == Some(ErrorKind::Invalid), "uid 0: {r:?}");
    let r = control::call(
        &root_sock,
        &permit(vec![d.join("missing.raw")], NOBODY),
        CALL,
    )?;
    assert!(!r.ok, "a missing image: {r:?}");
    let r = control::call(&root_sock, &permit(vec![img.clone()], NOBODY), CALL)?;
    assert!(r.ok, "{r:?}");
    let vm_sock = run.join("pv/control.sock");
    assert_eq!(
        r.result.as_ref().unwrap()["socket"],
        vm_sock.to_str().unwrap()
    );
    assert_eq!(owner_mode(&run.join("pv")), (NOBODY, 0o700));
    assert_eq!(owner_mode(&vm_sock), (NOBODY, 0o600));

    // Nobody cannot use acceld's own socket; another uid cannot use the VM's.
    assert_eq!(
        call_as(NOBODY, &root_sock, &Request::Status)?.err(),
        Some(libc::EACCES)
    );
    assert_eq!(
        call_as(NOBODY - 1, &vm_sock, &Request::Status)?.err(),
        Some(libc::EACCES)
    );

    // Everything but this VM's register, unregister and status is refused.
    let asked = [
        Request::Detach { vm: "pv".into() },
        Request::Attach { vm: "pv".into() },
        permit(vec![other.clone()], NOBODY),
        Request::Unregister { vm: "x".into() },
        register(&run, "x", &img),
        register(&run, "pv", &other),
        Request::Register {
            vm: "pv".into(),
            qmp: d.join("qmp.sock"),
            drives: vec![drive(&img)],
            cont: false,
            incoming: false,
        },
    ];
    for req in &asked {
        let r = call_as(NOBODY, &vm_sock, req)?.expect("connects");
        assert!(denied(&r), "{req:?}: {r:?}");
    }
    // No more drives than permitted images (each one a thread and a socket of root's).
    let two = Request::Register {
        vm: "pv".into(),
        qmp: run.join("pv/qemu-qmp.sock"),
        drives: vec![
            drive(&img),
            DriveSpec::parse(&format!("id=d1,image={}", img.display())).unwrap(),
        ],
        cont: false,
        incoming: false,
    };
    let r = call_as(NOBODY, &vm_sock, &two)?.expect("connects");
    assert!(denied(&r), "{r:?}");
    // A symbolic link to another image is that image.
    let link = d.join("link.raw");
    std::os::unix::fs::symlink(&other, &link)?;
    let r = call_as(NOBODY, &vm_sock, &register(&run, "pv", &link))?.expect("connects");
    assert!(denied(&r), "{r:?}");

    // Another VM, registered by root: nobody's status does not show it.
    let r = control::call(&root_sock, &register(&run, "rootvm", &other), CALL)?;
    assert!(r.ok, "{r:?}");

    // The registration itself: nobody's sockets.
    let r = call_as(NOBODY, &vm_sock, &register(&run, "pv", &img))?.expect("connects");
    assert!(r.ok, "{r:?}");
    let drive_sock = run.join("pv/d0.sock");
    assert_eq!(owner_mode(&drive_sock), (NOBODY, 0o600));
    let monitor = run.join("pv/monitor.sock");
    wait_exists(&monitor)?;
    let t0 = Instant::now();
    while owner_mode(&monitor).0 != NOBODY && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        owner_mode(&monitor),
        (NOBODY, 0o600),
        "the QMP proxy socket"
    );
    let r = call_as(NOBODY, &vm_sock, &Request::Status)?.expect("connects");
    let vms: Vec<String> = r.result.as_ref().unwrap()["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["vm"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(vms, ["pv"]);

    // The wrapper replacing a lost registration: unregister through the VM's socket keeps
    // the permit; registering again works.
    let r = call_as(NOBODY, &vm_sock, &Request::Unregister { vm: "pv".into() })?.unwrap();
    assert!(r.ok, "{r:?}");
    assert!(vm_sock.exists());
    let r = call_as(NOBODY, &vm_sock, &register(&run, "pv", &img))?.unwrap();
    assert!(r.ok, "{r:?}");

    // An acceld restart: the VM comes back with nobody's sockets.
    acc.restart()?;
    wait_exists(&drive_sock)?;
    assert_eq!(owner_mode(&drive_sock), (NOBODY, 0o600));
    assert_eq!(owner_mode(&run.join("pv")), (NOBODY, 0o700));
    let st = acc.status()?;
    assert_eq!(st["vms"].as_array().unwrap().len(), 2, "{st}");
    assert_eq!(
        owner_mode(&run.join("state.json")).1,
        0o600,
        "the state file"
    );

    // A connection made under one permit is worth nothing under the next one.
    let r = control::call(&root_sock, &permit(vec![img.clone()], NOBODY), CALL)?;
    assert!(r.ok, "{r:?}");
    let kept = std::os::unix::net::UnixStream::connect(&vm_sock)?;
    let ask = |mut s: &std::os::unix::net::UnixStream| -> Result<Reply> {
        use std::io::{BufRead, Write};
        writeln!(s, "{}", serde_json::to_string(&Request::Status)?)?;
        let mut line = String::new();
        std::io::BufReader::new(s).read_line(&mut line)?;
        Ok(serde_json::from_str(&line)?)
    };
    // Served under the first permit (so the connection is established)...
    assert!(ask(&kept)?.ok);
    let r = control::call(&root_sock, &permit(vec![img.clone()], NOBODY), CALL)?;
    assert!(r.ok, "{r:?}");
    // ...refused under the second.
    let r = ask(&kept)?;
    assert!(denied(&r), "{r:?}");

    // Root's unregister ends it all: no VM, no permit, no directory.
    let r = control::call(&root_sock, &Request::Unregister { vm: "pv".into() }, CALL)?;
    assert!(r.ok, "{r:?}");
    assert!(
        !run.join("pv").exists(),
        "the VM's directory is left: {:?}",
        std::fs::read_dir(run.join("pv"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    // A permit whose VM never registered ends with root's unregister too.
    let r = control::call(&root_sock, &permit(vec![img.clone()], NOBODY), CALL)?;
    assert!(r.ok, "{r:?}");
    let r = control::call(&root_sock, &Request::Unregister { vm: "pv".into() }, CALL)?;
    assert_eq!(r.kind, Some(ErrorKind::NotFound), "{r:?}");
    assert!(!run.join("pv").exists(), "the permit's directory is left");

    // Read-only and format per image, one image per drive.
    let spec_permit = |images: Vec<PermitImage>| Request::Permit {
        vm: "pv".into(),
        uid: NOBODY,
        gid: NOBODY,
        images,
    };
    let ro = |p: &Path| PermitImage::Spec {
        path: p.to_path_buf(),
        read_only: true,
        format: Some("raw".into()),
    };
    let rw = |p: &Path, f: &str| PermitImage::Spec {
        path: p.to_path_buf(),
        read_only: false,
        format: Some(f.into()),
    };
    let r = control::call(
        &root_sock,
        &spec_permit(vec![rw(&img, "raw"), ro(&other)]),
        CALL,
    )?;
    assert!(r.ok, "{r:?}");
    wait_exists(&vm_sock)?;
    let reg = |drives: Vec<DriveSpec>| Request::Register {
        vm: "pv".into(),
        qmp: run.join("pv/qemu-qmp.sock"),
        drives,
        cont: false,
        incoming: false,
    };
    let spec = |s: &str| DriveSpec::parse(s).unwrap();
    for (drives, why) in [
        (
            vec![spec(&format!("id=d0,image={}", other.display()))],
            "a read-only image registered writable",
        ),
        (
            vec![spec(&format!("id=d0,image={},format=qcow2", img.display()))],
            "another format than the domain's",
        ),
        (
            vec![
                spec(&format!("id=d0,image={}", img.display())),
                spec(&format!("id=d1,image={},read-only=on", img.display())),
            ],
            "one image for two drives (two images permitted)",
        ),
    ] {
        let r = call_as(NOBODY, &vm_sock, &reg(drives))?.expect("connects");
        assert!(denied(&r), "{why}: {r:?}");
    }
    let r = call_as(
        NOBODY,
        &vm_sock,
        &reg(vec![
            spec(&format!("id=d0,image={}", img.display())),
            spec(&format!("id=d1,image={},read-only=on", other.display())),
        ]),
    )?
    .expect("connects");
    assert!(r.ok, "{r:?}");
    let r = control::call(&root_sock, &Request::Unregister { vm: "pv".into() }, CALL)?;
    assert!(r.ok, "{r:?}");

    // A directory left by QEMU's user (with a file in it) is not reused for a root VM.
    let stale = run.join("pv");
    std::fs::create_dir(&stale)?;
    std::fs::write(stale.join("planted"), b"x")?;
    std::os::unix::fs::chown(&stale, Some(NOBODY), Some(NOBODY))?;
    let r = control::call(&root_sock, &register(&run, "pv", &img), CALL)?;
    assert!(r.ok, "{r:?}");
    assert_eq!(owner_mode(&stale), (0, 0o700), "the root VM's directory");
    assert!(!stale.join("planted").exists(), "the user's file is left");
    let r = control::call(&root_sock, &Request::Unregister { vm: "pv".into() }, CALL)?;
    assert!(r.ok, "{r:?}");
    Ok(())
}
