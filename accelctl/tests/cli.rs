//! accelctl without acceld: usage errors and the "not reachable" exit code. (The commands
//! against a live acceld are tested in integration/tests/supervisor.rs.)

use std::process::Command;

fn accelctl(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_accelctl"))
        .args(args)
        .output()
        .expect("run accelctl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unreachable_acceld_is_exit_5_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = accelctl(&["--run-dir", dir.path().to_str().unwrap(), "status"]);
    assert_eq!(code, 5, "{err}");
    assert!(
        err.contains("cannot reach acceld") && err.contains("acceld.sock"),
        "{err}"
    );
}

#[test]
fn usage_errors_are_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().to_str().unwrap();
    for (args, text) in [
        (
            vec!["--run-dir", rd, "frobnicate"],
            "unrecognized subcommand",
        ),
        (
            vec![
                "--run-dir",
                rd,
                "register",
                "--vm",
                "v",
                "--qmp",
                "/q",
                "--drive",
                "id=d0",
            ],
            "missing image=",
        ),
        (
            vec!["--run-dir", rd, "throttle", "v", "d"],
            "at least one limit",
        ),
        (
            vec![
                "--run-dir",
                rd,
                "throttle",
                "v",
                "d",
                "--clear",
                "--iops-total",
                "5",
            ],
            "cannot be used with",
        ),
    ] {
        let (code, err) = accelctl(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(text), "{args:?}: {err}");
    }
}

/// The hook prints nothing, for every operation, plain and converted domains alike: libvirt
/// reads output of `migrate` and `restore` as a rewritten XML and taints the domain
/// (`hook-script`); empty output means "unchanged".
#[test]
fn the_hook_prints_nothing() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("accel-qemu.conf");
    std::fs::write(
        &conf,
        format!("run-dir = \"{}\"\n", dir.path().join("run").display()),
    )
    .unwrap();
    let plain = "<domain type='qemu'><name>plain</name><devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>";
    let converted = "<domain type='qemu'><name>conv</name><devices><emulator>/usr/bin/accel-qemu</emulator></devices></domain>";
    for (xml, name) in [(plain, "plain"), (converted, "conv")] {
        for op in ["migrate", "restore", "release", "stopped"] {
            let mut child = Command::new(env!("CARGO_BIN_EXE_accelctl"))
                .args([
                    "libvirt",
                    "hook",
                    "--conf",
                    conf.to_str().unwrap(),
                    name,
                    op,
                    "begin",
                    "-",
                ])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(xml.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.stdout.is_empty(),
                "{name} {op}: printed {:?} (stderr {:?})",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
