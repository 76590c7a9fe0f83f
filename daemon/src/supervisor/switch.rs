//! The executor: performs a plan's action on a drive. A switch pauses and drains the drive
//! (requests stay in the vring), releases the old engine, brings up the new one (QMP steps,
//! file open + locks, or NBD connect) and resumes. A failure at any step rolls back to the old
//! engine; if even that fails, the drive is held (requests wait) and the error is shown in
//! status. The caller holds the drive's `op` lock: one operation at a time per drive.

use std::sync::Arc;
use std::time::Duration;

use super::offload;
use accel_api::control::DriveSpec;
use accel_api::status::EngineKind;
use policy::ServeSpec;
use qmp_client::Qmp;
use tracing::{debug, info, warn};

use super::drive_state::{Commit, ManagedDrive};
use super::plan::{Action, ToQemu};
use super::qemu_graph::{export_id, lift_limits, set_limits};
use super::vm::Vm;
use super::{SupError, Supervisor};
use accel_dataplane::drive::{Draining, SwitchReport};
use accel_dataplane::engine::nbd::NbdEngine;
use accel_dataplane::engine::relay::RelayEngine;
use accel_dataplane::engine::{Engine, FileEngine, FileEngineConfig, HeldEngine};
use accel_dataplane::util::lock;

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

/// How the direct engine opens a drive's image: the registered image (never the path QEMU reported,
/// which [`super::permit::check_qemu_image`] compared with it), opened by identity.
pub(super) fn file_config(
    drive: &DriveSpec,
    image: &super::permit::ImageRef,
    serve: &ServeSpec,
) -> FileEngineConfig {
    let mut c = FileEngineConfig::new(
        image.path.clone(),
        drive.read_only || serve.read_only || image.read_only,
        serve.direct,
        drive.logical_block_size,
    );
    c.identity = Some(image.id);
    c
}

impl Supervisor {
    /// Carries out one step of the plan, then saves the state once, whatever its outcome: the
    /// steps themselves return it and do not save (only [`Self::remove_nodes`] writes its
    /// recipe ahead, before QEMU's nodes go).
    pub(super) async fn execute(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        action: Action,
    ) -> Result<(), SupError> {
        let changes = !matches!(action, Action::Stay | Action::WaitQuiet);
        let outcome = self.step(vm, d, qmp, action).await;
        if changes {
            self.save();
        }
        outcome
    }

    async fn step(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        action: Action,
    ) -> Result<(), SupError> {
        match action {
            Action::Stay | Action::WaitQuiet => {
                self.ensure_lending(vm, d, qmp).await;
                Ok(())
            }
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
            Action::Repath { relay } => self.repath(vm, d, qmp, relay).await,
            Action::ToQemu(why) => {
                if why == ToQemu::ExportGone {
                    if let Some(n) = d.log.admit() {
                        warn!(drive = %d.spec.id, "acceld's NBD export is gone; re-creating it{}", accel_dataplane::util::suppressed(n));
                    }
                }
                self.transition(vm, d, qmp, Target::Qemu).await
            }
        }
    }

    /// QEMU's node names another file than the drive's image: QEMU pivoted to it (`virsh
    /// blockcopy --pivot`, `blockdev-mirror` then `job-complete`). The drive takes it if the
    /// user QEMU runs as may open it itself (the permit's owner, else the process serving
    /// QEMU's QMP socket, its ids, groups and capabilities as they are now): opened with
    /// those credentials, never beyond what QEMU could reach on its own. Anything else is refused and the drive stays
    /// on QEMU's block layer.
    async fn take_pivoted_image(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        old: &super::permit::ImageRef,
        spec: &policy::ServeSpec,
    ) -> Result<(), SupError> {
        let who = super::permit::Creds::of_qemu(vm.owner, qmp.peer_pid()).map_err(|why| {
            SupError::Denied(format!(
                "QEMU names {} for the direct engine, not the drive's image {}, and {why}",
                spec.image.display(),
                old.path.display()
            ))
        })?;
        let (uid, gid) = (who.uid, who.gid);
        let read_only = d.spec.read_only || spec.read_only || old.read_only;
        let new = super::permit::ImageRef::resolve_as_within(
            spec.image.clone(),
            who,
            read_only,
            Duration::from_secs(15),
        )
        .await
        .map_err(|e| {
            SupError::Denied(format!(
                "QEMU names {} for the direct engine, not the drive's image {}: {}",
                spec.image.display(),
                old.path.display(),
                e.chain()
            ))
        })?;
        info!(
            vm = %vm.name,
            drive = %d.spec.id,
            "the drive's image is now {} (QEMU pivoted from {}; opened as uid {} gid {})",
            new.path.display(),
            old.path.display(),
            uid,
            gid
        );
        d.set_image(new);
        Ok(())
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
        // Lent rings come back, and stay, until the drive is on the qemu engine again.
        d.stop_lending().await;
        if let Target::Direct(spec) = &to {
            let image = d.image();
            if super::permit::check_qemu_image(&image, &spec.image).is_err() {
                self.take_pivoted_image(vm, d, qmp, &image, spec).await?;
            }
        }
        // From direct to the qemu engine, everything but the hand-over happens before the
        // pause: QEMU's nodes, its export (acceld's lock shares write meanwhile; QEMU writes
        // nothing until acceld connects) and the NBD handshake. The pause is then the drain,
        // acceld closing the image, and the resume.
        // From the qemu engine to direct, acceld opens the image before the pause, sharing
        // write with QEMU's export (idle once acceld's connections close in the pause); the
        // export and nodes go after the resume, and then acceld's lock stops sharing write.
        let prepared: Option<(Arc<dyn Engine>, Commit)> = match (&to, from) {
            (Target::Qemu, EngineKind::Direct) => match self.qemu_engine(vm, d, qmp, true).await {
                Ok(up) => Some(up),
                Err(e) => {
                    self.unprepare_qemu(d, qmp).await;
                    lock(&d.stats).failed_switches += 1;
                    return Err(e);
                }
            },
            (Target::Direct(spec), EngineKind::Qemu) => {
                let cfg = file_config(&d.spec, &d.image(), spec);
                match offload::blocking(move || FileEngine::open_sharing_write(cfg)).await {
                    Ok(e) if e.size() >= d.drive.capacity() => Some((
                        Arc::new(e) as Arc<dyn Engine>,
                        Commit::direct(Some(spec.clone())),
                    )),
                    // The usual path then says why (and restores what it must).
                    _ => None,
                }
            }
            _ => None,
        };
        let was_prepared = prepared.is_some();
        let direct_prepared = was_prepared && matches!(to, Target::Direct(_));
        // The queues' contexts on a prepared engine too (io_uring rings, NBD queues on the
        // connections made ahead): the pause then does not wait for their set-up. If they
        // cannot be opened now, the resume opens them and says why.
        let mut ahead = match prepared.as_ref().map(|(e, _)| e.clone()) {
            Some(e) => {
                let dr = drive.clone();
                offload::blocking(move || dr.open_contexts(e.as_ref()))
                    .await
                    .ok()
            }
            None => None,
        };
        let old = drive.engine();
        // With the new engine ready on every queue, the switch overlaps: new requests go to
        // it at once, the ones in flight finish on the old engine, which is released only
        // after their last completion. The pause is then the hand-over alone, not the drain
        // (requests through QEMU, or a slow disk, take milliseconds).
        let mut prepared = prepared;
        let swapped = match (prepared.take(), ahead.take()) {
            (Some((e, commit)), Some(ctx)) => {
                let (dr, e2) = (drive.clone(), e.clone());
                match offload::blocking(move || dr.swap_engine(e2, ctx)).await {
                    Ok((rep, draining)) => Some((rep, draining, commit)),
                    Err((ctx, why)) => {
                        debug!(drive = %d.spec.id, "no overlapped switch: {why}");
                        prepared = Some((e, commit));
                        ahead = Some(ctx);
                        None
                    }
                }
            }
            (p, a) => {
                prepared = p;
                ahead = a;
                None
            }
        };
        let res = if let Some((rep, draining, commit)) = swapped {
            self.release_drained(d, old.clone(), draining, &rep, to.kind().as_str())
                .await;
            Ok((rep, commit))
        } else {
            let dr = drive.clone();
            let paused = match offload::blocking(move || dr.pause()).await {
                Ok(p) => p,
                Err(e) => {
                    // A prepared direct engine just closes (dropped here); the qemu engine
                    // still serves. A prepared qemu engine's export and nodes go.
                    if was_prepared && !direct_prepared {
                        self.unprepare_qemu(d, qmp).await;
                    }
                    return Err(e.into());
                }
            };
            let drained = paused.elapsed();
            // The next engine may be QEMU, whose flush covers only what it wrote itself:
            // what the old direct engine wrote is made durable now.
            let o = old.clone();
            if let Err(e) = offload::blocking(move || o.sync_data()).await {
                warn!(drive = %d.spec.id, "fdatasync before the switch failed: {e}");
            }
            // The old engine gives the storage up: inside the pause when the new one still
            // has to be brought up (QEMU's nodes may need the image), after the resume when
            // it was prepared (both already share the image, and the old one is idle once
            // drained).
            if !was_prepared {
                old.release();
            }
            let released = paused.elapsed();
            let up = match prepared {
                Some(up) => Ok(up),
                None => self.bring_up(vm, d, qmp, &to).await,
            };
            debug!(drive = %d.spec.id, to = to.kind().as_str(), drain_us = drained.as_micros() as u64, release_us = (released - drained).as_micros() as u64, bring_up_us = (paused.elapsed() - released).as_micros() as u64, "switch steps");
            let res = match up {
                Ok((engine, commit)) => {
                    match offload::blocking(move || paused.resume_with(engine, ahead)).await {
                        Ok(rep) => Ok((rep, commit)),
                        Err((p, e)) => Err((p, SupError::Switch(e))),
                    }
                }
                Err(e) => Err((paused, e)),
            };
            if was_prepared {
                old.release();
            }
            res
        };
        match res {
            Ok((rep, commit)) => {
                let us = rep.pause.as_micros() as u64;
                // A prepared direct engine commits once QEMU's export and nodes are gone.
                if direct_prepared {
                    if let Err(e) = self.finish_direct(d, qmp).await {
                        self.back_to_qemu(vm, d, qmp, &e).await;
                        return Err(e);
                    }
                }
                // The switch shows now, all of it: the engine with its pause. Per direction,
                // the live switches between the two engines; a take from held (start-up, or
                // after a hold) paused nothing that ran.
                let pause = (from != EngineKind::Held).then_some(us);
                d.commit(commit, pause);
                info!(vm = %vm.name, drive = %d.spec.id, from = from.as_str(), to = to.kind().as_str(), pause_us = us, "switched");
                if matches!(to, Target::Qemu) {
                    self.ensure_lending(vm, d, qmp).await;
                }
                Ok(())
            }
            Err((paused, e)) => {
                if let Some(n) = d.log.admit() {
                    warn!(vm = %vm.name, drive = %d.spec.id, "switch to {} failed, rolling back: {}{}", to.kind().as_str(), e.chain(), accel_dataplane::util::suppressed(n));
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
                        Ok((engine, commit)) => offload::blocking(move || paused.resume(engine))
                            .await
                            .map(|_| d.commit(commit, None))
                            .map_err(|(p, e)| (p, SupError::Switch(e))),
                        Err(e2) => Err((paused, e2)),
                    },
                    None => Err((paused, SupError::QemuState("have a way back".into()))),
                };
                if let Err((paused, e2)) = restored {
                    if let Some(n) = d.log.admit() {
                        warn!(vm = %vm.name, drive = %d.spec.id, "rollback failed, holding the drive's requests: {}{}", e2.chain(), accel_dataplane::util::suppressed(n));
                    }
                    let _ = offload::blocking(move || paused.resume(Arc::new(HeldEngine))).await;
                    d.set_engine(EngineKind::Held);
                }
                Err(e)
            }
        }
    }

    /// QEMU's nodes and acceld's export of the drive, and the qemu engine on it: the
    /// bring-up to the qemu engine, inside the pause or (`share_write_first`, from a running
    /// direct engine) before it.
    async fn qemu_engine(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Qmp,
        share_write_first: bool,
    ) -> Result<(Arc<dyn Engine>, Commit), SupError> {
        let t0 = std::time::Instant::now();
        self.qemu_down(d, qmp).await?;
        let t_down = t0.elapsed();
        self.restore_nodes(d, qmp).await?;
        let t_nodes = t0.elapsed();
        if share_write_first {
            d.drive.engine().share_write(true)?;
        }
        let throttle = lock(&d.intent).throttle.clone();
        let sock = vm.nbd_socket();
        let after_incoming = vm.incoming && lock(&vm.migration).as_deref() == Some("completed");
        let export = self
            .qemu_up(d, qmp, &sock, throttle.as_ref(), after_incoming)
            .await?;
        let t_up = t0.elapsed();
        let queues = usize::from(d.drive.config().num_queues);
        // The relay's export stays up either way; the drive goes through it only when
        // nothing that may drain QEMU's node is under way (plan's relay_wanted).
        let relay_now = lock(&d.graph).relay_allowed && !vm.relay_held();
        if !relay_now {
            debug!(drive = %d.spec.id, "over NBD for now: a block job or a held management command may drain QEMU's node");
        }
        if let Some(engine) = match relay_now {
            true => self.relay_engine(vm, d, qmp, queues).await,
            false => None,
        } {
            debug!(drive = %d.spec.id, before_pause = share_write_first, down_us = t_down.as_micros() as u64, nodes_us = (t_nodes - t_down).as_micros() as u64, export_us = (t_up - t_nodes).as_micros() as u64, connect_us = (t0.elapsed() - t_up).as_micros() as u64, "bring-up steps (qemu, relay)");
            return Ok((engine, Commit::qemu(None, throttle)));
        }
        // One connection per queue now, so the queues resume on connections that are up
        // (before the pause, when share_write_first).
        let engine = {
            let (s, x) = (sock.clone(), export.clone());
            offload::blocking(move || NbdEngine::connect_ahead(&s, &x, queues)).await?
        };
        debug!(drive = %d.spec.id, before_pause = share_write_first, down_us = t_down.as_micros() as u64, nodes_us = (t_nodes - t_down).as_micros() as u64, export_us = (t_up - t_nodes).as_micros() as u64, connect_us = (t0.elapsed() - t_up).as_micros() as u64, "bring-up steps (qemu)");
        if engine.info().size < d.drive.capacity() {
            return Err(SupError::Invalid(format!(
                "QEMU's export of {export} holds {} bytes, less than the disk the guest sees",
                engine.info().size
            )));
        }
        let commit = Commit::qemu(Some(engine.stats()), throttle);
        Ok((Arc::new(engine), commit))
    }

    /// The old engine of an overlapped switch is released once its last request completed;
    /// after the drain timeout a thread waits for them and releases it then (never an engine
    /// with requests on it), and no other switch starts meanwhile.
    async fn release_drained(
        &self,
        d: &Arc<ManagedDrive>,
        old: Arc<dyn Engine>,
        draining: Draining,
        rep: &SwitchReport,
        to: &str,
    ) {
        let t = std::time::Instant::now();
        let timeout = Duration::from_millis(self.cfg.drain_timeout_ms);
        match offload::blocking(move || draining.wait(timeout)).await {
            Ok(()) => {
                debug!(drive = %d.spec.id, to, swap_us = rep.pause.as_micros() as u64, handover_us = rep.handover.as_micros() as u64, old_drain_us = t.elapsed().as_micros() as u64, "switch steps (overlapped)");
                old.release();
            }
            Err(draining) => {
                if let Some(n) = d.log.admit() {
                    warn!(drive = %d.spec.id, "requests on the old engine did not finish within {timeout:?}; it is released once they do{}", accel_dataplane::util::suppressed(n));
                }
                std::thread::spawn(move || {
                    draining.wait_all();
                    old.release();
                });
            }
        }
    }

    /// On the qemu engine, moves the drive between QEMU's two exports of its node: the relay
    /// (QEMU's vhost-user-blk export, `relay`) and acceld's NBD export. Both serve the same
    /// node, so the move overlaps: new requests go to the new path at once and those in
    /// flight finish on the old one. When the relay cannot be reached the drive stays on NBD
    /// (logged); when the overlap is refused (held requests), an ordinary pause hands over.
    async fn repath(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        relay: bool,
    ) -> Result<(), SupError> {
        let queues = usize::from(d.drive.config().num_queues);
        let throttle = lock(&d.graph).applied_throttle.clone();
        let (new, nbd_stats) = if relay {
            self.ensure_relay_export(vm, d, qmp).await;
            match self.relay_engine(vm, d, qmp, queues).await {
                Some(e) => (e, None),
                None => return Ok(()),
            }
        } else {
            let (s, x) = (vm.nbd_socket(), export_id(d.id()));
            let e = offload::blocking(move || NbdEngine::connect_ahead(&s, &x, queues)).await?;
            if e.info().size < d.drive.capacity() {
                return Err(SupError::Invalid(format!(
                    "QEMU's export of {} holds {} bytes, less than the disk the guest sees",
                    export_id(d.id()),
                    e.info().size
                )));
            }
            let st = e.stats();
            (Arc::new(e) as Arc<dyn Engine>, Some(st))
        };
        let to = new.io_path().to_string();
        let drive = d.drive.clone();
        let old = drive.engine();
        let ahead = {
            let (dr, e) = (drive.clone(), new.clone());
            offload::blocking(move || dr.open_contexts(e.as_ref()))
                .await
                .ok()
        };
        let swapped = match ahead {
            Some(ctx) => {
                let (dr, e) = (drive.clone(), new.clone());
                offload::blocking(move || dr.swap_engine(e, ctx))
                    .await
                    .map_err(|(ctx, why)| {
                        debug!(drive = %d.spec.id, "no overlapped repath: {why}");
                        Some(ctx)
                    })
            }
            None => Err(None),
        };
        let pause_us = match swapped {
            Ok((rep, draining)) => {
                self.release_drained(d, old, draining, &rep, &to).await;
                rep.pause.as_micros() as u64
            }
            Err(ahead) => {
                let dr = drive.clone();
                let paused = offload::blocking(move || dr.pause()).await?;
                let e = new.clone();
                match offload::blocking(move || paused.resume_with(e, ahead)).await {
                    Ok(rep) => {
                        old.release();
                        rep.pause.as_micros() as u64
                    }
                    Err((paused, e)) => {
                        new.release();
                        let back = old.clone();
                        if let Err((paused, e2)) =
                            offload::blocking(move || paused.resume(back)).await
                        {
                            if let Some(n) = d.log.admit() {
                                warn!(vm = %vm.name, drive = %d.spec.id, "cannot resume the drive on its old path, holding its requests: {e2}{}", accel_dataplane::util::suppressed(n));
                            }
                            let _ = offload::blocking(move || paused.resume(Arc::new(HeldEngine)))
                                .await;
                            d.set_engine(EngineKind::Held);
                        }
                        return Err(SupError::Switch(e));
                    }
                }
            }
        };
        d.commit(Commit::qemu(nbd_stats, throttle), None);
        info!(vm = %vm.name, drive = %d.spec.id, to = %to, pause_us, "repathed on the qemu engine");
        Ok(())
    }

    /// The relay on QEMU's vhost-user-blk export of the drive (the default, made by
    /// `qemu_up`), or None (logged) when there is no export or its session cannot be set up:
    /// the drive then goes over NBD, and the export is removed.
    async fn relay_engine(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Qmp,
        queues: usize,
    ) -> Option<Arc<dyn Engine>> {
        let sock = lock(&d.graph).relay_socket.clone()?;
        // The export's server must be the VM's QEMU (its user), as for its monitor.
        let uid = vm.owner.map(|o| o.uid);
        let r = offload::blocking(move || RelayEngine::connect(&sock, uid, queues)).await;
        let why = match r {
            Ok(r) if r.config().capacity >= d.drive.capacity() => {
                // The registered image (the permit names it; a path QEMU pivoted to is
                // not asked): its file system tells ENOSPC from EIO.
                r.set_image(d.spec.image.clone());
                // A session that ends holds the requests; `reconcile` moves the drive to NBD.
                r.hold_when_lost(true);
                return Some(Arc::new(r));
            }
            Ok(r) => format!(
                "the export holds {} bytes, less than the disk the guest sees",
                r.config().capacity
            ),
            Err(e) => accel_dataplane::util::error_chain(&e),
        };
        if let Some(n) = d.log.admit() {
            warn!(vm = %vm.name, drive = %d.spec.id, "cannot relay through QEMU's vhost-user-blk export, serving over NBD: {why}{}", accel_dataplane::util::suppressed(n));
        }
        if let Err(e) = self.relay_down(d, qmp).await {
            warn!(drive = %d.spec.id, "cannot remove the relay's export: {}", e.chain());
        }
        None
    }

    /// After a switch to direct prepared before the pause: QEMU's export (idle, acceld's
    /// connections are closed) and nodes go, then acceld's lock stops sharing write.
    async fn finish_direct(&self, d: &Arc<ManagedDrive>, qmp: &Qmp) -> Result<(), SupError> {
        self.qemu_down(d, qmp).await?;
        self.remove_nodes(d, qmp).await?;
        d.drive.engine().share_write(false)?;
        Ok(())
    }

    /// `finish_direct` failed: QEMU kept its export or nodes, so the drive goes back to the
    /// qemu engine (one more pause) rather than run direct next to them; if even that fails,
    /// it holds its requests.
    async fn back_to_qemu(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Arc<Qmp>,
        why: &SupError,
    ) {
        if let Some(n) = d.log.admit() {
            warn!(vm = %vm.name, drive = %d.spec.id, "switch to direct failed after the resume, rolling back: {}{}", why.chain(), accel_dataplane::util::suppressed(n));
        }
        {
            let mut st = lock(&d.stats);
            st.failed_switches += 1;
            st.last_error = Some(why.chain());
        }
        let drive = d.drive.clone();
        let dr = drive.clone();
        let paused = match offload::blocking(move || dr.pause()).await {
            Ok(p) => p,
            Err(e) => {
                if let Some(n) = d.log.admit() {
                    warn!(vm = %vm.name, drive = %d.spec.id, "cannot pause the drive to roll back: {e}{}", accel_dataplane::util::suppressed(n));
                }
                return;
            }
        };
        drive.engine().release();
        self.resume_on_qemu(vm, d, qmp, paused, "the failed switch to direct")
            .await;
    }

    /// Undoes a `qemu_engine` made before the pause while the drive still runs direct: QEMU's export and nodes go,
    /// and acceld's lock stops sharing write again.
    async fn unprepare_qemu(&self, d: &Arc<ManagedDrive>, qmp: &Qmp) {
        // Each step on its own: the lock must come back even if QEMU keeps its nodes (nodes
        // without a user hold no write permission).
        let mut failed = Vec::new();
        if let Err(e) = self.qemu_down(d, qmp).await {
            failed.push(format!("the prepared export stays: {}", e.chain()));
        }
        if let Err(e) = self.remove_nodes(d, qmp).await {
            failed.push(format!("the prepared nodes stay: {}", e.chain()));
        }
        if let Err(e) = d.drive.engine().share_write(false) {
            failed.push(format!(
                "acceld's image lock still shares write: {}",
                crate::error_chain(&e)
            ));
        }
        if !failed.is_empty() {
            if let Some(n) = d.log.admit() {
                warn!(drive = %d.spec.id, "cannot undo the prepared qemu engine: {}{}", failed.join("; "), accel_dataplane::util::suppressed(n));
            }
        }
        d.commit(Commit::direct(None), None);
    }

    /// Makes `to` serve the drive and returns its engine, and what to commit once it serves
    /// (the drive is paused and the old engine released).
    async fn bring_up(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Qmp,
        to: &Target,
    ) -> Result<(Arc<dyn Engine>, Commit), SupError> {
        match to {
            Target::Direct(spec) => {
                let t0 = std::time::Instant::now();
                self.qemu_down(d, qmp).await?;
                let t_down = t0.elapsed();
                self.remove_nodes(d, qmp).await?;
                let t_nodes = t0.elapsed();
                let opened = FileEngine::open(file_config(&d.spec, &d.image(), spec));
                debug!(drive = %d.spec.id, down_us = t_down.as_micros() as u64, nodes_us = (t_nodes - t_down).as_micros() as u64, open_us = (t0.elapsed() - t_nodes).as_micros() as u64, "bring-up steps (direct)");
                let e = match opened {
                    Ok(e) if e.size() >= d.drive.capacity() => e,
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
                Ok((Arc::new(e), Commit::direct(Some(spec.clone()))))
            }
            Target::Qemu => self.qemu_engine(vm, d, qmp, false).await,
        }
    }
}

impl Supervisor {
    /// Runs `resize` (management's `block_resize`, forwarded by the QMP proxy) with acceld's
    /// export off the drive's node, since QEMU's NBD export forbids resizing the node it
    /// serves; then serves the drive on the qemu engine again at the node's new size, and
    /// tells the guest (vhost-user config-change message). The drive must be on the qemu
    /// engine with its data on its own node (the proxy holds it there first). The guest's
    /// requests wait in the vring meanwhile.
    pub async fn with_export_off<T, Fut>(
        self: &Arc<Self>,
        vm: &str,
        drive: &str,
        resize: impl FnOnce() -> Fut,
    ) -> Result<T, SupError>
    where
        Fut: std::future::Future<Output = T>,
    {
        let vmr = self.vm(vm)?;
        let d = vmr.drive(drive)?;
        let qmp = vmr.qmp()?;
        let _op = d.op.lock().await;
        if d.engine_kind() != EngineKind::Qemu {
            return Err(SupError::Invalid(format!(
                "drive '{drive}' is not on QEMU's block layer"
            )));
        }
        if let Some(n) = lock(&d.graph).data_node.clone() {
            return Err(SupError::Invalid(format!(
                "the guest's data is on node '{n}' now (an external snapshot, a job's filter or \
                 a mirror's pivot); resize it when the drive's data is on its own node again"
            )));
        }
        let dr = d.drive.clone();
        let paused = {
            let dr = dr.clone();
            offload::blocking(move || dr.pause()).await?
        };
        dr.engine().release();
        if let Err(e) = self.qemu_down(&d, &qmp).await {
            self.resume_after_resize(&vmr, &d, &qmp, paused).await;
            return Err(e);
        }
        let out = resize().await;
        let was = d.drive.capacity();
        let size = node_size(&qmp, &d.node()).await;
        let now = match size {
            Ok(s) if s != was => Some(d.drive.set_capacity(s)),
            Ok(_) => None,
            Err(e) => {
                if let Some(n) = d.log.admit() {
                    warn!(vm = %vmr.name, drive, "cannot read the node's size after a resize: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
                }
                None
            }
        };
        self.resume_after_resize(&vmr, &d, &qmp, paused).await;
        if let Some(now) = now {
            if let Some(n) = d.log.admit() {
                info!(vm = %vmr.name, drive, was, now, "drive resized{}", accel_dataplane::util::suppressed(n));
            }
            self.tell_new_size(&vmr, &d, &qmp).await;
        }
        self.save();
        Ok(out)
    }

    async fn resume_after_resize(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Qmp,
        paused: accel_dataplane::drive::Paused,
    ) {
        if let Some(e) = self.resume_on_qemu(vm, d, qmp, paused, "a resize").await {
            lock(&d.stats).last_error = Some(e.chain());
        }
    }

    /// Tells QEMU's vhost-user-blk that the config space changed. The backend channel's
    /// message is what QEMU acts on while the device runs; QEMU drops it while the guest's
    /// driver has not started the device (it keeps the config it read at connect), so then
    /// `device-sync-config` makes it read the config again.
    async fn tell_new_size(&self, vm: &Arc<Vm>, d: &Arc<ManagedDrive>, qmp: &Qmp) {
        let sent = match accel_dataplane::vhost::notify_config_change(&d.drive) {
            Ok(sent) => sent,
            Err(e) => {
                if let Some(n) = d.log.admit() {
                    warn!(vm = %vm.name, drive = %d.spec.id, "cannot send the config-change message: {e}{}", accel_dataplane::util::suppressed(n));
                }
                false
            }
        };
        if sent && d.drive.has_running_queues() {
            return;
        }
        let sync = qmp_client::commands::DeviceSyncConfig {
            id: d.spec.id.clone(),
        };
        if let Err(e) = super::qmp_run(qmp, &sync).await {
            if let Some(n) = d.log.admit() {
                warn!(vm = %vm.name, drive = %d.spec.id, "QEMU's device keeps the old size until the guest resets it: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
            }
        }
    }

    /// Ends a pause on a fresh qemu engine (after a rollback, a resize); if that fails the
    /// drive holds its requests (the next look at QEMU retries), and the error comes back.
    async fn resume_on_qemu(
        &self,
        vm: &Arc<Vm>,
        d: &Arc<ManagedDrive>,
        qmp: &Qmp,
        paused: accel_dataplane::drive::Paused,
        after: &str,
    ) -> Option<SupError> {
        let res = match self.qemu_engine(vm, d, qmp, false).await {
            Ok((engine, commit)) => offload::blocking(move || paused.resume(engine))
                .await
                .map(|_| d.commit(commit, None))
                .map_err(|(p, e)| (p, e.into())),
            Err(e) => Err((paused, e)),
        };
        let (paused, e): (_, SupError) = match res {
            Ok(_) => {
                self.ensure_lending(vm, d, qmp).await;
                return None;
            }
            Err(x) => x,
        };
        if let Some(n) = d.log.admit() {
            warn!(vm = %vm.name, drive = %d.spec.id, "cannot serve the drive on the qemu engine after {after}, holding its requests: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
        }
        let _ = offload::blocking(move || paused.resume(Arc::new(HeldEngine))).await;
        d.set_engine(EngineKind::Held);
        Some(e)
    }
}

/// The virtual size QEMU shows for node `name`.
async fn node_size(qmp: &Qmp, name: &str) -> Result<u64, SupError> {
    let nodes = super::qmp_run(qmp, &qmp_client::commands::QueryNamedBlockNodes::default()).await?;
    nodes
        .iter()
        .find(|n| n["node-name"].as_str() == Some(name))
        .and_then(|n| n["image"]["virtual-size"].as_u64())
        .ok_or_else(|| SupError::Parse(format!("no virtual size for node {name}")))
}
