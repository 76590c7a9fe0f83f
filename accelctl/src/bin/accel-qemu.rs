//! accel-qemu: the emulator wrapper a converted libvirt domain names in `<emulator>`.
//!
//! libvirt runs it as it would run QEMU. Capability probes and VMs without a disk acceld can
//! serve run the real QEMU unchanged. For a VM it registers the VM's eligible virtio-blk
//! disks with acceld (their sockets are served before QEMU starts), passes libvirt's
//! listening monitor socket to acceld's QMP proxy (libvirt talks to the proxy as to QEMU),
//! rewrites the disks into vhost-user-blk-pci devices on acceld's sockets and gives QEMU a
//! monitor of acceld's, then execs the real QEMU (same pid, same descriptors).
//! Config: docs/libvirt.md (`accel-qemu.conf`).

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use accel_api::control::{self, ErrorKind, Request};
use accelctl::libvirt::argv::{self, Monitor, Outcome, Plan};
use accelctl::libvirt::WrapperConf;

/// Registration waits for acceld to open images and serve sockets.
const REGISTER: Duration = Duration::from_secs(60);

fn exec(qemu: &Path, args: &[std::ffi::OsString]) -> ExitCode {
    let e = std::process::Command::new(qemu).args(args).exec();
    eprintln!("accel-qemu: cannot run {}: {e}", qemu.display());
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let mut all = std::env::args_os();
    let argv0 = PathBuf::from(all.next().unwrap_or_default());
    let raw: Vec<std::ffi::OsString> = all.collect();
    let conf = match WrapperConf::find(&argv0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("accel-qemu: {}", accel_api::error_chain(&e));
            return ExitCode::from(1);
        }
    };
    let Some(args) = raw
        .iter()
        .map(|a| a.to_str().map(str::to_string))
        .collect::<Option<Vec<String>>>()
    else {
        // Not text: nothing libvirt generates for a VM; QEMU decides.
        return exec(&conf.qemu, &raw);
    };
    match argv::plan(&args, &conf.wrap_config()) {
        Outcome::Unchanged(_) => exec(&conf.qemu, &raw),
        Outcome::Wrap(p) => match register(&conf, &p) {
            Ok(()) => {
                for n in &p.notes {
                    eprintln!("accel-qemu: {n}");
                }
                let args: Vec<std::ffi::OsString> = p.args.iter().map(Into::into).collect();
                exec(&conf.qemu, &args)
            }
            Err(e) => {
                eprintln!("accel-qemu: {e}");
                ExitCode::from(1)
            }
        },
    }
}

/// Registers the VM with acceld, handing it libvirt's monitor socket.
fn register(conf: &WrapperConf, p: &Plan) -> Result<(), String> {
    let (listener, path) = match &p.monitor {
        Monitor::Fd(n) => {
            if *n < 3 {
                return Err(format!("monitor fd={n} is not a socket libvirt passed"));
            }
            // SAFETY: libvirt passed descriptor `n` for the monitor and nothing else in this
            // process uses it; the wrapper owns it from here (closed before exec).
            let fd = unsafe { OwnedFd::from_raw_fd(*n) };
            let l = std::os::unix::net::UnixListener::from(fd);
            let path = l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(Path::to_path_buf))
                .ok_or_else(|| {
                    format!("monitor fd={n} is not a listening unix socket with a path")
                })?;
            (Some(l), path)
        }
        Monitor::Path(path) => (None, path.clone()),
    };
    let sock = conf.run_dir.join("acceld.sock");
    let req = Request::Register {
        vm: p.vm.clone(),
        qmp: p.qmp.clone(),
        drives: p.drives.clone(),
        cont: false,
        incoming: p.incoming,
        monitor: Some(path),
    };
    let call = || {
        control::call_with_fd(&sock, &req, listener.as_ref().map(|l| l.as_fd()), REGISTER).map_err(
            |e| {
                format!(
                    "acceld is not reachable ({}): start acceld before this VM",
                    accel_api::error_chain(&e)
                )
            },
        )
    };
    let mut r = call()?;
    if !r.ok && r.kind == Some(ErrorKind::Exists) {
        // A registration left from a VM of this name that is gone (libvirt runs one QEMU
        // per domain): replace it.
        let _ = control::call(&sock, &Request::Unregister { vm: p.vm.clone() }, REGISTER);
        r = call()?;
    }
    if !r.ok {
        return Err(format!(
            "acceld refused VM {}: {}",
            p.vm,
            r.error.unwrap_or_default()
        ));
    }
    // The sockets the command line names are the ones acceld serves.
    let served: Vec<PathBuf> = r
        .result
        .as_ref()
        .and_then(|v| v["sockets"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s.as_str().map(PathBuf::from))
        .collect();
    for d in &p.drives {
        let want = argv::drive_socket(&conf.wrap_config(), &p.vm, &d.id);
        if !served.contains(&want) {
            let _ = control::call(&sock, &Request::Unregister { vm: p.vm.clone() }, REGISTER);
            return Err(format!(
                "acceld serves {served:?}, not {} (is its run dir {}?)",
                want.display(),
                conf.run_dir.display()
            ));
        }
    }
    // The listening socket is acceld's now; QEMU must not inherit it.
    drop(listener);
    Ok(())
}
