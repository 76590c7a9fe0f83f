//! The supervisor of `acceld run`: a registry of VMs and their drives; for each VM a task that
//! attaches over QMP, asks `policy` about every drive, and moves each drive between the direct
//! engine (the raw file) and the qemu engine (NBD to the VM's own QEMU) — or holds its requests
//! while neither may serve it.
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
//! The parts, each in its own file:
//! - `registry.rs`: register, unregister, restore (the VM map) and `persist.rs` (state file);
//! - `vm.rs`: one VM's task: attach, find devices, watch events, reconcile;
//! - `observe.rs`: QEMU's answers -> the policy's view and decision;
//! - `plan.rs`: PURE: (decision, placement, intent, graph) -> an action;
//! - `switch.rs`: the executor: performs an action with timeouts, rollback and hold;
//! - `qemu_graph.rs`: the typed QMP steps (nodes, throttle filter, NBD export);
//! - `drive_state.rs`: per-drive state split by concern;
//! - `status.rs`, `contract.rs`: what `status` and `qemu-args` answer.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accel_api::control::{ErrorKind, ThrottleLimits};
use accel_api::status::{DriveStatus, EngineKind};
use policy::{Decision, Pin};
use qmp_client::{Command, Qmp, QmpError};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::warn;

use accel_dataplane::drive::DEFAULT_POLL_US;
use accel_dataplane::engine::nbd::NbdError;
use accel_dataplane::engine::EngineError;
use accel_dataplane::util::lock;

mod contract;
mod drive_state;
mod exit_watch;
mod migration;
mod observe;
pub(crate) mod offload;
mod permit;
mod persist;
pub mod plan;
mod qemu_graph;
mod registry;
mod status;
mod switch;
mod vm;

pub use drive_state::{ManagedDrive, Recorded};
pub use permit::{secure_own, Owner, Permitted};
pub use persist::PersistError;
pub use vm::Vm;

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
    /// On SIGTERM, how long acceld waits for requests in flight before it exits anyway.
    pub shutdown_timeout_ms: u64,
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
            shutdown_timeout_ms: 10_000,
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
    /// Not allowed through the socket it came on (a VM's own control socket).
    #[error("{0}")]
    Denied(String),
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
    Switch(#[from] accel_dataplane::drive::SwitchError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Nbd(#[from] NbdError),
    #[error(transparent)]
    Serve(#[from] accel_dataplane::vhost::ServeError),
    #[error(transparent)]
    Persist(#[from] PersistError),
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
            SupError::Invalid(_) | SupError::Persist(PersistError::Damaged { .. }) => {
                ErrorKind::Invalid
            }
            SupError::NotFound(_) => ErrorKind::NotFound,
            SupError::Exists(_) => ErrorKind::Exists,
            SupError::Denied(_) => ErrorKind::Denied,
            _ => ErrorKind::Failed,
        }
    }

    /// The error and its sources, one line.
    pub fn chain(&self) -> String {
        crate::error_chain(self)
    }
}

/// Runs one typed QMP command; a failure names the command.
async fn qmp_run<C: Command>(qmp: &Qmp, cmd: &C) -> Result<C::Ok, SupError> {
    qmp.execute(cmd).await.map_err(|source| SupError::Qmp {
        cmd: C::NAME.to_string(),
        source,
    })
}

/// What `explain` answers.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    pub vm: String,
    pub drive: String,
    pub engine: EngineKind,
    /// "direct" or "qemu".
    pub decision: &'static str,
    pub reasons: Vec<ReasonText>,
    /// How the drive would be served directly (when the rules allow it).
    pub serve: Option<policy::ServeSpec>,
    pub view: policy::DriveView,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReasonText {
    pub code: String,
    pub sentence: String,
}

pub struct Supervisor {
    pub cfg: Config,
    vms: Mutex<BTreeMap<String, Arc<Vm>>>,
    /// The registry's state file: only [`Supervisor::save`] writes it.
    state: persist::StateFile,
    /// Set when acceld stops: VM tasks end without touching QEMU.
    stopping: AtomicBool,
    register_hook: Mutex<Option<RegisterHook>>,
    /// VMs whose QEMU's user may register them (`permit.rs`).
    permits: Mutex<BTreeMap<String, permit::Permit>>,
    /// Names whose registration is under way (two at once would both build drives).
    registering: Mutex<std::collections::BTreeSet<String>>,
}

type RegisterHook = Box<dyn Fn(&str) + Send + Sync>;

impl Supervisor {
    pub fn new(cfg: Config) -> Arc<Self> {
        Arc::new(Supervisor {
            state: persist::StateFile::new(cfg.state_path()),
            cfg,
            vms: Mutex::new(BTreeMap::new()),
            stopping: AtomicBool::new(false),
            register_hook: Mutex::new(None),
            permits: Mutex::new(BTreeMap::new()),
            registering: Mutex::new(std::collections::BTreeSet::new()),
        })
    }

    fn vm(&self, name: &str) -> Result<Arc<Vm>, SupError> {
        lock(&self.vms)
            .get(name)
            .cloned()
            .ok_or_else(|| SupError::NotFound(format!("no VM named {name} is registered")))
    }

    /// The drive itself (its engine, its pause), for in-process tests and tools.
    pub fn drive_handle(
        &self,
        vm: &str,
        drive: &str,
    ) -> Result<Arc<accel_dataplane::drive::Drive>, SupError> {
        Ok(self.vm(vm)?.drive(drive)?.drive.clone())
    }

    fn all_vms(&self) -> Vec<Arc<Vm>> {
        lock(&self.vms).values().cloned().collect()
    }

    /// The QMP connection to a registered VM's QEMU (for the QMP proxy).
    pub fn vm_qmp(&self, name: &str) -> Result<Arc<qmp_client::Qmp>, SupError> {
        self.vm(name)?.qmp()
    }

    /// Starts QEMU's one NBD server on acceld's socket of the VM (or finds it started) and
    /// returns that socket: the QMP proxy serves management's NBD server through it.
    pub async fn ensure_nbd_server(&self, name: &str) -> Result<std::path::PathBuf, SupError> {
        let vmr = self.vm(name)?;
        let qmp = vmr.qmp()?;
        let sock = vmr.nbd_socket();
        self.start_nbd_server(&qmp, &sock).await?;
        Ok(sock)
    }

    /// Where a VM's QMP proxy listens: `RUN_DIR/VM/monitor.sock`.
    pub fn monitor_socket(&self, name: &str) -> std::path::PathBuf {
        self.cfg.run_dir.join(name).join("monitor.sock")
    }

    /// Called with the VM's name whenever a VM is registered or restored (acceld run starts the
    /// VM's QMP proxy from it).
    pub fn on_register(&self, f: Box<dyn Fn(&str) + Send + Sync>) {
        *lock(&self.register_hook) = Some(f);
    }

    pub fn vm_names(&self) -> Vec<String> {
        lock(&self.vms).keys().cloned().collect()
    }

    /// Saves the registry (after every change; the file is written only when the registry's
    /// saved form changed); a failure is logged, not fatal, and the next save tries again.
    fn save(&self) {
        let st = || persist::SavedState {
            vms: self.all_vms().iter().map(|vm| vm.saved()).collect(),
        };
        if let Err(e) = self.state.save(st) {
            warn!("{}", crate::error_chain(&e));
        }
    }

    /// Stops serving everything (acceld shutdown): drains each drive, leaves QEMU as it is, so
    /// the next acceld picks up from the state file.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        self.save();
        let vms = self.all_vms();
        // Every server drains at once: the shutdown bound holds for all of them together.
        for vm in &vms {
            vm.stop_task();
            for d in &vm.drives() {
                d.signal_stop();
            }
        }
        for vm in &vms {
            for d in &vm.drives() {
                d.stop_server();
                // Drop image locks now rather than when the kernel tears the rings down.
                d.drive.engine().release();
            }
        }
    }

    // ---- operator requests ----

    pub async fn set_pin(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        pin: Option<Pin>,
        persistent: bool,
    ) -> Result<DriveStatus, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        {
            let mut i = lock(&d.intent);
            i.pin = pin;
            i.pin_persistent = persistent && pin.is_some();
        }
        self.act_now(&vmr, &d, true).await
    }

    /// The QMP proxy is about to forward a management command that may drain QEMU's nodes
    /// (`on`), or has its answer (`!on`). QEMU 10.0.2's vhost-user-blk export aborts or hangs
    /// when its node is drained with requests in flight, so while any command is held no
    /// drive relays: each relayed drive moves to acceld's NBD export of the same node (an
    /// overlapped repath, nothing is paused for long) before the command goes, and back once
    /// the last one answered. Fails, giving the hold back, when a drive stays relayed.
    pub async fn hold_relay(self: &Arc<Self>, vm: &str, on: bool) -> Result<(), SupError> {
        let vmr = self.vm(vm)?;
        if on {
            vmr.relay_holds.fetch_add(1, Ordering::SeqCst);
        } else {
            let _ = vmr
                .relay_holds
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            if vmr.relay_held() {
                return Ok(());
            }
        }
        let Ok(qmp) = vmr.qmp() else {
            return Ok(());
        };
        let mut stuck = Vec::new();
        for d in vmr.drives() {
            let to_move = if on {
                d.relayed()
            } else {
                d.spec.relays() && d.engine_kind() == EngineKind::Qemu && !d.relayed()
            };
            if !to_move || !d.has_device() {
                continue;
            }
            let r = self.reconcile(&vmr, &d, &qmp, false).await;
            if on && d.relayed() {
                let why = r
                    .err()
                    .map_or_else(|| "it is still relayed".to_string(), |e| e.chain());
                stuck.push(format!("{}: {why}", d.spec.id));
            } else if let Err(e) = r {
                if let Some(n) = d.log.admit() {
                    tracing::warn!(vm, drive = %d.spec.id, "{}{}", e.chain(), accel_dataplane::util::suppressed(n));
                }
            }
        }
        self.save();
        if stuck.is_empty() {
            return Ok(());
        }
        let _ = vmr
            .relay_holds
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        Err(SupError::QemuState(format!(
            "move the relayed drives to NBD ({})",
            stuck.join("; ")
        )))
    }

    /// Retries the drive's held requests now (`accelctl resume`), e.g. after space was freed.
    pub fn resume(&self, vm: &str, drive: &str) -> Result<DriveStatus, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let held = d.drive.retry_held();
        tracing::info!(vm, drive, held, "operator resume: retrying held requests");
        Ok(status::drive_status(&vmr, &d))
    }

    /// Sets or clears a throttle. Setting acts at once; clearing lets the drive go back to
    /// direct after the quiet period (unless something else keeps it in QEMU).
    pub async fn set_throttle(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        limits: Option<ThrottleLimits>,
    ) -> Result<DriveStatus, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        if limits.as_ref().is_some_and(|l| l.is_empty()) {
            return Err(SupError::Invalid(
                "no limit given: name at least one, or clear the throttle".into(),
            ));
        }
        let data_node = lock(&d.graph).data_node.clone();
        if let Some(n) = data_node {
            // Adding or removing acceld's filter re-creates the export; a node QEMU made
            // implicitly (blockdev-snapshot-sync's overlay) lives only as long as its users,
            // so it would be gone. New limits on an existing throttle are fine.
            if lock(&d.intent).throttle.is_some() != limits.is_some() {
                return Err(SupError::Invalid(format!(
                    "the guest's data is on node '{n}' now (an external snapshot or a mirror's pivot): \
                     acceld cannot add or remove its throttle there yet; commit the overlay first"
                )));
            }
        }
        let urgent = limits.is_some();
        lock(&d.intent).throttle = limits;
        self.act_now(&vmr, &d, urgent).await
    }

    /// A throttle in management's group (`block_set_io_throttle group=`, or a `qom-set` of
    /// the group's limits, through the QMP proxy). `group`: `Some` joins that group (the
    /// drive's filter moves to it), `None` keeps the current one. With no limits the drive
    /// stays a member (as a QEMU device does with all-zero limits in its group) unless
    /// `leave` (QEMU's `block_set_io_throttle` with all zero ends the membership).
    pub async fn set_throttle_in_group(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        limits: Option<ThrottleLimits>,
        group: Option<String>,
        leave: bool,
    ) -> Result<DriveStatus, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let left = {
            let mut i = lock(&d.intent);
            if leave {
                i.throttle_group.take().is_some()
            } else {
                if group.is_some() {
                    i.throttle_group = group;
                }
                false
            }
        };
        if left && limits.is_none() && lock(&d.graph).group_external {
            // Management may delete its group right after: acceld's filter leaves it now,
            // not after the quiet period.
            lock(&d.intent).throttle = None;
            return self.act_now(&vmr, &d, true).await;
        }
        self.set_throttle(vm, drive, limits).await
    }

    /// Reconciles one drive now (operator request); `urgent` skips the quiet period.
    async fn act_now(
        self: &Arc<Self>,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        urgent: bool,
    ) -> Result<DriveStatus, SupError> {
        let qmp = vm.qmp()?;
        if !d.has_device() {
            return Err(SupError::NotFound(format!(
                "VM {} has no vhost-user-blk-pci device on {} (see the VM contract: accelctl qemu-args)",
                vm.name,
                d.socket.display()
            )));
        }
        let r = self.reconcile(vm, d, &qmp, urgent).await;
        self.save();
        r?;
        Ok(status::drive_status(vm, d))
    }

    pub async fn explain(&self, vm: &str, drive: &str) -> Result<Explanation, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let qmp = vmr.qmp()?;
        let snap = observe::snapshot(&qmp).await?;
        let view = observe::view(&d, &snap);
        let dec = observe::decide(&d, &view);
        let (decision, reasons, serve) = match &dec {
            Decision::Accelerate(s) => ("direct", Vec::new(), Some(s.clone())),
            Decision::Qemu(r) => ("qemu", r.clone(), None),
        };
        Ok(Explanation {
            vm: vm.to_string(),
            drive: drive.to_string(),
            engine: d.engine_kind(),
            decision,
            reasons: reasons
                .iter()
                .map(|r| ReasonText {
                    code: r.code(),
                    sentence: r.sentence(),
                })
                .collect(),
            serve,
            view,
        })
    }
}

/// The quiet period and the drain timeout as durations.
impl Config {
    fn quiet_period(&self) -> Duration {
        Duration::from_millis(self.quiet_period_ms)
    }
}
