//! The typed QMP steps acceld performs on a VM's block graph: remove and re-create a drive's
//! nodes, the throttle group and filter, the NBD server and acceld's export of the drive.

use std::path::Path;
use std::time::{Duration, Instant};

use accel_api::control::ThrottleLimits;
use policy::NodeView;
use qmp_client::commands::{
    BlockExportAdd, BlockExportDel, BlockdevAdd, BlockdevDel, BlockdevSetActive, NbdServerStart,
    ObjectAdd, ObjectDel, QomList, QomSet, QueryBlockExports, QueryNamedBlockNodes,
};
use qmp_client::Qmp;
use serde_json::json;
use tracing::{debug, warn};

use super::offload;

use super::drive_state::{ManagedDrive, Recorded};
use super::vm::Vm;
use super::{qmp_run, SupError, Supervisor};
use accel_dataplane::engine::nbd;
use accel_dataplane::util::lock;

pub(super) fn export_id(drive: &str) -> String {
    format!("accel-{drive}")
}
/// QEMU's vhost-user-blk export of the drive's node that its rings are lent to (`lend=on`).
pub(super) fn lend_export_id(drive: &str) -> String {
    format!("accel-lend-{drive}")
}
/// Where that export listens: beside QEMU's NBD server socket, in the VM's run directory.
pub(super) fn lend_socket(nbd_socket: &Path, drive: &str) -> std::path::PathBuf {
    nbd_socket.with_file_name(format!("lend-{drive}.sock"))
}
/// QEMU's vhost-user-blk export of the drive's node that acceld relays requests through
/// (the default; `nbd=on` turns it off), with rings of acceld's own.
pub(super) fn relay_export_id(drive: &str) -> String {
    format!("accel-relay-{drive}")
}
/// Where that export listens: in the VM's run directory, as the lend export.
pub(super) fn relay_socket(nbd_socket: &Path, drive: &str) -> std::path::PathBuf {
    nbd_socket.with_file_name(format!("relay-{drive}.sock"))
}
pub(super) fn filter_node(drive: &str) -> String {
    format!("accel-throttle-{drive}")
}
pub(super) fn group_id(drive: &str) -> String {
    format!("accel-tg-{drive}")
}

/// QEMU's `limits` object for a throttle group; absent limits are 0 (unlimited).
fn limits_value(l: &ThrottleLimits) -> serde_json::Value {
    serde_json::to_value(l).expect("limits serialize")
}

/// Sets the limits of the drive's throttle group (no switch).
pub(super) async fn set_limits(
    qmp: &Qmp,
    d: &ManagedDrive,
    limits: &ThrottleLimits,
) -> Result<(), SupError> {
    qmp_run(
        qmp,
        &QomSet {
            path: d.applied_group(),
            property: "limits".into(),
            value: limits_value(limits),
        },
    )
    .await
    .map(|_| ())
}

/// Lifts every limit of the drive's group (before a drain: the throttle would hold it up).
/// Not management's own group: other devices may share it.
pub(super) async fn lift_limits(qmp: &Qmp, d: &ManagedDrive) {
    if lock(&d.graph).group_external {
        return;
    }
    let drive = d.id();
    let unlimited = json!({"iops-total": 0, "iops-read": 0, "iops-write": 0,
                           "bps-total": 0, "bps-read": 0, "bps-write": 0});
    let r = qmp_run(
        qmp,
        &QomSet {
            path: d.applied_group(),
            property: "limits".into(),
            value: unlimited,
        },
    )
    .await;
    if let Err(e) = r {
        debug!(
            drive,
            "cannot lift the limits before the switch: {}",
            e.chain()
        );
    }
}

/// Deletes export `id` (hard: its clients are cut) if it exists, and waits until QEMU has.
async fn remove_export(qmp: &Qmp, id: &str) -> Result<(), SupError> {
    if !has_export(qmp, id).await? {
        return Ok(());
    }
    qmp_run(
        qmp,
        &BlockExportDel {
            id: id.to_string(),
            mode: Some("hard".into()),
        },
    )
    .await?;
    let t0 = Instant::now();
    while has_export(qmp, id).await? {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(SupError::QemuState(format!(
                "remove export {id} within 10 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

async fn has_export(qmp: &Qmp, id: &str) -> Result<bool, SupError> {
    let ex = qmp_run(qmp, &QueryBlockExports).await?;
    Ok(ex.iter().any(|e| e.id == id))
}

impl Supervisor {
    /// Puts the drive's top node (its throttle filter when throttled) behind acceld's NBD
    /// export; returns the export's name. The nodes must exist.
    pub(super) async fn qemu_up(
        &self,
        d: &ManagedDrive,
        qmp: &Qmp,
        nbd_socket: &Path,
        throttle: Option<&ThrottleLimits>,
        after_incoming: bool,
    ) -> Result<String, SupError> {
        let id = d.id();
        let node = d.node();
        if after_incoming {
            // The destination of a completed migration, still paused: its nodes stay
            // inactive until `cont`, and no active node (filter, export) may sit on an
            // inactive one. The source gave the image up, so activate the drive's node now.
            let nodes = qmp_run(qmp, &QueryNamedBlockNodes::default()).await?;
            let inactive = nodes
                .iter()
                .any(|n| n["node-name"].as_str() == Some(node.as_str()) && n["active"] == false);
            if inactive {
                qmp_run(
                    qmp,
                    &BlockdevSetActive {
                        node_name: Some(node.to_string()),
                        active: true,
                    },
                )
                .await?;
            }
        }
        // The guest's data: the drive's node, or what QEMU moved the export onto (an
        // overlay, a mirror's target) before this re-creation.
        let data = lock(&d.graph)
            .data_node
            .clone()
            .unwrap_or_else(|| node.to_string());
        let top = match throttle {
            Some(l) => {
                let group = d.group();
                let objs = qmp_run(
                    qmp,
                    &QomList {
                        path: "/objects".into(),
                    },
                )
                .await?;
                // Management's own group (object-add): join it with these limits, as
                // block_set_io_throttle does; otherwise acceld makes the group.
                let external = objs.iter().any(|o| o.name == group);
                {
                    let mut g = lock(&d.graph);
                    g.group_external = external;
                    g.applied_group = Some(group.clone());
                }
                if external {
                    set_limits(qmp, d, l).await?;
                } else {
                    qmp_run(qmp, &ObjectAdd::throttle_group(&group, &limits_value(l))).await?;
                }
                let r = qmp_run(
                    qmp,
                    &BlockdevAdd(json!({"driver": "throttle", "node-name": filter_node(id),
                                        "throttle-group": group, "file": data})),
                )
                .await;
                if let Err(e) = r {
                    if !external {
                        let _ = qmp_run(qmp, &ObjectDel { id: group }).await;
                    }
                    return Err(e);
                }
                filter_node(id)
            }
            None => data,
        };
        self.start_nbd_server(qmp, nbd_socket).await?;
        qmp_run(
            qmp,
            &BlockExportAdd::nbd(
                &export_id(id),
                &top,
                !d.spec.read_only,
                Some(self.cfg.iothread.as_str()),
            )
            // Fixed: QEMU 10.0.2 asserts in bdrv_insert_node (a backup's or a stream's filter)
            // when the node under a movable export follows the new filter into the main
            // loop; with the export fixed, the filter joins the iothread instead.
            .fixed_iothread()
            // Named like the export, not like the node: management's own export of the
            // node (named after it by default) must not collide with acceld's.
            .nbd_named(&export_id(id)),
        )
        .await?;
        if d.spec.lend {
            self.lend_up(d, qmp, nbd_socket, &top).await;
        }
        if d.spec.relays() {
            self.relay_up(d, qmp, nbd_socket, &top).await;
        }
        Ok(export_id(id))
    }

    /// QEMU's vhost-user-blk export of `top` (the node under acceld's NBD export) for the
    /// relay. Found again after an acceld restart (a new session is accepted only once the
    /// last one drained). Without it the drive is served over NBD, and the failure is logged.
    async fn relay_up(&self, d: &ManagedDrive, qmp: &Qmp, nbd_socket: &Path, top: &str) {
        let id = d.id();
        let sock = relay_socket(nbd_socket, id);
        match self
            .vhost_user_export(d, qmp, &relay_export_id(id), &sock, top)
            .await
        {
            Ok(()) => lock(&d.graph).relay_socket = Some(sock),
            Err(e) => {
                if let Some(n) = d.log.admit() {
                    warn!(drive = %id, "no vhost-user-blk export to relay through; the qemu engine serves over NBD: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
                }
            }
        }
    }

    /// QEMU's vhost-user-blk export `export` of `top` listening on `sock`, or acceld's own
    /// from before a restart; in acceld's iothread and fixed there (the lend's take-back and
    /// the relay's drain wait for the export's requests while QEMU's main loop may be blocked
    /// on acceld).
    async fn vhost_user_export(
        &self,
        d: &ManagedDrive,
        qmp: &Qmp,
        export: &str,
        sock: &Path,
        top: &str,
    ) -> Result<(), SupError> {
        if has_export(qmp, export).await? {
            return Ok(());
        }
        let _ = std::fs::remove_file(sock);
        let add = BlockExportAdd::vhost_user_blk(
            export,
            top,
            &sock.to_string_lossy(),
            !d.spec.read_only,
            d.drive.config().num_queues,
        )
        .logical_block_size(d.drive.config().logical_block_size)
        .in_iothread(&self.cfg.iothread)
        .fixed_iothread();
        qmp_run(qmp, &add).await.map(drop)
    }

    /// Removes QEMU's vhost-user-blk export the drive's requests were relayed through (its
    /// session ends with it; the drive is drained or on another engine by then).
    pub(super) async fn relay_down(&self, d: &ManagedDrive, qmp: &Qmp) -> Result<(), SupError> {
        remove_export(qmp, &relay_export_id(d.id())).await?;
        if let Some(sock) = lock(&d.graph).relay_socket.take() {
            let _ = std::fs::remove_file(sock);
        }
        Ok(())
    }

    /// QEMU's vhost-user-blk export of `top` (the node under acceld's NBD export), for the
    /// drive's rings to be lent to. Without it the drive is served over NBD only, and the
    /// failure is logged.
    async fn lend_up(&self, d: &ManagedDrive, qmp: &Qmp, nbd_socket: &Path, top: &str) {
        let id = d.id();
        let sock = lend_socket(nbd_socket, id);
        match self
            .vhost_user_export(d, qmp, &lend_export_id(id), &sock, top)
            .await
        {
            Ok(()) => lock(&d.graph).lend_socket = Some(sock),
            Err(e) => {
                if let Some(n) = d.log.admit() {
                    warn!(drive = %id, "no vhost-user-blk export to lend the rings to; the qemu engine serves over NBD: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
                }
            }
        }
    }

    /// The relay's export of a drive on the qemu engine, made again if missing (an acceld
    /// restart, a failed session that removed it): on the node under acceld's NBD export.
    pub(super) async fn ensure_relay_export(&self, vm: &Vm, d: &ManagedDrive, qmp: &Qmp) {
        if !d.spec.relays() || lock(&d.graph).relay_socket.is_some() {
            return;
        }
        let Ok(exports) = qmp_run(qmp, &QueryBlockExports).await else {
            return;
        };
        if let Some(top) = exports
            .iter()
            .find(|e| e.id == export_id(d.id()))
            .map(|e| e.node_name.clone())
        {
            self.relay_up(d, qmp, &vm.nbd_socket(), &top).await;
        }
    }

    /// A `lend=on` drive on the qemu engine lends its rings: QEMU's vhost-user-blk export of
    /// the node under acceld's NBD export (made if missing, e.g. after an acceld restart) and
    /// a lender on it. Nothing for other drives, or when a lender runs.
    pub(super) async fn ensure_lending(&self, vm: &Vm, d: &ManagedDrive, qmp: &Qmp) {
        if !d.spec.lend
            || d.engine_kind() != accel_api::status::EngineKind::Qemu
            || lock(&d.lender).is_some()
        {
            return;
        }
        if lock(&d.graph).lend_socket.is_none() {
            let exports = match qmp_run(qmp, &QueryBlockExports).await {
                Ok(x) => x,
                Err(_) => return,
            };
            let Some(top) = exports
                .iter()
                .find(|e| e.id == export_id(d.id()))
                .map(|e| e.node_name.clone())
            else {
                return;
            };
            self.lend_up(d, qmp, &vm.nbd_socket(), &top).await;
        }
        let Some(sock) = lock(&d.graph).lend_socket.clone() else {
            return;
        };
        // The export's server must be the VM's QEMU (its user), as for its monitor.
        let uid = vm.owner.map(|o| o.uid);
        match d.drive.spawn_lender(sock, uid) {
            Ok(l) => *lock(&d.lender) = Some(l),
            Err(e) => {
                if let Some(n) = d.log.admit() {
                    warn!(drive = %d.id(), "cannot start the lender: {e}{}", accel_dataplane::util::suppressed(n));
                }
            }
        }
    }

    /// Takes lent rings back and removes QEMU's vhost-user-blk export of the drive.
    pub(super) async fn lend_down(&self, d: &ManagedDrive, qmp: &Qmp) -> Result<(), SupError> {
        d.stop_lending().await;
        let export = lend_export_id(d.id());
        remove_export(qmp, &export).await?;
        if let Some(sock) = lock(&d.graph).lend_socket.take() {
            let _ = std::fs::remove_file(sock);
        }
        Ok(())
    }

    /// Starts QEMU's NBD server on acceld's socket of the VM, or finds it started.
    pub(super) async fn start_nbd_server(
        &self,
        qmp: &Qmp,
        nbd_socket: &Path,
    ) -> Result<(), SupError> {
        let r = qmp_run(qmp, &NbdServerStart::unix(&nbd_socket.to_string_lossy())).await;
        match r {
            Ok(_) => Ok(()),
            // QEMU has one NBD server and refuses a second start with a GenericError. When
            // the server greets on acceld's own socket (in the private run dir), acceld
            // started it before (another drive, or before a restart): go on. Anything else
            // is a failure.
            Err(SupError::Qmp { ref source, .. }) if source.class() == Some("GenericError") => {
                let sock = nbd_socket.to_path_buf();
                if offload::blocking(move || nbd::greets(&sock, Duration::from_secs(2))).await {
                    Ok(())
                } else {
                    r.map(|_| ())
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Removes acceld's export, throttle filter and throttle group of the drive, if present.
    pub(super) async fn qemu_down(&self, d: &ManagedDrive, qmp: &Qmp) -> Result<(), SupError> {
        self.lend_down(d, qmp).await?;
        self.relay_down(d, qmp).await?;
        let id = d.id();
        let export = export_id(id);
        remove_export(qmp, &export).await?;
        let nodes = qmp_run(qmp, &QueryNamedBlockNodes::default()).await?;
        let filter = filter_node(id);
        if nodes
            .iter()
            .any(|n| n["node-name"].as_str() == Some(&filter))
        {
            qmp_run(qmp, &BlockdevDel { node_name: filter }).await?;
        }
        let objs = qmp_run(
            qmp,
            &QomList {
                path: "/objects".into(),
            },
        )
        .await?;
        let group = d.applied_group();
        if !lock(&d.graph).group_external && objs.iter().any(|o| o.name == group) {
            qmp_run(qmp, &ObjectDel { id: group }).await?;
        }
        {
            let mut g = lock(&d.graph);
            g.applied_group = None;
            g.group_external = false;
        }
        lock(&d.graph).applied_throttle = None;
        Ok(())
    }

    /// Deletes the drive's nodes from QEMU, recording them for [`Self::restore_nodes`].
    pub(super) async fn remove_nodes(&self, d: &ManagedDrive, qmp: &Qmp) -> Result<(), SupError> {
        if lock(&d.graph).nodes_removed {
            return Ok(());
        }
        let view = lock(&d.observed).last_view.clone().ok_or_else(|| {
            SupError::QemuState("show the drive's nodes before the switch".into())
        })?;
        let node = view
            .node
            .clone()
            .ok_or_else(|| SupError::NotFound(format!("QEMU has no node {}", d.spec.id)))?;
        lock(&d.graph).recorded = Some(Recorded {
            node: node.clone(),
            protocol: view.protocol.clone(),
        });
        // Persist the recipe before the nodes go away.
        self.save();
        qmp_run(
            qmp,
            &BlockdevDel {
                node_name: node.name.clone(),
            },
        )
        .await?;
        if let Some(p) = &view.protocol {
            let r = qmp_run(
                qmp,
                &BlockdevDel {
                    node_name: p.name.clone(),
                },
            )
            .await;
            if let Err(e) = r {
                let _ = self.add_nodes(d, qmp, false).await;
                return Err(e);
            }
        }
        lock(&d.graph).nodes_removed = true;
        self.save();
        Ok(())
    }

    /// Re-creates nodes removed by [`Self::remove_nodes`].
    pub(super) async fn restore_nodes(&self, d: &ManagedDrive, qmp: &Qmp) -> Result<(), SupError> {
        if !lock(&d.graph).nodes_removed {
            return Ok(());
        }
        self.add_nodes(d, qmp, true).await?;
        lock(&d.graph).nodes_removed = false;
        self.save();
        Ok(())
    }

    async fn add_nodes(
        &self,
        d: &ManagedDrive,
        qmp: &Qmp,
        protocol_too: bool,
    ) -> Result<(), SupError> {
        let rec = lock(&d.graph)
            .recorded
            .clone()
            .ok_or_else(|| SupError::QemuState("record the drive's nodes".into()))?;
        let discard = d.spec.discard.as_str();
        let node_opts = |n: &NodeView| {
            json!({
                "node-name": n.name,
                "read-only": n.read_only,
                "discard": discard,
                "cache": {"direct": n.cache_direct, "no-flush": n.cache_no_flush},
                "driver": n.driver,
            })
        };
        match &rec.protocol {
            Some(p) => {
                if protocol_too {
                    let mut a = node_opts(p);
                    a["filename"] = p.filename.clone().into();
                    qmp_run(qmp, &BlockdevAdd(a)).await?;
                }
                let mut a = node_opts(&rec.node);
                a["file"] = p.name.clone().into();
                if let Err(e) = qmp_run(qmp, &BlockdevAdd(a)).await {
                    if protocol_too {
                        let _ = qmp_run(
                            qmp,
                            &BlockdevDel {
                                node_name: p.name.clone(),
                            },
                        )
                        .await;
                    }
                    return Err(e);
                }
            }
            None => {
                let mut a = node_opts(&rec.node);
                a["filename"] = rec.node.filename.clone().into();
                qmp_run(qmp, &BlockdevAdd(a)).await?;
            }
        }
        Ok(())
    }
}
