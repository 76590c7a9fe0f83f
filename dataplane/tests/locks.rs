//! QEMU-compatible image locks: while the direct engine holds an image, QEMU's tools cannot
//! write it, a second acceld cannot open it, and after release QEMU can.

use std::process::Command;

use accel_dataplane::engine::{Engine, EngineError, FileEngine, FileEngineConfig, IoMode};

fn cfg(path: &std::path::Path) -> FileEngineConfig {
    FileEngineConfig {
        path: path.to_path_buf(),
        read_only: false,
        direct: false,
        logical_block_size: 512,
        lock: true,
        io: IoMode::Auto,
        identity: None,
    }
}

fn qemu_io_write(path: &std::path::Path) -> (bool, String) {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x11 0 4k"])
        .arg(path)
        .output()
        .expect("qemu-io (qemu-utils)");
    (
        out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("lock"),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn locks_keep_qemu_and_a_second_acceld_out_until_released() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let e = FileEngine::open(cfg(&img)).unwrap();
    let (ok, out) = qemu_io_write(&img);
    assert!(!ok, "QEMU wrote an image acceld holds: {out}");
    assert!(
        out.contains("Failed to get") && out.contains("lock"),
        "{out}"
    );
    match FileEngine::open(cfg(&img)) {
        Err(EngineError::Locked { what, .. }) => assert_eq!(what, "write"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a second writer got the image"),
    }
    e.release();
    let (ok, out) = qemu_io_write(&img);
    assert!(ok, "after release QEMU may write: {out}");
    let data = std::fs::read(&img).unwrap();
    assert!(data[..4096].iter().all(|&b| b == 0x11));
}
