//! The proxy alone: a recording fake in place of the supervisor ([`Host`]) and no QEMU (its
//! QMP connection is "not attached", so whatever the proxy forwards fails with that error).
//! What the proxy does on its own (holds, pins, throttles) shows in the calls it makes.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accel_api::control::{DriveSpec, ThrottleLimits};
use accel_api::status::{DriveStatus, EngineKind};
use policy::Pin as DrivePin;
use serde_json::{json, Map, Value};

use super::host::{Host, HostFuture};
use super::intercept::command;
use super::message::{ErrorClass, Reply};
use super::state::{Ctx, Shared};
use crate::supervisor::{Owner, SupError};

/// One VM `v` with one direct drive `d0`; every call recorded.
struct Fake {
    calls: Mutex<Vec<String>>,
    /// What a pin to the qemu engine leaves the drive on (a switch that fails leaves it
    /// direct).
    pinned_qemu_lands_on: EngineKind,
}

impl Fake {
    fn new(pinned_qemu_lands_on: EngineKind) -> Arc<Fake> {
        Arc::new(Fake {
            calls: Mutex::new(Vec::new()),
            pinned_qemu_lands_on,
        })
    }

    fn record(&self, c: String) {
        self.calls.lock().unwrap().push(c);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn drive(engine: EngineKind) -> DriveStatus {
        DriveStatus {
            vm: "v".into(),
            drive: "d0".into(),
            device: Some("disk0".into()),
            node: "d0".into(),
            file_node: Some("d0-file".into()),
            node_driver: "raw".into(),
            format: "raw".into(),
            engine,
            ..Default::default()
        }
    }
}

fn not_attached(vm: &str) -> SupError {
    SupError::NotAttached(vm.into())
}

impl Host for Fake {
    fn drives(&self, vm: &str) -> Vec<DriveStatus> {
        if vm == "v" {
            vec![Fake::drive(EngineKind::Direct)]
        } else {
            Vec::new()
        }
    }
    fn vm_names(&self) -> Vec<String> {
        vec!["v".into()]
    }
    fn vm_qmp(&self, vm: &str) -> Result<Arc<qmp_client::Qmp>, SupError> {
        Err(not_attached(vm))
    }
    fn vm_owner(&self, _vm: &str) -> Option<Owner> {
        None
    }
    fn vm_lends(&self, _vm: &str) -> bool {
        false
    }
    fn run_dir(&self) -> PathBuf {
        "/nonexistent".into()
    }
    fn control_socket(&self) -> PathBuf {
        "/nonexistent/control.sock".into()
    }
    fn monitor_socket(&self, vm: &str) -> PathBuf {
        format!("/nonexistent/{vm}/monitor.sock").into()
    }
    fn management_owns_pause(&self, _vm: &str) -> bool {
        false
    }
    fn management_set_pause(&self, _vm: &str, on: bool, kept_on: bool) {
        self.record(format!("pause {on} {kept_on}"));
    }
    fn pre_switchover_done<'a>(
        &'a self,
        _vm: &'a str,
        _event: (i64, i64),
        _timeout: Duration,
    ) -> HostFuture<'a, bool> {
        Box::pin(async { true })
    }
    fn set_pin<'a>(
        &'a self,
        _vm: &'a str,
        drive: &'a str,
        pin: Option<DrivePin>,
        persistent: bool,
    ) -> HostFuture<'a, Result<DriveStatus, SupError>> {
        self.record(format!("pin {drive} {pin:?} {persistent}"));
        let engine = match pin {
            Some(DrivePin::Qemu) => self.pinned_qemu_lands_on,
            _ => EngineKind::Direct,
        };
        let d = Fake::drive(engine);
        Box::pin(async move { Ok(d) })
    }
    fn hold_relay<'a>(&'a self, _vm: &'a str, on: bool) -> HostFuture<'a, Result<(), SupError>> {
        self.record(format!("relay hold {on}"));
        Box::pin(async { Ok(()) })
    }
    fn set_throttle_in_group<'a>(
        &'a self,
        _vm: &'a str,
        drive: &'a str,
        limits: Option<ThrottleLimits>,
        group: Option<String>,
        leave: bool,
    ) -> HostFuture<'a, Result<DriveStatus, SupError>> {
        let iops = limits.as_ref().and_then(|l| l.iops_total);
        self.record(format!("throttle {drive} iops={iops:?} {group:?} {leave}"));
        let d = Fake::drive(EngineKind::Qemu);
        Box::pin(async move { Ok(d) })
    }
    fn with_export_off<'a>(
        &'a self,
        _vm: &'a str,
        drive: &'a str,
        resize: HostFuture<'a, Reply>,
    ) -> HostFuture<'a, Result<Reply, SupError>> {
        self.record(format!("export off {drive}"));
        Box::pin(async move { Ok(resize.await) })
    }
    fn plug<'a>(
        &'a self,
        vm: &'a str,
        _spec: DriveSpec,
    ) -> HostFuture<'a, Result<PathBuf, SupError>> {
        Box::pin(async move { Err(not_attached(vm)) })
    }
    fn plugged<'a>(
        &'a self,
        _vm: &'a str,
        _drive: &'a str,
        _device: Option<&'a str>,
    ) -> HostFuture<'a, ()> {
        Box::pin(async {})
    }
    fn unplug<'a>(&'a self, _vm: &'a str, _device: &'a str) -> HostFuture<'a, bool> {
        Box::pin(async { false })
    }
    fn ensure_nbd_server<'a>(&'a self, vm: &'a str) -> HostFuture<'a, Result<PathBuf, SupError>> {
        Box::pin(async move { Err(not_attached(vm)) })
    }
}

fn ctx(fake: &Arc<Fake>) -> Ctx {
    Ctx {
        sup: fake.clone(),
        vm: "v".into(),
        shared: Arc::new(Shared::default()),
    }
}

fn run(ctx: &Ctx, name: &str, a: Value) -> Reply {
    let args: Option<Map<String, Value>> = match a {
        Value::Object(m) => Some(m),
        _ => None,
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(command(ctx, name, args))
}

fn throttle_args(id: &str, iops: i64) -> Value {
    json!({"id": id, "bps": 0, "bps_rd": 0, "bps_wr": 0, "iops": iops, "iops_rd": 0, "iops_wr": 0})
}

/// `block_set_io_throttle` on an accelerated drive's QOM path is acceld's throttle, answered
/// without QEMU; on any other name it is QEMU's (here: forwarded, and QEMU is not there).
#[test]
fn a_throttle_on_a_drive_is_acceld_s_and_any_other_goes_to_qemu() {
    let fake = Fake::new(EngineKind::Qemu);
    let c = ctx(&fake);
    let r = run(
        &c,
        "block_set_io_throttle",
        throttle_args("/machine/peripheral/disk0/virtio-backend", 400),
    );
    assert_eq!(r.unwrap(), json!({}));
    // The relay is off while acceld's throttle changes QEMU's graph (a filter node).
    assert_eq!(
        fake.calls(),
        [
            "relay hold true",
            "throttle d0 iops=Some(400) None false",
            "relay hold false"
        ]
    );

    let e = run(
        &c,
        "block_set_io_throttle",
        throttle_args("/machine/peripheral/other/virtio-backend", 400),
    )
    .unwrap_err();
    assert!(e.desc.contains("is not attached"), "forwarded: {e:?}");
    assert_eq!(fake.calls().len(), 5, "acceld's throttle untouched");
    assert!(!fake.calls()[3..].iter().any(|c| c.starts_with("throttle")));

    // Malformed on a drive: answered as QEMU answers it, nothing changed.
    let e = run(
        &c,
        "block_set_io_throttle",
        json!({"id": "/machine/peripheral/disk0/virtio-backend"}),
    )
    .unwrap_err();
    assert_eq!(e.class, ErrorClass::GenericError);
    assert_eq!(e.desc, "Parameter 'bps' is missing");
    assert_eq!(fake.calls().len(), 7);
    assert!(!fake.calls()[3..].iter().any(|c| c.starts_with("throttle")));
}

/// `blockdev-backup` of drive d0's node (QEMU is not there: it fails once forwarded).
fn backup_of_d0(c: &Ctx) -> super::message::QmpError {
    run(
        c,
        "blockdev-backup",
        json!({"job-id": "j", "device": "d0", "target": "t", "sync": "full"}),
    )
    .unwrap_err()
}

/// A command that names a drive's node holds the drive on QEMU's block layer while QEMU runs
/// it (a temporary pin), and gives it back whatever QEMU answered.
#[test]
fn a_block_command_on_a_drive_pins_it_to_qemu_for_the_command() {
    let fake = Fake::new(EngineKind::Qemu);
    let c = ctx(&fake);
    let e = backup_of_d0(&c);
    assert!(e.desc.contains("is not attached"), "forwarded: {e:?}");
    assert_eq!(
        fake.calls(),
        [
            "relay hold true",
            "relay hold true",
            "pin d0 Some(Qemu) false",
            "pin d0 None false",
            "relay hold false",
            "relay hold false"
        ],
        "held for the command, then released"
    );
}

/// A drive that cannot be moved to QEMU's block layer (the switch left it direct): the
/// command does not reach QEMU, the pin is undone, and the client gets a clear error.
#[test]
fn a_drive_that_cannot_go_to_qemu_fails_the_command_before_qemu_sees_it() {
    let fake = Fake::new(EngineKind::Direct);
    let c = ctx(&fake);
    let e = backup_of_d0(&c);
    assert!(
        e.desc
            .contains("cannot move drive 'd0' to QEMU's block layer for blockdev-backup"),
        "{e:?}"
    );
    assert!(!e.desc.contains("not attached"), "not forwarded: {e:?}");
    assert_eq!(
        fake.calls(),
        [
            "relay hold true",
            "relay hold true",
            "pin d0 Some(Qemu) false",
            "pin d0 None false",
            "relay hold false",
            "relay hold false"
        ]
    );
}

/// `block_resize` of a drive runs with acceld's export off its node.
#[test]
fn a_resize_of_a_drive_runs_with_the_export_off() {
    let fake = Fake::new(EngineKind::Qemu);
    let c = ctx(&fake);
    let e = run(
        &c,
        "block_resize",
        json!({"node-name": "d0", "size": 1_073_741_824u64}),
    )
    .unwrap_err();
    assert!(e.desc.contains("is not attached"), "forwarded: {e:?}");
    assert_eq!(
        fake.calls(),
        [
            "relay hold true",
            "relay hold true",
            "pin d0 Some(Qemu) false",
            "export off d0",
            "pin d0 None false",
            "relay hold false",
            "relay hold false"
        ]
    );
}
