//! One VM: its drives, its QMP connection, and its task (attach, find the devices, watch QEMU's
//! events, reconcile every drive).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qmp_client::commands::{
    Cont, MigrateSetCapabilities, ObjectAdd, QomGet, QomList, QueryChardev, QueryMigrate,
    QueryStatus,
};
use qmp_client::Qmp;
use tracing::{debug, info, warn};

use super::drive_state::ManagedDrive;
use super::persist::{SavedDrive, SavedVm};
use super::plan::{self, Action, PlanInput, Quiet, Timer};
use super::{observe, qmp_run, SupError, Supervisor};
use accel_dataplane::util::{lock, suppressed, LogLimit};

pub struct Vm {
    pub name: String,
    pub qmp_path: PathBuf,
    pub cont: bool,
    /// Registered as a migration's destination (`--incoming`).
    pub incoming: bool,
    pub dir: PathBuf,
    /// QEMU's user when not root (it registered through a permit): the VM's sockets are theirs.
    pub owner: Option<super::Owner>,
    /// The drives by id: those registered, and those hot-plugged since (`device_add` through
    /// the QMP proxy) less those unplugged.
    drives: Mutex<BTreeMap<String, Arc<ManagedDrive>>>,
    qmp: Mutex<Option<Arc<Qmp>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    pub(super) attach_error: Mutex<Option<String>>,
    pub(super) run_state: Mutex<String>,
    /// QEMU's migration status as last seen.
    pub(super) migration: Mutex<Option<String>>,
    /// Who owns QEMU's pause-before-switchover (see `migration.rs`).
    pub(super) pause_owner: Mutex<super::migration::PauseOwner>,
    /// QEMU's timestamp of the last `pre-switchover` event whose work acceld has done (the QMP
    /// proxy holds the event back from management until then).
    pub(super) switchover_done: tokio::sync::watch::Sender<(i64, i64)>,
    continued: AtomicBool,
    /// One hot-plug or unplug at a time.
    pub(super) plugging: tokio::sync::Mutex<()>,
    /// Wakes the VM's task to look at its drives now (a disk was plugged).
    pub(super) kick: tokio::sync::Notify,
    /// Budget of the lines about this VM that repeat (attach retries).
    log: LogLimit,
    /// Management commands the QMP proxy holds (each may drain QEMU's nodes, even all of
    /// them): while any is, no drive relays (see [`Vm::relay_held`]).
    pub(super) relay_holds: std::sync::atomic::AtomicUsize,
    /// QEMU's monitors other than acceld's (`-qmp`/`-monitor` chardevs, found at attach): a
    /// command sent there is not the QMP proxy's to hold, so drives relay only if their spec
    /// says `relay=on` (see [`Vm::may_relay`]).
    pub(super) side_monitors: Mutex<Vec<String>>,
}

impl Vm {
    pub(super) fn new(
        name: String,
        qmp_path: PathBuf,
        cont: bool,
        incoming: bool,
        dir: PathBuf,
        owner: Option<super::Owner>,
        drives: BTreeMap<String, Arc<ManagedDrive>>,
    ) -> Self {
        Vm {
            name,
            qmp_path,
            cont,
            incoming,
            dir,
            owner,
            drives: Mutex::new(drives),
            switchover_done: tokio::sync::watch::Sender::new((0, 0)),
            qmp: Mutex::new(None),
            task: Mutex::new(None),
            attach_error: Mutex::new(None),
            run_state: Mutex::new(String::new()),
            migration: Mutex::new(None),
            pause_owner: Mutex::new(super::migration::PauseOwner::default()),
            continued: AtomicBool::new(false),
            plugging: tokio::sync::Mutex::new(()),
            kick: tokio::sync::Notify::new(),
            log: LogLimit::default(),
            relay_holds: std::sync::atomic::AtomicUsize::new(0),
            side_monitors: Mutex::new(Vec::new()),
        }
    }

    /// Whether drive `d` may relay in this VM at all: its spec relays, and either said
    /// `relay=on` or QEMU has no monitor beside acceld's. A block command sent to another
    /// monitor drains the node behind acceld's back, and QEMU 10.0.2's vhost-user-blk
    /// export aborts or hangs when its node is drained with requests in flight.
    pub(super) fn may_relay(&self, d: &ManagedDrive) -> bool {
        d.spec.relays() && (d.spec.relay_asked || lock(&self.side_monitors).is_empty())
    }

    /// The QMP proxy holds a management command: relayed drives serve over NBD meanwhile.
    pub(super) fn relay_held(&self) -> bool {
        self.relay_holds.load(Ordering::SeqCst) > 0
    }

    pub(super) fn qmp(&self) -> Result<Arc<Qmp>, SupError> {
        lock(&self.qmp)
            .clone()
            .filter(|q| !q.is_closed())
            .ok_or_else(|| SupError::NotAttached(self.name.clone()))
    }

    pub(super) fn set_qmp(&self, q: Option<Arc<Qmp>>) {
        *lock(&self.qmp) = q;
    }

    pub(super) fn nbd_socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }

    /// The VM's drives now, in id order.
    pub fn drives(&self) -> Vec<Arc<ManagedDrive>> {
        lock(&self.drives).values().cloned().collect()
    }

    /// Adds a hot-plugged drive; false if the VM has a drive of that id already.
    pub(super) fn add_drive(&self, d: Arc<ManagedDrive>) -> bool {
        let mut m = lock(&self.drives);
        if m.contains_key(d.id()) {
            return false;
        }
        m.insert(d.id().to_string(), d);
        true
    }

    /// Takes an unplugged drive out of the VM.
    pub(super) fn remove_drive(&self, d: &Arc<ManagedDrive>) {
        let mut m = lock(&self.drives);
        if m.get(d.id()).is_some_and(|x| Arc::ptr_eq(x, d)) {
            m.remove(d.id());
        }
    }

    pub(super) fn drive(&self, id: &str) -> Result<Arc<ManagedDrive>, SupError> {
        lock(&self.drives)
            .get(id)
            .cloned()
            .ok_or_else(|| SupError::NotFound(format!("VM {} has no drive {id}", self.name)))
    }

    /// Ends the VM's task (if any) and drops its QMP connection.
    pub(super) fn stop_task(&self) {
        if let Some(t) = lock(&self.task).take() {
            t.abort();
        }
        self.set_qmp(None);
    }

    /// The VM as the state file keeps it.
    pub(super) fn saved(&self) -> SavedVm {
        SavedVm {
            name: self.name.clone(),
            qmp: self.qmp_path.clone(),
            cont: self.cont,
            incoming: self.incoming,
            pause_owned: *lock(&self.pause_owner) == super::migration::PauseOwner::Acceld(true),
            owner: self.owner,
            drives: self
                .drives()
                .iter()
                .map(|d| {
                    let g = lock(&d.graph);
                    let i = lock(&d.intent);
                    SavedDrive {
                        spec: d.spec.clone(),
                        // A drive whose image went to a migration's destination is held:
                        // a restarted acceld must not open it again.
                        engine: if d.drive.image_handed_off() {
                            accel_api::status::EngineKind::Held
                        } else {
                            d.engine_kind()
                        },
                        nodes_removed: g.nodes_removed,
                        recorded: g.recorded.clone(),
                        pin: if i.pin_persistent { i.pin } else { None },
                        throttle: i.throttle.clone(),
                        image: Some(d.image()),
                        chs: d.drive.config().chs,
                    }
                })
                .collect(),
        }
    }
}

/// Aborts a task when the scope that started it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether acceld's QMP connection negotiates `oob` when QEMU offers it (see attach).
const OOB_UPSTREAM: bool = true;

fn pre_switchover(ev: &qmp_client::Event) -> bool {
    ev.name == "MIGRATION" && ev.data["status"] == "pre-switchover"
}

/// QMP events after which the drives are looked at again.
fn relevant(event: &str) -> bool {
    matches!(
        event,
        "STOP"
            | "RESUME"
            | "SHUTDOWN"
            | "MIGRATION"
            | "BLOCK_JOB_COMPLETED"
            | "BLOCK_JOB_CANCELLED"
            | "BLOCK_JOB_READY"
            | "BLOCK_JOB_ERROR"
            | "BLOCK_JOB_PENDING"
            | "JOB_STATUS_CHANGE"
            | "BLOCK_EXPORT_DELETED"
            | "DEVICE_DELETED"
    )
}

impl Supervisor {
    pub(super) fn spawn_vm_task(self: &Arc<Self>, vm: &Arc<Vm>) {
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
                    if let Some(n) = vm.log.admit() {
                        warn!(vm = %vm.name, "attach failed: {msg}{}", suppressed(n));
                    }
                    *lock(&vm.attach_error) = Some(msg);
                }
            }
            vm.set_qmp(None);
            if self.stopping.load(Ordering::Relaxed) {
                return;
            }
            if ever_attached && !vm.qmp_path.exists() {
                // QEMU is gone (its QMP socket went with it): detach cleanly.
                info!(vm = %vm.name, "VM disappeared");
                self.forget_vm(&vm).await;
                return;
            }
            if ever_attached {
                if let Err(e) = qmp_client::connect(&vm.qmp_path).await {
                    info!(vm = %vm.name, "VM disappeared ({e})");
                    self.forget_vm(&vm).await;
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn attach_once(&self, vm: &Arc<Vm>) -> Result<(), SupError> {
        let attempts = (self.cfg.attach_timeout_ms / 50).max(1) as u32;
        // Out-of-band on when QEMU offers it: the QMP proxy offers it to management exactly
        // then (it forwards `exec-oob` on this connection).
        let qmp = qmp_client::connect_with_retry_oob(
            &vm.qmp_path,
            attempts,
            Duration::from_millis(50),
            OOB_UPSTREAM,
        )
        .await
        .map_err(|source| SupError::Qmp {
            cmd: "connect".into(),
            source,
        })?;
        // QEMU's user owns the directory of its QMP socket: a link there could lead acceld
        // (root) to another process's monitor (another VM's, acceld's own proxy). The
        // process serving it must run as QEMU's user.
        if let Some(o) = vm.owner {
            if qmp.peer_uid() != Some(o.uid) {
                return Err(SupError::Denied(format!(
                    "{} is served by uid {:?}, not by QEMU's user {}",
                    vm.qmp_path.display(),
                    qmp.peer_uid(),
                    o.uid
                )));
            }
        }
        let qmp = Arc::new(qmp);
        qmp.set_timeout(Duration::from_millis(self.cfg.qmp_timeout_ms));
        find_devices(vm, &qmp).await?;
        self.ensure_iothread(&qmp).await?;
        if vm.incoming {
            // The MIGRATION event "completed" is when the destination takes its drives; QEMU
            // sends migration events only with this capability. Refused once the incoming
            // migration runs (then the poll tick notices the end).
            if let Err(e) = qmp_run(&qmp, &MigrateSetCapabilities::one("events", true)).await {
                debug!(vm = %vm.name, "migration events not enabled: {}", e.chain());
            }
        }
        vm.set_qmp(Some(qmp.clone()));
        info!(vm = %vm.name, "attached");
        self.reconcile_vm(vm, true).await;
        Ok(())
    }

    async fn ensure_iothread(&self, qmp: &Qmp) -> Result<(), SupError> {
        let objs = qmp_run(
            qmp,
            &QomList {
                path: "/objects".into(),
            },
        )
        .await?;
        if !objs.iter().any(|o| o.name == self.cfg.iothread) {
            qmp_run(qmp, &ObjectAdd::iothread(&self.cfg.iothread)).await?;
        }
        Ok(())
    }

    async fn watch(&self, vm: &Arc<Vm>) {
        let Ok(qmp) = vm.qmp() else { return };
        let mut events = qmp.events();
        // Its own task: a reconcile waiting on a QEMU stuck in its exit must not hold it up.
        let watched = super::exit_watch::Watched {
            name: vm.name.clone(),
            owner_uid: vm.owner.map(|o| o.uid),
        };
        let exit = tokio::spawn(super::exit_watch::watch_exit(
            watched,
            qmp.clone(),
            qmp.events(),
        ));
        let _exit = AbortOnDrop(exit);
        let mut tick = tokio::time::interval(Duration::from_millis(self.cfg.poll_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ev = events.recv() => match ev {
                    Ok(ev) => {
                        debug!(vm = %vm.name, event = %ev.name, "QMP event");
                        if let ("DEVICE_DELETED", Some(dev)) = (ev.name.as_str(), ev.data["device"].as_str()) {
                            // A drive's device went (management's device_del, the guest's
                            // eject): the drive ends. The QMP proxy holds the event back from
                            // management until this is done.
                            self.unplug(&vm.name, dev).await;
                        }
                        // The migration waits at pre-switchover: acceld's part comes first
                        // (it is the guest's downtime).
                        if pre_switchover(&ev) {
                            self.pre_switchover(vm, &qmp, ev.timestamp).await;
                        }
                        if relevant(&ev.name) {
                            // Let a burst of events settle, then look once. Not after a
                            // migration's end: the guest waits for its drives then.
                            if ev.name != "MIGRATION" || ev.data["status"] != "completed" {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            let mut pre = None;
                            while let Ok(e) = events.try_recv() {
                                if pre_switchover(&e) {
                                    pre = Some(e.timestamp);
                                }
                            }
                            if let Some(ts) = pre {
                                self.pre_switchover(vm, &qmp, ts).await;
                            }
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
                _ = vm.kick.notified() => {
                    // A disk was plugged: its first engine now (the guest waits for it).
                    self.reconcile_vm(vm, true).await;
                }
            }
        }
    }

    /// Looks at every drive of the VM, then `cont`s a VM registered with `--cont` once every
    /// drive has an engine.
    pub(super) async fn reconcile_vm(&self, vm: &Arc<Vm>, urgent: bool) {
        let Ok(qmp) = vm.qmp() else { return };
        if vm.incoming && vm.cont && !vm.continued.load(Ordering::Relaxed) {
            self.cont_after_incoming(vm, &qmp).await;
        }
        for d in &vm.drives() {
            if let Err(e) = self.reconcile(vm, d, &qmp, urgent).await {
                if qmp.is_closed() {
                    // QEMU quit (after a completed migration on the source, a shutdown): an
                    // expected end, not a fault; the VM's task notices it next.
                    if let Some(n) = vm.log.admit() {
                        if lock(&vm.migration).as_deref() == Some("completed") {
                            info!(vm = %vm.name, "QEMU ended after its migration completed{}", suppressed(n));
                        } else {
                            info!(vm = %vm.name, "QEMU closed its QMP connection{}", suppressed(n));
                        }
                    }
                    return;
                }
                let msg = e.chain();
                if let Some(n) = d.log.admit() {
                    warn!(vm = %vm.name, drive = %d.spec.id, "{msg}{}", suppressed(n));
                }
                lock(&d.stats).last_error = Some(msg);
            }
        }
        if let Ok(st) = qmp_run(&qmp, &QueryStatus).await {
            *lock(&vm.run_state) = st.status.clone();
            let all_served = vm
                .drives()
                .iter()
                .all(|d| d.engine_kind() != accel_api::status::EngineKind::Held);
            let migration = qmp_run(&qmp, &QueryMigrate)
                .await
                .ok()
                .and_then(|m| m["status"].as_str().map(str::to_string));
            // An incoming migration with -S ends `paused`: the VM contract's `cont` is due then.
            let waiting = st.status == "prelaunch"
                || (vm.incoming
                    && st.status == "paused"
                    && migration.as_deref() == Some("completed"));
            let migrating = policy::migrating(&policy::VmState {
                run_state: st.status.clone(),
                migration: migration.clone(),
            });
            *lock(&vm.migration) = migration;
            if !migrating {
                if let Err(e) = self.tune_migration_caps(vm, &qmp).await {
                    if let Some(n) = vm.log.admit() {
                        warn!(vm = %vm.name, "cannot set the migration capabilities: {}{}", e.chain(), suppressed(n));
                    }
                }
            }
            if vm.cont && waiting && all_served && !vm.continued.swap(true, Ordering::Relaxed) {
                match qmp_run(&qmp, &Cont).await {
                    Ok(_) => info!(vm = %vm.name, "every drive has an engine: cont"),
                    Err(e) => warn!(vm = %vm.name, "cont failed: {}", e.chain()),
                }
            }
        }
        self.save();
    }

    /// A completed incoming migration waits `paused` (the VM contract's -S): `cont` at once,
    /// before the drives are taken. The guest's CPUs run again as early as with QEMU's own
    /// backend; its disk requests wait in the vrings (held) for the few ms the take-over
    /// needs. QEMU activates the nodes at `cont`; parentless, they take no image locks.
    async fn cont_after_incoming(&self, vm: &Arc<Vm>, qmp: &Qmp) {
        let Ok(st) = qmp_run(qmp, &QueryStatus).await else {
            return;
        };
        if st.status != "paused" {
            return;
        }
        let done = qmp_run(qmp, &QueryMigrate)
            .await
            .is_ok_and(|m| m["status"] == "completed");
        if done && !vm.continued.swap(true, Ordering::Relaxed) {
            match qmp_run(qmp, &Cont).await {
                Ok(_) => info!(vm = %vm.name, "incoming migration completed: cont"),
                Err(e) => warn!(vm = %vm.name, "cont failed: {}", e.chain()),
            }
        }
    }

    /// Looks at one drive: observe QEMU, decide, plan, execute.
    pub(super) async fn reconcile(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        urgent: bool,
    ) -> Result<(), SupError> {
        let _g = d.op.lock().await;
        if !d.has_device() {
            return Ok(());
        }
        let mut snap = observe::snapshot(qmp).await?;
        let mut view = observe::view(d, &snap);
        let mut migrating = policy::migrating(&view.vm);
        if vm.incoming
            && !migrating
            && snap
                .exports
                .iter()
                .any(|e| e.id == super::migration::mirror_export(d.id()))
        {
            // A copy-storage destination whose migration ended: the mirror's export goes
            // before the drive is served from the new image.
            self.drop_mirror_export(d, qmp).await;
            snap = observe::snapshot(qmp).await?;
            view = observe::view(d, &snap);
            migrating = policy::migrating(&view.vm);
        }
        if vm.incoming
            && view.vm.run_state == "paused"
            && view.vm.migration.as_deref() == Some("completed")
        {
            // A completed incoming migration waiting for `cont`: QEMU keeps the nodes
            // inactive until then, but the source gave the image up, so the policy judges
            // them as they will be (otherwise the drive would go to the qemu engine first).
            for n in view.node.iter_mut().chain(view.protocol.iter_mut()) {
                n.active = true;
            }
        }
        let decision = observe::decide(d, &view);
        {
            let mut o = lock(&d.observed);
            o.reasons = match &decision {
                policy::Decision::Qemu(r) => r.clone(),
                policy::Decision::Accelerate(_) => Vec::new(),
            };
            o.last_view = Some(view);
        }
        let want = lock(&d.intent).throttle.clone();
        let have = lock(&d.graph).applied_throttle.clone();
        let accel_since = lock(&d.placement).accel_since;
        // The export must be re-created with its filter in another throttle group.
        let context_stale = have.is_some() && d.group() != d.applied_group();
        // QEMU 10.0.2's vhost-user-blk export aborts or hangs when its node is drained with
        // requests in flight (docs/qemu-engine.md): no relay while a block job (on any of
        // the VM's nodes: a job's end may drain more than its own) may drain it, or while
        // the proxy holds a management command that may.
        let job = snap.has_block_job()
            || matches!(&decision, policy::Decision::Qemu(r) if r.iter().any(|r| matches!(r, policy::Reason::BlockJob(_))));
        let relay_allowed = vm.may_relay(d) && !job && !vm.relay_held();
        self.relay_lost_or_back(vm, d, qmp, relay_allowed).await?;
        let relay_wanted = {
            let mut g = lock(&d.graph);
            g.relay_allowed = relay_allowed;
            relay_allowed && g.relay_socket.is_some()
        };
        let relayed = d.relayed();
        let p = plan::plan(&PlanInput {
            decision: &decision,
            engine: d.engine_kind(),
            has_device: true,
            want_throttle: want.as_ref(),
            applied_throttle: have.as_ref(),
            export_present: snap.has_export(d.id()),
            export_context_stale: context_stale,
            quiet: accel_since.map_or(Quiet::NotRunning, |t| Quiet::Running(t.elapsed())),
            quiet_period: self.cfg.quiet_period(),
            urgent,
            migrating,
            relayed,
            relay_wanted,
        });
        match p.timer {
            Timer::Keep => {}
            Timer::Start => {
                lock(&d.placement)
                    .accel_since
                    .get_or_insert_with(Instant::now);
            }
            Timer::Stop => lock(&d.placement).accel_since = None,
        }
        if matches!(p.action, Action::Stay | Action::WaitQuiet) {
            return Ok(());
        }
        self.execute(vm, d, qmp, p.action).await
    }
}

impl Supervisor {
    /// The relay's session ended under a relayed drive (QEMU's export deleted or failed, a
    /// used ring it got wrong): its requests are held (`PATH_LOST`). QEMU's export goes
    /// first, which QEMU finishes only after the requests it took completed, so nothing of
    /// the old session can land after their retry; then the drive repaths to NBD, where the
    /// held requests go through. `RELAY_RETRY` later the relay is made again.
    async fn relay_lost_or_back(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        relay_allowed: bool,
    ) -> Result<(), SupError> {
        if d.relayed() && d.drive.engine().lost() {
            if let Some(n) = d.log.admit() {
                warn!(vm = %vm.name, drive = %d.spec.id, "the relay's session with QEMU's export ended; holding the requests and serving over NBD{}", accel_dataplane::util::suppressed(n));
            }
            lock(&d.graph).relay_lost_at = Some(Instant::now());
            self.relay_down(d, qmp).await?;
            // Whatever the plan wants next: an overlapped switch is the only one a drive with
            // held requests can make, and NBD takes the held requests as they are.
            return self
                .execute(vm, d, qmp, Action::Repath { relay: false })
                .await;
        }
        let retry = {
            let g = lock(&d.graph);
            relay_allowed
                && g.relay_socket.is_none()
                && g.relay_lost_at.is_some_and(|t| t.elapsed() >= RELAY_RETRY)
        };
        if retry && d.engine_kind() == accel_api::status::EngineKind::Qemu && !d.relayed() {
            lock(&d.graph).relay_lost_at = None;
            self.ensure_relay_export(vm, d, qmp).await;
        }
        Ok(())
    }
}

/// How long a drive whose relay session ended serves over NBD before the relay is tried
/// again (a session that keeps ending costs one repath each time, no more).
pub(super) const RELAY_RETRY: Duration = Duration::from_secs(10);

/// The monitors QEMU has beside acceld's own QMP socket `own`: the chardevs `-qmp` and
/// `-monitor` make (`compat_monitorN`), whatever their transport. A `-mon` on a chardev of
/// its own is not told apart from a serial port, and is not found.
fn side_monitors(
    chardevs: &[qmp_client::commands::ChardevInfo],
    own: &std::path::Path,
) -> Vec<String> {
    chardevs
        .iter()
        .filter(|c| c.label.starts_with("compat_monitor"))
        .filter(|c| {
            let f = c
                .filename
                .strip_prefix("disconnected:")
                .unwrap_or(&c.filename);
            let path = f
                .strip_prefix("unix:")
                .map(|p| std::path::Path::new(p.split(',').next().unwrap_or(p)));
            path != Some(own)
        })
        .map(|c| c.label.clone())
        .collect()
}

/// Maps each registered drive to its vhost-user-blk-pci device, by socket path.
async fn find_devices(vm: &Vm, qmp: &Qmp) -> Result<(), SupError> {
    let chardevs = qmp_run(qmp, &QueryChardev).await?;
    let side = side_monitors(&chardevs, &vm.qmp_path);
    if !side.is_empty()
        && vm
            .drives()
            .iter()
            .any(|d| d.spec.relays() && !d.spec.relay_asked)
    {
        info!(vm = %vm.name, monitors = ?side, "QEMU has monitors beside acceld's, whose block commands the QMP proxy cannot hold: the qemu engine serves this VM's drives over NBD, not through the relay (relay=on in a drive's spec relays anyway)");
    }
    *lock(&vm.side_monitors) = side;
    let mut by_label = BTreeMap::new();
    for c in chardevs {
        // A reconnecting client socket shows as "disconnected:unix:PATH".
        let f = c
            .filename
            .strip_prefix("disconnected:")
            .unwrap_or(&c.filename);
        if let Some(p) = f.strip_prefix("unix:") {
            let path = p.split(',').next().unwrap_or(p);
            by_label.insert(c.label.clone(), PathBuf::from(path));
        }
    }
    let list = qmp_run(
        qmp,
        &QomList {
            path: "/machine/peripheral".into(),
        },
    )
    .await?;
    let mut found = BTreeMap::new();
    for p in list {
        if p.kind != "child<vhost-user-blk-pci>" {
            continue;
        }
        let ch = qmp_run(
            qmp,
            &QomGet {
                path: format!("/machine/peripheral/{}", p.name),
                property: "chardev".into(),
            },
        )
        .await?;
        if let Some(path) = ch.as_str().and_then(|l| by_label.get(l)) {
            found.insert(path.clone(), p.name.clone());
        }
    }
    for d in &vm.drives() {
        let dev = found.get(&d.socket).cloned();
        if dev.is_none() {
            warn!(vm = %vm.name, drive = %d.spec.id, socket = %d.socket.display(), "no vhost-user-blk-pci device uses this drive's socket");
        }
        lock(&d.graph).device = dev;
    }
    Ok(())
}

#[cfg(test)]
mod side_monitor_tests {
    use qmp_client::commands::ChardevInfo;

    fn c(label: &str, filename: &str) -> ChardevInfo {
        serde_json::from_value(
            serde_json::json!({"label": label, "filename": filename, "frontend-open": true}),
        )
        .unwrap()
    }

    /// As QEMU 10.0.2 lists them (`-qmp` twice, a `-mon` on its own chardev, a serial port
    /// and an HMP monitor on sockets, libvirt's `charmonitor`).
    #[test]
    fn monitors_beside_acceld_s() {
        let own = std::path::Path::new("/run/accel/vm1/qmp.sock");
        let list = [
            c("ser0", "disconnected:unix:/tmp/s.sock,server=on"),
            c("compat_monitor1", "disconnected:unix:/tmp/b.sock,server=on"),
            c("compat_monitor0", "unix:/run/accel/vm1/qmp.sock,server=on"),
            c("compat_monitor2", "tcp:127.0.0.1:4444,server=on"),
            c("mymon", "disconnected:unix:/tmp/c.sock,server=on"),
            c("charmonitor", "unix:/run/accel/vm1/qmp.sock,server=on"),
        ];
        assert_eq!(
            super::side_monitors(&list, own),
            ["compat_monitor1", "compat_monitor2"]
        );
        assert!(super::side_monitors(&list[2..3], own).is_empty());
        assert!(super::side_monitors(&list[5..], own).is_empty());
    }
}
