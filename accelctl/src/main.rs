//! accelctl: the operator's CLI for acceld (`acceld run`), over its control socket.
//!
//! Exit codes: 0 done; 1 the operation failed; 2 bad usage or invalid request; 3 no such VM or
//! drive; 4 already exists; 5 acceld is not reachable.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use accel_api::control::{self, DriveSpec, ErrorKind, Request, ThrottleLimits};
use accel_api::status::{DriveStatus, RunState, Status};
use clap::{Args, Parser, Subcommand};
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Operate acceld: see and steer where each guest disk is served"
)]
struct Cli {
    /// acceld's run directory (its control socket is RUN_DIR/acceld.sock).
    #[arg(
        long,
        env = "ACCEL_RUN_DIR",
        default_value = "/run/accel",
        global = true
    )]
    run_dir: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Every drive: engine, reasons, switches, pauses, rates, errors.
    Status {
        #[arg(long)]
        json: bool,
        /// Refresh every second until interrupted.
        #[arg(long)]
        watch: bool,
    },
    /// The policy's decision for a drive, every reason in words.
    Explain {
        vm: String,
        drive: String,
        #[arg(long)]
        json: bool,
    },
    /// Clear an operator pin and serve the drive directly if the rules allow.
    Accelerate {
        vm: String,
        drive: String,
        /// Pin to direct and keep the pin across acceld restarts.
        #[arg(long)]
        pin: bool,
    },
    /// Move the drive to QEMU's block layer and keep it there until `accelerate`.
    Handback {
        vm: String,
        drive: String,
        /// Keep the pin across acceld restarts.
        #[arg(long)]
        pin: bool,
    },
    /// Set I/O limits (QEMU's throttle filter; the drive moves to the qemu engine) or clear them.
    Throttle(ThrottleArgs),
    /// Retry the drive's held requests now (werror=enospc: after space was freed).
    Resume { vm: String, drive: String },
    /// Register a VM's drives before QEMU starts; their sockets are served at once.
    Register {
        #[arg(long)]
        vm: String,
        /// The VM's QMP socket (QEMU: -qmp unix:PATH,server=on,wait=off).
        #[arg(long)]
        qmp: PathBuf,
        /// id=D,image=PATH[,format=raw][,read-only=on][,serial=S][,queues=N][,discard=unmap|ignore][,direct=on|off][,logical-block-size=512|4096][,werror=enospc|report|stop|ignore][,rerror=report|stop|ignore][,lend=on|off]
        #[arg(long = "drive", required = true)]
        drives: Vec<String>,
        /// `cont` the VM once every drive has an engine (when QEMU was started with -S; after
        /// an incoming migration, once it completed).
        #[arg(long)]
        cont: bool,
        /// The VM is a live migration's destination (QEMU started with -incoming): drives stay
        /// held and no image is opened until the migration completed. Give each drive the
        /// source's current `writeback=on|off` (`accelctl migrate` does all of this).
        #[arg(long)]
        incoming: bool,
    },
    /// Hand the VM's drives back to QEMU's graph and stop serving them.
    Unregister { vm: String },
    /// (Re)connect to the VM's QMP and decide again.
    Attach { vm: String },
    /// Stop supervising the VM (drives keep their engine, no more switching).
    Detach { vm: String },
    /// The QEMU arguments of the VM contract, one per line (or --shell: one quoted line).
    QemuArgs {
        #[arg(long)]
        vm: String,
        /// Guest memory (shared memfd backend).
        #[arg(long, default_value = "512M")]
        memory: String,
        #[arg(long)]
        shell: bool,
    },
    /// Live-migrate a VM to another acceld (shared storage): registers it there as incoming with
    /// this side's drive config (write cache, limits), waits for the destination QEMU
    /// (`qemu-args` there, plus `-incoming URI`), migrates, checks the destination runs, quits the
    /// source QEMU.
    Migrate(MigrateArgs),
    /// libvirt: convert a domain, install or remove the hook and the wrapper's config, and the
    /// hook itself (docs/libvirt.md).
    #[command(subcommand)]
    Libvirt(LibvirtCmd),
}

#[derive(Subcommand, Debug)]
enum LibvirtCmd {
    /// Print DOMAIN.xml converted for accel (`<emulator>` the wrapper, shared memfd memory) on
    /// stdout, one line per change on stderr; `virsh define` takes the output as it is.
    Convert {
        /// The domain XML (`virsh dumpxml --inactive DOMAIN > DOMAIN.xml`); `-`: stdin.
        xml: PathBuf,
        /// The emulator wrapper.
        #[arg(long, default_value = "/usr/bin/accel-qemu")]
        emulator: String,
    },
    /// Install the hook (HOOKS_DIR/qemu.d/accel) and the wrapper's config; libvirtd finds a
    /// new hook when it starts.
    Install {
        /// libvirt's hook directory.
        #[arg(long, default_value = "/etc/libvirt/hooks")]
        hooks_dir: PathBuf,
        /// The wrapper's config file.
        #[arg(long, default_value = accelctl::libvirt::DEFAULT_CONF)]
        conf: PathBuf,
        /// The real QEMU binary the wrapper runs.
        #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
        qemu: PathBuf,
        /// acceld binary the hook starts when acceld is not running (hosts without systemd).
        #[arg(long)]
        start_acceld: Option<PathBuf>,
        /// Register every converted disk with `lend=on` (docs/qemu-engine.md).
        #[arg(long)]
        lend: bool,
        /// AppArmor's directory: where libvirt's QEMU abstraction is, the rules that let a
        /// confined QEMU reach acceld's sockets go (abstractions/libvirt-qemu.d/accel),
        /// checked with apparmor_parser when it is installed.
        #[arg(long, default_value = "/etc/apparmor.d")]
        apparmor_dir: PathBuf,
    },
    /// Remove what `install` installed.
    Uninstall {
        #[arg(long, default_value = "/etc/libvirt/hooks")]
        hooks_dir: PathBuf,
        #[arg(long, default_value = accelctl::libvirt::DEFAULT_CONF)]
        conf: PathBuf,
        #[arg(long, default_value = "/etc/apparmor.d")]
        apparmor_dir: PathBuf,
    },
    /// The hook itself (libvirt runs it: DOMAIN OP SUBOP EXTRA, the domain XML on stdin).
    Hook {
        /// The wrapper's config file (its run-dir is acceld's).
        #[arg(long, default_value = accelctl::libvirt::DEFAULT_CONF)]
        conf: PathBuf,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Args, Debug)]
struct MigrateArgs {
    vm: String,
    /// The destination acceld's run directory (its control socket is DIR/acceld.sock).
    #[arg(long)]
    to: PathBuf,
    /// The destination QEMU's QMP socket (the VM contract's -qmp there).
    #[arg(long)]
    dest_qmp: PathBuf,
    /// Where the destination QEMU listens (QEMU's migrate URI: unix:PATH, tcp:HOST:PORT).
    #[arg(long)]
    uri: String,
    /// Seconds to wait for the destination QEMU to appear, and for the migration itself.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Leave the source QEMU (postmigrate) running afterwards.
    #[arg(long)]
    keep_source: bool,
    /// Non-shared storage: copy each drive named by --dest-image into its new image while the
    /// VM runs (QEMU's mirror, through the qemu engine), then migrate.
    #[arg(long)]
    copy_storage: bool,
    /// ID=PATH: the destination's image of drive ID (same virtual size, e.g. a blank raw file);
    /// with --copy-storage.
    #[arg(long = "dest-image")]
    dest_images: Vec<String>,
}

#[derive(Args, Debug)]
struct ThrottleArgs {
    vm: String,
    drive: String,
    #[arg(long)]
    iops_total: Option<u64>,
    #[arg(long)]
    iops_read: Option<u64>,
    #[arg(long)]
    iops_write: Option<u64>,
    #[arg(long)]
    bps_total: Option<u64>,
    #[arg(long)]
    bps_read: Option<u64>,
    #[arg(long)]
    bps_write: Option<u64>,
    /// Remove every limit (the drive goes back to direct after a quiet period).
    #[arg(long, conflicts_with_all = ["iops_total", "iops_read", "iops_write", "bps_total", "bps_read", "bps_write"])]
    clear: bool,
}

enum Fail {
    Usage(String),
    Remote(ErrorKind, String),
    Unreachable(String),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail::Usage(m)) => {
            eprintln!("accelctl: {m}");
            ExitCode::from(2)
        }
        Err(Fail::Remote(k, m)) => {
            eprintln!("accelctl: {m}");
            ExitCode::from(match k {
                ErrorKind::Failed => 1,
                ErrorKind::Invalid => 2,
                ErrorKind::NotFound => 3,
                ErrorKind::Exists => 4,
                ErrorKind::Denied => 6,
            })
        }
        Err(Fail::Unreachable(m)) => {
            eprintln!("accelctl: {m}");
            ExitCode::from(5)
        }
    }
}

fn call(cli: &Cli, req: &Request) -> Result<Value, Fail> {
    let sock = cli.run_dir.join("acceld.sock");
    // Switches wait for drains and QMP: allow them time.
    match control::call(&sock, req, Duration::from_secs(120)) {
        Ok(r) if r.ok => Ok(r.result.unwrap_or(Value::Null)),
        Ok(r) => Err(Fail::Remote(
            r.kind.unwrap_or(ErrorKind::Failed),
            r.error.unwrap_or_else(|| "failed".into()),
        )),
        Err(e @ control::ClientError::Connect { .. }) => Err(Fail::Unreachable(chain(&e))),
        Err(e) => Err(Fail::Remote(ErrorKind::Failed, chain(&e))),
    }
}

fn io(what: &str, p: &std::path::Path, e: impl std::fmt::Display) -> Fail {
    Fail::Remote(ErrorKind::Failed, format!("{what} {}: {e}", p.display()))
}

fn chain(e: &dyn std::error::Error) -> String {
    accel_api::error_chain(e)
}

/// Marks the files `accelctl libvirt install` writes (uninstall removes only those).
const INSTALLED_BY: &str = "accelctl libvirt install";

fn libvirt(cli: &Cli, cmd: &LibvirtCmd) -> Result<(), Fail> {
    use accelctl::libvirt::{apparmor, hook, xml, WrapperConf};
    match cmd {
        LibvirtCmd::Convert {
            xml: path,
            emulator,
        } => {
            let text = if path.as_os_str() == "-" {
                hook::read_stdin().map_err(|e| io("read", path, e))?
            } else {
                std::fs::read_to_string(path).map_err(|e| io("read", path, e))?
            };
            let (out, changes) = xml::convert(&text, emulator)
                .map_err(|e| Fail::Usage(format!("{}: {e}", path.display())))?;
            for c in &changes {
                eprintln!("{c}");
            }
            if changes.is_empty() {
                eprintln!("nothing to change: the domain is converted already");
            }
            println!("{out}");
            Ok(())
        }
        LibvirtCmd::Install {
            hooks_dir,
            conf,
            qemu,
            start_acceld,
            lend,
            apparmor_dir,
        } => {
            let me = std::env::current_exe()
                .map_err(|e| Fail::Remote(ErrorKind::Failed, format!("where is accelctl: {e}")))?;
            let wrapper = me.with_file_name("accel-qemu");
            if !wrapper.exists() {
                return Err(Fail::Remote(
                    ErrorKind::Failed,
                    format!(
                        "the wrapper {} is missing (install the package)",
                        wrapper.display()
                    ),
                ));
            }
            if !qemu.exists() {
                return Err(Fail::Usage(format!(
                    "QEMU binary {} does not exist",
                    qemu.display()
                )));
            }
            let c = WrapperConf {
                run_dir: std::path::absolute(&cli.run_dir).unwrap_or_else(|_| cli.run_dir.clone()),
                qemu: qemu.clone(),
                iothread: "accel-io".into(),
                acceld: start_acceld.clone(),
                lend: *lend,
            };
            if let Some(d) = conf.parent() {
                std::fs::create_dir_all(d).map_err(|e| io("create", d, e))?;
            }
            std::fs::write(conf, c.render()).map_err(|e| io("write", conf, e))?;
            eprintln!("wrote {}", conf.display());
            let dir = hooks_dir.join("qemu.d");
            std::fs::create_dir_all(&dir).map_err(|e| io("create", &dir, e))?;
            let h = dir.join("accel");
            let script = format!(
                "#!/bin/sh\n# accel's libvirt hook ({INSTALLED_BY}). It never calls back into libvirt.\n\
                 exec {} libvirt hook --conf {} -- \"$@\"\n",
                shell_quote(&me.display().to_string()),
                shell_quote(&conf.display().to_string())
            );
            std::fs::write(&h, script).map_err(|e| io("write", &h, e))?;
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&h, std::fs::Permissions::from_mode(0o755))
                    .map_err(|e| io("chmod", &h, e))?;
            }
            eprintln!("wrote {}", h.display());
            install_apparmor(apparmor_dir, &c, conf, &wrapper)?;
            eprintln!(
                "convert a domain: accelctl libvirt convert DOMAIN.xml --emulator {} > new.xml && virsh define new.xml",
                wrapper.display()
            );
            eprintln!("libvirtd finds a new hook when it (re)starts");
            Ok(())
        }
        LibvirtCmd::Uninstall {
            hooks_dir,
            conf,
            apparmor_dir,
        } => {
            for p in [
                hooks_dir.join("qemu.d").join("accel"),
                conf.clone(),
                apparmor_dir.join(apparmor::FILE),
            ] {
                match std::fs::read_to_string(&p) {
                    Ok(t) if t.contains(INSTALLED_BY) => {
                        std::fs::remove_file(&p).map_err(|e| io("remove", &p, e))?;
                        eprintln!("removed {}", p.display());
                    }
                    Ok(_) => eprintln!("left {} alone: not written by accelctl", p.display()),
                    Err(_) => {}
                }
            }
            Ok(())
        }
        LibvirtCmd::Hook { conf, args } => {
            let c = if conf.exists() {
                WrapperConf::load(conf).map_err(|e| Fail::Remote(ErrorKind::Failed, chain(&e)))?
            } else {
                WrapperConf::default()
            };
            let input = hook::read_stdin()
                .map_err(|e| Fail::Remote(ErrorKind::Invalid, format!("accel hook: stdin: {e}")))?;
            let r = hook::run(&c, args, &input);
            for n in &r.notes {
                eprintln!("{n}");
            }
            match r.error {
                Some(e) => Err(Fail::Remote(ErrorKind::Failed, e)),
                None => Ok(()),
            }
        }
    }
}

fn run(cli: &Cli) -> Result<(), Fail> {
    match &cli.cmd {
        Cmd::Libvirt(l) => libvirt(cli, l),
        Cmd::Status { json, watch } => loop {
            let v = call(cli, &Request::Status)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            } else {
                if *watch {
                    print!("\x1b[2J\x1b[H");
                }
                print!("{}", status_table(&typed(v)?));
            }
            if !*watch {
                return Ok(());
            }
            std::thread::sleep(Duration::from_secs(1));
        },
        Cmd::Explain { vm, drive, json } => {
            let v = call(
                cli,
                &Request::Explain {
                    vm: vm.clone(),
                    drive: drive.clone(),
                },
            )?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&v).expect("json"));
                return Ok(());
            }
            println!(
                "{vm}/{drive}: engine now {}, policy says {}",
                v["engine"].as_str().unwrap_or("?"),
                v["decision"].as_str().unwrap_or("?")
            );
            let reasons = v["reasons"].as_array().cloned().unwrap_or_default();
            if reasons.is_empty() {
                println!(
                    "  nothing needs QEMU's block layer: served directly from {}",
                    v["serve"]["image"].as_str().unwrap_or("?")
                );
            }
            for r in reasons {
                println!(
                    "  {:<24} {}",
                    r["code"].as_str().unwrap_or(""),
                    r["sentence"].as_str().unwrap_or("")
                );
            }
            Ok(())
        }
        Cmd::Accelerate { vm, drive, pin } => print_drive(call(
            cli,
            &Request::Accelerate {
                vm: vm.clone(),
                drive: drive.clone(),
                pin: *pin,
            },
        )?),
        Cmd::Handback { vm, drive, pin } => print_drive(call(
            cli,
            &Request::Handback {
                vm: vm.clone(),
                drive: drive.clone(),
                pin: *pin,
            },
        )?),
        Cmd::Resume { vm, drive } => print_drive(call(
            cli,
            &Request::Resume {
                vm: vm.clone(),
                drive: drive.clone(),
            },
        )?),
        Cmd::Throttle(t) => {
            let limits = ThrottleLimits {
                iops_total: t.iops_total,
                iops_read: t.iops_read,
                iops_write: t.iops_write,
                bps_total: t.bps_total,
                bps_read: t.bps_read,
                bps_write: t.bps_write,
            };
            if !t.clear && limits.is_empty() {
                return Err(Fail::Usage(
                    "give at least one limit (--iops-total, --bps-total, …) or --clear".into(),
                ));
            }
            print_drive(call(
                cli,
                &Request::Throttle {
                    vm: t.vm.clone(),
                    drive: t.drive.clone(),
                    limits: if t.clear { None } else { Some(limits) },
                },
            )?)
        }
        Cmd::Register {
            vm,
            qmp,
            drives,
            cont,
            incoming,
        } => {
            let specs = drives
                .iter()
                .map(|d| DriveSpec::parse(d).map_err(|e| Fail::Usage(format!("--drive {d}: {e}"))))
                .collect::<Result<Vec<_>, _>>()?;
            let qmp = std::path::absolute(qmp).unwrap_or_else(|_| qmp.clone());
            let v = call(
                cli,
                &Request::Register {
                    vm: vm.clone(),
                    qmp,
                    drives: specs,
                    cont: *cont,
                    incoming: *incoming,
                },
            )?;
            for s in v["sockets"].as_array().into_iter().flatten() {
                println!("{}", s.as_str().unwrap_or(""));
            }
            Ok(())
        }
        Cmd::Unregister { vm } => {
            call(cli, &Request::Unregister { vm: vm.clone() })?;
            Ok(())
        }
        Cmd::Attach { vm } => {
            call(cli, &Request::Attach { vm: vm.clone() })?;
            Ok(())
        }
        Cmd::Detach { vm } => {
            call(cli, &Request::Detach { vm: vm.clone() })?;
            Ok(())
        }
        Cmd::Migrate(m) => migrate(cli, m),
        Cmd::QemuArgs { vm, memory, shell } => {
            let v = call(
                cli,
                &Request::QemuArgs {
                    vm: vm.clone(),
                    memory: memory.clone(),
                },
            )?;
            let args: Vec<String> = v
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a.as_str().map(String::from))
                .collect();
            // Management talks to the QMP proxy, not to QEMU's monitor (which acceld holds).
            eprintln!(
                "management's QMP monitor: {} (acceld's proxy)",
                cli.run_dir.join(vm).join("monitor.sock").display()
            );
            if *shell {
                let q: Vec<String> = args.iter().map(|a| shell_quote(a)).collect();
                println!("{}", q.join(" "));
            } else {
                for a in args {
                    println!("{a}");
                }
            }
            Ok(())
        }
    }
}

/// Writes the AppArmor rules a confined QEMU needs (when libvirt's AppArmor abstraction is
/// there) and checks that a domain profile including them parses (when apparmor_parser is
/// there); rules that do not parse are removed again.
fn install_apparmor(
    dir: &std::path::Path,
    c: &accelctl::libvirt::WrapperConf,
    conf: &std::path::Path,
    wrapper: &std::path::Path,
) -> Result<(), Fail> {
    use accelctl::libvirt::apparmor;
    if !dir.join(apparmor::ABSTRACTION).exists() {
        eprintln!(
            "no {}: libvirt's AppArmor abstraction is not installed, so no AppArmor rules were written",
            dir.join(apparmor::ABSTRACTION).display()
        );
        return Ok(());
    }
    let abs = |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let text = apparmor::rules(INSTALLED_BY, &c.run_dir, &abs(conf), &abs(wrapper), &c.qemu)
        .map_err(|e| Fail::Usage(e.to_string()))?;
    let f = dir.join(apparmor::FILE);
    match std::fs::read_to_string(&f) {
        Ok(t) if !t.contains(INSTALLED_BY) => {
            return Err(Fail::Remote(
                ErrorKind::Failed,
                format!(
                    "{} exists and was not written by accelctl: left alone",
                    f.display()
                ),
            ))
        }
        _ => {}
    }
    if let Some(d) = f.parent() {
        std::fs::create_dir_all(d).map_err(|e| io("create", d, e))?;
    }
    std::fs::write(&f, &text).map_err(|e| io("write", &f, e))?;
    eprintln!("wrote {}", f.display());
    let Some(parser) = ["/usr/sbin/apparmor_parser", "/sbin/apparmor_parser"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.exists())
    else {
        eprintln!("apparmor_parser is not installed: the rules' syntax was not checked");
        return Ok(());
    };
    let template = dir.join(apparmor::TEMPLATE);
    let Ok(t) = std::fs::read_to_string(&template) else {
        eprintln!(
            "no {}: the rules' syntax was not checked",
            template.display()
        );
        return Ok(());
    };
    // A domain profile as virt-aa-helper makes one from the template (mode 0600 in a
    // directory only root writes: nobody swaps it under the parser).
    let probe =
        Probe(std::env::temp_dir().join(format!("accel-apparmor-check-{}", std::process::id())));
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut fh = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&probe.0)
            .map_err(|e| io("create", &probe.0, e))?;
        fh.write_all(
            t.replace("LIBVIRT_TEMPLATE", "libvirt-accel-install-check")
                .as_bytes(),
        )
        .map_err(|e| io("write", &probe.0, e))?;
    }
    let out = std::process::Command::new(parser)
        .args(["--skip-kernel-load", "--skip-cache", "--preprocess", "-I"])
        .arg(dir)
        .arg(&probe.0)
        .output()
        .map_err(|e| io("run", parser, e))?;
    let pre = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !pre.contains(INSTALLED_BY) {
        let _ = std::fs::remove_file(&f);
        return Err(Fail::Remote(
            ErrorKind::Failed,
            format!(
                "{} rejects a domain profile with accel's rules (removed again){}: {}",
                parser.display(),
                if out.status.success() {
                    " or does not include them"
                } else {
                    ""
                },
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    let out = std::process::Command::new(parser)
        .args(["--skip-kernel-load", "--skip-cache", "-I"])
        .arg(dir)
        .arg(&probe.0)
        .output()
        .map_err(|e| io("run", parser, e))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&f);
        return Err(Fail::Remote(
            ErrorKind::Failed,
            format!(
                "{} rejects a domain profile with accel's rules (removed again): {}",
                parser.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    eprintln!(
        "a libvirt domain profile with these rules parses ({}); domains started from now on get them",
        parser.display()
    );
    Ok(())
}

/// A temporary file removed when dropped.
struct Probe(PathBuf);

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn shell_quote(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_=,./:@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Decodes acceld's answer as the typed value it is.
/// One step of `accelctl migrate` failed: says which.
fn step_err(step: &str, f: Fail) -> Fail {
    match f {
        Fail::Usage(m) => Fail::Usage(format!("{step}: {m}")),
        Fail::Remote(k, m) => Fail::Remote(k, format!("{step}: {m}")),
        Fail::Unreachable(m) => Fail::Unreachable(format!("{step}: {m}")),
    }
}

fn migrate(cli: &Cli, m: &MigrateArgs) -> Result<(), Fail> {
    let dest = Cli {
        run_dir: m.to.clone(),
        cmd: Cmd::Status {
            json: false,
            watch: false,
        },
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(m.timeout);
    let poll = Duration::from_millis(50);
    let vm_of = |c: &Cli| -> Result<Option<accel_api::status::VmStatus>, Fail> {
        let st: Status = typed(call(c, &Request::Status)?)?;
        Ok(st.vms.into_iter().find(|v| v.vm == m.vm))
    };
    // 1. This side's drives, with their runtime state.
    let src = vm_of(cli)
        .map_err(|e| step_err("source status", e))?
        .ok_or_else(|| Fail::Remote(ErrorKind::NotFound, format!("no VM {} here", m.vm)))?;
    if !src.attached {
        return Err(Fail::Remote(
            ErrorKind::Failed,
            format!(
                "VM {} is not attached here (its QEMU is not running?)",
                m.vm
            ),
        ));
    }
    let mut copies: Vec<(String, PathBuf)> = Vec::new();
    for di in &m.dest_images {
        let (id, path) = di
            .split_once('=')
            .ok_or_else(|| Fail::Usage(format!("--dest-image {di}: expected ID=PATH")))?;
        if !src.drives.iter().any(|d| d.drive == id) {
            return Err(Fail::Usage(format!(
                "--dest-image {di}: VM {} has no drive {id}",
                m.vm
            )));
        }
        copies.push((
            id.to_string(),
            std::path::absolute(path).unwrap_or_else(|_| path.into()),
        ));
    }
    if m.copy_storage == copies.is_empty() {
        return Err(Fail::Usage(
            "--copy-storage needs a --dest-image ID=PATH per copied drive, and --dest-image needs --copy-storage".into(),
        ));
    }
    let mut drives = Vec::new();
    for d in &src.drives {
        let mut spec = d.spec.clone().ok_or_else(|| {
            Fail::Remote(
                ErrorKind::Failed,
                "this acceld reports no drive specs".into(),
            )
        })?;
        spec.writeback = Some(d.writeback);
        spec.throttle = d.throttle.clone();
        if let Some((_, p)) = copies.iter().find(|(id, _)| *id == d.drive) {
            spec.image = p.clone();
        }
        drives.push(spec);
    }
    // 2. The destination: incoming, drives held.
    let qmp = std::path::absolute(&m.dest_qmp).unwrap_or_else(|_| m.dest_qmp.clone());
    call(
        &dest,
        &Request::Register {
            vm: m.vm.clone(),
            qmp,
            drives,
            cont: true,
            incoming: true,
        },
    )
    .map_err(|e| step_err("register on the destination", e))?;
    eprintln!(
        "registered {} on {} (incoming); start its QEMU: accelctl --run-dir {} qemu-args --vm {} ... -incoming {}",
        m.vm,
        m.to.display(),
        m.to.display(),
        m.vm,
        m.uri
    );
    // 3. The destination QEMU, waiting.
    loop {
        let v = vm_of(&dest).map_err(|e| step_err("destination status", e))?;
        if v.as_ref()
            .is_some_and(|v| v.attached && v.run_state == Some(RunState::Inmigrate))
        {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err(Fail::Remote(
                ErrorKind::Failed,
                format!(
                    "wait for the destination QEMU: not attached and inmigrate within {} s",
                    m.timeout
                ),
            ));
        }
        std::thread::sleep(poll);
    }
    eprintln!("destination QEMU is waiting (inmigrate)");
    // Copy-storage: each copied drive goes to QEMU's block layer here and is mirrored into the
    // destination's new image; the mirror ends in sync at the switchover.
    for (id, _) in &copies {
        let undo = |f: Fail| {
            let _ = call(
                cli,
                &Request::Accelerate {
                    vm: m.vm.clone(),
                    drive: id.clone(),
                    pin: false,
                },
            );
            f
        };
        call(
            cli,
            &Request::Handback {
                vm: m.vm.clone(),
                drive: id.clone(),
                pin: false,
            },
        )
        .map_err(|e| step_err(&format!("move {id} to the qemu engine for the copy"), e))?;
        let t = call(
            &dest,
            &Request::MirrorTarget {
                vm: m.vm.clone(),
                drive: id.clone(),
            },
        )
        .map_err(|e| {
            undo(step_err(
                &format!("export {id}'s new image on the destination"),
                e,
            ))
        })?;
        let socket = PathBuf::from(t["socket"].as_str().unwrap_or_default());
        let export = t["export"].as_str().unwrap_or_default().to_string();
        eprintln!("copying {id} to the destination's image ...");
        let r = call(
            cli,
            &Request::MirrorTo {
                vm: m.vm.clone(),
                drive: id.clone(),
                socket,
                export,
            },
        )
        .map_err(|e| undo(step_err(&format!("mirror {id}"), e)))?;
        eprintln!(
            "{id}: {} MiB in sync after {} ms; the mirror follows the guest's writes",
            r["len"].as_u64().unwrap_or(0) >> 20,
            r["took_ms"].as_u64().unwrap_or(0)
        );
    }
    // 4. Migrate.
    call(
        cli,
        &Request::Migrate {
            vm: m.vm.clone(),
            uri: m.uri.clone(),
        },
    )
    .map_err(|e| step_err("migrate", e))?;
    let mut last = String::new();
    let info = loop {
        let q = call(cli, &Request::MigrationStatus { vm: m.vm.clone() })
            .map_err(|e| step_err("query-migrate", e))?;
        let s = q["status"].as_str().unwrap_or("").to_string();
        if s != last {
            eprintln!(
                "migration: {s} ({} MiB sent)",
                q["ram"]["transferred"].as_u64().unwrap_or(0) >> 20
            );
            last = s.clone();
        }
        match s.as_str() {
            "completed" => break q,
            "failed" | "cancelled" => {
                return Err(Fail::Remote(
                    ErrorKind::Failed,
                    format!(
                        "migration {s}: {}; the VM keeps running here",
                        q["error-desc"].as_str().unwrap_or("no reason given")
                    ),
                ))
            }
            _ => {}
        }
        if std::time::Instant::now() > deadline {
            return Err(Fail::Remote(
                ErrorKind::Failed,
                format!("migration still {s} after {} s", m.timeout),
            ));
        }
        std::thread::sleep(poll);
    };
    // 5. The destination runs (its acceld sends `cont` once its drives are served).
    loop {
        let v = vm_of(&dest).map_err(|e| step_err("destination status", e))?;
        if v.as_ref()
            .is_some_and(|v| v.run_state == Some(RunState::Running))
        {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err(Fail::Remote(
                ErrorKind::Failed,
                "the destination did not start running after the migration completed".into(),
            ));
        }
        std::thread::sleep(poll);
    }
    println!(
        "{} migrated: total {} ms, downtime {} ms, setup {} ms",
        m.vm,
        info["total-time"].as_u64().unwrap_or(0),
        info["downtime"].as_u64().unwrap_or(0),
        info["setup-time"].as_u64().unwrap_or(0)
    );
    // 6. The source QEMU goes; its acceld forgets the VM when its monitor does.
    if !m.keep_source {
        call(cli, &Request::QuitMigrated { vm: m.vm.clone() })
            .map_err(|e| step_err("quit the source QEMU", e))?;
    }
    Ok(())
}

fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, Fail> {
    serde_json::from_value(v).map_err(|e| {
        Fail::Remote(
            ErrorKind::Failed,
            format!("acceld's answer is not what this accelctl reads ({e}); same version?"),
        )
    })
}

fn print_drive(v: Value) -> Result<(), Fail> {
    let d: DriveStatus = typed(v)?;
    println!(
        "{}/{}: {}{}{}",
        d.vm,
        d.drive,
        d.engine.as_str(),
        if d.lend.lent {
            " (rings lent)"
        } else if d.io_path == "vhost-user" {
            " (relayed through QEMU's vhost-user-blk export)"
        } else {
            ""
        },
        if d.reasons.is_empty() {
            String::new()
        } else {
            format!(" ({})", d.reasons.join(", "))
        }
    );
    Ok(())
}

fn ago(since: u64) -> String {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let s = now.saturating_sub(since);
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

fn status_table(st: &Status) -> String {
    let mut rows = vec![[
        "VM",
        "DRIVE",
        "ENGINE",
        "SINCE",
        "REASONS",
        "SWITCHES",
        "LAST PAUSE",
        "IOPS",
        "MB/s",
        "P99",
        "INFLIGHT",
        "ERRORS",
    ]
    .map(String::from)
    .to_vec()];
    let mut notes = Vec::new();
    for vm in &st.vms {
        if !vm.attached {
            let why = vm.attach_error.as_deref().unwrap_or("attaching");
            notes.push(format!("{}: not attached: {why}", vm.vm));
        }
        if let Some(m) = &vm.monitor {
            notes.push(format!("{}: management's QMP: {}", vm.vm, m.display()));
        }
        for d in &vm.drives {
            rows.push(vec![
                vm.vm.clone(),
                d.drive.clone(),
                if d.lend.lent {
                    format!("{}(lent)", d.engine.as_str())
                } else if d.io_path == "vhost-user" {
                    format!("{}(relay)", d.engine.as_str())
                } else {
                    d.engine.as_str().to_string()
                },
                ago(d.since),
                if d.reasons.is_empty() {
                    "-".into()
                } else {
                    d.reasons.join(",")
                },
                d.switch.count.to_string(),
                format!("{:.2}ms", d.switch.last_pause_us as f64 / 1000.0),
                format!("{:.0}", d.io.iops),
                format!("{:.1}", d.io.mbps),
                d.io.p99_us
                    .map(|u| format!("<{u}us"))
                    .unwrap_or_else(|| "-".into()),
                d.io.in_flight.to_string(),
                d.io.errors.to_string(),
            ]);
            if d.io.held_requests > 0 {
                notes.push(format!(
                    "{}/{}: {} requests held ({}); retried every 100 ms, or `accelctl resume {} {}`",
                    vm.vm, d.drive, d.io.held_requests, d.io.status.as_str(), vm.vm, d.drive
                ));
            }
            if d.lend.lent {
                notes.push(format!(
                    "{}/{}: rings lent to QEMU's vhost-user-blk export: QEMU serves the guest, its query-blockstats counts the requests",
                    vm.vm, d.drive
                ));
            }
            if let Some(e) = &d.io.last_error {
                notes.push(format!("{}/{}: {e}", vm.vm, d.drive));
            }
        }
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    for n in notes {
        out.push_str(&format!("! {n}\n"));
    }
    out
}
