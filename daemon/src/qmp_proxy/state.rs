//! What a VM's proxy clients share and what a command runs with: [`Ctx`] (the host, the VM,
//! the shared state) and [`Shared`] with each part's state (held drives, management's NBD
//! server, the nodes management added). The files that act on a part (`hold`, `nbd`,
//! `hotplug`) use this one; nothing here uses them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use accel_api::status::DriveStatus;
use accel_dataplane::util::{lock, LogLimit};
use policy::Pin;
use serde_json::{Map, Value};
use tokio::task::JoinHandle;

use super::host::Host;

pub struct Ctx {
    /// The rest of acceld (the supervisor, or a test's fake).
    pub sup: Arc<dyn Host>,
    pub vm: String,
    pub shared: Arc<Shared>,
}

impl Ctx {
    pub fn drives(&self) -> Vec<DriveStatus> {
        self.sup.drives(&self.vm)
    }

    pub fn again(&self) -> Ctx {
        Ctx {
            sup: self.sup.clone(),
            vm: self.vm.clone(),
            shared: self.shared.clone(),
        }
    }
}

/// What every client of a VM's proxy shares: the drives held on QEMU's block layer and
/// management's NBD server.
#[derive(Default)]
pub struct Shared {
    pub(super) holds: Holds,
    pub(super) nbd: MgmtNbd,
    /// The nodes management added (for its hot-plugged disks).
    pub(super) plugged: Nodes,
    /// Budget of the log lines management's commands can cause.
    pub(super) log: LogLimit,
}

/// A held drive: how many commands hold it, and the pin it had before the first (when the
/// hold changed it), with whether that pin was persistent.
pub(super) struct Entry {
    pub(super) holders: usize,
    pub(super) restore: Option<(Option<Pin>, bool)>,
}

#[derive(Default)]
pub struct Holds {
    pub(super) held: tokio::sync::Mutex<HashMap<String, Entry>>,
}

#[derive(Default)]
pub struct MgmtNbd {
    pub(super) server: tokio::sync::Mutex<Option<Server>>,
}

pub(super) struct Server {
    pub(super) task: JoinHandle<()>,
    /// The unix socket management asked for (removed at stop, as QEMU does).
    pub(super) unix_path: Option<PathBuf>,
    /// NBD exports management added while its server ran (deleted at stop).
    pub(super) exports: Vec<String>,
}

impl MgmtNbd {
    pub async fn running(&self) -> bool {
        self.server.lock().await.is_some()
    }

    pub async fn added(&self, id: &str) {
        if let Some(s) = self.server.lock().await.as_mut() {
            s.exports.push(id.to_string());
        }
    }

    pub async fn deleted(&self, id: &str) {
        if let Some(s) = self.server.lock().await.as_mut() {
            s.exports.retain(|e| e != id);
        }
    }
}

/// Most nodes the proxy remembers per VM (management's `blockdev-add`s not yet deleted).
const MAX_NODES: usize = 1024;
/// Largest `blockdev-add` options it remembers (libvirt's are a few hundred bytes).
const MAX_NODE_BYTES: usize = 16 * 1024;

/// The options of the nodes management added through this VM's proxy, by node name.
#[derive(Default)]
pub struct Nodes(std::sync::Mutex<BTreeMap<String, Value>>);

impl Nodes {
    /// QEMU took a `blockdev-add` with these options.
    pub fn added(&self, args: &Option<Map<String, Value>>) {
        let Some(a) = args else { return };
        let Some(name) = a.get("node-name").and_then(Value::as_str) else {
            return;
        };
        let v = Value::Object(a.clone());
        if v.to_string().len() > MAX_NODE_BYTES {
            return;
        }
        let mut m = lock(&self.0);
        if m.len() < MAX_NODES || m.contains_key(name) {
            m.insert(name.to_string(), v);
        }
    }

    /// QEMU deleted a node.
    pub fn deleted(&self, args: &Option<Map<String, Value>>) {
        if let Some(name) = args
            .as_ref()
            .and_then(|a| a.get("node-name"))
            .and_then(Value::as_str)
        {
            lock(&self.0).remove(name);
        }
    }

    pub(super) fn all(&self) -> BTreeMap<String, Value> {
        lock(&self.0).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn add(name: &str, extra: usize) -> Option<Map<String, Value>> {
        let v = json!({"driver": "file", "node-name": name, "filename": "x".repeat(extra)});
        v.as_object().cloned()
    }

    #[test]
    fn nodes_are_remembered_until_deleted_and_bounded() {
        let n = Nodes::default();
        n.added(&add("a", 1));
        n.added(&None);
        n.added(&json!({"driver": "file"}).as_object().cloned());
        assert_eq!(n.all().keys().collect::<Vec<_>>(), ["a"]);
        // Options larger than a node's bound are not kept.
        n.added(&add("big", MAX_NODE_BYTES));
        assert!(!n.all().contains_key("big"));
        for i in 0..MAX_NODES + 10 {
            n.added(&add(&format!("n{i}"), 1));
        }
        assert_eq!(n.all().len(), MAX_NODES);
        // A node added again replaces its options even at the bound.
        n.added(&add("a", 7));
        assert_eq!(n.all()["a"]["filename"], "x".repeat(7));
        n.deleted(&json!({"node-name": "a"}).as_object().cloned());
        n.deleted(&json!({"node-name": 5}).as_object().cloned());
        assert!(!n.all().contains_key("a"));
        assert_eq!(n.all().len(), MAX_NODES - 1);
    }
}
