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

use accel_api::status::EngineKind;
use qmp_client::commands::{
    Migrate, MigrateContinue, MigrateSetCapabilities, QueryMigrate, QueryMigrateCapabilities,
    QueryStatus, Quit,
};
use qmp_client::Qmp;
use tokio::task::block_in_place;
use tracing::{info, warn};

use super::vm::Vm;
use super::{qmp_run, SupError, Supervisor};
use crate::engine::HeldEngine;
use crate::util::lock;

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
}

const PAUSE: &str = "pause-before-switchover";

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

    /// Keeps `pause-before-switchover` on while a drive of the VM is on the qemu engine (and
    /// `events` on, to see `pre-switchover`), unless management owns it. Called when no
    /// migration runs (capabilities cannot change during one).
    pub(super) async fn tune_migration_caps(&self, vm: &Vm, qmp: &Qmp) -> Result<(), SupError> {
        let any_qemu = vm
            .drives
            .values()
            .any(|d| d.engine_kind() == EngineKind::Qemu);
        let owner = *lock(&vm.pause_owner);
        let want = match owner {
            PauseOwner::Management => return Ok(()),
            PauseOwner::Acceld(on) if on == any_qemu => return Ok(()),
            PauseOwner::Acceld(_) => any_qemu,
            PauseOwner::Unknown => {
                let caps = qmp_run(qmp, &QueryMigrateCapabilities).await?;
                if caps.iter().any(|c| c.capability == PAUSE && c.state) {
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
    pub(super) async fn pre_switchover(&self, vm: &Arc<Vm>, qmp: &Qmp) {
        let t0 = std::time::Instant::now();
        let mut n = 0;
        for d in vm.drives.values() {
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
            match block_in_place(|| drive.pause()) {
                Ok(p) => {
                    let _ = block_in_place(|| p.resume(Arc::new(HeldEngine)));
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
        self.save();
    }
}
