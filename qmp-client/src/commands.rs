//! Typed commands the supervisor needs. Replies that the supervisor inspects field by field are
//! typed structs (unknown fields ignored); the others are kept as JSON.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Command, VersionInfo};

macro_rules! no_args {
    ($(#[$m:meta])* $t:ident, $name:literal, $ok:ty) => {
        $(#[$m])*
        #[derive(Debug, Default, Clone, Serialize)]
        pub struct $t;
        impl Command for $t {
            const NAME: &'static str = $name;
            type Ok = $ok;
            fn has_args(&self) -> bool {
                false
            }
        }
    };
}

macro_rules! with_args {
    ($t:ident, $name:literal, $ok:ty) => {
        impl Command for $t {
            const NAME: &'static str = $name;
            type Ok = $ok;
        }
    };
}

no_args!(QueryVersion, "query-version", VersionInfo);
no_args!(QueryStatus, "query-status", StatusInfo);
no_args!(Stop, "stop", Value);
no_args!(Cont, "cont", Value);
no_args!(Quit, "quit", Value);
no_args!(QueryChardev, "query-chardev", Vec<ChardevInfo>);
no_args!(QueryBlock, "query-block", Vec<Value>);
no_args!(QueryBlockstats, "query-blockstats", Vec<Value>);
no_args!(QueryIothreads, "query-iothreads", Vec<IothreadInfo>);
no_args!(
    QueryBlockExports,
    "query-block-exports",
    Vec<BlockExportInfo>
);
no_args!(QueryMigrate, "query-migrate", Value);
no_args!(NbdServerStop, "nbd-server-stop", Value);
no_args!(QueryBlockJobs, "query-block-jobs", Vec<Value>);
no_args!(
    /// The whole block graph (nodes and edges with their roles); unstable (`x-`) but present in
    /// every QEMU since 4.0.
    XDebugQueryBlockGraph,
    "x-debug-query-block-graph",
    Value
);

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct StatusInfo {
    pub running: bool,
    pub status: String,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ChardevInfo {
    pub label: String,
    pub filename: String,
    #[serde(rename = "frontend-open", default)]
    pub frontend_open: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct IothreadInfo {
    pub id: String,
    #[serde(rename = "thread-id", default)]
    pub thread_id: i64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct BlockExportInfo {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(rename = "node-name")]
    pub node_name: String,
    #[serde(rename = "shutting-down", default)]
    pub shutting_down: bool,
}

/// `qom-list path`.
#[derive(Clone, Debug, Serialize)]
pub struct QomList {
    pub path: String,
}
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ObjectPropertyInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
}
with_args!(QomList, "qom-list", Vec<ObjectPropertyInfo>);

/// `qom-get path property`.
#[derive(Clone, Debug, Serialize)]
pub struct QomGet {
    pub path: String,
    pub property: String,
}
with_args!(QomGet, "qom-get", Value);

/// `query-named-block-nodes` (flat: one entry per node, no nested backing images).
#[derive(Clone, Debug, Serialize)]
pub struct QueryNamedBlockNodes {
    pub flat: bool,
}
impl Default for QueryNamedBlockNodes {
    fn default() -> Self {
        QueryNamedBlockNodes { flat: true }
    }
}
with_args!(QueryNamedBlockNodes, "query-named-block-nodes", Vec<Value>);

/// `qom-set path property value`.
#[derive(Clone, Debug, Serialize)]
pub struct QomSet {
    pub path: String,
    pub property: String,
    pub value: Value,
}
with_args!(QomSet, "qom-set", Value);

/// `object-add` with the object's own properties flattened in (`qom-type`, `id`, …).
#[derive(Clone, Debug, Serialize)]
pub struct ObjectAdd(pub Value);
with_args!(ObjectAdd, "object-add", Value);

impl ObjectAdd {
    pub fn iothread(id: &str) -> Self {
        ObjectAdd(serde_json::json!({"qom-type": "iothread", "id": id}))
    }
    /// A throttle group with QEMU's `limits` object (`iops-total`, `bps-read`, …).
    pub fn throttle_group(id: &str, limits: &Value) -> Self {
        ObjectAdd(serde_json::json!({"qom-type": "throttle-group", "id": id, "limits": limits}))
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ObjectDel {
    pub id: String,
}
with_args!(ObjectDel, "object-del", Value);

/// `blockdev-add` with the node's options (`driver`, `node-name`, …).
#[derive(Clone, Debug, Serialize)]
pub struct BlockdevAdd(pub Value);
with_args!(BlockdevAdd, "blockdev-add", Value);

#[derive(Clone, Debug, Serialize)]
pub struct BlockdevDel {
    #[serde(rename = "node-name")]
    pub node_name: String,
}
with_args!(BlockdevDel, "blockdev-del", Value);

/// Removes a chardev (a hot-plugged drive's vhost-user socket, once its device is gone).
#[derive(Clone, Debug, Serialize)]
pub struct ChardevRemove {
    pub id: String,
}
with_args!(ChardevRemove, "chardev-remove", Value);

/// Makes a device read its config from the backend again and interrupt the guest (QEMU 9.2+,
/// unstable; refused during a migration).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceSyncConfig {
    pub id: String,
}
with_args!(DeviceSyncConfig, "device-sync-config", Value);

#[derive(Clone, Debug, Serialize)]
pub struct BlockdevSetActive {
    #[serde(rename = "node-name", skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    pub active: bool,
}
with_args!(BlockdevSetActive, "blockdev-set-active", Value);

/// `nbd-server-start` on a unix socket.
#[derive(Clone, Debug, Serialize)]
pub struct NbdServerStart {
    pub addr: Value,
}
impl NbdServerStart {
    pub fn unix(path: &str) -> Self {
        NbdServerStart {
            addr: serde_json::json!({"type": "unix", "data": {"path": path}}),
        }
    }
}
with_args!(NbdServerStart, "nbd-server-start", Value);

/// `block-export-add`: an NBD export or a vhost-user-blk export.
#[derive(Clone, Debug, Serialize)]
pub struct BlockExportAdd(pub Value);
impl BlockExportAdd {
    pub fn nbd(id: &str, node: &str, writable: bool, iothread: Option<&str>) -> Self {
        let mut v = serde_json::json!({
            "type": "nbd", "id": id, "node-name": node, "writable": writable,
        });
        if let Some(t) = iothread {
            v["iothread"] = t.into();
        }
        BlockExportAdd(v)
    }
    /// The export stays in its iothread: QEMU then moves a node that joins the graph around it
    /// (a filter, an overlay) into that iothread instead of moving the node out of it.
    pub fn fixed_iothread(mut self) -> Self {
        self.0["fixed-iothread"] = true.into();
        self
    }
    /// An NBD export under an explicit export `name` (default: the node name).
    pub fn nbd_named(mut self, name: &str) -> Self {
        self.0["name"] = name.into();
        self
    }
    pub fn vhost_user_blk(id: &str, node: &str, socket: &str, writable: bool, queues: u16) -> Self {
        BlockExportAdd(serde_json::json!({
            "type": "vhost-user-blk", "id": id, "node-name": node, "writable": writable,
            "addr": {"type": "unix", "path": socket}, "num-queues": queues,
        }))
    }
    /// The vhost-user-blk export's logical block size.
    pub fn logical_block_size(mut self, bytes: u32) -> Self {
        self.0["logical-block-size"] = bytes.into();
        self
    }
    /// Serves the export from this iothread.
    pub fn in_iothread(mut self, id: &str) -> Self {
        self.0["iothread"] = id.into();
        self
    }
}
with_args!(BlockExportAdd, "block-export-add", Value);

#[derive(Clone, Debug, Serialize)]
pub struct BlockExportDel {
    pub id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}
with_args!(BlockExportDel, "block-export-del", Value);

/// `block_set_io_throttle` (all limit fields; zero means unlimited).
#[derive(Clone, Debug, Default, Serialize)]
pub struct BlockSetIoThrottle {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    pub bps: i64,
    pub bps_rd: i64,
    pub bps_wr: i64,
    pub iops: i64,
    pub iops_rd: i64,
    pub iops_wr: i64,
}
with_args!(BlockSetIoThrottle, "block_set_io_throttle", Value);

#[derive(Clone, Debug, Serialize)]
pub struct Migrate {
    pub uri: String,
}
with_args!(Migrate, "migrate", Value);

#[derive(Clone, Debug, Serialize)]
pub struct XQueryVirtioStatus {
    pub path: String,
}
with_args!(XQueryVirtioStatus, "x-query-virtio-status", Value);

no_args!(
    QueryMigrateCapabilities,
    "query-migrate-capabilities",
    Vec<MigrationCapabilityStatus>
);

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MigrationCapabilityStatus {
    pub capability: String,
    pub state: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct MigrateSetCapabilities {
    pub capabilities: Vec<MigrationCapabilityStatus>,
}
with_args!(MigrateSetCapabilities, "migrate-set-capabilities", Value);

impl MigrateSetCapabilities {
    pub fn one(capability: &str, state: bool) -> Self {
        MigrateSetCapabilities {
            capabilities: vec![MigrationCapabilityStatus {
                capability: capability.into(),
                state,
            }],
        }
    }
}

/// `migrate-continue` from a paused migration state (`pre-switchover`).
#[derive(Clone, Debug, Serialize)]
pub struct MigrateContinue {
    pub state: String,
}
with_args!(MigrateContinue, "migrate-continue", Value);

/// `blockdev-mirror` (arguments as QEMU names them).
#[derive(Clone, Debug, Serialize)]
pub struct BlockdevMirror(pub Value);
with_args!(BlockdevMirror, "blockdev-mirror", Value);

/// `block-job-cancel`: on a READY mirror, the job completes with the target in sync.
#[derive(Clone, Debug, Serialize)]
pub struct BlockJobCancel {
    pub device: String,
}
with_args!(BlockJobCancel, "block-job-cancel", Value);
