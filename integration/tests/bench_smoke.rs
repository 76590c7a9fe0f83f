//! accel-bench keeps working against both servers: a short verifying run at QD 8 on 2 queues
//! against acceld and against qemu-storage-daemon's vhost-user-blk export.

use std::path::Path;
use std::process::Command;

use accel_integration::Acceld;
use accel_tests::harness::{Qsd, QsdOptions};

fn bench(socket: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_accel-bench"))
        .arg("--socket")
        .arg(socket)
        .args(["--workload", "randrw", "--verify", "--requests", "4000"])
        .args(["--depth", "8", "--queues", "2", "--size", "16m", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "accel-bench failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn check(json: &str) {
    assert!(json.contains("\"requests\":4000"), "{json}");
    assert!(json.contains("\"errors\":0"), "{json}");
    assert!(json.contains("\"mismatches\":0"), "{json}");
    assert!(json.contains("\"verified\":true"), "{json}");
    assert!(
        !json.contains("\"reads\":0,"),
        "some reads were verified: {json}"
    );
}

fn image(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("disk.raw");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    p
}

#[test]
fn bench_verifies_against_acceld() {
    let dir = tempfile::Builder::new()
        .prefix("accel-bench")
        .tempdir_in("/var/tmp")
        .unwrap();
    let img = image(dir.path());
    let sock = dir.path().join("a.sock");
    let _d = Acceld::serve(
        &sock,
        &["--image", img.to_str().unwrap(), "--queues", "2"],
        &dir.path().join("acceld.log"),
    )
    .unwrap();
    check(&bench(&sock));
}

#[test]
fn bench_verifies_against_qemu_storage_daemon() {
    let dir = tempfile::Builder::new()
        .prefix("accel-bench")
        .tempdir_in("/var/tmp")
        .unwrap();
    let img = image(dir.path());
    let sock = dir.path().join("q.sock");
    let _q = Qsd::start(
        &img,
        &sock,
        &QsdOptions {
            queues: 2,
            ..Default::default()
        },
    )
    .unwrap();
    check(&bench(&sock));
}
