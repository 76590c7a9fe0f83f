//! One drive's supervisor-side state, split by concern, each part behind its own lock:
//! - [`Placement`]: which engine serves it, since when, the way back to direct, the quiet timer;
//! - [`Intent`]: what the operator asked (pin, throttle);
//! - [`GraphRecord`]: what acceld did to QEMU's block graph (nodes removed and their recipe,
//!   the throttle applied, the device found);
//! - [`Observed`]: the policy's last view and reasons;
//! - [`SwitchStats`]: pauses, failures, the last error, the NBD engine's counters, rates.
//!
//! Where they nest, they are taken in this order: `stats`, `observed`, `graph`, `intent`,
//! `placement`, then `image` and `node` (docs/architecture.md, "Lock order"). A switch's
//! outcome ([`Commit`]) is applied in one step under `stats`, `graph` and `placement`
//! ([`ManagedDrive::commit`]), once its new engine serves.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};

use accel_api::control::{DriveSpec, ThrottleLimits};
use accel_api::status::EngineKind;
use policy::{DriveView, NodeView, Pin, Reason, ServeSpec};
use serde::{Deserialize, Serialize};

use accel_dataplane::drive::Drive;
use accel_dataplane::engine::nbd::NbdStats;
use accel_dataplane::util::{lock, LogLimit};
use accel_dataplane::vhost::ShutdownHandle;

/// The drive's QEMU nodes as they were before acceld removed them, to re-create them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recorded {
    pub node: NodeView,
    pub protocol: Option<NodeView>,
}

#[derive(Debug)]
pub struct Placement {
    pub engine: EngineKind,
    /// When `engine` last changed.
    pub since: SystemTime,
    /// How the drive was last served directly (the way back if a switch to qemu fails).
    pub direct_spec: Option<ServeSpec>,
    /// When the rules started allowing direct again (the quiet period's timer).
    pub accel_since: Option<Instant>,
}

#[derive(Debug, Default)]
pub struct Intent {
    pub pin: Option<Pin>,
    /// The pin survives an acceld restart.
    pub pin_persistent: bool,
    pub throttle: Option<ThrottleLimits>,
    /// Management's throttle group for the drive (`block_set_io_throttle group=`, QMP
    /// proxy); acceld's own `accel-tg-ID` when `None`. The drive stays a member with all-zero
    /// limits, as a QEMU device does after a `qom-set` of zero limits on its group.
    pub throttle_group: Option<String>,
}

#[derive(Debug, Default)]
pub struct GraphRecord {
    /// The vhost-user-blk-pci device on the drive's socket (set at attach).
    pub device: Option<String>,
    /// acceld removed the drive's nodes from QEMU (direct engine).
    pub nodes_removed: bool,
    pub recorded: Option<Recorded>,
    /// The throttle QEMU has now (qemu engine only).
    pub applied_throttle: Option<ThrottleLimits>,
    /// The node under acceld's export (and filter) when it is no longer the drive's own:
    /// QEMU moved the export's backend onto an external snapshot's overlay or, at a mirror's
    /// pivot, onto its target. The guest's data is there; the drive cannot go direct on its
    /// image, and a re-created export goes on this node. Learnt at every look at QEMU.
    pub data_node: Option<String>,
    /// The throttle group object existed before acceld's filter used it (management's
    /// `object-add`): acceld neither deletes it nor lifts its limits.
    pub group_external: bool,
    /// The group acceld's filter uses now (`None`: not known, acceld's own name).
    pub applied_group: Option<String>,
    /// The socket of QEMU's vhost-user-blk export the rings are lent to (`lend=on`, qemu
    /// engine), while it exists.
    pub lend_socket: Option<std::path::PathBuf>,
    /// The socket of QEMU's vhost-user-blk export the requests are relayed through
    /// (the default on the qemu engine), while it exists.
    pub relay_socket: Option<std::path::PathBuf>,
    /// The relay may serve the drive now (the last look at QEMU found no block job on it,
    /// and the VM's QMP proxy holds no command): a bring-up of the qemu engine relays only
    /// then, otherwise it serves over NBD (see [`super::plan::PlanInput::relay_wanted`]).
    pub relay_allowed: bool,
    /// When the relay's session last ended under the drive (it then serves over NBD; the
    /// relay is tried again [`super::vm::RELAY_RETRY`] later).
    pub relay_lost_at: Option<Instant>,
}

#[derive(Debug, Default)]
pub struct Observed {
    pub reasons: Vec<Reason>,
    pub last_view: Option<DriveView>,
}

/// Rates over the last sampling interval.
#[derive(Clone, Debug, Default)]
pub struct Rates {
    pub at: Option<Instant>,
    pub ops: u64,
    pub bytes: u64,
    pub lat: Option<[u64; 40]>,
    pub iops: f64,
    pub mbps: f64,
    pub p99_us: Option<u64>,
}

#[derive(Debug, Default)]
pub struct SwitchStats {
    pub to_direct_us: Vec<u64>,
    pub to_qemu_us: Vec<u64>,
    pub failed_switches: u64,
    pub last_error: Option<String>,
    pub nbd: Option<Arc<NbdStats>>,
    pub rates: Rates,
}

/// What a switch makes true once its new engine serves, applied by [`ManagedDrive::commit`]:
/// the bring-up returns it instead of applying it, so nothing shows before the hand-over.
#[derive(Debug)]
pub struct Commit {
    pub engine: EngineKind,
    /// The NBD engine's counters (none on the relay and the direct engine).
    nbd: Option<Arc<NbdStats>>,
    /// The throttle QEMU has now (qemu engine only).
    throttle: Option<ThrottleLimits>,
    /// How the drive is served directly (the way back), when that changed.
    direct_spec: Option<ServeSpec>,
}

impl Commit {
    /// Served by the direct engine (`spec`: how, when it changed): no NBD engine, no throttle
    /// in QEMU.
    pub fn direct(spec: Option<ServeSpec>) -> Commit {
        Commit {
            engine: EngineKind::Direct,
            nbd: None,
            throttle: None,
            direct_spec: spec,
        }
    }

    /// Served by the qemu engine, over `nbd` (its counters; none on the relay), with
    /// `throttle` in QEMU.
    pub fn qemu(nbd: Option<Arc<NbdStats>>, throttle: Option<ThrottleLimits>) -> Commit {
        Commit {
            engine: EngineKind::Qemu,
            nbd,
            throttle,
            direct_spec: None,
        }
    }
}

type ServerThread = (ShutdownHandle, JoinHandle<()>);

pub struct ManagedDrive {
    pub spec: DriveSpec,
    /// The image as registered, or as taken after a pivot: the only file the direct engine
    /// opens (see [`super::permit::ImageRef`]).
    image: Mutex<super::permit::ImageRef>,
    /// QEMU's node of the drive: the registered one, or the one QEMU pivoted the device to.
    node: Mutex<String>,
    pub socket: PathBuf,
    pub drive: Arc<Drive>,
    server: Mutex<Option<ServerThread>>,
    /// One operation (switch, re-tune) at a time per drive.
    pub op: tokio::sync::Mutex<()>,
    pub placement: Mutex<Placement>,
    pub intent: Mutex<Intent>,
    pub graph: Mutex<GraphRecord>,
    pub observed: Mutex<Observed>,
    pub stats: Mutex<SwitchStats>,
    /// Lends the drive's rings to QEMU's vhost-user-blk export while it is on the qemu engine
    /// (`lend=on`).
    pub lender: Mutex<Option<accel_dataplane::drive::Lender>>,
    /// Budget of the supervisor's lines about this drive (a VM or a QMP client can make the
    /// same failure repeat every reconcile).
    pub log: LogLimit,
}

impl ManagedDrive {
    /// The drive's image now.
    pub fn image(&self) -> super::permit::ImageRef {
        lock(&self.image).clone()
    }

    /// The drive's image from now on (QEMU pivoted to it; resolved as QEMU's user).
    pub fn set_image(&self, image: super::permit::ImageRef) {
        *lock(&self.image) = image;
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: DriveSpec,
        image: super::permit::ImageRef,
        socket: PathBuf,
        drive: Arc<Drive>,
        server: ServerThread,
        placement: Placement,
        intent: Intent,
        graph: GraphRecord,
    ) -> Self {
        ManagedDrive {
            node: Mutex::new(spec.node_name().to_string()),
            spec,
            image: Mutex::new(image),
            socket,
            drive,
            server: Mutex::new(Some(server)),
            op: tokio::sync::Mutex::new(()),
            placement: Mutex::new(placement),
            intent: Mutex::new(intent),
            graph: Mutex::new(graph),
            observed: Mutex::new(Observed::default()),
            stats: Mutex::new(SwitchStats::default()),
            lender: Mutex::new(None),
            log: LogLimit::default(),
        }
    }

    /// Stops the drive's lender, if any: lent rings come back (blocking, so off the runtime).
    pub async fn stop_lending(&self) {
        let lender = lock(&self.lender).take();
        if lender.is_some() {
            super::offload::blocking(move || drop(lender)).await;
        }
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    /// QEMU's node-name of the drive's image.
    pub fn node(&self) -> String {
        lock(&self.node).clone()
    }

    /// The drive's node from now on (QEMU pivoted the device to it and removed the old one).
    pub fn set_node(&self, node: String) {
        *lock(&self.node) = node;
    }

    /// The throttle group acceld's filter uses now.
    pub fn applied_group(&self) -> String {
        lock(&self.graph)
            .applied_group
            .clone()
            .unwrap_or_else(|| super::qemu_graph::group_id(&self.spec.id))
    }

    /// The throttle group acceld's filter is to use: management's, or acceld's own.
    pub fn group(&self) -> String {
        lock(&self.intent)
            .throttle_group
            .clone()
            .unwrap_or_else(|| super::qemu_graph::group_id(&self.spec.id))
    }

    /// Asks the vhost-user server to stop (it drains), without waiting.
    pub fn signal_stop(&self) {
        if let Some((h, _)) = lock(&self.server).as_ref() {
            h.shutdown();
        }
    }

    /// Stops the vhost-user server (its connection drains) and removes the socket.
    pub fn stop_server(&self) {
        let s = lock(&self.server).take();
        if let Some((h, t)) = s {
            h.shutdown();
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// A switch's (or a repath's) outcome in one step, once its new engine serves: the
    /// engine and what goes with it, and the completed switch's `pause` (microseconds, `None`
    /// for a repath, a rollback or a take from held), are applied with `stats`, `graph` and
    /// `placement` held together (in the lock order, docs/architecture.md), as `status` holds
    /// them. So a status shows the drive before the switch or after it, never between: its
    /// engine and its count of completed switches change together.
    pub fn commit(&self, c: Commit, pause: Option<u64>) {
        let mut st = lock(&self.stats);
        let mut g = lock(&self.graph);
        let mut p = lock(&self.placement);
        st.nbd = c.nbd;
        if let Some(us) = pause {
            match c.engine {
                EngineKind::Direct => st.to_direct_us.push(us),
                EngineKind::Qemu => st.to_qemu_us.push(us),
                EngineKind::Held => {}
            }
            st.last_error = None;
        }
        g.applied_throttle = c.throttle;
        if c.direct_spec.is_some() {
            p.direct_spec = c.direct_spec;
        }
        if p.engine != c.engine {
            p.engine = c.engine;
            p.since = SystemTime::now();
        }
    }

    pub fn set_engine(&self, k: EngineKind) {
        let mut p = lock(&self.placement);
        if p.engine != k {
            p.engine = k;
            p.since = SystemTime::now();
        }
    }

    pub fn engine_kind(&self) -> EngineKind {
        lock(&self.placement).engine
    }

    /// On the qemu engine through the relay (QEMU's vhost-user-blk export), not NBD.
    pub fn relayed(&self) -> bool {
        self.engine_kind() == EngineKind::Qemu
            && self.drive.engine().io_path() == accel_dataplane::engine::relay::IO_PATH
    }

    pub fn has_device(&self) -> bool {
        lock(&self.graph).device.is_some()
    }
}
