//! The typed status of `acceld run` (`{"op":"status"}`), and the renderers that read it:
//! Prometheus text here, the table in accelctl. One type, so a field cannot be spelled two
//! ways.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::control::ThrottleLimits;

/// Which engine serves a drive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Requests wait in the vring (no engine may serve yet).
    #[default]
    Held,
    /// acceld on the image itself (io_uring or inline I/O).
    Direct,
    /// NBD to the VM's QEMU, whose block layer serves it.
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

/// A drive's pin (an operator's choice that overrides the rules where they allow it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinKind {
    Qemu,
    Direct,
}

/// Pause lengths of one switch direction.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseStats {
    pub count: usize,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl PauseStats {
    /// Quantiles of a list of pauses (microseconds).
    pub fn of(v: &[u64]) -> PauseStats {
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
            max_us: s[s.len() - 1],
        }
    }
}

/// I/O accounting in QEMU's `BlockDeviceStats` terms (what `query-blockstats` reports for a
/// virtio-blk drive): WRITE_ZEROES counts as a write, DISCARD as an unmap. Monotonic for the
/// drive's life in acceld, across engine switches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoCounters {
    pub rd_bytes: u64,
    pub wr_bytes: u64,
    pub unmap_bytes: u64,
    pub rd_operations: u64,
    pub wr_operations: u64,
    pub flush_operations: u64,
    pub unmap_operations: u64,
    pub rd_total_time_ns: u64,
    pub wr_total_time_ns: u64,
    pub flush_total_time_ns: u64,
    pub unmap_total_time_ns: u64,
    /// Requests that reached the engine and failed.
    pub failed_rd_operations: u64,
    pub failed_wr_operations: u64,
    pub failed_flush_operations: u64,
    pub failed_unmap_operations: u64,
    /// Requests rejected before any I/O (malformed, out of range, read-only).
    pub invalid_rd_operations: u64,
    pub invalid_wr_operations: u64,
    pub invalid_flush_operations: u64,
    pub invalid_unmap_operations: u64,
}

impl IoCounters {
    /// Reads completed, successful or failed.
    pub fn reads(&self) -> u64 {
        self.rd_operations + self.failed_rd_operations
    }

    /// Writes (and write-zeroes) completed, successful or failed.
    pub fn writes(&self) -> u64 {
        self.wr_operations + self.failed_wr_operations
    }
}

/// QEMU's `io-status` of a drive (`query-block`'s `io-status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoStatus {
    #[default]
    Ok,
    /// Writes are held for lack of space (`werror=enospc`).
    Nospace,
    /// Requests are held after another error (`werror`/`rerror=stop`).
    Failed,
}

impl IoStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            IoStatus::Ok => "ok",
            IoStatus::Nospace => "nospace",
            IoStatus::Failed => "failed",
        }
    }
}

/// A drive's I/O: what the guest asked and how it went.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DriveIo {
    pub status: IoStatus,
    /// Completed requests per second and MB/s over the last second, and the p99 completion
    /// latency over it (None: no request then).
    pub iops: f64,
    pub mbps: f64,
    pub p99_us: Option<u64>,
    pub in_flight: u64,
    /// Requests answered IOERR (rejected or failed).
    pub errors: u64,
    /// Failures of the NBD connection to QEMU (qemu engine).
    pub nbd_errors: u64,
    /// Queues whose ring the driver corrupted: they stop until the frontend resets them.
    pub broken_queues: u64,
    /// Rings found broken since the drive started.
    pub ring_errors: u64,
    /// Requests held after an error (werror=enospc or stop), retried until they succeed.
    pub held_requests: u64,
    /// Requests that failed with ENOSPC and were held.
    pub nospace_events: u64,
    /// Requests a previous acceld left in flight and this one resubmitted (INFLIGHT_SHMFD).
    pub resubmitted: u64,
    pub last_error: Option<String>,
    /// Every request by class, in QEMU's `query-blockstats` terms: the one count of reads,
    /// writes and their bytes.
    pub counters: IoCounters,
}

/// A drive's live switches between the engines.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SwitchStats {
    pub count: u64,
    pub failed: u64,
    pub last_pause_us: u64,
    /// Pauses of the switches from the qemu engine to direct, and the other way; a drive
    /// taken from `held` (at start-up, or after a hold) counts in neither.
    pub to_direct: PauseStats,
    pub to_qemu: PauseStats,
}

/// Lending the drive's rings to QEMU's own vhost-user-blk export (`lend=on`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LendStats {
    /// The rings are lent now: QEMU serves the guest directly, and the I/O counters stand
    /// still.
    pub lent: bool,
    /// Times the rings were lent.
    pub count: u64,
    /// Pauses of lending (drain, hand-over) and of taking back (the export's requests
    /// finishing), over the last 1000 of each.
    pub pauses: PauseStats,
    pub take_back_pauses: PauseStats,
}

/// The drive in a live migration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DriveMigration {
    /// The last switchover's ring stop on this side (drain, fdatasync, image release), in
    /// microseconds; 0 if none.
    pub switchover_stop_us: u64,
    /// The switchover released the image (flushed, unlocked, closed); it comes back if the
    /// guest runs here again.
    pub image_released: bool,
}

/// One drive, as `accelctl status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DriveStatus {
    pub vm: String,
    pub drive: String,
    /// The vhost-user-blk-pci device using the drive's socket (None until attached).
    pub device: Option<String>,
    /// QEMU's node-name of the drive's image.
    pub node: String,
    /// The file (protocol) node under `node`; None when `node` is the file node itself.
    pub file_node: Option<String>,
    /// The driver of `node` in QEMU: `raw` over a file node, or `file`/`host_device` itself.
    pub node_driver: String,
    pub socket: PathBuf,
    pub image: PathBuf,
    pub format: String,
    /// What GET_ID answers the guest (empty: no serial, as QEMU's virtio-blk without
    /// `serial=`).
    pub serial: String,
    /// Bytes the guest sees.
    pub capacity_bytes: u64,
    /// The write cache the guest sees now (config `writeback`).
    pub writeback: bool,
    pub engine: EngineKind,
    /// The path under the engine: "io_uring" or "inline" (direct), "nbd" or "vhost-user"
    /// (qemu: over NBD, or relayed through QEMU's vhost-user-blk export), "held".
    #[serde(default)]
    pub io_path: String,
    /// Unix time (seconds) of the last engine change.
    pub since: u64,
    /// Codes of the reasons that keep the drive on QEMU's block layer.
    pub reasons: Vec<String>,
    pub reason_sentences: Vec<String>,
    pub pin: Option<PinKind>,
    /// The pin survives an acceld restart (`--pin`).
    pub pin_persistent: bool,
    pub throttle: Option<ThrottleLimits>,
    /// Management's throttle group of the drive (QMP proxy), if it named one.
    pub throttle_group: Option<String>,
    /// The QEMU node the guest's data is on when it is not the drive's own node: an external
    /// snapshot's overlay, or a mirror's target after a pivot (the drive then stays on
    /// QEMU's block layer).
    pub data_node: Option<String>,
    /// The drive as registered (for a migration's destination).
    pub spec: Option<crate::control::DriveSpec>,
    pub io: DriveIo,
    pub switch: SwitchStats,
    pub lend: LendStats,
    pub migration: DriveMigration,
}

/// QEMU's run state (`query-status`, the `STATUS` of `RunState` in QEMU's QAPI schema).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    Debug,
    Inmigrate,
    InternalError,
    IoError,
    Paused,
    Postmigrate,
    Prelaunch,
    FinishMigrate,
    RestoreVm,
    Running,
    SaveVm,
    Shutdown,
    Suspended,
    Watchdog,
    GuestPanicked,
    Colo,
    /// A state this build does not know (a newer QEMU).
    #[serde(other)]
    Other,
}

impl RunState {
    /// QEMU's name of a state; None for an empty one (not seen yet).
    pub fn parse(s: &str) -> Option<RunState> {
        if s.is_empty() {
            return None;
        }
        Some(serde_json::from_value(serde_json::Value::String(s.into())).unwrap_or(RunState::Other))
    }
}

/// One VM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VmStatus {
    pub vm: String,
    pub qmp: PathBuf,
    pub attached: bool,
    /// QEMU's run state as last seen (None before attach).
    pub run_state: Option<RunState>,
    pub attach_error: Option<String>,
    pub drives: Vec<DriveStatus>,
    /// Registered as a migration's destination.
    #[serde(default)]
    pub incoming: bool,
    /// QEMU's migration status as last seen (`active`, `completed`, …), if any.
    #[serde(default)]
    pub migration: Option<String>,
    /// The QMP proxy socket management connects to instead of QEMU's monitor.
    #[serde(default)]
    pub monitor: Option<PathBuf>,
}

/// The reply of `{"op":"status"}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub vms: Vec<VmStatus>,
}

impl Status {
    pub fn drives(&self) -> impl Iterator<Item = &DriveStatus> {
        self.vms.iter().flat_map(|v| v.drives.iter())
    }

    /// Prometheus text exposition of every drive's counters.
    pub fn prometheus(&self) -> String {
        type Get = fn(&DriveStatus) -> f64;
        let metrics: [(&str, &str, Get); 15] = [
            // Completed requests (successful or failed), as QEMU counts them.
            ("accel_drive_reads_total", "counter", |d| {
                d.io.counters.reads() as f64
            }),
            ("accel_drive_writes_total", "counter", |d| {
                d.io.counters.writes() as f64
            }),
            ("accel_drive_read_bytes_total", "counter", |d| {
                d.io.counters.rd_bytes as f64
            }),
            ("accel_drive_written_bytes_total", "counter", |d| {
                d.io.counters.wr_bytes as f64
            }),
            ("accel_drive_errors_total", "counter", |d| {
                d.io.errors as f64
            }),
            ("accel_drive_switches_total", "counter", |d| {
                d.switch.count as f64
            }),
            ("accel_drive_in_flight", "gauge", |d| d.io.in_flight as f64),
            ("accel_drive_last_pause_microseconds", "gauge", |d| {
                d.switch.last_pause_us as f64
            }),
            ("accel_drive_iops", "gauge", |d| d.io.iops),
            ("accel_drive_broken_queues", "gauge", |d| {
                d.io.broken_queues as f64
            }),
            ("accel_drive_ring_errors_total", "counter", |d| {
                d.io.ring_errors as f64
            }),
            ("accel_drive_held_requests", "gauge", |d| {
                d.io.held_requests as f64
            }),
            ("accel_drive_nospace_total", "counter", |d| {
                d.io.nospace_events as f64
            }),
            // 1 while QEMU's vhost-user-blk export serves the rings (`lend=on`): the request
            // counters above stand still meanwhile.
            ("accel_drive_rings_lent", "gauge", |d| {
                f64::from(u8::from(d.lend.lent))
            }),
            ("accel_drive_lends_total", "counter", |d| {
                d.lend.count as f64
            }),
        ];
        let mut out = String::new();
        for (name, typ, get) in metrics {
            let _ = writeln!(out, "# TYPE {name} {typ}");
            for d in self.drives() {
                let _ = writeln!(
                    out,
                    "{name}{{vm=\"{}\",drive=\"{}\",engine=\"{}\"}} {}",
                    d.vm,
                    d.drive,
                    d.engine.as_str(),
                    get(d)
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_quantiles() {
        assert_eq!(PauseStats::of(&[]), PauseStats::default());
        let p = PauseStats::of(&[5, 1, 9, 3]);
        assert_eq!((p.count, p.p50_us, p.p99_us, p.max_us), (4, 3, 9, 9));
    }

    #[test]
    fn status_round_trips_through_json() {
        let d = DriveStatus {
            vm: "v".into(),
            drive: "d0".into(),
            device: Some("d0".into()),
            node: "d0".into(),
            file_node: Some("d0-file".into()),
            node_driver: "raw".into(),
            socket: "/run/accel/v/d0.sock".into(),
            image: "/img".into(),
            format: "raw".into(),
            engine: EngineKind::Qemu,
            since: 1,
            reasons: vec!["throttle".into()],
            reason_sentences: vec!["x".into()],
            pin: Some(PinKind::Direct),
            throttle: Some(ThrottleLimits {
                iops_total: Some(5),
                ..Default::default()
            }),
            writeback: true,
            io: DriveIo {
                status: IoStatus::Nospace,
                iops: 1.5,
                mbps: 0.25,
                broken_queues: 1,
                ring_errors: 1,
                counters: IoCounters {
                    rd_operations: 7,
                    failed_rd_operations: 1,
                    ..Default::default()
                },
                ..Default::default()
            },
            switch: SwitchStats {
                count: 2,
                last_pause_us: 10,
                to_direct: PauseStats::of(&[3]),
                ..Default::default()
            },
            lend: LendStats {
                lent: true,
                count: 3,
                pauses: PauseStats::of(&[400, 900]),
                ..Default::default()
            },
            ..Default::default()
        };
        let s = Status {
            vms: vec![VmStatus {
                vm: "v".into(),
                qmp: "/q".into(),
                attached: true,
                run_state: Some(RunState::Running),
                attach_error: None,
                drives: vec![d],
                incoming: false,
                migration: None,
                monitor: None,
            }],
        };
        let j = serde_json::to_value(&s).unwrap();
        let jd = &j["vms"][0]["drives"][0];
        assert_eq!(jd["engine"], "qemu");
        assert_eq!(jd["pin"], "direct");
        assert_eq!(jd["io"]["status"], "nospace");
        assert_eq!(jd["io"]["counters"]["rd_operations"], 7);
        assert_eq!(jd["switch"]["count"], 2);
        assert_eq!(jd["lend"]["lent"], true);
        assert_eq!(j["vms"][0]["run_state"], "running");
        let back: Status = serde_json::from_value(j).unwrap();
        assert_eq!(back, s);
        let prom = s.prometheus();
        assert!(prom.contains("accel_drive_reads_total{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 8\n"));
        assert!(prom.contains("# TYPE accel_drive_iops gauge\n"));
        assert!(
            prom.contains("accel_drive_broken_queues{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 1\n")
        );
        assert!(prom.contains("accel_drive_rings_lent{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 1\n"));
        assert!(prom.contains("accel_drive_lends_total{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 3\n"));
    }

    /// QEMU's run states by their QAPI names; one this build does not know is `Other`, never
    /// an error (the status of every other VM must still be readable).
    #[test]
    fn run_states_parse_as_qemu_names_them() {
        for (name, want) in [
            ("running", Some(RunState::Running)),
            ("paused", Some(RunState::Paused)),
            ("inmigrate", Some(RunState::Inmigrate)),
            ("postmigrate", Some(RunState::Postmigrate)),
            ("finish-migrate", Some(RunState::FinishMigrate)),
            ("io-error", Some(RunState::IoError)),
            ("internal-error", Some(RunState::InternalError)),
            ("guest-panicked", Some(RunState::GuestPanicked)),
            ("save-vm", Some(RunState::SaveVm)),
            ("restore-vm", Some(RunState::RestoreVm)),
            ("prelaunch", Some(RunState::Prelaunch)),
            ("shutdown", Some(RunState::Shutdown)),
            ("a-state-of-qemu-12", Some(RunState::Other)),
            ("", None),
        ] {
            assert_eq!(RunState::parse(name), want, "{name:?}");
        }
        assert_eq!(
            serde_json::to_value(RunState::FinishMigrate).unwrap(),
            "finish-migrate"
        );
    }

    /// A VM whose QEMU reports a state this build does not know still has a readable status.
    #[test]
    fn an_unknown_run_state_reads_as_other() {
        let v: VmStatus = serde_json::from_value(serde_json::json!({
            "vm": "v", "qmp": "/q", "attached": true, "run_state": "colo-2",
            "attach_error": null, "drives": []
        }))
        .unwrap();
        assert_eq!(v.run_state, Some(RunState::Other));
    }
}
