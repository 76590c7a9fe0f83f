//! acceld as systemd's `Type=notify` service runs it (packaging/deb/acceld.service): the
//! whole `acceld run` in a child process, `NOTIFY_SOCKET` naming a datagram socket the test
//! reads in the service manager's place.

use std::time::Duration;

use accel_tests::acceld_run::AcceldRun;
use acceld::control::{DriveSpec, PermitImage, Request};

/// `READY=1` comes once the control socket serves (libvirtd, ordered after acceld, may then
/// register domains at once), and `STOPPING=1` when SIGTERM starts the shutdown.
#[test]
fn ready_once_the_control_socket_serves_and_stopping_at_sigterm() {
    let mut a = AcceldRun::start("child", "");
    a.wait_ready();
    // At the moment of READY=1: no retry, no wait for the socket to appear.
    let r = a.status(Duration::from_secs(5));
    assert!(r.ok, "status refused: {r:?}");
    assert_eq!(r.result.unwrap()["vms"], serde_json::json!([]));
    a.terminate();
    assert_eq!(a.notification(Duration::from_secs(30)), "STOPPING=1");
    let st = a.wait();
    assert!(st.success(), "acceld run: {st}; log:\n{}", a.log());
    assert!(
        !a.control_socket().exists(),
        "the control socket outlived acceld"
    );
}

#[test]
#[ignore = "the child of the other tests (AcceldRun::start)"]
fn child() {
    accel_tests::acceld_run::child_main();
}

use accel_tests::harness::NOBODY;

/// The unit's `CapabilityBoundingSet=` as setpriv's `--bounding-set` argument.
fn units_bounding_set() -> String {
    let unit = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../packaging/deb/acceld.service"
    );
    let text = std::fs::read_to_string(unit).unwrap();
    let caps: Vec<String> = text
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit bounds acceld's capabilities")
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    assert!(
        text.lines().any(|l| l == "NoNewPrivileges=yes"),
        "NoNewPrivileges"
    );
    format!("-all,{}", caps.join(","))
}

/// With only the unit's capabilities (and no new privileges), root's acceld still does
/// what a libvirt domain whose QEMU runs as `libvirt-qemu` needs: a permit (the VM's
/// directory and control socket made the user's), and that user's registration of a raw
/// image it owns with mode 0600 in a directory only it can enter (acceld opens it) and of a
/// qcow2 image (`qemu-img info` as that user). Each of the five capabilities is needed by
/// one of these steps.
#[test]
fn the_units_capabilities_are_enough_for_a_permit_and_a_registration() {
    use std::os::unix::fs::PermissionsExt;
    let wrapper: Vec<String> = [
        "setpriv",
        "--no-new-privs",
        "--inh-caps=-all",
        &format!("--bounding-set={}", units_bounding_set()),
    ]
    .map(String::from)
    .to_vec();
    let mut a = AcceldRun::start_under(&wrapper, "child", "");
    a.wait_ready();
    let top = a.dir.path();
    std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The images: QEMU's user's, as libvirt's DAC driver leaves them.
    let images = top.join("images");
    std::fs::create_dir(&images).unwrap();
    let raw = images.join("a.raw");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let qcow2 = images.join("b.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&qcow2)
        .arg("1M")
        .status()
        .unwrap();
    assert!(st.success());
    for (p, mode) in [(&images, 0o700), (&raw, 0o600), (&qcow2, 0o600)] {
        std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let permit = Request::Permit {
        vm: "vm1".into(),
        uid: NOBODY,
        gid: NOBODY,
        images: vec![
            PermitImage::Path(raw.clone()),
            PermitImage::Spec {
                path: qcow2.clone(),
                read_only: false,
                format: Some("qcow2".into()),
            },
        ],
    };
    let r = acceld::control::call(&a.control_socket(), &permit, Duration::from_secs(10)).unwrap();
    assert!(r.ok, "permit: {r:?}; log:\n{}", a.log());
    let vm_dir = a.run_dir.join("vm1");
    let register = Request::Register {
        vm: "vm1".into(),
        qmp: vm_dir.join("qemu-qmp.sock"),
        drives: vec![
            DriveSpec::parse(&format!("id=d0,image={}", raw.display())).unwrap(),
            DriveSpec::parse(&format!("id=d1,image={},format=qcow2", qcow2.display())).unwrap(),
        ],
        cont: false,
        incoming: false,
    };
    // The registration comes from QEMU's user: this test binary again, as nobody.
    let sock = vm_dir.join("control.sock").to_string_lossy().into_owned();
    let req = serde_json::to_string(&register).unwrap();
    let (ok, text) = accel_tests::harness::run_child_test_as_nobody(
        top,
        "register_as_nobody",
        &[("ACCEL_TEST_SOCKET", &sock), ("ACCEL_TEST_REQUEST", &req)],
    );
    assert!(
        ok && text.contains("CHILD-OK"),
        "{text}\nacceld's log:\n{}",
        a.log()
    );
    let st = a.status(Duration::from_secs(5));
    let drives = &st.result.unwrap()["vms"][0]["drives"];
    assert_eq!(drives.as_array().map(Vec::len), Some(2), "{drives}");
    a.terminate();
    assert_eq!(a.notification(Duration::from_secs(30)), "STOPPING=1");
    assert!(a.wait().success(), "log:\n{}", a.log());
}

#[test]
#[ignore = "run as nobody by the_units_capabilities_are_enough_for_a_permit_and_a_registration"]
fn register_as_nobody() {
    let sock = std::env::var_os("ACCEL_TEST_SOCKET").expect("run by the capabilities test");
    let req: Request = serde_json::from_str(&std::env::var("ACCEL_TEST_REQUEST").unwrap()).unwrap();
    let r = acceld::control::call(sock.as_ref(), &req, Duration::from_secs(20)).unwrap();
    assert!(r.ok, "register: {r:?}");
    println!("CHILD-OK");
}
