//! What `status` answers, typed ([`accel_api::status`]), and the rates sampled for it.

use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use accel_api::status::{
    DriveIo, DriveMigration, DriveStatus, EngineKind, IoStatus, LendStats, PauseStats, PinKind,
    RunState, Status, SwitchStats, VmStatus,
};
use policy::Pin;

use super::drive_state::ManagedDrive;
use super::vm::Vm;
use super::Supervisor;
use accel_dataplane::drive::LatencyHistogram;
use accel_dataplane::util::lock;

/// QEMU's `io-status` for the drive: `nospace` while writes are held for lack of space,
/// `failed` while requests are held after another error (werror/rerror=stop), else `ok`.
fn io_status(s: &accel_dataplane::drive::DriveStats) -> IoStatus {
    if s.held_requests.load(Ordering::Relaxed) == 0 {
        IoStatus::Ok
    } else if s.hold_errno.load(Ordering::Relaxed) == libc::ENOSPC {
        IoStatus::Nospace
    } else {
        IoStatus::Failed
    }
}

pub(super) fn drive_status(vm: &Vm, d: &ManagedDrive) -> DriveStatus {
    let s = &d.drive.stats;
    // Held first and to the end, in the lock order (stats, observed, graph, intent,
    // placement): a switch commits its engine, NBD counters and throttle under the same
    // locks (`ManagedDrive::commit`), so this shows it all or not at all.
    let st = lock(&d.stats);
    let (engine, since) = {
        let p = lock(&d.placement);
        let since = p
            .since
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|t| t.as_secs())
            .unwrap_or(0);
        // A migration's switchover gave the image to the destination: nothing serves it here.
        let engine = if d.drive.image_handed_off() {
            EngineKind::Held
        } else {
            p.engine
        };
        (engine, since)
    };
    let (reasons, reason_sentences) = {
        let o = lock(&d.observed);
        (
            o.reasons.iter().map(|r| r.code()).collect(),
            o.reasons.iter().map(|r| r.sentence()).collect(),
        )
    };
    let (pin, pin_persistent, throttle) = {
        let i = lock(&d.intent);
        let pin = i.pin.map(|p| match p {
            Pin::Qemu => PinKind::Qemu,
            Pin::Direct => PinKind::Direct,
        });
        (pin, i.pin_persistent, i.throttle.clone())
    };
    // A ring broken now is the most urgent thing to show.
    let ring_last = (s.broken_queues.load(Ordering::Relaxed) > 0)
        .then(|| lock(&s.last_ring_error).clone())
        .flatten();
    let nbd_errors = st
        .nbd
        .as_ref()
        .map(|n| n.errors.load(Ordering::Relaxed))
        .unwrap_or(0);
    let nbd_last = st.nbd.as_ref().and_then(|n| lock(&n.last_error).clone());
    // The node's layers: its driver and its file node, as QEMU showed them last, or as
    // recorded before their removal (after a restart, before any look at QEMU); else the VM
    // contract's raw node over `NODE-file`.
    let layers = |n: &policy::NodeView, p: Option<&policy::NodeView>| {
        (n.driver.clone(), p.map(|p| p.name.clone()))
    };
    let (device, data_node, recorded) = {
        let g = lock(&d.graph);
        let rec = g
            .recorded
            .as_ref()
            .map(|r| layers(&r.node, r.protocol.as_ref()));
        (g.device.clone(), g.data_node.clone(), rec)
    };
    let (node_driver, file_node) = lock(&d.observed)
        .last_view
        .as_ref()
        .and_then(|v| v.node.as_ref().map(|n| layers(n, v.protocol.as_ref())))
        .or(recorded)
        .unwrap_or_else(|| (d.spec.format.clone(), Some(format!("{}-file", d.node()))));
    DriveStatus {
        vm: vm.name.clone(),
        drive: d.spec.id.clone(),
        device,
        node: d.node(),
        file_node,
        node_driver,
        data_node,
        throttle_group: lock(&d.intent).throttle_group.clone(),
        socket: d.socket.clone(),
        serial: d.drive.config().serial.clone(),
        image: d.image().path,
        format: d.spec.format.clone(),
        engine,
        // Mid-switch the data plane may have its next engine before the switch commits:
        // the path shown is the engine's shown, or none.
        io_path: {
            let e = d.drive.engine();
            if e.kind() == engine {
                e.io_path().to_string()
            } else {
                String::new()
            }
        },
        since,
        reasons,
        reason_sentences,
        pin,
        pin_persistent,
        throttle,
        io: DriveIo {
            status: io_status(s),
            iops: (st.rates.iops * 10.0).round() / 10.0,
            mbps: (st.rates.mbps * 100.0).round() / 100.0,
            p99_us: st.rates.p99_us,
            in_flight: s.in_flight.load(Ordering::Relaxed),
            errors: s.io_errors.load(Ordering::Relaxed),
            nbd_errors,
            broken_queues: s.broken_queues.load(Ordering::Relaxed),
            ring_errors: s.ring_errors.load(Ordering::Relaxed),
            held_requests: s.held_requests.load(Ordering::Relaxed),
            nospace_events: s.nospace_events.load(Ordering::Relaxed),
            resubmitted: s.resubmitted.load(Ordering::Relaxed),
            last_error: ring_last.or_else(|| st.last_error.clone()).or(nbd_last),
            counters: s.acct.counters(),
        },
        switch: SwitchStats {
            count: s.switches.load(Ordering::Relaxed),
            failed: st.failed_switches,
            last_pause_us: s.last_pause_us.load(Ordering::Relaxed),
            to_direct: PauseStats::of(&st.to_direct_us),
            to_qemu: PauseStats::of(&st.to_qemu_us),
        },
        lend: LendStats {
            lent: d.drive.rings_lent(),
            count: s.lends.load(Ordering::Relaxed),
            pauses: PauseStats::of(lock(&s.lend_pauses_us).make_contiguous()),
            take_back_pauses: PauseStats::of(lock(&s.take_back_pauses_us).make_contiguous()),
        },
        migration: DriveMigration {
            switchover_stop_us: s.switchover_stop_us.load(Ordering::Relaxed),
            image_released: d.drive.image_handed_off(),
        },
        writeback: d.drive.writeback(),
        spec: Some(d.spec.clone()),
        capacity_bytes: d.drive.capacity(),
    }
}

/// Every drive of `vm`, as `status` shows it.
fn drive_statuses(vm: &Vm) -> Vec<DriveStatus> {
    vm.drives().iter().map(|d| drive_status(vm, d)).collect()
}

impl Supervisor {
    /// The drives of one VM as `status` shows them (none for a VM acceld does not know),
    /// without building the others'.
    pub fn vm_drive_statuses(&self, vm: &str) -> Vec<DriveStatus> {
        self.vm(vm).map(|v| drive_statuses(&v)).unwrap_or_default()
    }

    /// Updates every drive's rates (called about once a second).
    pub fn sample_rates(&self) {
        for vm in self.all_vms() {
            for d in &vm.drives() {
                let s = &d.drive.stats;
                // Completed reads and writes (failed ones too) and the bytes they moved.
                let c = s.acct.counters();
                let ops = c.reads() + c.writes();
                let bytes = c.rd_bytes + c.wr_bytes;
                let lat = s.latency.snapshot();
                let now = Instant::now();
                let mut st = lock(&d.stats);
                let r = &mut st.rates;
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

    pub fn status(&self) -> Status {
        Status {
            vms: self
                .all_vms()
                .iter()
                .map(|vm| VmStatus {
                    vm: vm.name.clone(),
                    qmp: vm.qmp_path.clone(),
                    attached: vm.qmp().is_ok(),
                    run_state: RunState::parse(&lock(&vm.run_state)),
                    attach_error: lock(&vm.attach_error).clone(),
                    drives: drive_statuses(vm),
                    incoming: vm.incoming,
                    migration: lock(&vm.migration).clone(),
                    monitor: Some(self.monitor_socket(&vm.name)),
                })
                .collect(),
        }
    }

    /// Prometheus text exposition of every drive's counters.
    pub fn metrics(&self) -> String {
        self.status().prometheus()
    }
}
