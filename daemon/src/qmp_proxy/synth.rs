//! What QEMU would answer about an accelerated drive if it were a virtio-blk drive on the
//! same node (measured against QEMU 10.0.2 with such a drive): `query-block` and
//! `query-blockstats` entries, and HMP `info block` / `info blockstats` text. Pure: built from
//! acceld's status of the drive and, when the drive is on QEMU's block layer, QEMU's own
//! description of the node that holds the guest's data.

use accel_api::status::DriveStatus;
use serde_json::{json, Value};

/// The QOM path of a drive's device backend, as management names it
/// (`/machine/peripheral/ID/virtio-backend`).
pub fn qdev_path(d: &DriveStatus) -> String {
    format!(
        "/machine/peripheral/{}/virtio-backend",
        d.device.as_deref().unwrap_or(&d.drive)
    )
}

/// The drive's own QEMU node (an older acceld's status has none: the drive id).
pub fn node(d: &DriveStatus) -> &str {
    if d.node.is_empty() {
        &d.drive
    } else {
        &d.node
    }
}

/// The node's driver in QEMU: `raw` over a file node, or the file node itself.
fn node_driver(d: &DriveStatus) -> &str {
    if d.node_driver.is_empty() {
        &d.format
    } else {
        &d.node_driver
    }
}

/// The node holding the guest's data: an overlay or mirror target, or the drive's own.
pub fn data_node(d: &DriveStatus) -> &str {
    d.data_node.as_deref().unwrap_or_else(|| node(d))
}

/// The drive as QEMU's `query-block` shows a virtio-blk drive. `node`: QEMU's
/// `query-named-block-nodes` entry of the data node, when QEMU has it (the qemu engine);
/// without it (direct) the entry is made from acceld's record of the node and the image.
pub fn block_info(d: &DriveStatus, qemu_node: Option<&Value>) -> Value {
    let path = qdev_path(d);
    let t = d.throttle.clone().unwrap_or_default();
    let n = |x: Option<u64>| x.unwrap_or(0);
    let mut inserted = match qemu_node {
        Some(n) => n.clone(),
        None => {
            let (ro, direct) = d
                .spec
                .as_ref()
                .map_or((false, true), |s| (s.read_only, s.direct));
            let actual = std::fs::metadata(&d.image)
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                .unwrap_or(0);
            json!({
                "detect_zeroes": "off", "active": true,
                "image": {"virtual-size": d.capacity_bytes, "filename": d.image,
                          "format": node_driver(d), "actual-size": actual, "dirty-flag": false},
                "ro": ro, "node-name": node(d), "backing_file_depth": 0, "drv": node_driver(d),
                "write_threshold": 0, "encrypted": false,
                "cache": {"no-flush": false, "direct": direct, "writeback": d.writeback},
                "file": d.image,
            })
        }
    };
    // The limits are the device's (a BlockBackend's, in QEMU), never a node's.
    for (k, v) in [
        ("bps", t.bps_total),
        ("bps_rd", t.bps_read),
        ("bps_wr", t.bps_write),
        ("iops", t.iops_total),
        ("iops_rd", t.iops_read),
        ("iops_wr", t.iops_write),
    ] {
        inserted[k] = json!(n(v));
    }
    if let Some(o) = inserted.as_object_mut() {
        o.remove("group");
    }
    if let Some(g) = &d.throttle_group {
        // Management's group: the device stays a member with all-zero limits.
        inserted["group"] = json!(g);
    } else if d.throttle.is_some() {
        // QEMU names a device's own throttle group after its QOM path.
        inserted["group"] = json!(path);
    }
    // The write cache is the guest's (virtio's WCE), not the node's.
    inserted["cache"]["writeback"] = json!(d.writeback);
    json!({"io-status": d.io.status.as_str(),
           "device": "", "locked": false, "removable": false, "inserted": inserted,
           "qdev": path, "type": "unknown"})
}

/// `query-named-block-nodes` entries of a drive whose nodes QEMU does not have now (direct:
/// acceld removed them): the file node, and the raw node over it, as QEMU lists them. A node
/// has no I/O limits of its own (they are the device's).
pub fn node_infos(d: &DriveStatus) -> Vec<Value> {
    let mut own = block_info(d, None)["inserted"].take();
    for k in ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"] {
        own[k] = json!(0);
    }
    if let Some(o) = own.as_object_mut() {
        o.remove("group");
    }
    match d.file_node.as_deref() {
        None => {
            own["image"]["format-specific"] = json!({"type": node_driver_of_file(d), "data": {}});
            vec![own]
        }
        Some(f) => {
            let mut file = own.clone();
            file["node-name"] = json!(f);
            file["drv"] = json!(node_driver_of_file(d));
            file["image"]["format"] = json!(node_driver_of_file(d));
            file["image"]["format-specific"] = json!({"type": node_driver_of_file(d), "data": {}});
            vec![file, own]
        }
    }
}

fn zero_stats() -> Value {
    let mut s = serde_json::Map::new();
    for k in [
        "unmap_operations",
        "unmap_merged",
        "failed_zone_append_operations",
        "flush_total_time_ns",
        "wr_highest_offset",
        "wr_total_time_ns",
        "failed_wr_operations",
        "failed_rd_operations",
        "wr_merged",
        "wr_bytes",
        "failed_unmap_operations",
        "zone_append_merged",
        "failed_flush_operations",
        "rd_total_time_ns",
        "invalid_unmap_operations",
        "flush_operations",
        "wr_operations",
        "unmap_bytes",
        "rd_merged",
        "rd_bytes",
        "unmap_total_time_ns",
        "invalid_flush_operations",
        "zone_append_total_time_ns",
        "zone_append_operations",
        "rd_operations",
        "zone_append_bytes",
        "invalid_zone_append_operations",
        "invalid_wr_operations",
        "invalid_rd_operations",
    ] {
        s.insert(k.into(), json!(0));
    }
    s.insert("timed_stats".into(), json!([]));
    s.insert("account_invalid".into(), json!(false));
    s.insert("account_failed".into(), json!(false));
    Value::Object(s)
}

fn file_specific(d: &DriveStatus) -> Value {
    json!({"discard-bytes-ok": 0, "discard-nb-ok": 0, "driver": node_driver_of_file(d),
           "discard-nb-failed": 0})
}

/// The protocol layer's driver: the bare node's own, or `file` under a raw node.
fn node_driver_of_file(d: &DriveStatus) -> &str {
    match node_driver(d) {
        "host_device" => "host_device",
        _ => "file",
    }
}

/// The file node's stats entry (under a raw node); None when the node is the file itself.
fn file_node_stats(d: &DriveStatus) -> Option<Value> {
    let name = d.file_node.as_deref()?;
    Some(json!({"stats": zero_stats(), "node-name": name, "driver-specific": file_specific(d)}))
}

/// acceld's counters as QEMU's `BlockDeviceStats` (monotonic across engine switches).
pub fn block_stats(d: &DriveStatus) -> Value {
    let c = &d.io.counters;
    let mut stats = zero_stats();
    for (k, v) in [
        ("unmap_operations", c.unmap_operations),
        ("flush_total_time_ns", c.flush_total_time_ns),
        ("wr_total_time_ns", c.wr_total_time_ns),
        ("failed_wr_operations", c.failed_wr_operations),
        ("failed_rd_operations", c.failed_rd_operations),
        ("wr_bytes", c.wr_bytes),
        ("failed_unmap_operations", c.failed_unmap_operations),
        ("failed_flush_operations", c.failed_flush_operations),
        ("rd_total_time_ns", c.rd_total_time_ns),
        ("invalid_unmap_operations", c.invalid_unmap_operations),
        ("flush_operations", c.flush_operations),
        ("wr_operations", c.wr_operations),
        ("unmap_bytes", c.unmap_bytes),
        ("rd_bytes", c.rd_bytes),
        ("unmap_total_time_ns", c.unmap_total_time_ns),
        ("invalid_flush_operations", c.invalid_flush_operations),
        ("rd_operations", c.rd_operations),
        ("invalid_wr_operations", c.invalid_wr_operations),
        ("invalid_rd_operations", c.invalid_rd_operations),
    ] {
        stats[k] = json!(v);
    }
    // A device accounts invalid and failed requests (QEMU's defaults for -device).
    stats["account_invalid"] = json!(true);
    stats["account_failed"] = json!(true);
    let mut e = json!({"device": "", "stats": stats, "node-name": data_node(d),
                       "qdev": qdev_path(d)});
    match file_node_stats(d) {
        Some(f) => e["parent"] = f,
        None => e["driver-specific"] = file_specific(d),
    }
    e
}

/// `query-blockstats query-nodes=true` entries of a drive whose nodes QEMU does not have now
/// (direct): the format node over its file node, as QEMU lists them. A node's own stats
/// carry no accounting (acceld's counters are the device's).
pub fn node_stats(d: &DriveStatus) -> Vec<Value> {
    match file_node_stats(d) {
        Some(file) => vec![
            file.clone(),
            json!({"parent": file, "stats": zero_stats(), "node-name": node(d)}),
        ],
        None => vec![json!({"stats": zero_stats(), "node-name": node(d),
                            "driver-specific": file_specific(d)})],
    }
}

fn num(v: &Value, k: &str) -> i64 {
    v[k].as_i64().unwrap_or(0)
}

/// HMP `info block`'s paragraph of a `query-block` entry (QEMU's format, `\r\n` lines as
/// the monitor sends them).
pub fn hmp_block(info: &Value) -> String {
    let i = &info["inserted"];
    let mut s = format!(
        "{}: {} ({}{}{})\r\n",
        info["device"]
            .as_str()
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| i["node-name"].as_str().unwrap_or("")),
        i["file"].as_str().unwrap_or(""),
        i["drv"].as_str().unwrap_or(""),
        if i["ro"] == true { ", read-only" } else { "" },
        if i["encrypted"] == true {
            ", encrypted"
        } else {
            ""
        },
    );
    s += &format!(
        "    Attached to:      {}\r\n",
        info["qdev"].as_str().unwrap_or("")
    );
    if let Some(st) = info["io-status"].as_str().filter(|s| *s != "ok") {
        s += &format!("    I/O status:       {st}\r\n");
    }
    let c = &i["cache"];
    s += &format!(
        "    Cache mode:       {}{}{}\r\n",
        if c["writeback"] == true {
            "writeback"
        } else {
            "writethrough"
        },
        if c["direct"] == true { ", direct" } else { "" },
        if c["no-flush"] == true {
            ", ignore flushes"
        } else {
            ""
        },
    );
    if let Some(b) = i["backing_file"].as_str() {
        s += &format!(
            "    Backing file:     {b} (chain depth: {})\r\n",
            num(i, "backing_file_depth")
        );
    }
    if let Some(z) = i["detect_zeroes"].as_str().filter(|z| *z != "off") {
        s += &format!("    Detect zeroes:    {z}\r\n");
    }
    let limited = ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"]
        .iter()
        .any(|k| num(i, k) != 0);
    if limited {
        s += &format!(
            "    I/O throttling:   bps={} bps_rd={} bps_wr={} bps_max={} bps_rd_max={} bps_wr_max={} \
             iops={} iops_rd={} iops_wr={} iops_max={} iops_rd_max={} iops_wr_max={} iops_size={} group={}\r\n",
            num(i, "bps"), num(i, "bps_rd"), num(i, "bps_wr"), num(i, "bps_max"),
            num(i, "bps_rd_max"), num(i, "bps_wr_max"), num(i, "iops"), num(i, "iops_rd"),
            num(i, "iops_wr"), num(i, "iops_max"), num(i, "iops_rd_max"),
            num(i, "iops_wr_max"), num(i, "iops_size"), i["group"].as_str().unwrap_or(""),
        );
    }
    s
}

/// HMP `info blockstats`' line of a drive (QEMU prints the BlockBackend's name: empty for a
/// `-blockdev` drive).
pub fn hmp_blockstats(d: &DriveStatus) -> String {
    let c = &d.io.counters;
    format!(
        ": rd_bytes={} wr_bytes={} rd_operations={} wr_operations={} flush_operations={} \
         wr_total_time_ns={} rd_total_time_ns={} flush_total_time_ns={} rd_merged=0 wr_merged=0 idle_time_ns=0\r\n",
        c.rd_bytes, c.wr_bytes, c.rd_operations, c.wr_operations, c.flush_operations,
        c.wr_total_time_ns, c.rd_total_time_ns, c.flush_total_time_ns
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmp_block_as_qemu_prints_it() {
        // QEMU 10.0.2, a virtio-blk drive on node d0 with iops=100 (measured).
        let info = json!({"io-status": "ok", "device": "", "qdev": "/machine/peripheral/d0/virtio-backend",
            "inserted": {"node-name": "d0", "file": "/tmp/ref/ref.raw", "drv": "raw", "ro": false,
                         "encrypted": false, "detect_zeroes": "off", "iops": 100,
                         "group": "/machine/peripheral/d0/virtio-backend",
                         "cache": {"writeback": true, "direct": true, "no-flush": false}}});
        assert_eq!(
            hmp_block(&info),
            "d0: /tmp/ref/ref.raw (raw)\r\n    Attached to:      /machine/peripheral/d0/virtio-backend\r\n    \
             Cache mode:       writeback, direct\r\n    I/O throttling:   bps=0 bps_rd=0 bps_wr=0 bps_max=0 \
             bps_rd_max=0 bps_wr_max=0 iops=100 iops_rd=0 iops_wr=0 iops_max=0 iops_rd_max=0 iops_wr_max=0 \
             iops_size=0 group=/machine/peripheral/d0/virtio-backend\r\n"
        );
    }
}
