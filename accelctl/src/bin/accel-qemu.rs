//! accel-qemu: the emulator wrapper a converted libvirt domain names in `<emulator>`.
//!
//! libvirt runs it as it would run QEMU. Capability probes and VMs without a disk acceld can
//! serve run the real QEMU unchanged. For a VM it registers the VM's eligible virtio-blk
//! disks with acceld (their sockets are served before QEMU starts), leaves a relay between
//! libvirt's listening monitor socket and acceld's QMP proxy (libvirt talks to the proxy as to
//! QEMU, across acceld restarts: `libvirt/relay.rs`), rewrites the disks into vhost-user-blk-pci devices on acceld's sockets and gives QEMU a
//! monitor of acceld's, then execs the real QEMU (same pid, same descriptors).
//! Config: docs/libvirt.md (`accel-qemu.conf`).

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use accel_api::control::{self, ErrorKind, Request};
use accelctl::libvirt::argv::{self, Monitor, Outcome, Plan};
use accelctl::libvirt::relay::{self, Relay};
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
        Outcome::Wrap(p) => match monitor_listener(&p.monitor)
            .and_then(|l| register(&conf, &p).map(|()| l))
            .and_then(|l| spawn_relay(l, relay::proxy_socket(&conf.run_dir, &p.vm)))
        {
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

/// libvirt's listening monitor socket: the one it passed (`fd=N`), or one the wrapper makes
/// at the path QEMU was to listen on.
fn monitor_listener(m: &Monitor) -> Result<UnixListener, String> {
    match m {
        Monitor::Fd(n) => {
            if *n < 3 {
                return Err(format!("monitor fd={n} is not a socket libvirt passed"));
            }
            // SAFETY: libvirt passed descriptor `n` for the monitor and nothing else in this
            // process uses it; the wrapper owns it from here (the relay keeps it).
            let fd = unsafe { OwnedFd::from_raw_fd(*n) };
            let mut on: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into `on`, which has that size.
            let r = unsafe {
                libc::getsockopt(
                    *n,
                    libc::SOL_SOCKET,
                    libc::SO_ACCEPTCONN,
                    (&raw mut on).cast(),
                    &raw mut len,
                )
            };
            if r != 0 || on == 0 {
                return Err(format!("monitor fd={n} is not a listening socket"));
            }
            let l = UnixListener::from(fd);
            l.local_addr()
                .map_err(|e| format!("monitor fd={n} is not a unix socket: {e}"))?;
            Ok(l)
        }
        Monitor::Path(p) => {
            let _ = std::fs::remove_file(p);
            UnixListener::bind(p).map_err(|e| format!("cannot listen on {}: {e}", p.display()))
        }
    }
}

/// The control socket the wrapper registers through: acceld's own as root, else the VM's
/// own, which acceld serves to QEMU's user once libvirt's hook asked for it (`start`).
fn register_socket(conf: &WrapperConf, vm: &str) -> Result<PathBuf, String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return Ok(conf.control_socket());
    }
    let sock = conf.vm_control_socket(vm);
    if !sock.exists() {
        return Err(format!(
            "QEMU runs as uid {euid} and acceld serves no control socket for VM {vm} ({}): \
             libvirt's accel hook asks acceld for one when the domain starts \
             (accelctl libvirt install, then restart libvirtd)",
            sock.display()
        ));
    }
    Ok(sock)
}

/// Registers the VM with acceld (its drives are served from here on).
fn register(conf: &WrapperConf, p: &Plan) -> Result<(), String> {
    let sock = register_socket(conf, &p.vm)?;
    let req = Request::Register {
        vm: p.vm.clone(),
        qmp: p.qmp.clone(),
        drives: p.drives.clone(),
        cont: false,
        incoming: p.incoming,
    };
    let call = || {
        control::call(&sock, &req, REGISTER).map_err(|e| {
            format!(
                "acceld is not reachable ({}): start acceld before this VM",
                accel_api::error_chain(&e)
            )
        })
    };
    let mut r = call()?;
    if !r.ok && r.kind == Some(ErrorKind::Exists) {
        // A registration left from a VM of this name whose QEMU is gone (libvirt runs one
        // QEMU per domain; a lost `release` leaves one): replace it, unless acceld is
        // attached to a QEMU of that name.
        if WrapperConf::vm_status_at(&sock, &p.vm, REGISTER).is_some_and(|v| v.attached) {
            return Err(format!(
                "acceld serves a running VM named {} already (its QEMU is attached)",
                p.vm
            ));
        }
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
    Ok(())
}

/// Leaves the monitor relay running beside QEMU (a detached grandchild: no zombie, no
/// inherited descriptor but the listener, stdio on /dev/null).
fn spawn_relay(listener: UnixListener, proxy: PathBuf) -> Result<(), String> {
    // This process becomes QEMU: the relay watches it through a pidfd opened now.
    let qemu = relay::Process::open(std::process::id() as i32)
        .map_err(|e| format!("pidfd_open: {e} (Linux 5.3 or later is needed)"))?;
    // SAFETY: the wrapper is single-threaded (no thread was started), so the child may run
    // any code; fork has no memory-safety preconditions.
    let child = unsafe { libc::fork() };
    match child {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            // SAFETY: as above (the child is single-threaded too).
            let grandchild = unsafe { libc::fork() };
            if grandchild == 0 {
                relay_process(listener, proxy, qemu);
            }
            let code = if grandchild < 0 { 1 } else { 0 };
            // SAFETY: _exit ends the intermediate child at once (no destructors, no atexit).
            unsafe { libc::_exit(code) }
        }
        pid => {
            let mut status = 0;
            // SAFETY: `pid` is this process's child; `status` is a valid out pointer.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            if r != pid || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
                return Err("cannot start the monitor relay (fork failed)".into());
            }
            Ok(())
        }
    }
}

fn relay_process(listener: UnixListener, proxy: PathBuf, qemu: relay::Process) -> ! {
    use std::os::fd::AsRawFd;
    // SAFETY: setsid has no preconditions; it detaches from libvirt's session.
    unsafe { libc::setsid() };
    let keep = [listener.as_raw_fd(), qemu.as_raw_fd()];
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing a descriptor this process inherited (libvirt's pipes, QEMU's
            // descriptors) and does not use; the read_dir handle is closed already.
            unsafe { libc::close(fd) };
        }
    }
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for std_fd in 0..3 {
            // SAFETY: dup2 onto stdio; `null` stays open until after the loop.
            unsafe { libc::dup2(null.as_raw_fd(), std_fd) };
        }
    }
    Relay {
        listener,
        proxy,
        qemu,
    }
    .run();
    // SAFETY: _exit ends the relay without running the wrapper's atexit handlers.
    unsafe { libc::_exit(0) }
}
