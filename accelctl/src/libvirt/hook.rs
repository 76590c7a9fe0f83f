//! The libvirt hook (`/etc/libvirt/hooks/qemu.d/accel` runs `accelctl libvirt hook`): argv
//! `DOMAIN OP SUBOP EXTRA`, the domain XML on stdin. It never calls back into libvirt (that
//! deadlocks), every wait is bounded, and whatever it starts is detached from its stdout and
//! stderr (libvirt waits for their EOF). Domains that do not use `accel-qemu` are left alone.

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use accel_api::control::{self, ErrorKind, Request};

use super::{xml, WrapperConf};

/// Longest domain XML read from stdin.
const MAX_XML: u64 = 16 << 20;
/// Every call to acceld.
const CALL: Duration = Duration::from_secs(10);
/// How long `prepare` waits for an acceld it started.
const START_WAIT: Duration = Duration::from_secs(15);

/// What the hook tells libvirt: the error that fails the operation. It never prints to
/// stdout: for `migrate` and `restore` libvirt takes any output as a rewritten domain XML
/// (and taints the domain `hook-script`), and empty output as "unchanged", which is what
/// acceld's hook always means.
#[derive(Debug, Default)]
pub struct HookResult {
    pub error: Option<String>,
    /// Lines for stderr that do not fail anything.
    pub notes: Vec<String>,
}

fn reachable(sock: &Path) -> bool {
    control::call(sock, &Request::Status, CALL).is_ok_and(|r| r.ok)
}

fn start_acceld(conf: &WrapperConf, bin: &Path) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let log = conf.run_dir.with_extension("log");
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|e| format!("cannot open acceld's log {}: {e}", log.display()))?;
    let err = out
        .try_clone()
        .map_err(|e| format!("cannot open acceld's log {}: {e}", log.display()))?;
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("run")
        .arg("--run-dir")
        .arg(&conf.run_dir)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    drop(child);
    let sock = conf.control_socket();
    let t0 = Instant::now();
    while t0.elapsed() < START_WAIT {
        if reachable(&sock) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!(
        "started {} but its control socket {} did not answer within {START_WAIT:?} (see {})",
        bin.display(),
        sock.display(),
        log.display()
    ))
}

/// QEMU's `uid:gid` from a DAC label (`+64055:+64055`, or user and group names).
pub fn parse_dac_label(label: &str) -> Result<(u32, u32), String> {
    let (u, g) = label
        .split_once(':')
        .ok_or_else(|| format!("DAC label '{label}' is not USER:GROUP"))?;
    let uid = match u.strip_prefix('+') {
        Some(n) => n.parse().ok(),
        None => lookup_id(u, false),
    }
    .ok_or_else(|| format!("DAC label '{label}': no user '{u}'"))?;
    let gid = match g.strip_prefix('+') {
        Some(n) => n.parse().ok(),
        None => lookup_id(g, true),
    }
    .ok_or_else(|| format!("DAC label '{label}': no group '{g}'"))?;
    Ok((uid, gid))
}

/// A user's (or a group's) id by name, through the C library (NSS included).
fn lookup_id(name: &str, group: bool) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 1 << 16];
    if group {
        // SAFETY: all-zero is a valid `group` (null pointers, zero id) for getgrnam_r to fill.
        let mut gr: libc::group = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: `c` is NUL-terminated; `gr`, `buf` (with its length) and `out` are valid for
        // writes for the whole call; the strings it stores point into `buf`, unused after.
        let r =
            unsafe { libc::getgrnam_r(c.as_ptr(), &mut gr, buf.as_mut_ptr(), buf.len(), &mut out) };
        (r == 0 && !out.is_null()).then_some(gr.gr_gid)
    } else {
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids) for getpwnam_r to fill.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: as for getgrnam_r above.
        let r =
            unsafe { libc::getpwnam_r(c.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
        (r == 0 && !out.is_null()).then_some(pw.pw_uid)
    }
}

/// `start`: when QEMU will not run as root, asks acceld to let QEMU's user register the VM
/// (its own control socket, its sockets that user's, only the domain's images).
fn permit(sock: &Path, vm: &str, facts: &xml::DomainFacts) -> Result<(), String> {
    let Some(label) = facts.dac_label.as_deref() else {
        return Ok(());
    };
    let (uid, gid) = parse_dac_label(label)?;
    if uid == 0 || facts.images.is_empty() {
        return Ok(());
    }
    let req = Request::Permit {
        vm: vm.to_string(),
        uid,
        gid,
        images: facts
            .images
            .iter()
            .map(|i| accel_api::control::PermitImage::Spec {
                path: i.path.clone().into(),
                read_only: i.read_only,
                format: i.format.clone(),
            })
            .collect(),
    };
    match control::call(sock, &req, CALL) {
        Ok(r) if r.ok => Ok(()),
        Ok(r) => Err(format!(
            "acceld refused to let uid {uid} register {vm}: {}",
            r.error.unwrap_or_default()
        )),
        Err(e) => Err(format!(
            "acceld is not reachable ({}): QEMU as uid {uid} cannot register {vm}",
            accel_api::error_chain(&e)
        )),
    }
}

/// Runs the hook for `op` with the domain XML `input`.
pub fn run(conf: &WrapperConf, args: &[String], input: &str) -> HookResult {
    let mut res = HookResult::default();
    let op = args.get(1).map(String::as_str).unwrap_or("");
    let facts = match xml::facts(input) {
        Ok(f) => f,
        Err(e) => {
            res.notes.push(format!("accel hook: {e}; nothing done"));
            return res;
        }
    };
    if !xml::uses_wrapper(&facts) {
        return res;
    }
    let Some(vm) = super::argv::vm_name(&facts.name, facts.uuid.as_deref()) else {
        res.error = Some(format!(
            "accel: the domain name '{}' is not a valid acceld name and the domain has no UUID",
            facts.name
        ));
        return res;
    };
    let sock = conf.control_socket();
    match op {
        "prepare" => {
            if reachable(&sock) {
                return res;
            }
            match &conf.acceld {
                Some(bin) => {
                    if let Err(e) = start_acceld(conf, bin) {
                        res.error = Some(format!("accel: {e}"));
                    }
                }
                None => {
                    res.error = Some(format!(
                        "accel: acceld is not running (no answer on {}); start it (systemctl start acceld) before starting {}",
                        sock.display(),
                        facts.name
                    ))
                }
            }
        }
        "start" => {
            if let Err(e) = permit(&sock, &vm, &facts) {
                res.error = Some(format!("accel: {e}"));
            }
        }
        "release" => match control::call(&sock, &Request::Unregister { vm: vm.clone() }, CALL) {
            Ok(r) if r.ok || r.kind == Some(ErrorKind::NotFound) => {}
            Ok(r) => res.notes.push(format!(
                "accel hook: unregister {vm}: {}",
                r.error.unwrap_or_default()
            )),
            Err(e) => res.notes.push(format!(
                "accel hook: unregister {vm}: {}",
                accel_api::error_chain(&e)
            )),
        },
        "reconnect" if conf.vm_status(&vm, CALL).is_none() => {
            res.notes.push(format!(
                "accel hook: libvirt reconnects to {}, which acceld does not serve (is acceld running at {}?)",
                facts.name,
                conf.run_dir.display()
            ));
        }
        _ => {}
    }
    res
}

/// Reads the XML from stdin (bounded: more than 16 MiB is an error, never a cut XML).
pub fn read_stdin() -> std::io::Result<String> {
    let mut s = String::new();
    std::io::stdin().take(MAX_XML + 1).read_to_string(&mut s)?;
    if s.len() as u64 > MAX_XML {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the domain XML is longer than {MAX_XML} bytes"),
        ));
    }
    Ok(s)
}
