//! `acceld serve` as a process: clear errors for bad input, clean SIGTERM.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn acceld() -> Command {
    Command::new(env!("CARGO_BIN_EXE_acceld"))
}

fn stderr_of(args: &[&str]) -> (bool, String) {
    let out = acceld().args(args).stdin(Stdio::null()).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn missing_image_is_named() {
    let (ok, err) = stderr_of(&[
        "serve",
        "--image",
        "/nonexistent/x.raw",
        "--socket",
        "/tmp/x.sock",
    ]);
    assert!(!ok);
    assert!(
        err.contains("image /nonexistent/x.raw does not exist"),
        "{err}"
    );
}

#[test]
fn bad_options_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let img = img.to_str().unwrap();
    for (args, want) in [
        (vec!["--queue-size", "100"], "not a power of two"),
        (vec!["--logical-block-size", "1024"], "not 512 or 4096"),
        (vec!["--queues", "0"], "--queues"),
        (vec!["--direct", "maybe"], "--direct"),
        (
            vec!["--serial", "012345678901234567890"],
            "longer than 20 bytes",
        ),
    ] {
        let mut a = vec!["serve", "--image", img, "--socket", "/tmp/never.sock"];
        a.extend(args);
        let (ok, err) = stderr_of(&a);
        assert!(!ok, "{a:?}");
        assert!(err.contains(want), "{a:?}: {err}");
    }
    let empty = dir.path().join("empty.raw");
    std::fs::File::create(&empty).unwrap();
    let (ok, err) = stderr_of(&[
        "serve",
        "--image",
        empty.to_str().unwrap(),
        "--socket",
        "/tmp/n.sock",
    ]);
    assert!(!ok);
    assert!(err.contains("less than one 512-byte block"), "{err}");
}

#[test]
fn socket_in_use_and_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let sock = dir.path().join("s.sock");
    let mut first = acceld()
        .args([
            "serve",
            "--image",
            img.to_str().unwrap(),
            "--socket",
            sock.to_str().unwrap(),
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    let (ok, err) = stderr_of(&[
        "serve",
        "--image",
        img.to_str().unwrap(),
        "--socket",
        sock.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("is in use by another server"), "{err}");
    // A second server on the same image, on another socket: refused by the image lock.
    let other = dir.path().join("other.sock");
    let (ok, err) = stderr_of(&[
        "serve",
        "--image",
        img.to_str().unwrap(),
        "--socket",
        other.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("in use by another process"), "{err}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(first.id() as i32, libc::SIGTERM) };
    let st = first.wait().unwrap();
    assert!(st.success(), "{st}");
    assert!(!sock.exists(), "socket removed on exit");
}
