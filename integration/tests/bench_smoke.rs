//! accel-bench keeps working against both servers: a short verifying run at QD 8 on 2 queues
//! against acceld and against qemu-storage-daemon's vhost-user-blk export.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accel_integration::Acceld;

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

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn bench_verifies_against_qemu_storage_daemon() {
    let dir = tempfile::Builder::new()
        .prefix("accel-bench")
        .tempdir_in("/var/tmp")
        .unwrap();
    let img = image(dir.path());
    let sock = dir.path().join("q.sock");
    let _q = Kill(
        Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f0,filename={},cache.direct=on",
                img.display()
            ))
            .args(["--blockdev", "driver=raw,node-name=d0,file=f0"])
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path={},writable=on,num-queues=2",
                sock.display()
            ))
            .stdout(Stdio::null())
            .spawn()
            .expect("qemu-storage-daemon (qemu-utils)"),
    );
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(20));
    }
    check(&bench(&sock));
}
