//! The executor: performs a plan's action on a drive. A switch pauses and drains the drive
//! (requests stay in the vring), releases the old engine, brings up the new one (QMP steps,
//! file open + locks, or NBD connect) and resumes. A failure at any step rolls back to the old
//! engine; if even that fails, the drive is held (requests wait) and the error is shown in
//! status. The caller holds the drive's `op` lock: one operation at a time per drive.

use std::sync::Arc;

use accel_api::control::DriveSpec;
use accel_api::status::EngineKind;
use policy::ServeSpec;
use qmp_client::Qmp;
use tokio::task::block_in_place;
use tracing::{info, warn};

use super::drive_state::ManagedDrive;
use super::plan::{Action, ToQemu};
use super::qemu_graph::{lift_limits, set_limits};
use super::vm::Vm;
use super::{SupError, Supervisor};
use crate::engine::nbd::NbdEngine;
use crate::engine::{Engine, FileEngine, FileEngineConfig, HeldEngine};
use crate::util::lock;

#[derive(Clone, Debug)]
enum Target {
    Direct(ServeSpec),
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

/// How the direct engine opens a drive's image.
pub(super) fn file_config(drive: &DriveSpec, serve: &ServeSpec) -> FileEngineConfig {
    FileEngineConfig::new(
        serve.image.clone(),
        drive.read_only || serve.read_only,
        serve.direct,
        drive.logical_block_size,
    )
}

impl Supervisor {
    pub(super) async fn execute(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        action: Action,
    ) -> Result<(), SupError> {
        match action {
            Action::Stay | Action::WaitQuiet => Ok(()),
            Action::Retune(limits) => {
                set_limits(qmp, d, &limits).await?;
                lock(&d.graph).applied_throttle = Some(limits);
                Ok(())
            }
            Action::ToDirect {
                spec,
                lift_throttle,
            } => {
                if lift_throttle {
                    // The drain would otherwise wait for every request the throttle is holding
                    // back (in flight / limit seconds).
                    lift_limits(qmp, d).await;
                }
                self.transition(vm, d, qmp, Target::Direct(spec)).await
            }
            Action::ToQemu(why) => {
                if why == ToQemu::ExportGone {
                    if let Some(n) = d.log.admit() {
                        warn!(drive = %d.spec.id, "acceld's NBD export is gone; re-creating it{}", crate::util::suppressed(n));
                    }
                }
                self.transition(vm, d, qmp, Target::Qemu).await
            }
        }
    }

    async fn transition(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
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
                let mut st = lock(&d.stats);
                match to {
                    Target::Direct(_) => st.to_direct_us.push(us),
                    Target::Qemu => st.to_qemu_us.push(us),
                }
                st.last_error = None;
                drop(st);
                if matches!(to, Target::Direct(_)) {
                    // The next export goes in acceld's iothread again.
                    lock(&d.intent).main_loop_export = false;
                }
                info!(vm = %vm.name, drive = %d.spec.id, from = from.as_str(), to = to.kind().as_str(), pause_us = us, "switched");
                self.save();
                Ok(())
            }
            Err((paused, e)) => {
                if let Some(n) = d.log.admit() {
                    warn!(vm = %vm.name, drive = %d.spec.id, "switch to {} failed, rolling back: {}{}", to.kind().as_str(), e.chain(), crate::util::suppressed(n));
                }
                lock(&d.stats).failed_switches += 1;
                let back = match from {
                    EngineKind::Direct => {
                        lock(&d.placement).direct_spec.clone().map(Target::Direct)
                    }
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
                    if let Some(n) = d.log.admit() {
                        warn!(vm = %vm.name, drive = %d.spec.id, "rollback failed, holding the drive's requests: {}{}", e2.chain(), crate::util::suppressed(n));
                    }
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
        d: &Arc<ManagedDrive>,
        qmp: &Qmp,
        to: &Target,
    ) -> Result<Arc<dyn Engine>, SupError> {
        match to {
            Target::Direct(spec) => {
                self.qemu_down(d, qmp).await?;
                self.remove_nodes(d, qmp).await?;
                let e = match FileEngine::open(file_config(&d.spec, spec)) {
                    Ok(e) if e.size() >= d.drive.config().capacity_bytes => e,
                    Ok(e) => {
                        e.release();
                        self.restore_nodes(d, qmp).await?;
                        return Err(SupError::Invalid(format!(
                            "image {} is smaller than the disk the guest sees",
                            spec.image.display()
                        )));
                    }
                    Err(err) => {
                        self.restore_nodes(d, qmp).await?;
                        return Err(err.into());
                    }
                };
                lock(&d.graph).applied_throttle = None;
                lock(&d.stats).nbd = None;
                lock(&d.placement).direct_spec = Some(spec.clone());
                d.set_engine(EngineKind::Direct);
                Ok(Arc::new(e))
            }
            Target::Qemu => {
                self.qemu_down(d, qmp).await?;
                self.restore_nodes(d, qmp).await?;
                let throttle = lock(&d.intent).throttle.clone();
                let sock = vm.nbd_socket();
                let after_incoming =
                    vm.incoming && lock(&vm.migration).as_deref() == Some("completed");
                let export = self
                    .qemu_up(d, qmp, &sock, throttle.as_ref(), after_incoming)
                    .await?;
                let engine = block_in_place(|| NbdEngine::connect(&sock, &export))?;
                if engine.info().size < d.drive.config().capacity_bytes {
                    return Err(SupError::Invalid(format!(
                        "QEMU's export of {export} holds {} bytes, less than the disk the guest sees",
                        engine.info().size
                    )));
                }
                lock(&d.graph).applied_throttle = throttle;
                lock(&d.stats).nbd = Some(engine.stats());
                d.set_engine(EngineKind::Qemu);
                Ok(Arc::new(engine))
            }
        }
    }
}
