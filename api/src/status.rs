//! The typed status of `acceld run` (`{"op":"status"}`), and the renderers that read it:
//! Prometheus text here, the table in accelctl. One type, so a field cannot be spelled two
//! ways.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::control::ThrottleLimits;

/// Which engine serves a drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Requests wait in the vring (no engine may serve yet).
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

/// One drive, as `accelctl status` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriveStatus {
    pub vm: String,
    pub drive: String,
    /// The vhost-user-blk-pci device using the drive's socket (None until attached).
    pub device: Option<String>,
    /// QEMU's node-name of the drive's image (empty from an older acceld: the drive id).
    #[serde(default)]
    pub node: String,
    /// The file (protocol) node under `node`; None when `node` is the file node itself.
    #[serde(default)]
    pub file_node: Option<String>,
    /// The driver of `node` in QEMU: `raw` over a file node, or `file`/`host_device` itself.
    #[serde(default)]
    pub node_driver: String,
    pub socket: PathBuf,
    pub image: PathBuf,
    pub format: String,
    /// What GET_ID answers the guest (empty: no serial, as QEMU's virtio-blk without
    /// `serial=`).
    #[serde(default)]
    pub serial: String,
    pub engine: EngineKind,
    /// Unix time (seconds) of the last engine change.
    pub since: u64,
    /// Codes of the reasons that keep the drive on QEMU's block layer.
    pub reasons: Vec<String>,
    pub reason_sentences: Vec<String>,
    pub pin: Option<PinKind>,
    /// The pin survives an acceld restart (`--pin`).
    #[serde(default)]
    pub pin_persistent: bool,
    pub throttle: Option<ThrottleLimits>,
    pub switches: u64,
    pub failed_switches: u64,
    pub last_pause_us: u64,
    /// The drive's rings are lent to QEMU's own vhost-user-blk export (`lend=on`, qemu
    /// engine): QEMU serves the guest directly, and the request counters here stand still.
    #[serde(default)]
    pub rings_lent: bool,
    /// Times the rings were lent.
    #[serde(default)]
    pub lends: u64,
    /// The last migration switchover's ring stop on this side (drain, fdatasync, image
    /// release), in microseconds; 0 if none.
    #[serde(default)]
    pub switchover_stop_us: u64,
    /// Pauses of the live switches from the qemu engine to direct, and the other way; a
    /// drive taken from `held` (at start-up, or after a hold) counts in neither.
    pub pauses_to_direct: PauseStats,
    pub pauses_to_qemu: PauseStats,
    /// Pauses of lending the rings to QEMU's export (drain, hand-over) and of taking them
    /// back (the export's requests finishing), over the last 1000 of each (`lend=on`).
    #[serde(default)]
    pub pauses_lend: PauseStats,
    #[serde(default)]
    pub pauses_take_back: PauseStats,
    pub iops: f64,
    pub mbps: f64,
    pub p99_us: Option<u64>,
    pub in_flight: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests answered IOERR.
    pub errors: u64,
    pub nbd_errors: u64,
    /// Queues whose ring the driver corrupted: they stop until the frontend resets them.
    #[serde(default)]
    pub broken_queues: u64,
    /// Rings found broken since the drive started.
    #[serde(default)]
    pub ring_errors: u64,
    /// Requests held after an error (werror=enospc or stop), retried until they succeed.
    #[serde(default)]
    pub held_requests: u64,
    /// Requests that failed with ENOSPC and were held.
    #[serde(default)]
    pub nospace_events: u64,
    /// Requests a previous acceld left in flight and this one resubmitted (INFLIGHT_SHMFD).
    #[serde(default)]
    pub resubmitted: u64,
    /// QEMU's io-status: `ok`, `nospace` (writes held for lack of space) or `failed`.
    #[serde(default)]
    pub io_status: String,
    pub last_error: Option<String>,
    /// QEMU-style accounting (for `query-blockstats`).
    pub io: IoCounters,
    /// The write cache the guest sees now (config `writeback`).
    #[serde(default)]
    pub writeback: bool,
    /// A migration's switchover released the image (flushed, unlocked, closed); it comes back
    /// if the guest runs here again.
    #[serde(default)]
    pub image_released: bool,
    /// The drive as registered (for a migration's destination).
    #[serde(default)]
    pub spec: Option<crate::control::DriveSpec>,
    /// Bytes the guest sees.
    #[serde(default)]
    pub capacity_bytes: u64,
    /// The QEMU node the guest's data is on when it is not the drive's own node: an external
    /// snapshot's overlay, or a mirror's target after a pivot (the drive then stays on
    /// QEMU's block layer).
    #[serde(default)]
    pub data_node: Option<String>,
    /// Management's throttle group of the drive (QMP proxy), if it named one.
    #[serde(default)]
    pub throttle_group: Option<String>,
}

/// One VM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VmStatus {
    pub vm: String,
    pub qmp: PathBuf,
    pub attached: bool,
    /// QEMU's run state as last seen (`running`, `prelaunch`, …; empty before attach).
    pub run_state: String,
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
            ("accel_drive_reads_total", "counter", |d| d.reads as f64),
            ("accel_drive_writes_total", "counter", |d| d.writes as f64),
            ("accel_drive_read_bytes_total", "counter", |d| {
                d.bytes_read as f64
            }),
            ("accel_drive_written_bytes_total", "counter", |d| {
                d.bytes_written as f64
            }),
            ("accel_drive_errors_total", "counter", |d| d.errors as f64),
            ("accel_drive_switches_total", "counter", |d| {
                d.switches as f64
            }),
            ("accel_drive_in_flight", "gauge", |d| d.in_flight as f64),
            ("accel_drive_last_pause_microseconds", "gauge", |d| {
                d.last_pause_us as f64
            }),
            ("accel_drive_iops", "gauge", |d| d.iops),
            ("accel_drive_broken_queues", "gauge", |d| {
                d.broken_queues as f64
            }),
            ("accel_drive_ring_errors_total", "counter", |d| {
                d.ring_errors as f64
            }),
            ("accel_drive_held_requests", "gauge", |d| {
                d.held_requests as f64
            }),
            ("accel_drive_nospace_total", "counter", |d| {
                d.nospace_events as f64
            }),
            // 1 while QEMU's vhost-user-blk export serves the rings (`lend=on`): the request
            // counters above stand still meanwhile.
            ("accel_drive_rings_lent", "gauge", |d| {
                f64::from(u8::from(d.rings_lent))
            }),
            ("accel_drive_lends_total", "counter", |d| d.lends as f64),
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
            serial: String::new(),
            image: "/img".into(),
            format: "raw".into(),
            engine: EngineKind::Qemu,
            since: 1,
            reasons: vec!["throttle".into()],
            reason_sentences: vec!["x".into()],
            pin: Some(PinKind::Direct),
            pin_persistent: false,
            throttle: Some(ThrottleLimits {
                iops_total: Some(5),
                ..Default::default()
            }),
            switches: 2,
            failed_switches: 0,
            last_pause_us: 10,
            rings_lent: true,
            lends: 3,
            pauses_to_direct: PauseStats::of(&[3]),
            pauses_to_qemu: PauseStats::default(),
            pauses_lend: PauseStats::of(&[400, 900]),
            pauses_take_back: PauseStats::default(),
            iops: 1.5,
            mbps: 0.25,
            p99_us: None,
            in_flight: 0,
            reads: 7,
            writes: 8,
            bytes_read: 9,
            bytes_written: 10,
            errors: 0,
            nbd_errors: 0,
            broken_queues: 1,
            ring_errors: 1,
            held_requests: 0,
            nospace_events: 0,
            resubmitted: 0,
            io_status: "ok".into(),
            last_error: None,
            io: IoCounters {
                rd_operations: 7,
                ..Default::default()
            },
            writeback: true,
            switchover_stop_us: 0,
            image_released: false,
            spec: None,
            capacity_bytes: 0,
            data_node: None,
            throttle_group: None,
        };
        let s = Status {
            vms: vec![VmStatus {
                vm: "v".into(),
                qmp: "/q".into(),
                attached: true,
                run_state: "running".into(),
                attach_error: None,
                drives: vec![d],
                incoming: false,
                migration: None,
                monitor: None,
            }],
        };
        let j = serde_json::to_value(&s).unwrap();
        assert_eq!(j["vms"][0]["drives"][0]["engine"], "qemu");
        assert_eq!(j["vms"][0]["drives"][0]["pin"], "direct");
        assert_eq!(j["vms"][0]["drives"][0]["io"]["rd_operations"], 7);
        let back: Status = serde_json::from_value(j).unwrap();
        assert_eq!(back, s);
        let prom = s.prometheus();
        assert!(prom.contains("accel_drive_reads_total{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 7\n"));
        assert!(prom.contains("# TYPE accel_drive_iops gauge\n"));
        assert!(
            prom.contains("accel_drive_broken_queues{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 1\n")
        );
        assert!(prom.contains("accel_drive_rings_lent{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 1\n"));
        assert!(prom.contains("accel_drive_lends_total{vm=\"v\",drive=\"d0\",engine=\"qemu\"} 3\n"));
    }
}
