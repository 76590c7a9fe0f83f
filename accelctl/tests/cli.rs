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

/// `libvirt install` writes AppArmor rules for libvirt's confined QEMU into
/// abstractions/libvirt-qemu.d/accel, checks with the real apparmor_parser that a domain
/// profile made from libvirt's template includes them and parses, refuses to overwrite a file
/// it did not write, removes its rules again when the profile does not parse, and `uninstall`
/// removes them. Uses libvirt's own abstraction and template (a copy, in a scratch AppArmor
/// directory) and needs apparmor_parser (integration/setup.sh installs both).
#[test]
fn libvirt_install_writes_apparmor_rules_that_parse() {
    let sys = std::path::Path::new("/etc/apparmor.d");
    let (abs, tpl) = (
        sys.join("abstractions/libvirt-qemu"),
        sys.join("libvirt/TEMPLATE.qemu"),
    );
    assert!(
        abs.exists() && tpl.exists() && std::path::Path::new("/usr/sbin/apparmor_parser").exists(),
        "libvirt's AppArmor abstraction and template, and apparmor_parser, are needed: run integration/setup.sh"
    );
    let d = tempfile::tempdir().unwrap();
    let aa = d.path().join("apparmor.d");
    std::fs::create_dir_all(aa.join("abstractions")).unwrap();
    std::fs::create_dir_all(aa.join("libvirt")).unwrap();
    std::fs::copy(&abs, aa.join("abstractions/libvirt-qemu")).unwrap();
    std::fs::copy(&tpl, aa.join("libvirt/TEMPLATE.qemu")).unwrap();
    let (hooks, conf) = (d.path().join("hooks"), d.path().join("accel-qemu.conf"));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let run_dir = d.path().join("run dir");
    let install = |extra: &[&str]| {
        let mut a = vec![
            "--run-dir".to_string(),
            s(&run_dir),
            "libvirt".into(),
            "install".into(),
            "--hooks-dir".into(),
            s(&hooks),
            "--conf".into(),
            s(&conf),
            "--apparmor-dir".into(),
            s(&aa),
        ];
        a.extend(extra.iter().map(|x| x.to_string()));
        accelctl(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let rules = aa.join("abstractions/libvirt-qemu.d/accel");
    let (code, err) = install(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("domain profile with these rules parses"),
        "{err}"
    );
    let text = std::fs::read_to_string(&rules).unwrap();
    let rd = s(&run_dir);
    for line in [
        format!("  \"{rd}/*/*.sock\" rwk,"),
        format!("  \"{rd}/acceld.sock\" rw,"),
        format!("  \"{}\" r,", s(&conf)),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // The real parser includes them in a profile made from libvirt's template.
    let out = Command::new("/usr/sbin/apparmor_parser")
        .args(["--skip-kernel-load", "--skip-cache", "--preprocess", "-I"])
        .arg(&aa)
        .arg(aa.join("libvirt/TEMPLATE.qemu"))
        .output()
        .unwrap();
    let pre = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pre.contains(&format!("\"{rd}/*/*.sock\" rwk,")), "{pre}");
    // Installing again replaces its own file.
    assert_eq!(install(&[]).0, 0);
    // Somebody else's broken drop-in beside it: the domain profile does not parse, so the
    // install fails and takes its own rules back out.
    let broken = aa.join("abstractions/libvirt-qemu.d/other");
    std::fs::write(&broken, "  /x rw\n  this is no rule,\n").unwrap();
    let (code, err) = install(&[]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("rejects a domain profile"), "{err}");
    assert!(
        !rules.exists(),
        "the rules stayed although the profile does not parse"
    );
    std::fs::remove_file(&broken).unwrap();
    // A file of that name accelctl did not write is left alone.
    std::fs::write(&rules, "# the admin's own\n").unwrap();
    let (code, err) = install(&[]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("not written by accelctl"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&rules).unwrap(),
        "# the admin's own\n"
    );
    std::fs::remove_file(&rules).unwrap();
    assert_eq!(install(&[]).0, 0);
    // uninstall removes the rules with the hook and the config.
    let (code, err) = accelctl(&[
        "libvirt",
        "uninstall",
        "--hooks-dir",
        &s(&hooks),
        "--conf",
        &s(&conf),
        "--apparmor-dir",
        &s(&aa),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!rules.exists() && !conf.exists() && !hooks.join("qemu.d/accel").exists());
}
