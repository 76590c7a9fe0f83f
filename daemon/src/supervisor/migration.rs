//! The supervisor's part in a live migration.
//!
//! - Drives on the direct engine need nothing from the supervisor: the vhost-user layer hands
//!   the image off at the switchover's last ring stop (see `Drive::hand_off_image`).
//! - Drives on the qemu engine: acceld's writable NBD export on the drive's node would make the
//!   source QEMU's `bdrv_inactivate_all()` fail at completion, and the migration with it. So the
//!   migration must pause at `pre-switchover` (the vhost-user rings are stopped and drained by
//!   then): acceld removes its export, filter and group and holds the drive, then the owner of
//!   the pause continues. When no one else set `pause-before-switchover`, acceld sets it while a
//!   drive of the VM is on the qemu engine, and continues the migration itself. When management
//!   owns it (libvirt always sets it), management sends `migrate-continue`; acceld's part runs
//!   as soon as the `MIGRATION` event arrives (it turns on the `events` capability for that).

use std::sync::Arc;

use super::offload;
use accel_api::status::EngineKind;
use qmp_client::commands::{
    BlockExportAdd, BlockExportDel, BlockJobCancel, BlockdevAdd, BlockdevDel, BlockdevMirror,
    Migrate, MigrateContinue, MigrateSetCapabilities, QueryBlockExports, QueryBlockJobs,
    QueryMigrate, QueryMigrateCapabilities, QueryStatus, Quit,
};
use qmp_client::Qmp;
use tracing::{info, warn};

use super::vm::Vm;
use super::{qmp_run, SupError, Supervisor};
use accel_dataplane::engine::HeldEngine;
use accel_dataplane::util::lock;

/// Who owns QEMU's `pause-before-switchover` capability.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PauseOwner {
    /// Not looked at yet.
    #[default]
    Unknown,
    /// acceld set it to this value (and continues the migrations it pauses).
    Acceld(bool),
    /// It was on before acceld looked: management continues the migration.
    Management,
    /// A restarted acceld had turned it on before: if it is still on, it is acceld's.
    Restored,
}

const PAUSE: &str = "pause-before-switchover";

/// Copy-storage: the destination's export of its drive node, the source's target node and
/// mirror job (all acceld's, hidden from its other bookkeeping by these names).
pub(super) fn mirror_export(drive: &str) -> String {
    format!("accel-mirror-{drive}")
}
fn mirror_target(drive: &str) -> String {
    format!("accel-mirror-target-{drive}")
}
fn mirror_job(drive: &str) -> String {
    format!("accel-mirror-{drive}")
}

/// Longest wait for a copy-storage mirror to be READY (the whole image copied once).
const MIRROR_READY: std::time::Duration = std::time::Duration::from_secs(600);

impl Supervisor {
    /// Starts a live migration of `vm` to `uri`. The capabilities acceld needs are set first
    /// (events; pause-before-switchover when a drive is on the qemu engine and management does
    /// not own it).
    pub async fn migrate(&self, vm: &str, uri: &str) -> Result<serde_json::Value, SupError> {
        let vmr = self.vm(vm)?;
        if uri.is_empty() {
            return Err(SupError::Invalid("empty migration URI".into()));
        }
        let qmp = vmr.qmp()?;
        self.tune_migration_caps(&vmr, &qmp).await?;
        qmp_run(&qmp, &MigrateSetCapabilities::one("events", true)).await?;
        qmp_run(&qmp, &Migrate { uri: uri.into() }).await?;
        info!(vm, uri, "migration started");
        Ok(serde_json::json!({"vm": vm, "uri": uri}))
    }

    /// Copy-storage, the destination's half: exports the drive's node (on the new image) for
    /// the source's mirror, on this acceld's NBD socket. Only while QEMU waits `inmigrate`.
    pub async fn mirror_target_export(
        &self,
        vm: &str,
        drive: &str,
    ) -> Result<serde_json::Value, SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let qmp = vmr.qmp()?;
        let st = qmp_run(&qmp, &QueryStatus).await?;
        if !vmr.incoming || st.status != "inmigrate" {
            return Err(SupError::Invalid(format!(
                "VM {vm} is not a waiting migration destination ({}); register it --incoming and start QEMU with -incoming",
                st.status
            )));
        }
        let sock = vmr.nbd_socket();
        self.start_nbd_server(&qmp, &sock).await?;
        let name = mirror_export(d.id());
        let exports = qmp_run(&qmp, &QueryBlockExports).await?;
        if !exports.iter().any(|e| e.id == name) {
            qmp_run(
                &qmp,
                &BlockExportAdd::nbd(&name, &d.node(), true, Some(&self.cfg.iothread))
                    .nbd_named(&name),
            )
            .await?;
        }
        info!(vm, drive, export = %name, "copy-storage: destination node exported for the mirror");
        Ok(serde_json::json!({"socket": sock, "export": name}))
    }

    /// Copy-storage, the source's half: mirrors the drive's node into the destination's export
    /// through QEMU's block layer (the drive must be on the qemu engine: `handback`). Returns
    /// when the mirror is READY. The mirror copies in the background (guest writes never wait
    /// for the destination): a write-blocking mirror makes a guest write wait for the target's
    /// NBD connection, and at the switchover QEMU's main thread waits for acceld's drain of
    /// exactly those writes (a stall seen in about one run in six). The rest is copied when
    /// acceld ends the mirror at pre-switchover, with the VM stopped.
    ///
    /// A relayed drive moves to NBD first (the VM's relay hold, as the QMP proxy takes it for
    /// a management command that names nodes): starting the mirror drains the node, and QEMU
    /// 10.0.2's vhost-user-blk export aborts when its node is drained under I/O. Once the job
    /// exists the hold goes back; the job itself keeps the drive off the relay until it ends.
    pub async fn mirror_to(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        socket: &std::path::Path,
        export: &str,
    ) -> Result<serde_json::Value, SupError> {
        self.hold_relay(vm, true).await?;
        let started = self.start_mirror(vm, drive, socket, export).await;
        if let Err(e) = self.hold_relay(vm, false).await {
            warn!(vm, drive, "cannot give the relay hold back: {}", e.chain());
        }
        let (qmp, id) = started?;
        self.wait_mirror_ready(vm, drive, &qmp, &id).await
    }

    /// Adds the mirror's target node and starts the mirror job.
    async fn start_mirror(
        &self,
        vm: &str,
        drive: &str,
        socket: &std::path::Path,
        export: &str,
    ) -> Result<(Arc<Qmp>, String), SupError> {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let qmp = vmr.qmp()?;
        if d.engine_kind() != EngineKind::Qemu {
            return Err(SupError::Invalid(format!(
                "drive {drive} is on the {} engine; copy-storage mirrors through QEMU's block layer (handback first)",
                d.engine_kind().as_str()
            )));
        }
        let id = d.id().to_string();
        qmp_run(
            &qmp,
            &BlockdevAdd(serde_json::json!({
                "driver": "nbd", "node-name": mirror_target(&id),
                "server": {"type": "unix", "path": socket}, "export": export,
            })),
        )
        .await?;
        let r = qmp_run(
            &qmp,
            &BlockdevMirror(serde_json::json!({
                "job-id": mirror_job(&id), "device": d.node(), "target": mirror_target(&id),
                "sync": "full", "copy-mode": "background", "auto-dismiss": true,
            })),
        )
        .await;
        if let Err(e) = r {
            let _ = qmp_run(
                &qmp,
                &BlockdevDel {
                    node_name: mirror_target(&id),
                },
            )
            .await;
            return Err(e);
        }
        Ok((qmp, id))
    }

    /// Waits for the mirror job of drive `id` to be READY.
    async fn wait_mirror_ready(
        &self,
        vm: &str,
        drive: &str,
        qmp: &Qmp,
        id: &str,
    ) -> Result<serde_json::Value, SupError> {
        let t0 = std::time::Instant::now();
        loop {
            let jobs = qmp_run(qmp, &QueryBlockJobs).await?;
            let Some(j) = jobs.iter().find(|j| j["device"] == mirror_job(id)) else {
                return Err(SupError::QemuState(format!(
                    "keep the mirror job {} (it ended before it was in sync)",
                    mirror_job(id)
                )));
            };
            if j["ready"] == true {
                info!(
                    vm,
                    drive,
                    took_ms = t0.elapsed().as_millis() as u64,
                    "copy-storage: mirror in sync"
                );
                return Ok(serde_json::json!({"job": mirror_job(id), "ready": true,
                    "len": j["len"], "took_ms": t0.elapsed().as_millis() as u64}));
            }
            if t0.elapsed() > MIRROR_READY {
                return Err(SupError::QemuState(format!(
                    "bring mirror {} in sync within {MIRROR_READY:?}",
                    mirror_job(id)
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Ends acceld's copy-storage mirrors at the switchover (the VM is stopped): a cancelled
    /// READY mirror finishes with its target in sync; then its target node goes.
    async fn finish_mirrors(&self, vm: &Vm, qmp: &Qmp) {
        for d in &vm.drives() {
            let job = mirror_job(d.id());
            let Ok(jobs) = qmp_run(qmp, &QueryBlockJobs).await else {
                return;
            };
            if !jobs.iter().any(|j| j["device"] == job) {
                continue;
            }
            if let Err(e) = qmp_run(
                qmp,
                &BlockJobCancel {
                    device: job.clone(),
                },
            )
            .await
            {
                warn!(vm = %vm.name, job, "cannot finish the mirror: {}", e.chain());
                continue;
            }
            let t0 = std::time::Instant::now();
            while qmp_run(qmp, &QueryBlockJobs)
                .await
                .is_ok_and(|j| j.iter().any(|j| j["device"] == job))
            {
                if t0.elapsed() > std::time::Duration::from_secs(60) {
                    warn!(vm = %vm.name, job, "the mirror did not finish within 60 s");
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            let _ = qmp_run(
                qmp,
                &BlockdevDel {
                    node_name: mirror_target(d.id()),
                },
            )
            .await;
            info!(vm = %vm.name, drive = %d.spec.id, "copy-storage: mirror finished in sync");
        }
    }

    /// A destination after its incoming migration completed: the copy-storage export goes
    /// before acceld takes the new image.
    pub(super) async fn drop_mirror_export(&self, d: &super::drive_state::ManagedDrive, qmp: &Qmp) {
        let name = mirror_export(d.id());
        if qmp_run(qmp, &QueryBlockExports)
            .await
            .is_ok_and(|e| e.iter().any(|e| e.id == name))
        {
            match qmp_run(
                qmp,
                &BlockExportDel {
                    id: name.clone(),
                    mode: Some("hard".into()),
                },
            )
            .await
            {
                Ok(_) => info!(drive = %d.spec.id, "copy-storage: destination export removed"),
                Err(e) => {
                    warn!(drive = %d.spec.id, "cannot remove the copy-storage export: {}", e.chain())
                }
            }
            let t0 = std::time::Instant::now();
            while qmp_run(qmp, &QueryBlockExports)
                .await
                .is_ok_and(|e| e.iter().any(|e| e.id == name))
                && t0.elapsed() < std::time::Duration::from_secs(10)
            {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
    }

    pub async fn migration_status(&self, vm: &str) -> Result<serde_json::Value, SupError> {
        let vmr = self.vm(vm)?;
        let qmp = vmr.qmp()?;
        qmp_run(&qmp, &QueryMigrate).await
    }

    /// Ends a QEMU that migrated away (its state is `postmigrate`): the VM is forgotten once
    /// its QMP socket goes.
    pub async fn quit_migrated(&self, vm: &str) -> Result<serde_json::Value, SupError> {
        let vmr = self.vm(vm)?;
        let qmp = vmr.qmp()?;
        let st = qmp_run(&qmp, &QueryStatus).await?;
        if st.status != "postmigrate" {
            return Err(SupError::Invalid(format!(
                "VM {vm} is {}, not postmigrate: it did not migrate away; not quitting it",
                st.status
            )));
        }
        // QEMU may close the monitor before it answers.
        let _ = qmp_run(&qmp, &Quit).await;
        Ok(serde_json::json!({"vm": vm, "quit": true}))
    }

    /// For the QMP proxy: whether management owns the `pre-switchover` pause (it set
    /// `pause-before-switchover` itself; otherwise the pause is acceld's and management, which
    /// did not ask for it, does not see it), and a wait until acceld's work for the
    /// `pre-switchover` event stamped `event` is done (false: not within `timeout`).
    pub fn management_owns_pause(&self, vm: &str) -> bool {
        self.vm(vm)
            .is_ok_and(|v| *lock(&v.pause_owner) == PauseOwner::Management)
    }

    /// Management set `pause-before-switchover` to `on` (through the QMP proxy, which kept
    /// it on if `kept_on`).
    pub fn management_set_pause(&self, vm: &str, on: bool, kept_on: bool) {
        if let Ok(v) = self.vm(vm) {
            *lock(&v.pause_owner) = match (on, kept_on) {
                (true, _) => PauseOwner::Management,
                (false, true) => PauseOwner::Acceld(true),
                (false, false) => PauseOwner::Acceld(false),
            };
        }
    }

    pub async fn pre_switchover_done(
        &self,
        vm: &str,
        event: (i64, i64),
        timeout: std::time::Duration,
    ) -> bool {
        let Ok(v) = self.vm(vm) else { return false };
        let mut rx = v.switchover_done.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|done| *done >= event))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Keeps `pause-before-switchover` on while a drive of the VM is on the qemu engine (and
    /// `events` on, to see `pre-switchover`), unless management owns it. Called when no
    /// migration runs (capabilities cannot change during one).
    pub(super) async fn tune_migration_caps(&self, vm: &Vm, qmp: &Qmp) -> Result<(), SupError> {
        let any_qemu = vm
            .drives()
            .iter()
            .any(|d| d.engine_kind() == EngineKind::Qemu);
        let owner = *lock(&vm.pause_owner);
        let want = match owner {
            PauseOwner::Management => return Ok(()),
            PauseOwner::Acceld(on) if on == any_qemu => return Ok(()),
            PauseOwner::Acceld(_) => any_qemu,
            PauseOwner::Unknown | PauseOwner::Restored => {
                let caps = qmp_run(qmp, &QueryMigrateCapabilities).await?;
                let on = caps.iter().any(|c| c.capability == PAUSE && c.state);
                if on && owner == PauseOwner::Restored {
                    *lock(&vm.pause_owner) = PauseOwner::Acceld(true);
                    return Ok(());
                }
                if on {
                    *lock(&vm.pause_owner) = PauseOwner::Management;
                    qmp_run(qmp, &MigrateSetCapabilities::one("events", true)).await?;
                    return Ok(());
                }
                if !any_qemu {
                    *lock(&vm.pause_owner) = PauseOwner::Acceld(false);
                    return Ok(());
                }
                true
            }
        };
        let mut set = MigrateSetCapabilities::one(PAUSE, want);
        if want {
            set.capabilities
                .push(qmp_client::commands::MigrationCapabilityStatus {
                    capability: "events".into(),
                    state: true,
                });
        }
        qmp_run(qmp, &set).await?;
        *lock(&vm.pause_owner) = PauseOwner::Acceld(want);
        info!(vm = %vm.name, on = want, "pause-before-switchover (acceld's qemu-engine drives migrate through it)");
        Ok(())
    }

    /// The migration paused at `pre-switchover`: the rings are stopped and drained. Takes
    /// acceld's exports off the qemu-engine drives' nodes (so QEMU can inactivate them) and
    /// holds those drives, then continues the migration if acceld owns the pause.
    pub(super) async fn pre_switchover(&self, vm: &Arc<Vm>, qmp: &Qmp, event: (i64, i64)) {
        let t0 = std::time::Instant::now();
        self.finish_mirrors(vm, qmp).await;
        let mut n = 0;
        for d in &vm.drives() {
            let _g = d.op.lock().await;
            if d.engine_kind() != EngineKind::Qemu {
                continue;
            }
            if let Err(e) = self.qemu_down(d, qmp).await {
                warn!(vm = %vm.name, drive = %d.spec.id, "cannot remove acceld's export before the switchover: {}", e.chain());
                lock(&d.stats).last_error = Some(e.chain());
                continue;
            }
            let drive = d.drive.clone();
            match offload::blocking(move || drive.pause()).await {
                Ok(p) => {
                    let _ = offload::blocking(move || p.resume(Arc::new(HeldEngine))).await;
                }
                Err(e) => warn!(vm = %vm.name, drive = %d.spec.id, "cannot hold the drive: {e}"),
            }
            lock(&d.stats).nbd = None;
            d.set_engine(EngineKind::Held);
            n += 1;
        }
        if *lock(&vm.pause_owner) == PauseOwner::Acceld(true) {
            match qmp_run(
                qmp,
                &MigrateContinue {
                    state: "pre-switchover".into(),
                },
            )
            .await
            {
                Ok(_) => {}
                Err(e) => warn!(vm = %vm.name, "migrate-continue failed: {}", e.chain()),
            }
        }
        info!(vm = %vm.name, drives = n, took_us = t0.elapsed().as_micros() as u64, "pre-switchover: acceld's exports removed");
        vm.switchover_done.send_replace(event);
        self.save();
    }
}
