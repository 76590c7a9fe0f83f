//! A virtio-blk-pci device as acceld serves it: the pure conversion of QEMU's
//! `virtio-blk-pci` device options (and the block nodes it names, as `-blockdev` or
//! `blockdev-add` give them) into acceld's drive spec and the `vhost-user-blk-pci` device
//! that takes its place. The libvirt emulator wrapper uses it for the command line, the QMP
//! proxy for a hot-plugged disk (`blockdev-add` then `device_add`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{json, Map, Value};

use crate::control::{check_id, DiscardMode, DriveSpec, ErrorPolicy, MAX_SERIAL_BYTES};

/// virtio-blk-pci's default `queue-size` (QEMU 10).
pub const VIRTIO_BLK_QUEUE_SIZE: u16 = 256;

/// `-device` properties of virtio-blk-pci that vhost-user-blk-pci has too, kept as they are.
const KEPT: &[&str] = &[
    "bus",
    "addr",
    "multifunction",
    "id",
    "bootindex",
    "num-queues",
    "queue-size",
    "ats",
    "iommu_platform",
    "disable-legacy",
    "disable-modern",
    "packed",
    "vectors",
    "romfile",
    "rombar",
    "failover_pair_id",
    "acpi-index",
    "event_idx",
    "indirect_desc",
];

/// Properties that acceld takes over (the drive spec) or that do not apply to a
/// vhost-user-blk device (its I/O runs in acceld).
const TAKEN: &[&str] = &[
    "driver",
    "drive",
    "serial",
    "write-cache",
    "werror",
    "rerror",
    "logical_block_size",
    "physical_block_size",
    "min_io_size",
    "opt_io_size",
    "discard_granularity",
    "iothread",
    "iothread-vq-mapping",
    "scsi",
    "config-wce",
];

/// The protocol node a drive's image is on, and what acceld needs of the chain.
struct Chain {
    node: String,
    format: String,
    image: String,
    read_only: bool,
    direct: bool,
    discard: DiscardMode,
}

fn protocol(n: &Value) -> bool {
    matches!(n["driver"].as_str(), Some("file" | "host_device"))
}

fn chain(nodes: &BTreeMap<String, Value>, name: &str) -> Result<Chain, String> {
    let top = nodes
        .get(name)
        .ok_or_else(|| format!("its node {name} is not a -blockdev of the command line"))?;
    let driver = top["driver"].as_str().unwrap_or("");
    let file = if protocol(top) {
        top
    } else {
        match driver {
            "raw" if top.get("offset").is_some() || top.get("size").is_some() => {
                return Err("its raw node shows a part of the file (offset/size)".into())
            }
            "raw" | "qcow2" | "qed" | "vmdk" | "vdi" | "vhdx" | "vpc" => {}
            d => return Err(format!("its node's driver is {d}")),
        }
        let child = top["file"]
            .as_str()
            .and_then(|c| nodes.get(c))
            .ok_or_else(|| format!("its {driver} node has no named file node"))?;
        if !protocol(child) {
            return Err(format!(
                "its {driver} node is on a {} node, not a file",
                child["driver"].as_str().unwrap_or("?")
            ));
        }
        child
    };
    let image = file["filename"].as_str().unwrap_or("").to_string();
    if !image.starts_with('/') || image.starts_with("/dev/fdset/") {
        return Err(format!(
            "its image '{image}' is not a path acceld can open (libvirt passed a descriptor)"
        ));
    }
    let ro = |n: &Value| n["read-only"] == true;
    let unmap = |n: &Value| n["discard"] == "unmap" || n["discard"] == "on";
    Ok(Chain {
        node: name.to_string(),
        format: if protocol(top) { "raw" } else { driver }.to_string(),
        image,
        read_only: ro(top) || ro(file),
        direct: file["cache"]["direct"] == true,
        discard: if unmap(top) && unmap(file) {
            DiscardMode::Unmap
        } else {
            DiscardMode::Ignore
        },
    })
}

fn policy(v: &Value, key: &str) -> Result<Option<ErrorPolicy>, String> {
    match v[key].as_str() {
        None => Ok(None),
        Some(s) => s.parse().map(Some).map_err(|e| format!("{key}={s}: {e}")),
    }
}

/// The drive spec and the vhost-user-blk-pci device of an eligible virtio-blk-pci device.
pub fn convert_device(
    dev: &Map<String, Value>,
    nodes: &BTreeMap<String, Value>,
    cpus: u64,
) -> Result<(DriveSpec, Map<String, Value>), String> {
    let dv = Value::Object(dev.clone());
    let id = dev
        .get("id")
        .and_then(Value::as_str)
        .ok_or("it has no id")?;
    check_id("drive id", id).map_err(|e| e.0)?;
    for k in dev.keys() {
        if !KEPT.contains(&k.as_str()) && !TAKEN.contains(&k.as_str()) {
            return Err(format!(
                "its property '{k}' has no vhost-user-blk equivalent"
            ));
        }
    }
    if dv["share-rw"] == true {
        return Err("it is shared with other VMs (share-rw)".into());
    }
    let node = dev
        .get("drive")
        .and_then(Value::as_str)
        .ok_or("it has no drive")?;
    let c = chain(nodes, node)?;
    // Without num-queues QEMU gives a virtio-blk-pci device one queue per vCPU; the
    // vhost-user-blk device gets as many, explicitly (acceld serves what it is told).
    let queues = match dev.get("num-queues") {
        None => cpus.clamp(1, 64) as u16,
        Some(q) => q
            .as_u64()
            .filter(|q| (1..=64).contains(q))
            .ok_or_else(|| format!("num-queues {q} is not 1 to 64"))? as u16,
    };
    let serial = dv["serial"].as_str().map(str::to_string);
    if serial.as_ref().is_some_and(|s| s.len() > MAX_SERIAL_BYTES) {
        return Err(format!(
            "its serial is longer than {MAX_SERIAL_BYTES} bytes"
        ));
    }
    let lbs = match dv["logical_block_size"].as_u64() {
        None | Some(512) => 512,
        Some(4096) => 4096,
        Some(n) => return Err(format!("logical_block_size {n}")),
    };
    let writeback = match &dv["write-cache"] {
        Value::Null => None,
        Value::String(s) if s == "auto" => None,
        Value::String(s) => Some(s == "on"),
        Value::Bool(b) => Some(*b),
        v => return Err(format!("write-cache {v}")),
    };
    let mut spec = DriveSpec::parse(&format!("id={id},image=/x")).map_err(|e| e.0)?;
    spec.node = Some(c.node);
    spec.image = PathBuf::from(c.image);
    spec.format = c.format;
    spec.read_only = c.read_only;
    spec.direct = c.direct;
    spec.discard = c.discard;
    spec.queues = queues;
    spec.serial = serial;
    spec.logical_block_size = lbs;
    spec.writeback = writeback;
    if let Some(p) = policy(&dv, "werror")? {
        spec.werror = p;
    }
    if let Some(p) = policy(&dv, "rerror")? {
        spec.rerror = p;
    }
    spec.validate().map_err(|e| e.0)?;
    let mut out = Map::new();
    out.insert("driver".into(), json!("vhost-user-blk-pci"));
    out.insert("chardev".into(), json!(chardev_id(id)));
    for (k, v) in dev {
        if KEPT.contains(&k.as_str()) {
            out.insert(k.clone(), v.clone());
        }
    }
    out.insert("num-queues".into(), json!(queues));
    // virtio-blk-pci's rings have 256 entries unless libvirt says otherwise;
    // vhost-user-blk-pci's default is 128. The guest keeps its queue depth.
    if !out.contains_key("queue-size") {
        out.insert("queue-size".into(), json!(VIRTIO_BLK_QUEUE_SIZE));
    }
    Ok((spec, out))
}

/// The chardev of a drive's vhost-user socket (the VM contract's `DRIVE-sock`).
pub fn chardev_id(drive: &str) -> String {
    format!("{drive}-sock")
}
