//! What QEMU says, read once per reconcile round, and the policy's view and decision of a
//! drive with acceld's own export and throttle filter taken out.

use policy::{Decision, DriveView, NodeView, Parent, Reason};
use qmp_client::commands::{
    BlockExportInfo, QueryBlock, QueryBlockExports, QueryMigrate, QueryNamedBlockNodes,
    QueryStatus, XDebugQueryBlockGraph,
};
use qmp_client::Qmp;
use serde_json::Value;

use super::drive_state::ManagedDrive;
use super::qemu_graph::{export_id, filter_node, lend_export_id, relay_export_id};
use super::{qmp_run, SupError};
use accel_dataplane::util::lock;

pub(super) struct QemuSnapshot {
    pub nodes: Vec<NodeView>,
    pub graph: Option<policy::qemu::BlockGraph>,
    pub throttled: Vec<String>,
    pub vm: policy::VmState,
    pub exports: Vec<BlockExportInfo>,
}

impl QemuSnapshot {
    /// acceld's export of the drive exists.
    pub fn has_export(&self, drive: &str) -> bool {
        self.exports.iter().any(|e| e.id == export_id(drive))
    }

    /// A block job runs on one of the VM's nodes (as far as the block graph shows).
    pub fn has_block_job(&self) -> bool {
        self.graph
            .as_ref()
            .is_some_and(|g| g.nodes.iter().any(|(_, t, _)| t == "block-job"))
    }
}

pub(super) async fn snapshot(qmp: &Qmp) -> Result<QemuSnapshot, SupError> {
    let nodes_v = qmp_run(qmp, &QueryNamedBlockNodes::default()).await?;
    let nodes = policy::qemu::parse_nodes(&Value::Array(nodes_v))
        .map_err(|e| SupError::Parse(e.to_string()))?;
    // The graph is an unstable command: without it the policy sees fewer parents.
    let graph = match qmp_run(qmp, &XDebugQueryBlockGraph).await {
        Ok(g) => policy::qemu::parse_graph(&g).ok(),
        Err(_) => None,
    };
    let qb = qmp_run(qmp, &QueryBlock).await?;
    let throttled = policy::qemu::throttled_nodes(&Value::Array(qb));
    let status = qmp_run(qmp, &QueryStatus).await?;
    let status = serde_json::to_value(&status).map_err(|e| SupError::Parse(e.to_string()))?;
    let migrate = qmp_run(qmp, &QueryMigrate).await.ok();
    let vm = policy::qemu::vm_state(&status, migrate.as_ref());
    let exports = qmp_run(qmp, &QueryBlockExports).await?;
    Ok(QemuSnapshot {
        nodes,
        graph,
        throttled,
        vm,
        exports,
    })
}

/// The policy's view of a drive, with acceld's own export and throttle filter taken out of
/// the parents, and the recorded nodes standing in for removed ones.
pub(super) fn view(d: &ManagedDrive, snap: &QemuSnapshot) -> DriveView {
    if let Some(n) = served_node(d.id(), snap) {
        let mut g = lock(&d.graph);
        let mut data = (n != d.node()).then_some(n);
        // A pivot (blockcopy, `blockdev-mirror` + `job-complete`): QEMU moved the device and
        // acceld's export onto the job's target, and management removed the drive's old
        // node. The drive follows: the target is its node from now on, judged by the policy
        // as any other (direct again if it is a raw file QEMU's user may open).
        let gone = !snap.nodes.iter().any(|x| x.name == d.node());
        if let (Some(to), true, false) = (&data, gone, g.nodes_removed) {
            if let Some(n) = d.log.admit() {
                tracing::info!(drive = d.id(), from = %d.node(), to = %to, "the drive's node is now QEMU's pivot target{}", accel_dataplane::util::suppressed(n));
            }
            d.set_node(to.clone());
            g.recorded = None;
            data = None;
        }
        if g.data_node != data {
            // Management's graph changes cause these: budgeted with the drive's other lines.
            if let Some(n) = d.log.admit() {
                tracing::info!(drive = d.id(), from = ?g.data_node, to = ?data, "the guest's data moved to another QEMU node{}", accel_dataplane::util::suppressed(n));
            }
            g.data_node = data;
        }
    }
    let ctx = policy::qemu::DriveContext {
        vm: snap.vm.clone(),
        memory_shared: true,
        pin: lock(&d.intent).pin,
        options: policy::RecordedOptions {
            discard: d.spec.discard.as_str().into(),
            logical_block_size: d.spec.logical_block_size,
            queues: d.spec.queues,
            serial: d.spec.serial.clone(),
        },
        throttled: snap.throttled.clone(),
    };
    let id = d.id();
    let node = d.node();
    let node = node.as_str();
    let present = snap.nodes.iter().any(|n| n.name == node);
    {
        let g = lock(&d.graph);
        if let (false, true, Some(rec)) = (present, g.nodes_removed, &g.recorded) {
            return DriveView {
                drive: node.to_string(),
                node: Some(rec.node.clone()),
                protocol: rec.protocol.clone(),
                parents: Vec::new(),
                other_children: Vec::new(),
                vm: ctx.vm.clone(),
                memory_shared: true,
                pin: ctx.pin,
                options: ctx.options,
            };
        }
    }
    let mut v = policy::qemu::drive_view(node, &snap.nodes, snap.graph.as_ref(), &ctx);
    // Our own users of the node are not reasons: the NBD export, and the vhost-user-blk
    // export a `lend=on` drive's rings are lent to.
    let ours = snap
        .exports
        .iter()
        .filter(|e| {
            (e.id == export_id(id) || e.id == lend_export_id(id) || e.id == relay_export_id(id))
                && e.node_name == node
        })
        .count();
    for _ in 0..ours {
        if let Some(i) = v
            .parents
            .iter()
            .position(|p| matches!(p, Parent::Backend(_)))
        {
            v.parents.remove(i);
        }
    }
    if snap.nodes.iter().any(|n| n.name == filter_node(id)) {
        if let Some(i) = v
            .parents
            .iter()
            .position(|p| matches!(p, Parent::Filter(f) if f == "throttle"))
        {
            v.parents.remove(i);
        }
    }
    v
}

/// The node under acceld's export (below its throttle filter), if the export exists and the
/// graph says.
fn served_node(id: &str, snap: &QemuSnapshot) -> Option<String> {
    let e = snap.exports.iter().find(|e| e.id == export_id(id))?;
    if e.node_name != filter_node(id) {
        return Some(e.node_name.clone());
    }
    let g = snap.graph.as_ref()?;
    let f = g
        .nodes
        .iter()
        .find(|(_, t, n)| t == "block-driver" && *n == e.node_name)?
        .0;
    let child = g.edges.iter().find(|(p, _, n)| *p == f && n == "file")?.1;
    g.nodes
        .iter()
        .find(|(i, _, _)| *i == child)
        .map(|(_, _, n)| n.clone())
}

/// The policy's decision, with an operator's throttle and a moved data node as more reasons
/// for QEMU.
pub(super) fn decide(d: &ManagedDrive, view: &DriveView) -> Decision {
    let mut extra = Vec::new();
    if lock(&d.intent).throttle.is_some() {
        extra.push(Reason::Throttle);
    }
    if let Some(n) = lock(&d.graph).data_node.clone() {
        extra.push(Reason::NodeInUse(format!(
            "node '{n}', which holds the guest's data now (an external snapshot or a mirror's pivot)"
        )));
    }
    let dec = policy::decide(view);
    if extra.is_empty() {
        return dec;
    }
    match dec {
        Decision::Accelerate(_) => Decision::Qemu(extra),
        Decision::Qemu(mut r) => {
            for x in extra {
                if !r.contains(&x) {
                    r.push(x);
                }
            }
            Decision::Qemu(r)
        }
    }
}
