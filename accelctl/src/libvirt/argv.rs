//! The emulator wrapper's decision, pure: libvirt's QEMU command line in, the accelerated
//! command line and acceld's registration out (or "run QEMU as it is").
//!
//! What libvirt 11.3 generates for a file disk (measured, `docs/libvirt.md`):
//! `-blockdev {"driver":"file","filename":"/x.raw","node-name":"libvirt-1-storage",…}`
//! `-device {"driver":"virtio-blk-pci","drive":"libvirt-1-storage","id":"virtio-disk0",…}`
//! and its monitor as an already-listening socket:
//! `-chardev socket,id=charmonitor,fd=N,server=on,wait=off -mon chardev=charmonitor,…`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accel_api::control::{check_id, DriveSpec};
pub use accel_api::convert::{chardev_id, convert_device, VIRTIO_BLK_QUEUE_SIZE};
use serde_json::{json, Map, Value};

/// QEMU options that take no argument (everything else takes one).
const FLAGS: &[&str] = &[
    "-S",
    "-no-user-config",
    "-nodefaults",
    "-no-shutdown",
    "-no-reboot",
    "-nographic",
    "-enable-kvm",
    "-snapshot",
    "-daemonize",
    "-full-screen",
    "-s",
    "-preconfig",
    "-only-migratable",
    "-version",
    "-help",
    "-h",
    "-no-hpet",
    "-no-acpi",
    "-enable-sync-profile",
    "-semihosting",
    "-old-param",
    "-win2k-hack",
    "-no-fd-bootchk",
    "-async-teardown",
    "-mem-prealloc",
    "-usb",
    "-enable-fips",
    "-nodefconfig",
    "-no-kvm-pit-reinjection",
    "-perfmap",
    "-jitdump",
    "-xen-attach",
    "-alt-grab",
    "-ctrl-grab",
    "-no-quit",
    "-singlestep",
    "-no-frame",
];

/// Options whose argument is never itself an option: seeing one there means the command line
/// has a flag the wrapper does not know, and it is not rewritten.
const WITH_VALUE: &[&str] = &[
    "-name",
    "-object",
    "-device",
    "-blockdev",
    "-chardev",
    "-machine",
    "-m",
    "-smp",
    "-mon",
    "-numa",
    "-incoming",
    "-uuid",
    "-cpu",
    "-accel",
    "-mem-path",
    "-drive",
    "-netdev",
];

#[derive(Clone, Debug)]
pub struct WrapConfig {
    /// acceld's run directory.
    pub run_dir: PathBuf,
    /// acceld's iothread for the NBD exports (acceld's `iothread` config).
    pub iothread: String,
    /// Register every drive with `lend=on`.
    pub lend: bool,
}

/// libvirt's monitor, as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Monitor {
    /// An already-listening socket (libvirt ≥ 8): its path is the socket's own address.
    Fd(i32),
    /// A path QEMU was to listen on.
    Path(PathBuf),
}

/// What the wrapper does with a VM's command line.
#[derive(Clone, Debug)]
pub struct Plan {
    pub vm: String,
    pub drives: Vec<DriveSpec>,
    pub monitor: Monitor,
    /// acceld's QMP socket, given to QEMU in place of libvirt's monitor.
    pub qmp: PathBuf,
    /// QEMU waits for an incoming migration (`virsh restore`, a migration's destination).
    pub incoming: bool,
    /// The command line to exec (without argv[0]).
    pub args: Vec<String>,
    /// One line per change or per disk left alone, for libvirt's domain log.
    pub notes: Vec<String>,
}

#[derive(Clone, Debug)]
pub enum Outcome {
    /// Run QEMU with the command line as it is (a capability probe, no eligible disk).
    Unchanged(String),
    Wrap(Box<Plan>),
}

/// Splits QEMU's `key=value,…` option text (`,,` is a comma).
pub fn split_opts(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == ',' {
            if it.peek() == Some(&',') {
                it.next();
                cur.push(',');
            } else {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

fn opt<'a>(parts: &'a [String], key: &str) -> Option<&'a str> {
    parts
        .iter()
        .find_map(|p| p.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// acceld's name for a libvirt domain: the domain's name when it is a valid acceld id, else
/// `vm-` and the first hex digits of its UUID.
pub fn vm_name(domain: &str, uuid: Option<&str>) -> Option<String> {
    if check_id("VM name", domain).is_ok() {
        return Some(domain.to_string());
    }
    let hex: String = uuid?.chars().filter(char::is_ascii_hexdigit).collect();
    (hex.len() >= 16).then(|| format!("vm-{}", &hex[..24.min(hex.len())]))
}

/// One option of the command line and its argument.
struct Arg {
    name: String,
    value: Option<String>,
}

/// The options, or None when an option's argument is an option itself (a flag the wrapper
/// does not know: it cannot tell the command line's structure).
fn parse_args(args: &[String]) -> Option<Vec<Arg>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        let norm = a
            .strip_prefix('-')
            .filter(|r| r.starts_with('-'))
            .unwrap_or(a);
        if norm.starts_with('-') && !FLAGS.contains(&norm) && i + 1 < args.len() {
            let next = &args[i + 1];
            let next_norm = next
                .strip_prefix('-')
                .filter(|r| r.starts_with('-'))
                .unwrap_or(next);
            if FLAGS.contains(&next_norm) || WITH_VALUE.contains(&next_norm) {
                return None;
            }
            out.push(Arg {
                name: norm.to_string(),
                value: Some(args[i + 1].clone()),
            });
            i += 2;
        } else {
            out.push(Arg {
                name: a.clone(),
                value: None,
            });
            i += 1;
        }
    }
    Some(out)
}

/// acceld's socket of a drive (`RUN_DIR/VM/DRIVE.sock`, acceld's registry).
pub fn drive_socket(cfg: &WrapConfig, vm: &str, drive: &str) -> PathBuf {
    cfg.run_dir.join(vm).join(format!("{drive}.sock"))
}

/// acceld's QMP socket of a VM.
pub fn qmp_socket(cfg: &WrapConfig, vm: &str) -> PathBuf {
    cfg.run_dir.join(vm).join("qemu-qmp.sock")
}

/// Shared memory for vhost-user: libvirt's RAM backends become shared memfd backends.
/// Returns false when a backend cannot be shared (a file backend without `share`).
fn share_memory(o: &mut Map<String, Value>, notes: &mut Vec<String>) -> bool {
    let id = o
        .get("id")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    match o.get("qom-type").and_then(Value::as_str) {
        Some("memory-backend-ram") => {
            o.insert("qom-type".into(), json!("memory-backend-memfd"));
            o.insert("share".into(), json!(true));
            notes.push(format!(
                "memory {id}: memory-backend-ram -> shared memory-backend-memfd (vhost-user needs shared guest memory)"
            ));
            true
        }
        Some("memory-backend-memfd") => {
            if o.get("share") != Some(&json!(true)) {
                o.insert("share".into(), json!(true));
                notes.push(format!("memory {id}: memfd made shared"));
            }
            true
        }
        Some("memory-backend-file") => o.get("share") == Some(&json!(true)),
        _ => true,
    }
}

/// Decides what to run for libvirt's command line `args` (argv without argv[0]).
pub fn plan(args: &[String], cfg: &WrapConfig) -> Outcome {
    let Some(parsed) = parse_args(args) else {
        return Outcome::Unchanged("an option the wrapper does not know takes no argument".into());
    };
    let value = |name: &str| {
        parsed
            .iter()
            .find(|a| a.name == name)
            .and_then(|a| a.value.as_deref())
    };
    let Some(name_opt) = value("-name") else {
        return Outcome::Unchanged("no -name: not a VM (a capability probe)".into());
    };
    if value("-machine").is_some_and(|m| split_opts(m).first().is_some_and(|t| t == "none")) {
        return Outcome::Unchanged("-machine none: a capability probe".into());
    }
    let parts = split_opts(name_opt);
    let domain = opt(&parts, "guest").unwrap_or(&parts[0]).to_string();
    let Some(vm) = vm_name(&domain, value("-uuid")) else {
        return Outcome::Unchanged(format!(
            "the domain name '{domain}' is not a valid acceld name and there is no -uuid"
        ));
    };
    // libvirt's monitor: the -mon in control mode and its chardev.
    let mon_chardev = parsed
        .iter()
        .filter(|a| a.name == "-mon")
        .filter_map(|a| a.value.as_deref())
        .map(split_opts)
        .find(|p| opt(p, "mode") == Some("control"))
        .and_then(|p| opt(&p, "chardev").map(str::to_string));
    let Some(mon_chardev) = mon_chardev else {
        return Outcome::Unchanged("no QMP monitor (-mon …,mode=control) to proxy".into());
    };
    // One pass over the options: the block nodes, the monitor's chardev (and where it is),
    // the JSON objects (by position).
    let mut monitor = None;
    let mut monitor_at = None;
    let mut nodes = BTreeMap::new();
    let mut objects: Vec<Option<Map<String, Value>>> = vec![None; parsed.len()];
    for (i, a) in parsed.iter().enumerate() {
        let Some(v) = a.value.as_deref() else {
            continue;
        };
        match a.name.as_str() {
            "-blockdev" => {
                if let Ok(n) = serde_json::from_str::<Value>(v) {
                    if let Some(name) = n["node-name"].as_str() {
                        nodes.insert(name.to_string(), n.clone());
                    }
                }
            }
            "-chardev" => {
                let p = split_opts(v);
                if p[0] == "socket" && opt(&p, "id") == Some(mon_chardev.as_str()) {
                    monitor_at = Some(i);
                    monitor = match (opt(&p, "fd").and_then(|f| f.parse().ok()), opt(&p, "path")) {
                        (Some(fd), _) => Some(Monitor::Fd(fd)),
                        (None, Some(path)) => Some(Monitor::Path(PathBuf::from(path))),
                        _ => None,
                    };
                }
            }
            "-object" => {
                if let Ok(Value::Object(o)) = serde_json::from_str(v) {
                    objects[i] = Some(o);
                }
            }
            _ => {}
        }
    }
    let Some(monitor) = monitor else {
        return Outcome::Unchanged(format!(
            "the monitor chardev {mon_chardev} is not a unix socket (fd= or path=)"
        ));
    };
    let incoming = value("-incoming").is_some();
    let cpus = value("-smp")
        .map(split_opts)
        .and_then(|p| {
            opt(&p, "cpus")
                .or_else(|| p.first().map(String::as_str).filter(|f| !f.contains('=')))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .unwrap_or(1);
    if value("-mem-path").is_some() {
        return Outcome::Unchanged("-mem-path: guest memory is not shared".into());
    }
    // Guest memory must be a backend the wrapper can see and share: the machine's
    // memory-backend (and every NUMA node's memdev) a JSON -object.
    let mut backends: Vec<String> = value("-machine")
        .map(split_opts)
        .and_then(|p| opt(&p, "memory-backend").map(str::to_string))
        .into_iter()
        .collect();
    for a in parsed.iter().filter(|a| a.name == "-numa") {
        if let Some(m) = a
            .value
            .as_deref()
            .map(split_opts)
            .and_then(|p| opt(&p, "memdev").map(str::to_string))
        {
            backends.push(m);
        }
    }
    if backends.is_empty() {
        return Outcome::Unchanged("no memory-backend: guest memory is not shared".into());
    }
    if let Some(b) = backends.iter().find(|b| {
        !objects
            .iter()
            .flatten()
            .any(|o| o.get("id").and_then(Value::as_str) == Some(b.as_str()))
    }) {
        return Outcome::Unchanged(format!("memory backend {b} is not a JSON -object"));
    }
    let mut notes = Vec::new();
    // Memory first: without shared memory no disk can be accelerated.
    let mut out: Vec<String> = Vec::with_capacity(args.len() + 8);
    let mut shared = true;
    let mut has_iothread = false;
    // Only what changed is written anew (libvirt's own text otherwise).
    let changed: Vec<Option<Value>> = objects
        .into_iter()
        .map(|o| {
            let mut o = o?;
            let before = o.clone();
            shared &= share_memory(&mut o, &mut notes);
            if o.get("qom-type") == Some(&json!("iothread"))
                && o.get("id").and_then(Value::as_str) == Some(cfg.iothread.as_str())
            {
                has_iothread = true;
            }
            (o != before).then_some(Value::Object(o))
        })
        .collect();
    let mut drives = Vec::new();
    let mut devices = Vec::new();
    for a in &parsed {
        let mut new = None;
        if let ("-device", Some(v)) = (a.name.as_str(), a.value.as_deref()) {
            if let Ok(Value::Object(d)) = serde_json::from_str::<Value>(v) {
                if d.get("driver").and_then(Value::as_str) == Some("virtio-blk-pci") {
                    let id = d
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_string();
                    match convert_device(&d, &nodes, cpus) {
                        Err(why) => notes.push(format!("{id}: stays a virtio-blk-pci device: {why}")),
                        Ok(_) if !shared => notes.push(format!(
                            "{id}: stays a virtio-blk-pci device: guest memory is a file backend without share=on"
                        )),
                        Ok((mut spec, dev)) => {
                            spec.lend = cfg.lend;
                            notes.push(format!(
                                "{id}: virtio-blk-pci on node {} -> vhost-user-blk-pci served by acceld ({} {}{})",
                                spec.node_name(),
                                spec.format,
                                spec.image.display(),
                                if spec.lend { ", lend=on" } else { "" }
                            ));
                            drives.push(spec);
                            new = Some(Value::Object(dev));
                        }
                    }
                }
            }
        }
        devices.push(new);
    }
    if drives.is_empty() {
        return Outcome::Unchanged("no virtio-blk-pci disk acceld can serve".into());
    }
    let qmp = qmp_socket(cfg, &vm);
    for (i, a) in parsed.iter().enumerate() {
        match (a.name.as_str(), &a.value) {
            (_, Some(_)) if changed[i].is_some() => {
                out.push(a.name.clone());
                out.push(changed[i].as_ref().expect("checked").to_string());
            }
            ("-device", Some(_)) if devices[i].is_some() => {
                let dev = devices[i].as_ref().expect("checked");
                let id = dev["id"].as_str().unwrap_or("");
                out.push("-chardev".into());
                out.push(format!(
                    "socket,id={},path={},reconnect-ms=1000",
                    chardev_id(id),
                    opt_escape(&drive_socket(cfg, &vm, id))
                ));
                out.push(a.name.clone());
                out.push(dev.to_string());
            }
            (_, Some(_)) if monitor_at == Some(i) => {
                out.push(a.name.clone());
                out.push(format!(
                    "socket,id={mon_chardev},path={},server=on,wait=off",
                    opt_escape(&qmp)
                ));
                notes.push(format!(
                    "monitor {mon_chardev}: libvirt's socket goes to acceld's QMP proxy; QEMU's monitor is {}",
                    qmp.display()
                ));
            }
            (_, Some(v)) => {
                out.push(a.name.clone());
                out.push(v.clone());
            }
            (_, None) => out.push(a.name.clone()),
        }
    }
    if !has_iothread {
        out.push("-object".into());
        out.push(json!({"qom-type": "iothread", "id": cfg.iothread}).to_string());
        notes.push(format!(
            "iothread {} added for acceld's NBD exports",
            cfg.iothread
        ));
    }
    Outcome::Wrap(Box::new(Plan {
        vm,
        drives,
        monitor,
        qmp,
        incoming,
        args: out,
        notes,
    }))
}

/// A path in QEMU's option syntax (`,` doubled).
fn opt_escape(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}
