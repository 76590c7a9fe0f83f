//! The commands the proxy answers itself, or changes on their way, because they concern an
//! accelerated drive (which QEMU does not know as a block device):
//! - block commands naming a drive (its node, qdev id or QOM path, anywhere in the
//!   arguments): the drive is held on QEMU's block layer while QEMU runs the command, so its
//!   nodes exist; a job, overlay or export the command leaves keeps it there (the policy),
//!   and it goes back to direct when they are gone;
//! - VM snapshots: every drive is held first, so a snapshot never leaves one out;
//! - throttling by the device's QOM path (acceld's throttle);
//! - `query-block`, `query-blockstats` and HMP `info block` / `info blockstats`: entries as
//!   QEMU shows a virtio-blk drive;
//! - management's NBD server (`nbd`), and acceld's own exports, nodes, iothread and objects
//!   hidden.
//!
//! Everything else goes to QEMU as it is.

use std::future::Future;
use std::pin::Pin;

use accel_api::status::{DriveStatus, EngineKind};
use serde_json::{json, Map, Value};

use super::hold::{hold, release};
use super::state::Ctx;
use super::synth::{self, node, qdev_path};
use super::upstream::forward;
use super::{nbd, throttle};

use super::message::{QmpError, Reply};

/// Names acceld gives its own objects in QEMU.
fn own_name(s: &str) -> bool {
    s.starts_with("accel-")
}

fn arg<'a>(args: &'a Option<Map<String, Value>>, k: &str) -> Option<&'a Value> {
    args.as_ref().and_then(|a| a.get(k))
}

/// Commands outside the block prefixes that name block nodes.
const NODE_COMMANDS: &[&str] = &["transaction", "change-backing-file", "nbd-server-add"];
/// Block commands that do not hold a drive: jobs are named by job id (`block-job-*`), these
/// look nodes up only to read them or end acceld-unrelated objects.
const NOT_NODE_COMMANDS: &[&str] = &[
    "block-export-del",
    "block-latency-histogram-set",
    "blockdev-del",
];

/// Commands that name block nodes (or a device's backend) in their arguments.
fn names_nodes(cmd: &str) -> bool {
    let block = ["blockdev-", "block-", "block_", "drive-", "x-blockdev-"]
        .iter()
        .any(|p| cmd.starts_with(p))
        || NODE_COMMANDS.contains(&cmd);
    block && !cmd.starts_with("block-job-") && !NOT_NODE_COMMANDS.contains(&cmd)
}

/// Every accelerated drive a command's arguments name: the drive's node (or the node that
/// holds its data now), its file node, its qdev id or QOM path, as any string anywhere in
/// the arguments (`transaction` actions, `blockdev-add` children, bitmap lists).
fn named_drives(drives: &[DriveStatus], args: &Option<Map<String, Value>>) -> Vec<String> {
    fn walk(v: &Value, f: &mut dyn FnMut(&str)) {
        match v {
            Value::String(s) => f(s),
            Value::Array(l) => l.iter().for_each(|x| walk(x, f)),
            Value::Object(m) => m.values().for_each(|x| walk(x, f)),
            _ => {}
        }
    }
    let mut hit = Vec::new();
    if let Some(a) = args {
        for v in a.values() {
            walk(v, &mut |s| {
                for d in drives {
                    let named = s == node(d)
                        || d.file_node.as_deref() == Some(s)
                        || d.device.as_deref() == Some(s)
                        || d.data_node.as_deref() == Some(s)
                        || s == qdev_path(d);
                    if named && !hit.contains(&d.drive) {
                        hit.push(d.drive.clone());
                    }
                }
            });
        }
    }
    hit
}

/// A command's arguments, as the client sent them.
type Args = Option<Map<String, Value>>;
type Fut<'a> = Pin<Box<dyn Future<Output = Reply> + Send + 'a>>;
/// What the proxy does with one command instead of forwarding it as it is: called with the
/// command's name (QEMU's spelling) and arguments; answers as QEMU would.
type Handler = for<'a> fn(&'a Ctx, &'a str, Args) -> Fut<'a>;

/// A [`Handler`] from an async body over `ctx`, the command's `name` and its `args`.
macro_rules! handler {
    (|$ctx:ident, $name:ident, $args:ident| $body:expr) => {{
        fn h<'a>($ctx: &'a Ctx, $name: &'a str, $args: Args) -> Fut<'a> {
            Box::pin(async move { $body })
        }
        h as Handler
    }};
}

/// Every command the proxy intercepts, one handler each. A command not here that names
/// block nodes ([`names_nodes`]) is forwarded with the drives it names held on QEMU's block
/// layer; any other goes to QEMU as it is. Each name is one QEMU 10.0.2 knows (tested
/// against its `query-commands`).
const HANDLERS: &[(&str, Handler)] = &[
    (
        "block_set_io_throttle",
        handler!(|ctx, name, args| io_throttle(ctx, name, args).await),
    ),
    (
        "block_resize",
        handler!(|ctx, _name, args| resize(ctx, args).await),
    ),
    (
        "migrate-set-capabilities",
        handler!(|ctx, _name, args| migrate_caps(ctx, args).await),
    ),
    (
        "qom-set",
        handler!(|ctx, name, args| qom_set(ctx, name, args).await),
    ),
    (
        "nbd-server-start",
        handler!(|ctx, _name, args| nbd::start(ctx, args).await),
    ),
    (
        "nbd-server-stop",
        handler!(|ctx, _name, _args| nbd::stop(ctx).await),
    ),
    (
        "block-export-add",
        handler!(|ctx, name, args| export_add(ctx, name, args).await),
    ),
    (
        "nbd-server-add",
        handler!(|ctx, name, args| nbd_server_add(ctx, name, args).await),
    ),
    (
        "block-export-del",
        handler!(|ctx, name, args| export_del(ctx, name, args, "id").await),
    ),
    (
        "nbd-server-remove",
        handler!(|ctx, name, args| export_del(ctx, name, args, "name").await),
    ),
    (
        "query-block",
        handler!(|ctx, name, args| query_block(ctx, name, args).await),
    ),
    (
        "query-blockstats",
        handler!(|ctx, name, args| query_blockstats(ctx, name, args).await),
    ),
    (
        "human-monitor-command",
        handler!(|ctx, _name, args| hmp(ctx, args).await),
    ),
    (
        "device_add",
        handler!(|ctx, _name, args| super::hotplug::device_add(ctx, args).await),
    ),
    (
        "blockdev-add",
        handler!(|ctx, name, args| blockdev_add(ctx, name, args).await),
    ),
    (
        "blockdev-del",
        handler!(|ctx, name, args| blockdev_del(ctx, name, args).await),
    ),
    (
        "snapshot-save",
        handler!(|ctx, name, args| vm_snapshot(ctx, name, args).await),
    ),
    (
        "snapshot-load",
        handler!(|ctx, name, args| vm_snapshot(ctx, name, args).await),
    ),
    (
        "snapshot-delete",
        handler!(|ctx, name, args| vm_snapshot(ctx, name, args).await),
    ),
    (
        "query-yank",
        handler!(|ctx, name, args| query_yank(ctx, name, args).await),
    ),
    (
        "query-iothreads",
        handler!(|ctx, name, args| without_own(ctx, name, args, "id").await),
    ),
    (
        "query-block-exports",
        handler!(|ctx, name, args| without_own(ctx, name, args, "id").await),
    ),
    (
        "qom-list",
        handler!(|ctx, name, args| qom_list(ctx, name, args).await),
    ),
    (
        "query-named-block-nodes",
        handler!(|ctx, name, args| named_block_nodes(ctx, name, args).await),
    ),
];

/// The proxy's answer to a command of a management client. A command that may drain QEMU's
/// block nodes runs with the VM's drives off the relay ([`may_drain`]).
pub async fn command(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let relay = if may_drain(name, &args) {
        Some(hold(ctx, &[], name).await?)
    } else {
        None
    };
    let r = match HANDLERS.iter().find(|(n, _)| *n == name) {
        Some((_, h)) => h(ctx, name, args).await,
        None => unhandled(ctx, name, args).await,
    };
    if let Some(held) = relay {
        release(ctx, held).await;
    }
    r
}

/// Commands that may drain QEMU's block nodes: every block, export, NBD server, job and VM
/// snapshot command (a node or an export that goes drains its node, `nbd-server-stop` ends
/// every NBD export, a job's step drains its nodes), `transaction`, `object-del` (a throttle
/// group, an iothread), `device_del`, and HMP but its `info` commands. QEMU 10.0.2's
/// vhost-user-blk export aborts or hangs when its node is drained with requests in flight,
/// so these never meet a relayed drive (docs/qemu-engine.md).
fn may_drain(cmd: &str, args: &Args) -> bool {
    if cmd == "human-monitor-command" {
        let line = arg(args, "command-line")
            .and_then(Value::as_str)
            .unwrap_or_default();
        return !line.trim_start().starts_with("info");
    }
    const PREFIXES: &[&str] = &[
        "blockdev-",
        "block-",
        "block_",
        "drive-",
        "x-blockdev-",
        "nbd-",
        "job-",
        "snapshot-",
    ];
    const OTHERS: &[&str] = &[
        "transaction",
        "change-backing-file",
        "object-del",
        "device_del",
        "eject",
    ];
    names_nodes(cmd) || PREFIXES.iter().any(|p| cmd.starts_with(p)) || OTHERS.contains(&cmd)
}

/// A command without a handler (or one its handler leaves alone): forwarded, with the
/// drives it names held on QEMU's block layer if it names block nodes.
async fn unhandled(ctx: &Ctx, name: &str, args: Args) -> Reply {
    if names_nodes(name) {
        with_drives(ctx, name, args).await
    } else {
        forward(ctx, name, args).await
    }
}

/// `block_set_io_throttle` by an accelerated drive's QOM path: acceld's throttle.
async fn io_throttle(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let id = arg(&args, "id").and_then(Value::as_str);
    let d = id.and_then(|id| ctx.drives().into_iter().find(|d| qdev_path(d) == id));
    match d {
        Some(d) => set_throttle(ctx, &d, args.unwrap_or_default()).await,
        // Other names get QEMU's own answer (its texts and classes).
        None => forward(ctx, name, args).await,
    }
}

/// `qom-set`: a throttle group's `limits` concern the accelerated drives in the group.
async fn qom_set(ctx: &Ctx, name: &str, args: Args) -> Reply {
    if arg(&args, "property").and_then(Value::as_str) == Some("limits") {
        group_limits(ctx, args).await
    } else {
        unhandled(ctx, name, args).await
    }
}

/// `block-export-add`: an NBD export needs management's server (acceld's own one runs
/// apart); the export is remembered, so `nbd-server-stop` ends it as QEMU would.
async fn export_add(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let is_nbd = arg(&args, "type").and_then(Value::as_str) == Some("nbd");
    if is_nbd && !ctx.shared.nbd.running().await {
        // acceld's server runs, but management's does not.
        return Err(QmpError::generic("NBD server not running"));
    }
    let id = arg(&args, "id").and_then(Value::as_str).map(str::to_string);
    let r = with_drives(ctx, name, args).await;
    if let (Ok(_), true, Some(id)) = (&r, is_nbd, id) {
        ctx.shared.nbd.added(&id).await;
    }
    r
}

/// `nbd-server-add` (the legacy form): as `block-export-add` of an NBD export.
async fn nbd_server_add(ctx: &Ctx, name: &str, args: Args) -> Reply {
    if !ctx.shared.nbd.running().await {
        return Err(QmpError::generic("NBD server not running"));
    }
    let id = arg(&args, "name")
        .or_else(|| arg(&args, "device"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let r = with_drives(ctx, name, args).await;
    if let (Ok(_), Some(id)) = (&r, id) {
        ctx.shared.nbd.added(&id).await;
    }
    r
}

/// `block-export-del` / `nbd-server-remove` (the export named by `key`): acceld's own
/// exports do not exist for management.
async fn export_del(ctx: &Ctx, name: &str, args: Args, key: &str) -> Reply {
    let id = arg(&args, key).and_then(Value::as_str).map(str::to_string);
    if let Some(id) = id.as_deref().filter(|i| own_name(i)) {
        return Err(QmpError::generic(format!("Export '{id}' is not found")));
    }
    let r = forward(ctx, name, args).await;
    if let (Ok(_), Some(id)) = (&r, id) {
        ctx.shared.nbd.deleted(&id).await;
    }
    r
}

/// `query-block`: QEMU's list and the accelerated drives, as QEMU shows a virtio-blk drive.
async fn query_block(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let mut v = forward(ctx, name, args).await?;
    let extra = block_infos(ctx).await;
    if let Some(list) = v.as_array_mut() {
        list.extend(extra);
    }
    Ok(v)
}

/// `query-blockstats`: the accelerated drives' counters added (by device, or by node with
/// `query-nodes`), acceld's own nodes hidden.
async fn query_blockstats(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let nodes = arg(&args, "query-nodes").and_then(Value::as_bool) == Some(true);
    let mut v = forward(ctx, name, args).await?;
    if let Some(list) = v.as_array_mut() {
        if nodes {
            list.retain(|e| !e["node-name"].as_str().is_some_and(own_name));
            for d in ctx.drives() {
                if !list.iter().any(|e| e["node-name"] == node(&d)) {
                    list.extend(synth::node_stats(&d));
                }
            }
        } else {
            list.extend(ctx.drives().iter().map(synth::block_stats));
        }
    }
    Ok(v)
}

/// `blockdev-add`: a node over an accelerated drive holds it; every node added is
/// remembered for a `device_add` that may plug it (`hotplug`).
async fn blockdev_add(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let r = with_drives(ctx, name, args.clone()).await;
    if r.is_ok() {
        ctx.shared.plugged.added(&args);
    }
    r
}

async fn blockdev_del(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let r = forward(ctx, name, args.clone()).await;
    if r.is_ok() {
        ctx.shared.plugged.deleted(&args);
    }
    r
}

/// `snapshot-save` / `snapshot-load` / `snapshot-delete`: every drive held first, so the
/// snapshot covers them all; with a job, until the job ends.
async fn vm_snapshot(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let job = arg(&args, "job-id")
        .and_then(Value::as_str)
        .map(str::to_string);
    let held = hold_all(ctx, "the VM snapshot").await?;
    let r = forward(ctx, name, args).await;
    match (&r, job) {
        // A job: the drives stay in QEMU until it ends.
        (Ok(_), Some(job)) => {
            let ctx2 = ctx.again();
            tokio::spawn(async move {
                wait_job(&ctx2, &job).await;
                release(&ctx2, held).await;
            });
        }
        _ => release(ctx, held).await,
    }
    r
}

async fn query_yank(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let mut v = forward(ctx, name, args).await?;
    hide_own_yank(ctx, &mut v);
    Ok(v)
}

/// A list whose entries acceld made (`key` named `accel-…`) left out.
async fn without_own(ctx: &Ctx, name: &str, args: Args, key: &str) -> Reply {
    let mut v = forward(ctx, name, args).await?;
    if let Some(list) = v.as_array_mut() {
        list.retain(|e| !e[key].as_str().is_some_and(own_name));
    }
    Ok(v)
}

/// `qom-list` of `/objects`: acceld's objects left out.
async fn qom_list(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let objects = arg(&args, "path").and_then(Value::as_str) == Some("/objects");
    let mut v = forward(ctx, name, args).await?;
    if let (true, Some(list)) = (objects, v.as_array_mut()) {
        list.retain(|o| !o["name"].as_str().is_some_and(own_name));
    }
    Ok(v)
}

async fn named_block_nodes(ctx: &Ctx, name: &str, args: Args) -> Reply {
    let mut v = forward(ctx, name, args).await?;
    if let Some(list) = v.as_array_mut() {
        list.retain(|n| !n["node-name"].as_str().is_some_and(own_name));
        // A direct drive's nodes are gone from QEMU (docs/architecture.md): shown as
        // QEMU showed them, so management finds the node it named.
        for d in ctx.drives() {
            if !list.iter().any(|n| n["node-name"] == node(&d)) && d.data_node.is_none() {
                list.extend(synth::node_infos(&d));
            }
        }
    }
    Ok(v)
}

/// acceld's vhost-user sockets (`DRIVE-sock` chardevs of the VM contract) are not
/// management's to yank: a yank would cut the drive's connection.
pub fn hide_own_yank(ctx: &Ctx, v: &mut Value) {
    let own: Vec<String> = ctx
        .drives()
        .iter()
        .map(|d| format!("{}-sock", d.drive))
        .collect();
    if let Some(list) = v.as_array_mut() {
        list.retain(|y| {
            !(y["type"] == "chardev"
                && y["id"].as_str().is_some_and(|i| own.iter().any(|o| o == i)))
        });
    }
}

/// Forwards a block command with the drives it names held on QEMU's block layer.
async fn with_drives(ctx: &Ctx, name: &str, args: Option<Map<String, Value>>) -> Reply {
    // With no drive named, the hold still keeps the relay off: a transaction or a reopen
    // may drain every node.
    let drives = named_drives(&ctx.drives(), &args);
    let held = hold(ctx, &drives, name).await?;
    let r = forward(ctx, name, args).await;
    release(ctx, held).await;
    r
}

/// `block_resize` of an accelerated drive: held on QEMU's block layer, acceld's export off
/// the node while QEMU resizes it (QEMU's NBD export forbids resizing its node), then served
/// at the new size, which the guest is told (a config interrupt, as QEMU's own device gives).
async fn resize(ctx: &Ctx, args: Option<Map<String, Value>>) -> Reply {
    let name = "block_resize";
    let drives = named_drives(&ctx.drives(), &args);
    let [drive] = drives.as_slice() else {
        return forward(ctx, name, args).await;
    };
    let held = hold(ctx, &drives, name).await?;
    let r = ctx
        .sup
        .with_export_off(&ctx.vm, drive, Box::pin(forward(ctx, name, args)))
        .await;
    release(ctx, held).await;
    r.unwrap_or_else(|e| {
        Err(QmpError::generic(format!(
            "acceld: cannot resize drive '{drive}': {}",
            e.chain()
        )))
    })
}

async fn hold_all(ctx: &Ctx, why: &str) -> Result<super::hold::Held, QmpError> {
    let all: Vec<String> = ctx.drives().into_iter().map(|d| d.drive).collect();
    hold(ctx, &all, why).await
}

/// `query-block` entries of the VM's drives; QEMU's own description of the data node for a
/// drive on its block layer.
async fn block_infos(ctx: &Ctx) -> Vec<Value> {
    let drives = ctx.drives();
    let nodes = if drives.iter().any(|d| d.engine == EngineKind::Qemu) {
        forward(ctx, "query-named-block-nodes", None)
            .await
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    drives
        .iter()
        .map(|d| {
            let node = nodes.iter().find(|n| n["node-name"] == synth::data_node(d));
            synth::block_info(d, node.filter(|_| d.engine == EngineKind::Qemu))
        })
        .collect()
}

async fn hmp(ctx: &Ctx, args: Option<Map<String, Value>>) -> Reply {
    let line = arg(&args, "command-line")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        // A VM snapshot covers every drive QEMU knows: the accelerated ones must be in
        // QEMU's block layer first, or they are silently left out.
        ["savevm" | "loadvm" | "delvm", ..] => {
            let held = hold_all(ctx, "the VM snapshot").await?;
            let r = forward(ctx, "human-monitor-command", args).await;
            release(ctx, held).await;
            r
        }
        ["info", "block"] => {
            let v = forward(ctx, "human-monitor-command", args).await?;
            let mut text = v.as_str().unwrap_or("").to_string();
            for info in block_infos(ctx).await {
                if !text.is_empty() {
                    text += "\r\n";
                }
                text += &synth::hmp_block(&info);
            }
            Ok(json!(text))
        }
        ["info", "blockstats"] => {
            let v = forward(ctx, "human-monitor-command", args).await?;
            let mut text = v.as_str().unwrap_or("").to_string();
            for d in ctx.drives() {
                text += &synth::hmp_blockstats(&d);
            }
            Ok(json!(text))
        }
        _ => forward(ctx, "human-monitor-command", args).await,
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

/// Management's `pause-before-switchover`: when it turns it on, the pause is management's
/// (it continues the migration, after acceld's part: the proxy holds the event back until
/// then). When it turns it off while a drive is on QEMU's block layer, acceld keeps it on and
/// continues the migration itself (the drive's export must come off its node first).
async fn migrate_caps(ctx: &Ctx, args: Option<Map<String, Value>>) -> Reply {
    let pause = arg(&args, "capabilities")
        .and_then(Value::as_array)
        .and_then(|l| {
            l.iter()
                .find(|c| c["capability"] == "pause-before-switchover")
                .and_then(|c| c["state"].as_bool())
        });
    let Some(on) = pause else {
        return forward(ctx, "migrate-set-capabilities", args).await;
    };
    let any_qemu = ctx.drives().iter().any(|d| d.engine == EngineKind::Qemu);
    let mut args = args;
    if !on && any_qemu {
        if let Some(l) = args
            .as_mut()
            .and_then(|a| a.get_mut("capabilities"))
            .and_then(Value::as_array_mut)
        {
            for c in l.iter_mut() {
                if c["capability"] == "pause-before-switchover" {
                    c["state"] = json!(true);
                }
            }
        }
    }
    let r = forward(ctx, "migrate-set-capabilities", args).await;
    if r.is_ok() {
        ctx.sup.management_set_pause(&ctx.vm, on, any_qemu);
    }
    r
}

/// Throttling an accelerated drive: QEMU's throttle on the qemu engine (all-zero limits clear
/// it and the drive goes back to direct). Answers when the drive runs under the new limits.
async fn set_throttle(ctx: &Ctx, d: &DriveStatus, a: Map<String, Value>) -> Reply {
    let limits = throttle::parse(&a)?;
    let group = throttle::group(&a);
    if limits.is_none() && d.throttle.is_none() && d.throttle_group.is_none() {
        return Ok(json!({}));
    }
    // All zero ends the throttle and the membership of a group, as in QEMU.
    let leave = limits.is_none();
    ctx.sup
        .set_throttle_in_group(&ctx.vm, &d.drive, limits, group, leave)
        .await
        .map(|_| json!({}))
        .map_err(|e| QmpError::generic(format!("acceld: {}", e.chain())))
}

/// `qom-set` of a throttle group's `limits`: QEMU sets the object's limits (management's
/// `object-add`ed group, its other members included, and acceld's filter if it is in it),
/// then each acceld drive in the group takes them: all zero lets it go direct, still a
/// member. A group QEMU does not have (one made by `block_set_io_throttle group=`, while
/// the drive is direct) gets QEMU's answer, as in QEMU, where such groups are not objects.
async fn group_limits(ctx: &Ctx, args: Option<Map<String, Value>>) -> Reply {
    let path = arg(&args, "path")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let value = arg(&args, "value").cloned().unwrap_or(Value::Null);
    let mut members = Vec::new();
    for d in ctx.drives() {
        if d.throttle_group.as_deref() == Some(path.as_str()) {
            let limits = throttle::parse_group_limits(&value, d.throttle.as_ref())?;
            members.push((d.drive, limits));
        }
    }
    let r = forward(ctx, "qom-set", args).await?;
    for (drive, limits) in members {
        ctx.sup
            .set_throttle_in_group(&ctx.vm, &drive, limits, None, false)
            .await
            .map_err(|e| QmpError::generic(format!("acceld: {}", e.chain())))?;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drive(id: &str) -> DriveStatus {
        let mut d = DriveStatus {
            vm: "v".into(),
            drive: id.into(),
            device: Some(id.into()),
            socket: "/s".into(),
            image: "/i".into(),
            format: "raw".into(),
            engine: EngineKind::Direct,
            ..Default::default()
        };
        d.data_node = None;
        d.node = id.into();
        d.file_node = Some(format!("{id}-file"));
        d
    }

    /// QEMU 10.0.2's commands (`query-commands`, recorded).
    fn qemu_commands() -> Vec<&'static str> {
        include_str!("testdata/query-commands-qemu-10.0.2.txt")
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect()
    }

    /// A handler under a name QEMU does not have would never run (and the command would go
    /// to QEMU as it is): each is spelled as QEMU spells it, once.
    #[test]
    fn every_handler_is_for_a_qemu_command_and_there_is_one_each() {
        let known = qemu_commands();
        let mut seen = std::collections::HashSet::new();
        for (name, _) in HANDLERS {
            assert!(known.contains(name), "{name}: not a QEMU 10.0.2 command");
            assert!(seen.insert(*name), "{name}: two handlers");
        }
        for name in NODE_COMMANDS.iter().chain(NOT_NODE_COMMANDS) {
            assert!(known.contains(name), "{name}: not a QEMU 10.0.2 command");
        }
    }

    /// Which commands keep the relay off while QEMU runs them.
    #[test]
    fn commands_that_may_drain_nodes() {
        let known = qemu_commands();
        let hmp = |line: &str| Some(json!({"command-line": line}).as_object().cloned().unwrap());
        for (cmd, args, drains) in [
            ("nbd-server-stop", None, true),
            ("nbd-server-remove", None, true),
            ("block-export-del", None, true),
            ("blockdev-del", None, true),
            ("blockdev-add", None, true),
            ("block-job-complete", None, true),
            ("job-dismiss", None, true),
            ("snapshot-save", None, true),
            ("transaction", None, true),
            ("object-del", None, true),
            ("device_del", None, true),
            ("human-monitor-command", hmp("savevm s1"), true),
            ("human-monitor-command", hmp("  info block"), false),
            ("query-block", None, false),
            ("query-blockstats", None, false),
            ("query-named-block-nodes", None, false),
            ("qom-get", None, false),
            ("qom-set", None, false),
            ("stop", None, false),
            ("cont", None, false),
            ("device_add", None, false),
        ] {
            assert!(known.contains(&cmd), "{cmd}: a QEMU command");
            assert_eq!(may_drain(cmd, &args), drains, "{cmd} {args:?}");
        }
        // Every command that holds the drives it names also keeps the relay off.
        for c in known.iter().filter(|c| names_nodes(c)) {
            assert!(may_drain(c, &None), "{c}");
        }
    }

    /// Which of QEMU's commands hold the drives they name.
    #[test]
    fn block_commands_that_name_nodes() {
        let known = qemu_commands();
        let holding: Vec<&str> = known.iter().copied().filter(|c| names_nodes(c)).collect();
        for c in [
            "blockdev-mirror",
            "blockdev-backup",
            "blockdev-snapshot",
            "blockdev-snapshot-sync",
            "blockdev-reopen",
            "block-commit",
            "block-stream",
            "block-dirty-bitmap-add",
            "block-export-add",
            "block_resize",
            "block_set_io_throttle",
            "drive-mirror",
            "drive-backup",
            "transaction",
            "change-backing-file",
            "nbd-server-add",
        ] {
            assert!(holding.contains(&c), "{c} holds the drives it names");
        }
        for c in [
            "block-job-cancel",
            "block-job-complete",
            "block-job-pause",
            "blockdev-del",
            "block-export-del",
            "block-latency-histogram-set",
            "query-block",
            "device_add",
            "qom-set",
            "job-complete",
        ] {
            assert!(known.contains(&c), "{c}: a QEMU command");
            assert!(!holding.contains(&c), "{c} does not hold a drive");
        }
    }

    fn args(v: Value) -> Option<Map<String, Value>> {
        match v {
            Value::Object(m) => Some(m),
            _ => None,
        }
    }

    #[test]
    fn drives_named_anywhere_in_a_command() {
        let ds = [drive("d0"), drive("d1")];
        let n = |v: Value| named_drives(&ds, &args(v));
        assert_eq!(n(json!({"node-name": "d0", "snapshot-file": "/x"})), ["d0"]);
        assert_eq!(
            n(
                json!({"actions": [{"type": "blockdev-snapshot", "data": {"node": "d1", "overlay": "o"}},
                                 {"type": "blockdev-backup", "data": {"device": "d0-file"}}]})
            ),
            ["d1", "d0"]
        );
        assert_eq!(
            n(json!({"id": "/machine/peripheral/d1/virtio-backend"})),
            ["d1"]
        );
        assert!(n(json!({"node-name": "d00", "x": "/d0"})).is_empty());
        assert!(names_nodes("blockdev-mirror") && names_nodes("transaction"));
        assert!(names_nodes("block-commit") && names_nodes("drive-backup"));
        assert!(!names_nodes("block-job-cancel") && !names_nodes("query-block"));
        assert!(!names_nodes("job-dismiss") && !names_nodes("blockdev-del"));
    }
}
