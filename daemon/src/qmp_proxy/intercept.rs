//! The commands the proxy answers itself, or changes on their way, because they concern an
//! accelerated drive (which QEMU does not know as a block device): throttling by the device's
//! QOM path, `query-block` and `query-blockstats` entries as QEMU shows a virtio-blk drive,
//! and acceld's own exports and nodes hidden. Everything else goes to QEMU as it is.

use std::sync::Arc;

use accel_api::control::ThrottleLimits;
use accel_api::status::DriveStatus;
use serde_json::{json, Map, Value};

use super::forward;
use crate::supervisor::Supervisor;

pub struct Ctx {
    pub sup: Arc<Supervisor>,
    pub vm: String,
}

type Reply = Result<Value, (String, String)>;

fn generic(desc: impl Into<String>) -> (String, String) {
    ("GenericError".into(), desc.into())
}

/// The QOM path of a drive's device backend, as management names it
/// (`/machine/peripheral/ID/virtio-backend`).
fn qdev_path(d: &DriveStatus) -> String {
    format!(
        "/machine/peripheral/{}/virtio-backend",
        d.device.as_deref().unwrap_or(&d.drive)
    )
}

impl Ctx {
    fn drives(&self) -> Vec<DriveStatus> {
        self.sup
            .status()
            .vms
            .into_iter()
            .find(|v| v.vm == self.vm)
            .map(|v| v.drives)
            .unwrap_or_default()
    }
}

/// Names acceld gives its own objects in QEMU.
fn own_name(s: &str) -> bool {
    s.starts_with("accel-")
}

pub async fn command(ctx: &Ctx, name: &str, args: Option<Map<String, Value>>) -> Reply {
    match name {
        "block_set_io_throttle" => {
            let id = args
                .as_ref()
                .and_then(|a| a.get("id"))
                .and_then(Value::as_str);
            let d = id.and_then(|id| ctx.drives().into_iter().find(|d| qdev_path(d) == id));
            match d {
                Some(d) => throttle(ctx, &d, args.unwrap_or_default()).await,
                // Other names get QEMU's own answer (its texts and classes).
                None => forward(ctx, name, args).await,
            }
        }
        "query-block" => {
            let mut v = forward(ctx, name, args).await?;
            if let Some(list) = v.as_array_mut() {
                list.extend(ctx.drives().iter().map(block_info));
            }
            Ok(v)
        }
        "query-blockstats" => {
            let nodes = args
                .as_ref()
                .and_then(|a| a.get("query-nodes"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let mut v = forward(ctx, name, args).await?;
            if let Some(list) = v.as_array_mut() {
                if !nodes {
                    list.extend(ctx.drives().iter().map(block_stats));
                }
            }
            Ok(v)
        }
        "human-monitor-command" => {
            let word = args
                .as_ref()
                .and_then(|a| a.get("command-line"))
                .and_then(Value::as_str)
                .and_then(|l| l.split_whitespace().next());
            match word {
                // A VM snapshot covers every drive QEMU knows: the accelerated ones must be
                // in QEMU's block layer first, or they are silently left out.
                Some("savevm" | "loadvm" | "delvm") => {
                    let held = hold_all(ctx).await?;
                    let r = forward(ctx, name, args).await;
                    release(ctx, held).await;
                    r
                }
                _ => forward(ctx, name, args).await,
            }
        }
        "snapshot-save" | "snapshot-load" | "snapshot-delete" => {
            let job = args
                .as_ref()
                .and_then(|a| a.get("job-id"))
                .and_then(Value::as_str)
                .map(str::to_string);
            let held = hold_all(ctx).await?;
            let r = forward(ctx, name, args).await;
            match (&r, job) {
                // A job: the drives stay in QEMU until it ends.
                (Ok(_), Some(job)) => {
                    let ctx2 = Ctx {
                        sup: ctx.sup.clone(),
                        vm: ctx.vm.clone(),
                    };
                    tokio::spawn(async move {
                        wait_job(&ctx2, &job).await;
                        release(&ctx2, held).await;
                    });
                }
                _ => release(ctx, held).await,
            }
            r
        }
        "query-iothreads" => {
            let mut v = forward(ctx, name, args).await?;
            if let Some(list) = v.as_array_mut() {
                list.retain(|t| !t["id"].as_str().is_some_and(own_name));
            }
            Ok(v)
        }
        "qom-list" => {
            let objects = args
                .as_ref()
                .and_then(|a| a.get("path"))
                .and_then(Value::as_str)
                == Some("/objects");
            let mut v = forward(ctx, name, args).await?;
            if let (true, Some(list)) = (objects, v.as_array_mut()) {
                list.retain(|o| !o["name"].as_str().is_some_and(own_name));
            }
            Ok(v)
        }
        "query-block-exports" => {
            let mut v = forward(ctx, name, args).await?;
            if let Some(list) = v.as_array_mut() {
                list.retain(|e| !e["id"].as_str().is_some_and(own_name));
            }
            Ok(v)
        }
        "query-named-block-nodes" => {
            let mut v = forward(ctx, name, args).await?;
            if let Some(list) = v.as_array_mut() {
                list.retain(|n| !n["node-name"].as_str().is_some_and(own_name));
            }
            Ok(v)
        }
        _ => forward(ctx, name, args).await,
    }
}

/// Drives moved to QEMU's block layer for a VM-wide operation, with the pin each had.
type Held = Vec<(String, Option<policy::Pin>)>;

fn pin_of(p: Option<accel_api::status::PinKind>) -> Option<policy::Pin> {
    p.map(|p| match p {
        accel_api::status::PinKind::Qemu => policy::Pin::Qemu,
        accel_api::status::PinKind::Direct => policy::Pin::Direct,
    })
}

/// Puts every drive of the VM on the qemu engine (a temporary pin); fails, releasing what it
/// moved, if one cannot go.
async fn hold_all(ctx: &Ctx) -> Result<Held, (String, String)> {
    let mut held = Vec::new();
    for d in ctx.drives() {
        // Drives already on the qemu engine are pinned too: a pin keeps them there even if
        // what keeps them (a throttle, a job) ends during the operation.
        let prev = pin_of(d.pin);
        if prev == Some(policy::Pin::Qemu) {
            continue;
        }
        match ctx
            .sup
            .set_pin(&ctx.vm, &d.drive, Some(policy::Pin::Qemu), false)
            .await
        {
            Ok(s) if s.engine == accel_api::status::EngineKind::Qemu => {
                held.push((d.drive.clone(), prev))
            }
            r => {
                held.push((d.drive.clone(), prev));
                release(ctx, held).await;
                let why = r
                    .err()
                    .map_or("it stayed where it was".to_string(), |e| e.chain());
                return Err(generic(format!(
                    "acceld: cannot move drive '{}' to QEMU's block layer for the snapshot: {why}",
                    d.drive
                )));
            }
        }
    }
    Ok(held)
}

async fn release(ctx: &Ctx, held: Held) {
    for (drive, prev) in held {
        if let Err(e) = ctx.sup.set_pin(&ctx.vm, &drive, prev, false).await {
            tracing::warn!(vm = %ctx.vm, drive, "QMP proxy: cannot release the drive after the snapshot: {}", e.chain());
        }
    }
}

/// Waits until QEMU's job `id` has ended (concluded, or dismissed).
async fn wait_job(ctx: &Ctx, id: &str) {
    loop {
        let Ok(v) = forward(ctx, "query-jobs", None).await else {
            return;
        };
        let running =
            v.as_array().into_iter().flatten().any(|j| {
                j["id"] == id && !matches!(j["status"].as_str(), Some("concluded" | "null"))
            });
        if !running {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The six limits every `block_set_io_throttle` carries, in QEMU's order.
const REQUIRED: [&str; 6] = ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"];
/// The optional ones QEMU takes; acceld's throttle does not have them yet.
const OPTIONAL: [&str; 15] = [
    "bps_max",
    "bps_rd_max",
    "bps_wr_max",
    "iops_max",
    "iops_rd_max",
    "iops_wr_max",
    "bps_max_length",
    "bps_rd_max_length",
    "bps_wr_max_length",
    "iops_max_length",
    "iops_rd_max_length",
    "iops_wr_max_length",
    "iops_size",
    "group",
    "device",
];

/// QEMU's limit on every throttle value (`THROTTLE_VALUE_MAX`).
const THROTTLE_VALUE_MAX: i64 = 1_000_000_000_000_000;

/// Parses `block_set_io_throttle`'s arguments as QEMU does (its texts), into acceld's limits
/// (`None`: all zero, no throttle).
pub fn parse_throttle(a: &Map<String, Value>) -> Result<Option<ThrottleLimits>, (String, String)> {
    let mut v = [0i64; 6];
    for (i, k) in REQUIRED.iter().enumerate() {
        match a.get(*k) {
            None => return Err(generic(format!("Parameter '{k}' is missing"))),
            Some(x) => {
                v[i] = x.as_i64().ok_or_else(|| {
                    generic(format!(
                        "Invalid parameter type for '{k}', expected: integer"
                    ))
                })?
            }
        }
    }
    for k in a.keys() {
        if k == "id" || REQUIRED.contains(&k.as_str()) {
            continue;
        }
        if !OPTIONAL.contains(&k.as_str()) {
            return Err(generic(format!("Parameter '{k}' is unexpected")));
        }
        let set = match &a[k] {
            Value::Null => false,
            Value::Number(n) => n.as_i64() != Some(0),
            Value::String(_) => k != "device",
            _ => true,
        };
        if set {
            return Err(generic(format!(
                "acceld's QMP proxy: '{k}' is not supported on an accelerated drive yet"
            )));
        }
    }
    if v.iter().any(|&x| !(0..=THROTTLE_VALUE_MAX).contains(&x)) {
        return Err(generic(format!(
            "bps/iops/max values must be within [0, {THROTTLE_VALUE_MAX}]"
        )));
    }
    if v.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    let o = |x: i64| (x > 0).then_some(x as u64);
    Ok(Some(ThrottleLimits {
        bps_total: o(v[0]),
        bps_read: o(v[1]),
        bps_write: o(v[2]),
        iops_total: o(v[3]),
        iops_read: o(v[4]),
        iops_write: o(v[5]),
    }))
}

/// Throttling an accelerated drive: QEMU's throttle on the qemu engine (all-zero limits clear
/// it and the drive goes back to direct). Answers when the drive runs under the new limits.
async fn throttle(ctx: &Ctx, d: &DriveStatus, a: Map<String, Value>) -> Reply {
    let limits = parse_throttle(&a)?;
    if limits.is_none() && d.throttle.is_none() {
        return Ok(json!({}));
    }
    ctx.sup
        .set_throttle(&ctx.vm, &d.drive, limits)
        .await
        .map(|_| json!({}))
        .map_err(|e| generic(format!("acceld: {}", e.chain())))
}

/// The drive as QEMU's `query-block` shows a virtio-blk drive on the same node.
fn block_info(d: &DriveStatus) -> Value {
    let path = qdev_path(d);
    let spec = d.spec.clone();
    let (ro, direct) = spec
        .as_ref()
        .map_or((false, true), |s| (s.read_only, s.direct));
    let actual = std::fs::metadata(&d.image)
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .unwrap_or(0);
    let t = d.throttle.clone().unwrap_or_default();
    let n = |x: Option<u64>| x.unwrap_or(0);
    let mut inserted = json!({
        "iops_rd": n(t.iops_read), "detect_zeroes": "off", "active": true,
        "image": {"virtual-size": d.capacity_bytes, "filename": d.image, "format": d.format,
                  "actual-size": actual, "dirty-flag": false},
        "iops_wr": n(t.iops_write), "ro": ro, "node-name": d.drive, "backing_file_depth": 0,
        "drv": d.format, "iops": n(t.iops_total), "bps_wr": n(t.bps_write), "write_threshold": 0,
        "encrypted": false, "bps": n(t.bps_total), "bps_rd": n(t.bps_read),
        "cache": {"no-flush": false, "direct": direct, "writeback": d.writeback},
        "file": d.image,
    });
    if d.throttle.is_some() {
        // QEMU names a device's own throttle group after its QOM path.
        inserted["group"] = json!(path);
    }
    json!({"io-status": if d.io_status.is_empty() { "ok" } else { &d.io_status },
           "device": "", "locked": false, "removable": false, "inserted": inserted,
           "qdev": path, "type": "unknown"})
}

/// acceld's counters as QEMU's `BlockDeviceStats` (monotonic across engine switches).
fn block_stats(d: &DriveStatus) -> Value {
    let c = &d.io;
    let stats = json!({
        "unmap_operations": c.unmap_operations, "unmap_merged": 0,
        "failed_zone_append_operations": 0, "flush_total_time_ns": c.flush_total_time_ns,
        "wr_highest_offset": 0, "wr_total_time_ns": c.wr_total_time_ns,
        "failed_wr_operations": c.failed_wr_operations,
        "failed_rd_operations": c.failed_rd_operations, "wr_merged": 0, "wr_bytes": c.wr_bytes,
        "timed_stats": [], "failed_unmap_operations": c.failed_unmap_operations,
        "zone_append_merged": 0, "failed_flush_operations": c.failed_flush_operations,
        "account_invalid": true, "rd_total_time_ns": c.rd_total_time_ns,
        "invalid_unmap_operations": c.invalid_unmap_operations,
        "flush_operations": c.flush_operations, "wr_operations": c.wr_operations,
        "unmap_bytes": c.unmap_bytes, "rd_merged": 0, "rd_bytes": c.rd_bytes,
        "unmap_total_time_ns": c.unmap_total_time_ns,
        "invalid_flush_operations": c.invalid_flush_operations, "account_failed": true,
        "zone_append_total_time_ns": 0, "zone_append_operations": 0,
        "rd_operations": c.rd_operations, "zone_append_bytes": 0,
        "invalid_zone_append_operations": 0, "invalid_wr_operations": c.invalid_wr_operations,
        "invalid_rd_operations": c.invalid_rd_operations,
    });
    // A node's own stats (the parent, QEMU's file node) carry no accounting.
    let mut parent_stats = stats.clone();
    if let Some(o) = parent_stats.as_object_mut() {
        for (k, v) in o.iter_mut() {
            *v = match k.as_str() {
                "timed_stats" => json!([]),
                "account_invalid" | "account_failed" => json!(false),
                _ => json!(0),
            };
        }
    }
    json!({"device": "", "parent": {"stats": parent_stats, "node-name": format!("{}-file", d.drive),
           "driver-specific": {"discard-bytes-ok": 0, "discard-nb-ok": 0, "driver": "file",
                               "discard-nb-failed": 0}},
           "stats": stats, "node-name": d.drive, "qdev": qdev_path(d)})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("an object"),
        }
    }

    #[test]
    fn throttle_arguments_as_qemu_checks_them() {
        let base = json!({"id": "x", "bps": 0, "bps_rd": 0, "bps_wr": 0, "iops": 100,
                          "iops_rd": 0, "iops_wr": 0});
        let l = parse_throttle(&args(base.clone())).unwrap().unwrap();
        assert_eq!(l.iops_total, Some(100));
        assert_eq!(l.bps_total, None);
        let mut zero = base.clone();
        zero["iops"] = json!(0);
        assert_eq!(
            parse_throttle(&args(zero)).unwrap(),
            None,
            "all zero: no throttle"
        );
        let mut missing = base.clone();
        missing.as_object_mut().unwrap().remove("iops_rd");
        assert_eq!(
            parse_throttle(&args(missing)).unwrap_err().1,
            "Parameter 'iops_rd' is missing"
        );
        let mut typed = base.clone();
        typed["bps"] = json!("1");
        assert_eq!(
            parse_throttle(&args(typed)).unwrap_err().1,
            "Invalid parameter type for 'bps', expected: integer"
        );
        let mut extra = base.clone();
        extra["nope"] = json!(1);
        assert_eq!(
            parse_throttle(&args(extra)).unwrap_err().1,
            "Parameter 'nope' is unexpected"
        );
        let mut neg = base.clone();
        neg["bps"] = json!(-1);
        assert!(parse_throttle(&args(neg))
            .unwrap_err()
            .1
            .contains("must be within"));
        let mut max = base;
        max["iops_max"] = json!(0);
        assert!(
            parse_throttle(&args(max.clone())).is_ok(),
            "zero optional limits are fine"
        );
        max["iops_max"] = json!(5);
        assert!(parse_throttle(&args(max))
            .unwrap_err()
            .1
            .contains("not supported"));
    }
}
