//! Disk hot-plug through the proxy, as libvirt (`virsh attach-disk --live`,
//! `attach-device`) and Proxmox send it: `blockdev-add` of the nodes, then `device_add
//! driver=virtio-blk-pci drive=NODE id=ID …`. The proxy keeps the options of every node
//! `blockdev-add` made through it; a `device_add` of a virtio-blk-pci device on such a node
//! becomes acceld's drive (served on its socket, opened as QEMU's user could), a chardev on
//! that socket and a `vhost-user-blk-pci` device with the same id, bus, address and queues,
//! exactly as the emulator wrapper converts a disk of the command line
//! ([`accel_api::convert`]). The guest sees a virtio disk with the requested serial; the
//! answer is QEMU's own. A device acceld cannot serve (an option vhost-user-blk has no
//! equivalent for, a node the proxy did not see made, an image QEMU's user cannot open)
//! goes to QEMU as it came: a plain virtio-blk-pci disk, as without acceld.
//!
//! `device_del` goes to QEMU as it is; the `DEVICE_DELETED` event of a drive's device is held
//! back from management until the drive has ended and QEMU has its nodes back (see
//! [`crate::supervisor::Supervisor::unplug`]), so that management's `blockdev-del` that
//! follows finds them, as on a plain VM.

use serde_json::{json, Map, Value};
use tracing::{info, warn};

use super::state::Ctx;
use super::upstream::{forward, upstream, Via};
use accel_dataplane::util::suppressed;

use super::message::Reply;

/// `device_add`: a virtio-blk-pci disk on a node management added becomes acceld's.
pub async fn device_add(ctx: &Ctx, args: Option<Map<String, Value>>) -> Reply {
    let Some(dev) = args.as_ref() else {
        return forward(ctx, "device_add", args).await;
    };
    let virtio_blk = dev.get("driver").and_then(Value::as_str) == Some("virtio-blk-pci");
    let node = dev.get("drive").and_then(Value::as_str);
    let (true, Some(node)) = (virtio_blk, node) else {
        return forward(ctx, "device_add", args).await;
    };
    let id = dev.get("id").and_then(Value::as_str).unwrap_or("?");
    let plain = |why: String| {
        if let Some(n) = ctx.shared.log.admit() {
            info!(vm = %ctx.vm, device = id, "hot-plugged disk stays a virtio-blk-pci device: {why}{}", suppressed(n));
        }
    };
    let nodes = ctx.shared.plugged.all();
    if !nodes.contains_key(node) {
        plain(format!(
            "its node {node} was not added through acceld's QMP proxy"
        ));
        return forward(ctx, "device_add", args).await;
    }
    // Without num-queues QEMU gives a virtio-blk-pci device one queue per vCPU.
    let cpus = match forward(ctx, "query-cpus-fast", None).await {
        Ok(Value::Array(l)) => l.len() as u64,
        _ => 1,
    };
    let (mut spec, vdev) = match accel_api::convert::convert_device(dev, &nodes, cpus) {
        Ok(c) => c,
        Err(why) => {
            plain(why);
            return forward(ctx, "device_add", args).await;
        }
    };
    // The VM's drives lend their rings, or none do (the wrapper's `lend` is per host).
    spec.lend = ctx.sup.vm_lends(&ctx.vm);
    let drive = spec.id.clone();
    let socket = match ctx.sup.plug(&ctx.vm, spec).await {
        Ok(s) => s,
        Err(e) => {
            if let Some(n) = ctx.shared.log.admit() {
                warn!(vm = %ctx.vm, device = id, "hot-plugged disk stays a virtio-blk-pci device: acceld cannot serve it: {}{}", e.chain(), suppressed(n));
            }
            return forward(ctx, "device_add", args).await;
        }
    };
    let chardev = accel_api::convert::chardev_id(&drive);
    let backend = json!({"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": socket.to_string_lossy()}},
        "server": false,
        "reconnect-ms": 1000,
    }});
    let ch = Map::from_iter([
        ("id".to_string(), json!(chardev)),
        ("backend".to_string(), backend),
    ]);
    if let Err(super::message::QmpError { desc, .. }) =
        upstream(ctx, "chardev-add", Some(ch), Via::InBand).await
    {
        if let Some(n) = ctx.shared.log.admit() {
            warn!(vm = %ctx.vm, device = id, "hot-plugged disk stays a virtio-blk-pci device: chardev-add: {desc}{}", suppressed(n));
        }
        ctx.sup.plugged(&ctx.vm, &drive, None).await;
        return forward(ctx, "device_add", args).await;
    }
    match forward(ctx, "device_add", Some(vdev)).await {
        Ok(v) => {
            info!(vm = %ctx.vm, device = id, node, "hot-plugged virtio-blk-pci disk -> vhost-user-blk-pci served by acceld");
            ctx.sup.plugged(&ctx.vm, &drive, Some(&drive)).await;
            Ok(v)
        }
        Err(super::message::QmpError { desc, .. }) => {
            // QEMU refused the device (a bus without hot-plug, a taken address): the
            // device asked for gets QEMU's own answer, whatever it is.
            if let Some(n) = ctx.shared.log.admit() {
                info!(vm = %ctx.vm, device = id, "QEMU refused the vhost-user-blk-pci device ({desc}); the virtio-blk-pci device goes to QEMU as asked{}", suppressed(n));
            }
            let rm = Map::from_iter([("id".to_string(), json!(chardev))]);
            let _ = forward(ctx, "chardev-remove", Some(rm)).await;
            ctx.sup.plugged(&ctx.vm, &drive, None).await;
            forward(ctx, "device_add", args).await
        }
    }
}
