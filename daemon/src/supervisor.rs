//! The supervisor of `acceld run`: a registry of VMs and their drives; for each VM a task that
//! attaches over QMP, asks `policy` about every drive, and moves each drive between the direct
//! engine (io_uring on the raw file) and the qemu engine (NBD to the VM's own QEMU) — or holds
//! its requests while neither may serve it.
//!
//! One writer at a time, always:
//! - direct: acceld holds QEMU-compatible image locks, and the drive's block nodes are
//!   *removed* from QEMU (`blockdev-del`, options recorded), so a QMP snapshot, mirror or
//!   export of the node fails cleanly with "no node named …" instead of acting behind
//!   acceld's back;
//! - qemu: acceld holds no lock and no file; QEMU has the nodes back (re-created from the
//!   recorded options), an optional throttle filter on top, and an NBD export of the top node
//!   that acceld's NBD engine connects to.
//!
//! A switch: pause and drain the drive (requests stay in the vring), release the old engine,
//! bring up the new one (QMP steps, file open + locks, or NBD connect), resume. A failure at
//! any step rolls back to the old engine; if even that fails, the drive is held (requests
//! wait) and the error is shown in status. One switch at a time per drive (`op` lock).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use policy::{Decision, DriveView, NodeView, Parent, Pin, Reason};
use qmp_client::{Qmp, QmpError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;
use tokio::task::block_in_place;
use tracing::{debug, info, warn};

use crate::control::{check_id, DriveSpec, ErrorKind, ThrottleLimits};
use crate::drive::{DiscardMode, Drive, DriveConfig, LatencyHistogram, DEFAULT_POLL_US};
use crate::engine::nbd::{NbdEngine, NbdError, NbdStats};
use crate::engine::{
    image_size, Engine, EngineError, FileEngine, FileEngineConfig, HeldEngine, IoMode,
};
use crate::util::lock;
use crate::vhost::{Server, ShutdownHandle};

/// `acceld run` settings (TOML; every field optional).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    /// Sockets and state live here (mode 0700).
    pub run_dir: PathBuf,
    /// Registry persisted across restarts. Default: RUN_DIR/state.json.
    pub state_file: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP on this local address (e.g. "127.0.0.1:9720").
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// A drive whose reasons for QEMU went away goes back to direct after this long.
    pub quiet_period_ms: u64,
    /// How long a switch waits for in-flight requests before it gives up (rollback).
    pub drain_timeout_ms: u64,
    /// Timeout of each QMP command.
    pub qmp_timeout_ms: u64,
    /// How long to wait for a registered VM's QMP socket before retrying later.
    pub attach_timeout_ms: u64,
    /// Re-read each attached VM's block graph this often (events also trigger it).
    pub poll_interval_ms: u64,
    /// Iothread of the NBD exports (created if the VM lacks it).
    pub iothread: String,
    /// Most microseconds a queue busy-polls before sleeping (adaptive; 0: never poll).
    pub poll_us: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            run_dir: PathBuf::from("/run/accel"),
            state_file: None,
            metrics_addr: None,
            quiet_period_ms: 1000,
            drain_timeout_ms: 30_000,
            qmp_timeout_ms: 10_000,
            attach_timeout_ms: 30_000,
            poll_interval_ms: 1000,
            iothread: "accel-io".into(),
            poll_us: DEFAULT_POLL_US,
        }
    }
}

impl Config {
    pub fn state_path(&self) -> PathBuf {
        self.state_file
            .clone()
            .unwrap_or_else(|| self.run_dir.join("state.json"))
    }
    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join("acceld.sock")
    }
}

#[derive(Debug, Error)]
pub enum SupError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Exists(String),
    #[error("VM {0} is not attached (no QMP connection yet)")]
    NotAttached(String),
    #[error("QMP {cmd} failed")]
    Qmp {
        cmd: String,
        #[source]
        source: QmpError,
    },
    #[error("QEMU did not {0}")]
    QemuState(String),
    #[error(transparent)]
    Switch(#[from] crate::drive::SwitchError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Nbd(#[from] NbdError),
    #[error(transparent)]
    Serve(#[from] crate::vhost::ServeError),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read QEMU's answer: {0}")]
    Parse(String),
}

impl SupError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            SupError::Invalid(_) => ErrorKind::Invalid,
            SupError::NotFound(_) => ErrorKind::NotFound,
            SupError::Exists(_) => ErrorKind::Exists,
            _ => ErrorKind::Failed,
        }
    }

    /// The error and its sources, one line.
    pub fn chain(&self) -> String {
        crate::error_chain(self)
    }
}

/// Which engine serves a drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Requests wait in the vring (no engine may serve yet).
    Held,
    /// io_uring on the image.
    Direct,
    /// NBD to the VM's QEMU.
    Qemu,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Held => "held",
            EngineKind::Direct => "direct",
            EngineKind::Qemu => "qemu",
        }
    }
}

/// The drive's QEMU nodes as they were before acceld removed them, to re-create them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recorded {
    pub node: NodeView,
    pub protocol: Option<NodeView>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct SavedDrive {
    spec: DriveSpec,
    engine: EngineKind,
    nodes_removed: bool,
    recorded: Option<Recorded>,
    #[serde(default)]
    pin: Option<Pin>,
    #[serde(default)]
    throttle: Option<ThrottleLimits>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct SavedVm {
    name: String,
    qmp: PathBuf,
    cont: bool,
    drives: Vec<SavedDrive>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct SavedState {
    vms: Vec<SavedVm>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PauseStats {
    pub count: usize,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

fn pause_stats(v: &[u64]) -> PauseStats {
    if v.is_empty() {
        return PauseStats::default();
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let q = |f: f64| s[((s.len() as f64 * f).ceil() as usize).clamp(1, s.len()) - 1];
    PauseStats {
        count: s.len(),
        p50_us: q(0.5),
        p99_us: q(0.99),
        max_us: *s.last().expect("non-empty"),
    }
}

/// Rates over the last sampling interval.
#[derive(Clone, Debug, Default)]
struct Rates {
    at: Option<Instant>,
    ops: u64,
    bytes: u64,
    lat: Option<[u64; 40]>,
    iops: f64,
    mbps: f64,
    p99_us: Option<u64>,
}

/// A drive's supervisor-side state.
struct DriveRt {
    engine: EngineKind,
    since: SystemTime,
    reasons: Vec<Reason>,
    /// When the rules started allowing direct again (quiet period).
    accel_since: Option<Instant>,
    pin: Option<Pin>,
    pin_persistent: bool,
    throttle: Option<ThrottleLimits>,
    /// The throttle QEMU has now (qemu engine only).
    applied_throttle: Option<ThrottleLimits>,
    nodes_removed: bool,
    recorded: Option<Recorded>,
    /// The device is present in QEMU (set at attach).
    device: Option<String>,
    to_direct_us: Vec<u64>,
    to_qemu_us: Vec<u64>,
    failed_switches: u64,
    last_error: Option<String>,
    nbd: Option<Arc<NbdStats>>,
    last_view: Option<DriveView>,
    /// How the drive was last served directly (the way back if a switch to qemu fails).
    direct_spec: Option<policy::ServeSpec>,
    rates: Rates,
}

pub struct DriveSlot {
    pub spec: DriveSpec,
    pub socket: PathBuf,
    pub drive: Arc<Drive>,
    server: Mutex<Option<(ShutdownHandle, std::thread::JoinHandle<()>)>>,
    op: tokio::sync::Mutex<()>,
    rt: Mutex<DriveRt>,
}

impl DriveSlot {
    fn stop_server(&self) {
        let s = lock(&self.server).take();
        if let Some((h, t)) = s {
            h.shutdown();
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    fn set_engine(&self, k: EngineKind) {
        let mut rt = lock(&self.rt);
        if rt.engine != k {
            rt.engine = k;
            rt.since = SystemTime::now();
        }
    }

    fn engine_kind(&self) -> EngineKind {
        lock(&self.rt).engine
    }
}

pub struct Vm {
    pub name: String,
    pub qmp_path: PathBuf,
    pub cont: bool,
    pub dir: PathBuf,
    pub drives: BTreeMap<String, Arc<DriveSlot>>,
    qmp: Mutex<Option<Arc<Qmp>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    attach_error: Mutex<Option<String>>,
    run_state: Mutex<String>,
    continued: AtomicBool,
}

impl Vm {
    fn qmp(&self) -> Result<Arc<Qmp>, SupError> {
        lock(&self.qmp)
            .clone()
            .filter(|q| !q.is_closed())
            .ok_or_else(|| SupError::NotAttached(self.name.clone()))
    }
    fn nbd_socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }
    fn drive(&self, id: &str) -> Result<Arc<DriveSlot>, SupError> {
        self.drives
            .get(id)
            .cloned()
            .ok_or_else(|| SupError::NotFound(format!("VM {} has no drive {id}", self.name)))
    }
}

fn export_id(drive: &str) -> String {
    format!("accel-{drive}")
}
fn filter_node(drive: &str) -> String {
    format!("accel-throttle-{drive}")
}
fn group_id(drive: &str) -> String {
    format!("accel-tg-{drive}")
}

/// What QEMU says, read once per reconcile round.
struct QemuSnapshot {
    nodes: Vec<NodeView>,
    graph: Option<policy::qemu::BlockGraph>,
    throttled: Vec<String>,
    vm: policy::VmState,
    exports: Vec<(String, String)>,
}

async fn q(qmp: &Qmp, cmd: &str, args: Value) -> Result<Value, SupError> {
    let a = if args.is_null() { None } else { Some(args) };
    qmp.execute_raw(cmd, a)
        .await
        .map_err(|source| SupError::Qmp {
            cmd: cmd.to_string(),
            source,
        })
}

pub struct Supervisor {
    pub cfg: Config,
    vms: Mutex<BTreeMap<String, Arc<Vm>>>,
    save_lock: Mutex<()>,
    /// Set when acceld stops: VM tasks end without touching QEMU.
    stopping: AtomicBool,
}

impl Supervisor {
    pub fn new(cfg: Config) -> Arc<Self> {
        Arc::new(Supervisor {
            cfg,
            vms: Mutex::new(BTreeMap::new()),
            save_lock: Mutex::new(()),
            stopping: AtomicBool::new(false),
        })
    }

    fn vm(&self, name: &str) -> Result<Arc<Vm>, SupError> {
        lock(&self.vms)
            .get(name)
            .cloned()
            .ok_or_else(|| SupError::NotFound(format!("no VM named {name} is registered")))
    }

    pub fn vm_names(&self) -> Vec<String> {
        lock(&self.vms).keys().cloned().collect()
    }

    // ---- persistence ----

    fn save(&self) {
        let _g = lock(&self.save_lock);
        let vms: Vec<Arc<Vm>> = lock(&self.vms).values().cloned().collect();
        let st = SavedState {
            vms: vms
                .iter()
                .map(|vm| SavedVm {
                    name: vm.name.clone(),
                    qmp: vm.qmp_path.clone(),
                    cont: vm.cont,
                    drives: vm
                        .drives
                        .values()
                        .map(|d| {
                            let rt = lock(&d.rt);
                            SavedDrive {
                                spec: d.spec.clone(),
                                engine: rt.engine,
                                nodes_removed: rt.nodes_removed,
                                recorded: rt.recorded.clone(),
                                pin: if rt.pin_persistent { rt.pin } else { None },
                                throttle: rt.throttle.clone(),
                            }
                        })
                        .collect(),
                })
                .collect(),
        };
        let path = self.cfg.state_path();
        let tmp = path.with_extension("tmp");
        let data = serde_json::to_vec_pretty(&st).expect("state serializes");
        let res = std::fs::write(&tmp, data).and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = res {
            warn!("cannot save state to {}: {e}", path.display());
        }
    }

    /// Registers again every VM of the state file (after a restart). Drives that were direct
    /// are served directly at once; the others wait for the re-attach.
    pub fn restore(self: &Arc<Self>) -> Result<usize, SupError> {
        let path = self.cfg.state_path();
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(source) => {
                return Err(SupError::Io {
                    what: format!("cannot read state file {}", path.display()),
                    source,
                })
            }
        };
        let st: SavedState = serde_json::from_slice(&data).map_err(|e| {
            SupError::Invalid(format!("state file {} is damaged: {e}", path.display()))
        })?;
        let n = st.vms.len();
        for vm in st.vms {
            let name = vm.name.clone();
            if let Err(e) = self.register_inner(vm.name, vm.qmp, vm.cont, vm.drives) {
                warn!(vm = %name, "cannot restore: {}", e.chain());
            }
        }
        Ok(n)
    }

    // ---- registration ----

    pub fn register(
        self: &Arc<Self>,
        vm: String,
        qmp: PathBuf,
        drives: Vec<DriveSpec>,
        cont: bool,
    ) -> Result<Value, SupError> {
        check_id("VM name", &vm).map_err(SupError::Invalid)?;
        if drives.is_empty() {
            return Err(SupError::Invalid(format!("VM {vm}: no drive given")));
        }
        for (i, d) in drives.iter().enumerate() {
            d.validate().map_err(SupError::Invalid)?;
            if drives[..i].iter().any(|o| o.id == d.id) {
                return Err(SupError::Invalid(format!("drive id {} given twice", d.id)));
            }
        }
        if !qmp.is_absolute() {
            return Err(SupError::Invalid(format!(
                "QMP socket {} is not an absolute path",
                qmp.display()
            )));
        }
        let saved = drives
            .into_iter()
            .map(|spec| SavedDrive {
                spec,
                engine: EngineKind::Held,
                nodes_removed: false,
                recorded: None,
                pin: None,
                throttle: None,
            })
            .collect();
        let vmr = self.register_inner(vm, qmp, cont, saved)?;
        self.save();
        Ok(json!({
            "vm": vmr.name,
            "sockets": vmr.drives.values().map(|d| d.socket.clone()).collect::<Vec<_>>(),
        }))
    }

    fn register_inner(
        self: &Arc<Self>,
        name: String,
        qmp: PathBuf,
        cont: bool,
        drives: Vec<SavedDrive>,
    ) -> Result<Arc<Vm>, SupError> {
        if lock(&self.vms).contains_key(&name) {
            return Err(SupError::Exists(format!("VM {name} is already registered")));
        }
        let dir = self.cfg.run_dir.join(&name);
        create_private_dir(&dir)?;
        let mut slots = BTreeMap::new();
        let mut started: Vec<Arc<DriveSlot>> = Vec::new();
        for sd in drives {
            match self.start_drive(&dir, sd) {
                Ok(s) => {
                    started.push(s.clone());
                    slots.insert(s.spec.id.clone(), s);
                }
                Err(e) => {
                    for s in started {
                        s.stop_server();
                    }
                    return Err(e);
                }
            }
        }
        let vm = Arc::new(Vm {
            name: name.clone(),
            qmp_path: qmp,
            cont,
            dir,
            drives: slots,
            qmp: Mutex::new(None),
            task: Mutex::new(None),
            attach_error: Mutex::new(None),
            run_state: Mutex::new(String::new()),
            continued: AtomicBool::new(false),
        });
        lock(&self.vms).insert(name.clone(), vm.clone());
        info!(vm = %name, drives = vm.drives.len(), "registered");
        self.spawn_vm_task(&vm);
        Ok(vm)
    }

    fn start_drive(&self, dir: &Path, sd: SavedDrive) -> Result<Arc<DriveSlot>, SupError> {
        let spec = sd.spec;
        if !spec.image.exists() {
            return Err(SupError::Invalid(format!(
                "drive {}: image {} does not exist",
                spec.id,
                spec.image.display()
            )));
        }
        let size = if spec.format == "raw" {
            image_size(&spec.image).map_err(|source| SupError::Io {
                what: format!("cannot read the size of {}", spec.image.display()),
                source,
            })?
        } else {
            qemu_img_virtual_size(&spec.image)?
        };
        let lbs = u64::from(spec.logical_block_size);
        if size < lbs {
            return Err(SupError::Invalid(format!(
                "drive {}: image {} holds {size} bytes, less than one block",
                spec.id,
                spec.image.display()
            )));
        }
        let socket = dir.join(format!("{}.sock", spec.id));
        if socket.as_os_str().len() >= 108 {
            return Err(SupError::Invalid(format!(
                "socket path {} is too long for a unix socket; use a shorter run dir",
                socket.display()
            )));
        }
        let cfg = DriveConfig {
            name: spec.id.clone(),
            serial: spec.serial.clone().unwrap_or_else(|| spec.id.clone()),
            capacity_bytes: size / lbs * lbs,
            logical_block_size: spec.logical_block_size,
            read_only: spec.read_only,
            num_queues: spec.queues,
            queue_size: 1024,
            discard: if spec.discard == "ignore" {
                DiscardMode::Ignore
            } else {
                DiscardMode::Unmap
            },
            poll_us: self.cfg.poll_us,
        };
        // A drive that was direct before a restart goes on directly at once (its QEMU nodes
        // are still removed); everything else waits for the supervisor.
        let mut direct_spec = None;
        let (engine, kind): (Arc<dyn Engine>, EngineKind) = match (&sd.recorded, sd.engine) {
            (Some(rec), EngineKind::Direct) if sd.nodes_removed => {
                let path = rec
                    .protocol
                    .as_ref()
                    .map(|p| PathBuf::from(&p.filename))
                    .unwrap_or_else(|| PathBuf::from(&rec.node.filename));
                direct_spec = Some(policy::ServeSpec {
                    image: path.clone(),
                    read_only: spec.read_only,
                    direct: spec.direct,
                    discard: spec.discard.clone(),
                    logical_block_size: spec.logical_block_size,
                    queues: spec.queues,
                    serial: spec.serial.clone(),
                    block_device: false,
                });
                let cfg = FileEngineConfig {
                    path,
                    read_only: spec.read_only,
                    direct: spec.direct,
                    logical_block_size: spec.logical_block_size,
                    lock: true,
                    io: IoMode::Auto,
                };
                let e = FileEngine::open_waiting(cfg, Duration::from_secs(5))?;
                (Arc::new(e), EngineKind::Direct)
            }
            _ => (Arc::new(HeldEngine), EngineKind::Held),
        };
        let drive = Drive::new(cfg, engine);
        let server = Server::bind(&socket, drive.clone())?;
        set_mode(&socket, 0o600)?;
        let stop = server.shutdown_handle();
        let id = spec.id.clone();
        let mut server = server;
        let thread = std::thread::Builder::new()
            .name(format!("vu-{}", id.chars().take(12).collect::<String>()))
            .spawn(move || {
                if let Err(e) = server.run() {
                    warn!(drive = %id, "vhost-user server ended: {e}");
                }
            })
            .map_err(|source| SupError::Io {
                what: "cannot spawn a server thread".into(),
                source,
            })?;
        info!(drive = %spec.id, socket = %socket.display(), engine = kind.as_str(), "serving");
        Ok(Arc::new(DriveSlot {
            socket,
            drive,
            server: Mutex::new(Some((stop, thread))),
            op: tokio::sync::Mutex::new(()),
            rt: Mutex::new(DriveRt {
                engine: kind,
                since: SystemTime::now(),
                reasons: Vec::new(),
                accel_since: None,
                pin: sd.pin,
                pin_persistent: sd.pin.is_some(),
                throttle: sd.throttle,
                applied_throttle: None,
                nodes_removed: sd.nodes_removed,
                recorded: sd.recorded,
                device: None,
                to_direct_us: Vec::new(),
                to_qemu_us: Vec::new(),
                failed_switches: 0,
                last_error: None,
                nbd: None,
                last_view: None,
                direct_spec,
                rates: Rates::default(),
            }),
            spec,
        }))
    }

    /// Hands the drives back to QEMU (when it is reachable) and stops serving them.
    pub async fn unregister(self: &Arc<Self>, name: &str) -> Result<Value, SupError> {
        let vm = self.vm(name)?;
        self.stop_task(&vm);
        let mut handed = Vec::new();
        if let Ok(qmp) = vm.qmp() {
            for d in vm.drives.values() {
                let _g = d.op.lock().await;
                if d.engine_kind() == EngineKind::Direct {
                    // Give QEMU its nodes back; the guest's device loses its server anyway.
                    let paused = block_in_place(|| d.drive.pause())?;
                    d.drive.engine().release();
                    let r = self.restore_nodes(&vm, d, &qmp).await;
                    let _ = block_in_place(|| paused.resume(Arc::new(HeldEngine)));
                    d.set_engine(EngineKind::Held);
                    r?;
                    handed.push(d.spec.id.clone());
                } else if d.engine_kind() == EngineKind::Qemu {
                    d.drive.engine().release();
                    let _ = self.qemu_down(&vm, d, &qmp).await;
                }
            }
        }
        self.forget_vm(&vm);
        Ok(json!({"vm": name, "nodes_restored": handed}))
    }

    fn forget_vm(&self, vm: &Arc<Vm>) {
        lock(&self.vms).remove(&vm.name);
        for d in vm.drives.values() {
            d.stop_server();
        }
        let _ = std::fs::remove_file(vm.nbd_socket());
        let _ = std::fs::remove_dir(&vm.dir);
        *lock(&vm.qmp) = None;
        self.save();
        info!(vm = %vm.name, "unregistered; sockets removed");
    }

    fn stop_task(&self, vm: &Vm) {
        if let Some(t) = lock(&vm.task).take() {
            t.abort();
        }
        *lock(&vm.qmp) = None;
    }

    pub fn detach(&self, name: &str) -> Result<Value, SupError> {
        let vm = self.vm(name)?;
        self.stop_task(&vm);
        Ok(json!({"vm": name, "attached": false}))
    }

    pub fn attach(self: &Arc<Self>, name: &str) -> Result<Value, SupError> {
        let vm = self.vm(name)?;
        self.stop_task(&vm);
        self.spawn_vm_task(&vm);
        Ok(json!({"vm": name, "attaching": true}))
    }

    /// Stops serving everything (acceld shutdown): drains each drive, leaves QEMU as it is, so
    /// the next acceld picks up from the state file.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        self.save();
        let vms: Vec<Arc<Vm>> = lock(&self.vms).values().cloned().collect();
        for vm in vms {
            self.stop_task(&vm);
            for d in vm.drives.values() {
                d.stop_server();
                // Drop image locks now rather than when the kernel tears the rings down.
                d.drive.engine().release();
            }
        }
    }

    // ---- the VM task: attach, reconcile, watch ----

    fn spawn_vm_task(self: &Arc<Self>, vm: &Arc<Vm>) {
        let sup = self.clone();
        let vm2 = vm.clone();
        let h = tokio::spawn(async move { sup.vm_task(vm2).await });
        *lock(&vm.task) = Some(h);
    }

    async fn vm_task(self: Arc<Self>, vm: Arc<Vm>) {
        let mut ever_attached = false;
        loop {
            match self.attach_once(&vm).await {
                Ok(()) => {
                    ever_attached = true;
                    *lock(&vm.attach_error) = None;
                    self.watch(&vm).await;
                }
                Err(e) => {
                    let msg = e.chain();
                    warn!(vm = %vm.name, "attach failed: {msg}");
                    *lock(&vm.attach_error) = Some(msg);
                }
            }
            *lock(&vm.qmp) = None;
            if self.stopping.load(Ordering::Relaxed) {
                return;
            }
            if ever_attached && !vm.qmp_path.exists() {
                // QEMU is gone (its QMP socket went with it): detach cleanly.
                info!(vm = %vm.name, "VM disappeared");
                self.forget_vm(&vm);
                return;
            }
            if ever_attached {
                if let Err(e) = qmp_client::connect(&vm.qmp_path).await {
                    info!(vm = %vm.name, "VM disappeared ({e})");
                    self.forget_vm(&vm);
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn attach_once(&self, vm: &Arc<Vm>) -> Result<(), SupError> {
        let attempts = (self.cfg.attach_timeout_ms / 50).max(1) as u32;
        let qmp = qmp_client::connect_with_retry(&vm.qmp_path, attempts, Duration::from_millis(50))
            .await
            .map_err(|source| SupError::Qmp {
                cmd: "connect".into(),
                source,
            })?;
        let qmp = Arc::new(qmp);
        qmp.set_timeout(Duration::from_millis(self.cfg.qmp_timeout_ms));
        self.find_devices(vm, &qmp).await?;
        self.ensure_iothread(&qmp).await?;
        *lock(&vm.qmp) = Some(qmp.clone());
        info!(vm = %vm.name, "attached");
        self.reconcile_vm(vm, true).await;
        Ok(())
    }

    /// Maps each registered drive to its vhost-user-blk-pci device, by socket path.
    async fn find_devices(&self, vm: &Vm, qmp: &Qmp) -> Result<(), SupError> {
        let chardevs = q(qmp, "query-chardev", Value::Null).await?;
        let mut by_label = BTreeMap::new();
        for c in chardevs.as_array().into_iter().flatten() {
            if let (Some(l), Some(f)) = (c["label"].as_str(), c["filename"].as_str()) {
                // A reconnecting client socket shows as "disconnected:unix:PATH".
                let f = f.strip_prefix("disconnected:").unwrap_or(f);
                if let Some(p) = f.strip_prefix("unix:") {
                    let path = p.split(',').next().unwrap_or(p);
                    by_label.insert(l.to_string(), PathBuf::from(path));
                }
            }
        }
        let list = q(qmp, "qom-list", json!({"path": "/machine/peripheral"})).await?;
        let mut found = BTreeMap::new();
        for p in list.as_array().into_iter().flatten() {
            if p["type"].as_str() != Some("child<vhost-user-blk-pci>") {
                continue;
            }
            let Some(dev) = p["name"].as_str() else {
                continue;
            };
            let ch = q(
                qmp,
                "qom-get",
                json!({"path": format!("/machine/peripheral/{dev}"), "property": "chardev"}),
            )
            .await?;
            if let Some(path) = ch.as_str().and_then(|l| by_label.get(l)) {
                found.insert(path.clone(), dev.to_string());
            }
        }
        for d in vm.drives.values() {
            let dev = found.get(&d.socket).cloned();
            if dev.is_none() {
                warn!(vm = %vm.name, drive = %d.spec.id, socket = %d.socket.display(), "no vhost-user-blk-pci device uses this drive's socket");
            }
            lock(&d.rt).device = dev;
        }
        Ok(())
    }

    async fn ensure_iothread(&self, qmp: &Qmp) -> Result<(), SupError> {
        let objs = q(qmp, "qom-list", json!({"path": "/objects"})).await?;
        let have = objs
            .as_array()
            .into_iter()
            .flatten()
            .any(|o| o["name"].as_str() == Some(&self.cfg.iothread));
        if !have {
            q(
                qmp,
                "object-add",
                json!({"qom-type": "iothread", "id": self.cfg.iothread}),
            )
            .await?;
        }
        Ok(())
    }

    async fn watch(&self, vm: &Arc<Vm>) {
        let Ok(qmp) = vm.qmp() else { return };
        let mut events = qmp.events();
        let mut tick = tokio::time::interval(Duration::from_millis(self.cfg.poll_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ev = events.recv() => match ev {
                    Ok(ev) => {
                        let relevant = matches!(ev.name.as_str(),
                            "STOP" | "RESUME" | "SHUTDOWN" | "MIGRATION" | "BLOCK_JOB_COMPLETED"
                            | "BLOCK_JOB_CANCELLED" | "BLOCK_JOB_READY" | "BLOCK_JOB_ERROR"
                            | "BLOCK_JOB_PENDING" | "JOB_STATUS_CHANGE" | "BLOCK_EXPORT_DELETED"
                            | "DEVICE_DELETED");
                        debug!(vm = %vm.name, event = %ev.name, "QMP event");
                        if relevant {
                            // Let a burst of events settle, then look once.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            while events.try_recv().is_ok() {}
                            self.reconcile_vm(vm, false).await;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        self.reconcile_vm(vm, false).await;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick() => {
                    if qmp.is_closed() {
                        return;
                    }
                    self.reconcile_vm(vm, false).await;
                }
            }
        }
    }

    async fn snapshot(&self, qmp: &Qmp) -> Result<QemuSnapshot, SupError> {
        let nodes_v = q(qmp, "query-named-block-nodes", json!({"flat": true})).await?;
        let nodes =
            policy::qemu::parse_nodes(&nodes_v).map_err(|e| SupError::Parse(e.to_string()))?;
        let graph = match q(qmp, "x-debug-query-block-graph", Value::Null).await {
            Ok(g) => policy::qemu::parse_graph(&g).ok(),
            Err(_) => None,
        };
        let qb = q(qmp, "query-block", Value::Null).await?;
        let throttled = policy::qemu::throttled_nodes(&qb);
        let status = q(qmp, "query-status", Value::Null).await?;
        let migrate = q(qmp, "query-migrate", Value::Null).await.ok();
        let vmst = policy::qemu::vm_state(&status, migrate.as_ref());
        let ex = q(qmp, "query-block-exports", Value::Null).await?;
        let exports = ex
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| {
                Some((
                    e["id"].as_str()?.to_string(),
                    e["node-name"].as_str()?.to_string(),
                ))
            })
            .collect();
        Ok(QemuSnapshot {
            nodes,
            graph,
            throttled,
            vm: vmst,
            exports,
        })
    }

    /// The policy's view of a drive, with acceld's own export and throttle filter taken out
    /// of the parents, and the recorded nodes standing in for removed ones.
    fn view(&self, d: &DriveSlot, snap: &QemuSnapshot) -> DriveView {
        let rt = lock(&d.rt);
        let ctx = policy::qemu::DriveContext {
            vm: snap.vm.clone(),
            memory_shared: true,
            pin: rt.pin,
            options: policy::RecordedOptions {
                discard: d.spec.discard.clone(),
                logical_block_size: d.spec.logical_block_size,
                queues: d.spec.queues,
                serial: d.spec.serial.clone(),
            },
            throttled: snap.throttled.clone(),
        };
        let id = &d.spec.id;
        let present = snap.nodes.iter().any(|n| &n.name == id);
        if !present && rt.nodes_removed {
            if let Some(rec) = &rt.recorded {
                return DriveView {
                    drive: id.clone(),
                    node: Some(rec.node.clone()),
                    protocol: rec.protocol.clone(),
                    parents: Vec::new(),
                    other_children: Vec::new(),
                    vm: ctx.vm.clone(),
                    memory_shared: true,
                    pin: ctx.pin,
                    options: ctx.options.clone(),
                };
            }
        }
        let mut v = policy::qemu::drive_view(id, &snap.nodes, snap.graph.as_ref(), &ctx);
        // Our own users of the node are not reasons.
        let ours_export = snap
            .exports
            .iter()
            .any(|(e, n)| e == &export_id(id) && n == id);
        if ours_export {
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

    fn decide(&self, d: &DriveSlot, view: &DriveView) -> Decision {
        let mut dec = policy::decide(view);
        let throttled = lock(&d.rt).throttle.is_some();
        if throttled {
            dec = match dec {
                Decision::Accelerate(_) => Decision::Qemu(vec![Reason::Throttle]),
                Decision::Qemu(mut r) => {
                    if !r.contains(&Reason::Throttle) {
                        r.push(Reason::Throttle);
                    }
                    Decision::Qemu(r)
                }
            };
        }
        dec
    }

    async fn reconcile_vm(&self, vm: &Arc<Vm>, urgent: bool) {
        let Ok(qmp) = vm.qmp() else { return };
        for d in vm.drives.values() {
            if let Err(e) = self.reconcile(vm, d, &qmp, urgent).await {
                let msg = e.chain();
                warn!(vm = %vm.name, drive = %d.spec.id, "{msg}");
                lock(&d.rt).last_error = Some(msg);
            }
        }
        if let Ok(st) = q(&qmp, "query-status", Value::Null).await {
            let s = st["status"].as_str().unwrap_or_default().to_string();
            *lock(&vm.run_state) = s.clone();
            let all_served = vm
                .drives
                .values()
                .all(|d| d.engine_kind() != EngineKind::Held);
            if vm.cont
                && s == "prelaunch"
                && all_served
                && !vm.continued.swap(true, Ordering::Relaxed)
            {
                match q(&qmp, "cont", Value::Null).await {
                    Ok(_) => info!(vm = %vm.name, "every drive has an engine: cont"),
                    Err(e) => warn!(vm = %vm.name, "cont failed: {}", e.chain()),
                }
            }
        }
        self.save();
    }

    /// Looks at one drive and switches it when the policy's answer changed.
    async fn reconcile(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<DriveSlot>,
        qmp: &Arc<Qmp>,
        urgent: bool,
    ) -> Result<(), SupError> {
        let _g = d.op.lock().await;
        if lock(&d.rt).device.is_none() {
            return Ok(());
        }
        let snap = self.snapshot(qmp).await?;
        let view = self.view(d, &snap);
        let dec = self.decide(d, &view);
        let cur = d.engine_kind();
        let reasons = match &dec {
            Decision::Qemu(r) => r.clone(),
            Decision::Accelerate(_) => Vec::new(),
        };
        {
            let mut rt = lock(&d.rt);
            rt.reasons = reasons;
            rt.last_view = Some(view.clone());
        }
        match (&dec, cur) {
            (Decision::Accelerate(_), EngineKind::Direct) => {
                lock(&d.rt).accel_since = None;
                Ok(())
            }
            (Decision::Accelerate(spec), EngineKind::Qemu) => {
                let quiet = Duration::from_millis(self.cfg.quiet_period_ms);
                let since = *lock(&d.rt).accel_since.get_or_insert_with(Instant::now);
                if !urgent && since.elapsed() < quiet {
                    return Ok(());
                }
                if lock(&d.rt).applied_throttle.is_some() {
                    // Lift the limits first: the drain would otherwise wait for every request
                    // the throttle is holding back (in flight / limit seconds).
                    let unlimited = json!({"iops-total": 0, "iops-read": 0, "iops-write": 0,
                                           "bps-total": 0, "bps-read": 0, "bps-write": 0});
                    let r = q(
                        qmp,
                        "qom-set",
                        json!({"path": group_id(&d.spec.id), "property": "limits", "value": unlimited}),
                    )
                    .await;
                    if let Err(e) = r {
                        debug!(drive = %d.spec.id, "cannot lift the limits before the switch: {}", e.chain());
                    }
                }
                self.transition(vm, d, qmp, Target::Direct(spec.clone()))
                    .await
            }
            (Decision::Accelerate(spec), EngineKind::Held) => {
                self.transition(vm, d, qmp, Target::Direct(spec.clone()))
                    .await
            }
            (Decision::Qemu(_), EngineKind::Qemu) => {
                lock(&d.rt).accel_since = None;
                let (want, have) = {
                    let rt = lock(&d.rt);
                    (rt.throttle.clone(), rt.applied_throttle.clone())
                };
                let export_ok = snap
                    .exports
                    .iter()
                    .any(|(e, _)| e == &export_id(&d.spec.id));
                match (&want, &have) {
                    _ if !export_ok => {
                        warn!(drive = %d.spec.id, "acceld's NBD export is gone; re-creating it");
                        self.transition(vm, d, qmp, Target::Qemu).await
                    }
                    (Some(w), Some(h)) if w != h => {
                        // New limits on the same group: no switch needed.
                        q(
                            qmp,
                            "qom-set",
                            json!({"path": group_id(&d.spec.id), "property": "limits", "value": w}),
                        )
                        .await?;
                        lock(&d.rt).applied_throttle = Some(w.clone());
                        Ok(())
                    }
                    (Some(_), None) | (None, Some(_)) => {
                        self.transition(vm, d, qmp, Target::Qemu).await
                    }
                    _ => Ok(()),
                }
            }
            (Decision::Qemu(_), EngineKind::Direct | EngineKind::Held) => {
                lock(&d.rt).accel_since = None;
                self.transition(vm, d, qmp, Target::Qemu).await
            }
        }
    }

    // ---- switching ----

    async fn transition(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<DriveSlot>,
        qmp: &Arc<Qmp>,
        to: Target,
    ) -> Result<(), SupError> {
        let from = d.engine_kind();
        let drive = d.drive.clone();
        let paused = block_in_place(|| drive.pause())?;
        drive.engine().release();
        let res = match self.bring_up(vm, d, qmp, &to).await {
            Ok(engine) => match block_in_place(|| paused.resume(engine)) {
                Ok(rep) => Ok(rep),
                Err((p, e)) => Err((p, SupError::Switch(e))),
            },
            Err(e) => Err((paused, e)),
        };
        match res {
            Ok(rep) => {
                let us = rep.pause.as_micros() as u64;
                let mut rt = lock(&d.rt);
                match to {
                    Target::Direct(_) => rt.to_direct_us.push(us),
                    Target::Qemu => rt.to_qemu_us.push(us),
                }
                rt.last_error = None;
                drop(rt);
                info!(vm = %vm.name, drive = %d.spec.id, from = from.as_str(), to = to.kind().as_str(), pause_us = us, "switched");
                self.save();
                Ok(())
            }
            Err((paused, e)) => {
                warn!(vm = %vm.name, drive = %d.spec.id, "switch to {} failed, rolling back: {}", to.kind().as_str(), e.chain());
                lock(&d.rt).failed_switches += 1;
                let back = match from {
                    EngineKind::Direct => lock(&d.rt).direct_spec.clone().map(Target::Direct),
                    EngineKind::Qemu => Some(Target::Qemu),
                    EngineKind::Held => None,
                };
                let restored = match back {
                    Some(t) => match self.bring_up(vm, d, qmp, &t).await {
                        Ok(engine) => block_in_place(|| paused.resume(engine))
                            .map_err(|(p, e)| (p, SupError::Switch(e))),
                        Err(e2) => Err((paused, e2)),
                    },
                    None => Err((paused, SupError::QemuState("have a way back".into()))),
                };
                if let Err((paused, e2)) = restored {
                    warn!(vm = %vm.name, drive = %d.spec.id, "rollback failed, holding the drive's requests: {}", e2.chain());
                    let _ = block_in_place(|| paused.resume(Arc::new(HeldEngine)));
                    d.set_engine(EngineKind::Held);
                }
                self.save();
                Err(e)
            }
        }
    }

    /// Makes `to` serve the drive and returns its engine (the drive is paused and the old
    /// engine released).
    async fn bring_up(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<DriveSlot>,
        qmp: &Qmp,
        to: &Target,
    ) -> Result<Arc<dyn Engine>, SupError> {
        match to {
            Target::Direct(spec) => {
                self.qemu_down(vm, d, qmp).await?;
                self.remove_nodes(vm, d, qmp).await?;
                let opened = FileEngine::open(FileEngineConfig {
                    path: spec.image.clone(),
                    read_only: d.spec.read_only || spec.read_only,
                    direct: spec.direct,
                    logical_block_size: d.spec.logical_block_size,
                    lock: true,
                    io: IoMode::Auto,
                });
                let e = match opened {
                    Ok(e) if e.size() >= d.drive.config().capacity_bytes => e,
                    Ok(e) => {
                        e.release();
                        self.restore_nodes(vm, d, qmp).await?;
                        return Err(SupError::Invalid(format!(
                            "image {} is smaller than the disk the guest sees",
                            spec.image.display()
                        )));
                    }
                    Err(err) => {
                        self.restore_nodes(vm, d, qmp).await?;
                        return Err(err.into());
                    }
                };
                {
                    let mut rt = lock(&d.rt);
                    rt.applied_throttle = None;
                    rt.nbd = None;
                    rt.direct_spec = Some(spec.clone());
                }
                d.set_engine(EngineKind::Direct);
                Ok(Arc::new(e))
            }
            Target::Qemu => {
                self.qemu_down(vm, d, qmp).await?;
                self.restore_nodes(vm, d, qmp).await?;
                let id = d.spec.id.clone();
                let throttle = lock(&d.rt).throttle.clone();
                let top = match &throttle {
                    Some(l) => {
                        q(
                            qmp,
                            "object-add",
                            json!({"qom-type": "throttle-group", "id": group_id(&id), "limits": l}),
                        )
                        .await?;
                        let r = q(
                            qmp,
                            "blockdev-add",
                            json!({"driver": "throttle", "node-name": filter_node(&id),
                                   "throttle-group": group_id(&id), "file": id}),
                        )
                        .await;
                        if let Err(e) = r {
                            let _ = q(qmp, "object-del", json!({"id": group_id(&id)})).await;
                            return Err(e);
                        }
                        filter_node(&id)
                    }
                    None => id.clone(),
                };
                let sock = vm.nbd_socket();
                let r = q(
                    qmp,
                    "nbd-server-start",
                    json!({"addr": {"type": "unix", "data": {"path": sock}}}),
                )
                .await;
                if let Err(e) = r {
                    if !e.chain().contains("already running") {
                        return Err(e);
                    }
                }
                q(
                    qmp,
                    "block-export-add",
                    json!({"type": "nbd", "id": export_id(&id), "node-name": top, "name": id,
                           "writable": !d.spec.read_only, "iothread": self.cfg.iothread}),
                )
                .await?;
                let engine = block_in_place(|| NbdEngine::connect(&sock, &id))?;
                if engine.info().size < d.drive.config().capacity_bytes {
                    return Err(SupError::Invalid(format!(
                        "QEMU's export of {id} holds {} bytes, less than the disk the guest sees",
                        engine.info().size
                    )));
                }
                {
                    let mut rt = lock(&d.rt);
                    rt.applied_throttle = throttle;
                    rt.nbd = Some(engine.stats());
                }
                d.set_engine(EngineKind::Qemu);
                Ok(Arc::new(engine))
            }
        }
    }

    /// Removes acceld's export, throttle filter and throttle group of the drive, if present.
    async fn qemu_down(&self, _vm: &Vm, d: &DriveSlot, qmp: &Qmp) -> Result<(), SupError> {
        let id = &d.spec.id;
        let ex = q(qmp, "query-block-exports", Value::Null).await?;
        let has = |v: &Value| {
            v.as_array()
                .into_iter()
                .flatten()
                .any(|e| e["id"].as_str() == Some(&export_id(id)))
        };
        if has(&ex) {
            q(
                qmp,
                "block-export-del",
                json!({"id": export_id(id), "mode": "hard"}),
            )
            .await?;
            let t0 = Instant::now();
            loop {
                let ex = q(qmp, "query-block-exports", Value::Null).await?;
                if !has(&ex) {
                    break;
                }
                if t0.elapsed() > Duration::from_secs(10) {
                    return Err(SupError::QemuState(format!(
                        "remove export {} within 10 s",
                        export_id(id)
                    )));
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        let nodes = q(qmp, "query-named-block-nodes", json!({"flat": true})).await?;
        let has_filter = nodes
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["node-name"].as_str() == Some(&filter_node(id)));
        if has_filter {
            q(qmp, "blockdev-del", json!({"node-name": filter_node(id)})).await?;
        }
        let objs = q(qmp, "qom-list", json!({"path": "/objects"})).await?;
        let has_group = objs
            .as_array()
            .into_iter()
            .flatten()
            .any(|o| o["name"].as_str() == Some(&group_id(id)));
        if has_group {
            q(qmp, "object-del", json!({"id": group_id(id)})).await?;
        }
        lock(&d.rt).applied_throttle = None;
        Ok(())
    }

    /// Deletes the drive's nodes from QEMU, recording them for [`Self::restore_nodes`].
    async fn remove_nodes(&self, _vm: &Vm, d: &DriveSlot, qmp: &Qmp) -> Result<(), SupError> {
        if lock(&d.rt).nodes_removed {
            return Ok(());
        }
        let view = lock(&d.rt).last_view.clone().ok_or_else(|| {
            SupError::QemuState("show the drive's nodes before the switch".into())
        })?;
        let node = view
            .node
            .clone()
            .ok_or_else(|| SupError::NotFound(format!("QEMU has no node {}", d.spec.id)))?;
        {
            let mut rt = lock(&d.rt);
            rt.recorded = Some(Recorded {
                node: node.clone(),
                protocol: view.protocol.clone(),
            });
        }
        // Persist the recipe before the nodes go away.
        self.save();
        q(qmp, "blockdev-del", json!({"node-name": node.name})).await?;
        if let Some(p) = &view.protocol {
            if let Err(e) = q(qmp, "blockdev-del", json!({"node-name": p.name})).await {
                let _ = self.add_nodes(d, qmp, false).await;
                return Err(e);
            }
        }
        lock(&d.rt).nodes_removed = true;
        self.save();
        Ok(())
    }

    /// Re-creates nodes removed by [`Self::remove_nodes`].
    async fn restore_nodes(&self, _vm: &Vm, d: &DriveSlot, qmp: &Qmp) -> Result<(), SupError> {
        if !lock(&d.rt).nodes_removed {
            return Ok(());
        }
        self.add_nodes(d, qmp, true).await?;
        lock(&d.rt).nodes_removed = false;
        self.save();
        Ok(())
    }

    async fn add_nodes(
        &self,
        d: &DriveSlot,
        qmp: &Qmp,
        protocol_too: bool,
    ) -> Result<(), SupError> {
        let rec = lock(&d.rt)
            .recorded
            .clone()
            .ok_or_else(|| SupError::QemuState("record the drive's nodes".into()))?;
        let discard = if d.spec.discard == "unmap" {
            "unmap"
        } else {
            "ignore"
        };
        let node_opts = |n: &NodeView| {
            json!({
                "node-name": n.name,
                "read-only": n.read_only,
                "discard": discard,
                "cache": {"direct": n.cache_direct, "no-flush": n.cache_no_flush},
            })
        };
        match &rec.protocol {
            Some(p) => {
                if protocol_too {
                    let mut a = node_opts(p);
                    a["driver"] = p.driver.clone().into();
                    a["filename"] = p.filename.clone().into();
                    q(qmp, "blockdev-add", a).await?;
                }
                let mut a = node_opts(&rec.node);
                a["driver"] = rec.node.driver.clone().into();
                a["file"] = p.name.clone().into();
                if let Err(e) = q(qmp, "blockdev-add", a).await {
                    if protocol_too {
                        let _ = q(qmp, "blockdev-del", json!({"node-name": p.name})).await;
                    }
                    return Err(e);
                }
            }
            None => {
                let mut a = node_opts(&rec.node);
                a["driver"] = rec.node.driver.clone().into();
                a["filename"] = rec.node.filename.clone().into();
                q(qmp, "blockdev-add", a).await?;
            }
        }
        Ok(())
    }

    // ---- operator requests ----

    pub async fn set_pin(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        pin: Option<Pin>,
        persistent: bool,
    ) -> Result<Value, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        {
            let mut rt = lock(&d.rt);
            rt.pin = pin;
            rt.pin_persistent = persistent && pin.is_some();
        }
        self.act_now(&vmr, &d, true).await
    }

    /// Sets or clears a throttle. Setting acts at once; clearing lets the drive go back to
    /// direct after the quiet period (unless something else keeps it in QEMU).
    pub async fn set_throttle(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        limits: Option<ThrottleLimits>,
    ) -> Result<Value, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        if limits.as_ref().is_some_and(|l| l.is_empty()) {
            return Err(SupError::Invalid(
                "no limit given: name at least one, or clear the throttle".into(),
            ));
        }
        let urgent = limits.is_some();
        lock(&d.rt).throttle = limits;
        self.act_now(&vmr, &d, urgent).await
    }

    /// Reconciles one drive now (operator request); `urgent` skips the quiet period.
    async fn act_now(
        self: &Arc<Self>,
        vm: &Arc<Vm>,
        d: &Arc<DriveSlot>,
        urgent: bool,
    ) -> Result<Value, SupError> {
        let qmp = vm.qmp()?;
        if lock(&d.rt).device.is_none() {
            return Err(SupError::NotFound(format!(
                "VM {} has no vhost-user-blk-pci device on {} (see the VM contract: accelctl qemu-args)",
                vm.name,
                d.socket.display()
            )));
        }
        let r = self.reconcile(vm, d, &qmp, urgent).await;
        self.save();
        r?;
        Ok(self.drive_status(vm, d))
    }

    pub async fn explain(&self, vm: &str, drive: &str) -> Result<Value, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let qmp = vmr.qmp()?;
        let snap = self.snapshot(&qmp).await?;
        let view = self.view(&d, &snap);
        let dec = self.decide(&d, &view);
        let (verdict, reasons) = match &dec {
            Decision::Accelerate(_) => ("direct", Vec::new()),
            Decision::Qemu(r) => ("qemu", r.clone()),
        };
        Ok(json!({
            "vm": vm,
            "drive": drive,
            "engine": d.engine_kind().as_str(),
            "decision": verdict,
            "reasons": reasons.iter().map(|r| json!({"code": r.code(), "sentence": r.sentence()})).collect::<Vec<_>>(),
            "serve": match &dec { Decision::Accelerate(s) => serde_json::to_value(s).unwrap_or(Value::Null), _ => Value::Null },
            "view": serde_json::to_value(&view).unwrap_or(Value::Null),
        }))
    }

    // ---- status ----

    /// Updates every drive's rates (called about once a second).
    pub fn sample_rates(&self) {
        let vms: Vec<Arc<Vm>> = lock(&self.vms).values().cloned().collect();
        for vm in vms {
            for d in vm.drives.values() {
                let s = &d.drive.stats;
                let ops = s.reads.load(Ordering::Relaxed) + s.writes.load(Ordering::Relaxed);
                let bytes =
                    s.bytes_read.load(Ordering::Relaxed) + s.bytes_written.load(Ordering::Relaxed);
                let lat = s.latency.snapshot();
                let now = Instant::now();
                let mut rt = lock(&d.rt);
                let r = &mut rt.rates;
                if let (Some(at), Some(prev)) = (r.at, r.lat) {
                    let dt = now.duration_since(at).as_secs_f64().max(1e-3);
                    r.iops = (ops - r.ops.min(ops)) as f64 / dt;
                    r.mbps = (bytes - r.bytes.min(bytes)) as f64 / dt / 1e6;
                    let diff: [u64; 40] = std::array::from_fn(|i| lat[i] - prev[i].min(lat[i]));
                    r.p99_us = LatencyHistogram::quantile_us(&diff, 0.99);
                }
                r.at = Some(now);
                r.ops = ops;
                r.bytes = bytes;
                r.lat = Some(lat);
            }
        }
    }

    fn drive_status(&self, vm: &Vm, d: &DriveSlot) -> Value {
        let rt = lock(&d.rt);
        let s = &d.drive.stats;
        let since = rt
            .since
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|t| t.as_secs())
            .unwrap_or(0);
        let nbd_errors = rt
            .nbd
            .as_ref()
            .map(|n| n.errors.load(Ordering::Relaxed))
            .unwrap_or(0);
        let nbd_last = rt.nbd.as_ref().and_then(|n| lock(&n.last_error).clone());
        json!({
            "vm": vm.name,
            "drive": d.spec.id,
            "device": rt.device,
            "socket": d.socket,
            "image": d.spec.image,
            "format": d.spec.format,
            "engine": rt.engine.as_str(),
            "since": since,
            "reasons": rt.reasons.iter().map(|r| r.code()).collect::<Vec<_>>(),
            "reason_sentences": rt.reasons.iter().map(|r| r.sentence()).collect::<Vec<_>>(),
            "pin": rt.pin.map(|p| match p { Pin::Qemu => "qemu", Pin::Direct => "direct" }),
            "throttle": rt.throttle,
            "switches": s.switches.load(Ordering::Relaxed),
            "failed_switches": rt.failed_switches,
            "last_pause_us": s.last_pause_us.load(Ordering::Relaxed),
            "pauses_to_direct": pause_stats(&rt.to_direct_us),
            "pauses_to_qemu": pause_stats(&rt.to_qemu_us),
            "iops": (rt.rates.iops * 10.0).round() / 10.0,
            "mbps": (rt.rates.mbps * 100.0).round() / 100.0,
            "p99_us": rt.rates.p99_us,
            "in_flight": s.in_flight.load(Ordering::Relaxed),
            "reads": s.reads.load(Ordering::Relaxed),
            "writes": s.writes.load(Ordering::Relaxed),
            "bytes_read": s.bytes_read.load(Ordering::Relaxed),
            "bytes_written": s.bytes_written.load(Ordering::Relaxed),
            "errors": s.io_errors.load(Ordering::Relaxed),
            "nbd_errors": nbd_errors,
            "last_error": rt.last_error.clone().or(nbd_last),
        })
    }

    pub fn status(&self) -> Value {
        let vms: Vec<Arc<Vm>> = lock(&self.vms).values().cloned().collect();
        let mut out = Vec::new();
        for vm in &vms {
            out.push(json!({
                "vm": vm.name,
                "qmp": vm.qmp_path,
                "attached": vm.qmp().is_ok(),
                "run_state": lock(&vm.run_state).clone(),
                "attach_error": lock(&vm.attach_error).clone(),
                "drives": vm.drives.values().map(|d| self.drive_status(vm, d)).collect::<Vec<_>>(),
            }));
        }
        json!({"vms": out})
    }

    /// The VM contract as QEMU arguments, one per element.
    pub fn qemu_args(&self, vm: &str, memory: &str) -> Result<Value, SupError> {
        let vmr = self.vm(vm)?;
        if memory.is_empty()
            || !memory
                .trim_end_matches(['K', 'M', 'G', 'T'])
                .chars()
                .all(|c| c.is_ascii_digit())
        {
            return Err(SupError::Invalid(format!(
                "memory size '{memory}' is not a number with an optional K/M/G/T suffix"
            )));
        }
        let mut a: Vec<String> = vec![
            "-object".into(),
            format!("memory-backend-memfd,id=accel-mem,size={memory},share=on"),
            "-machine".into(),
            "memory-backend=accel-mem".into(),
            "-m".into(),
            memory.into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", vmr.qmp_path.display()),
            "-object".into(),
            format!("iothread,id={}", self.cfg.iothread),
        ];
        for d in vmr.drives.values() {
            let s = &d.spec;
            let ro = if s.read_only { ",read-only=on" } else { "" };
            let direct = if s.direct { "on" } else { "off" };
            a.push("-blockdev".into());
            a.push(format!(
                "driver=file,filename={},node-name={}-file,cache.direct={direct},discard={}{ro}",
                s.image.display(),
                s.id,
                s.discard
            ));
            a.push("-blockdev".into());
            a.push(format!(
                "driver={},file={}-file,node-name={},cache.direct={direct},discard={}{ro}",
                s.format, s.id, s.id, s.discard
            ));
            a.push("-chardev".into());
            a.push(format!(
                "socket,id={}-sock,path={},reconnect-ms=1000",
                s.id,
                d.socket.display()
            ));
            a.push("-device".into());
            a.push(format!(
                "vhost-user-blk-pci,id={},chardev={}-sock,num-queues={}",
                s.id, s.id, s.queues
            ));
        }
        a.push("-S".into());
        Ok(json!(a))
    }

    /// Prometheus text exposition of every drive's counters.
    pub fn metrics(&self) -> String {
        let st = self.status();
        let mut out = String::new();
        let metrics: [(&str, &str, &str); 9] = [
            ("accel_drive_reads_total", "counter", "reads"),
            ("accel_drive_writes_total", "counter", "writes"),
            ("accel_drive_read_bytes_total", "counter", "bytes_read"),
            (
                "accel_drive_written_bytes_total",
                "counter",
                "bytes_written",
            ),
            ("accel_drive_errors_total", "counter", "errors"),
            ("accel_drive_switches_total", "counter", "switches"),
            ("accel_drive_in_flight", "gauge", "in_flight"),
            (
                "accel_drive_last_pause_microseconds",
                "gauge",
                "last_pause_us",
            ),
            ("accel_drive_iops", "gauge", "iops"),
        ];
        let drives: Vec<&Value> = st["vms"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|v| v["drives"].as_array().into_iter().flatten())
            .collect();
        for (name, typ, field) in metrics {
            out.push_str(&format!("# TYPE {name} {typ}\n"));
            for d in &drives {
                out.push_str(&format!(
                    "{name}{{vm=\"{}\",drive=\"{}\",engine=\"{}\"}} {}\n",
                    d["vm"].as_str().unwrap_or_default(),
                    d["drive"].as_str().unwrap_or_default(),
                    d["engine"].as_str().unwrap_or_default(),
                    d[field].as_f64().unwrap_or(0.0)
                ));
            }
        }
        out
    }
}

#[derive(Clone, Debug)]
enum Target {
    Direct(policy::ServeSpec),
    Qemu,
}

impl Target {
    fn kind(&self) -> EngineKind {
        match self {
            Target::Direct(_) => EngineKind::Direct,
            Target::Qemu => EngineKind::Qemu,
        }
    }
}

fn create_private_dir(dir: &Path) -> Result<(), SupError> {
    std::fs::create_dir_all(dir).map_err(|source| SupError::Io {
        what: format!("cannot create {}", dir.display()),
        source,
    })?;
    set_mode(dir, 0o700)
}

fn set_mode(p: &Path, mode: u32) -> Result<(), SupError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(|source| {
        SupError::Io {
            what: format!("cannot set the mode of {}", p.display()),
            source,
        }
    })
}

/// The guest-visible size of a non-raw image (`qemu-img info -U`).
fn qemu_img_virtual_size(image: &Path) -> Result<u64, SupError> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(image)
        .output()
        .map_err(|source| SupError::Io {
            what: "cannot run qemu-img (qemu-utils)".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(SupError::Invalid(format!(
            "qemu-img info {}: {}",
            image.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| SupError::Parse(format!("qemu-img info: {e}")))?;
    v["virtual-size"]
        .as_u64()
        .ok_or_else(|| SupError::Parse("qemu-img info has no virtual-size".into()))
}
