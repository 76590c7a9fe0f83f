//! What the QMP proxy needs of the rest of acceld, as one trait: the VM's drives and its QMP
//! connection, the pins and throttles the proxy sets on management's behalf, hot-plug, the
//! migration pause, management's NBD server. acceld's supervisor is the one implementation
//! ([`SupHost`]); the proxy's own tests put a recording fake in its place, so the proxy is
//! tested without a supervisor (and, for what it answers itself, without a QEMU).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use accel_api::control::{DriveSpec, ThrottleLimits};
use accel_api::status::DriveStatus;
use policy::Pin as DrivePin;

use super::message::Reply;
use crate::supervisor::{Owner, SupError, Supervisor};

/// A future the proxy awaits (boxed: the trait is used as `dyn Host`).
pub type HostFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub trait Host: Send + Sync {
    /// The VM's drives, as `status` shows them (none for a VM acceld does not know).
    fn drives(&self, vm: &str) -> Vec<DriveStatus>;
    /// The VMs acceld has registered (a VM's proxy ends when its VM is gone).
    fn vm_names(&self) -> Vec<String>;
    /// acceld's QMP connection to the VM's QEMU, which the proxy forwards on.
    fn vm_qmp(&self, vm: &str) -> Result<Arc<qmp_client::Qmp>, SupError>;
    /// QEMU's user, when it is not root's (the proxy's socket and files are made its).
    fn vm_owner(&self, vm: &str) -> Option<Owner>;
    /// Whether a drive of the VM lends its rings (a hot-plugged drive does too).
    fn vm_lends(&self, vm: &str) -> bool;
    /// acceld's run directory (`RUN_DIR/VM/…`).
    fn run_dir(&self) -> PathBuf;
    /// acceld's control socket.
    fn control_socket(&self) -> PathBuf;
    /// The VM's proxy socket.
    fn monitor_socket(&self, vm: &str) -> PathBuf;
    /// Management, not acceld, asked for the migration's pause before switchover.
    fn management_owns_pause(&self, vm: &str) -> bool;
    fn management_set_pause(&self, vm: &str, on: bool, kept_on: bool);
    /// acceld's part of a switchover (its exports off the nodes) is done, or `timeout` passed.
    fn pre_switchover_done<'a>(
        &'a self,
        vm: &'a str,
        event: (i64, i64),
        timeout: Duration,
    ) -> HostFuture<'a, bool>;
    /// Pins a drive (None: unpins), answered once the drive runs where the pin says.
    fn set_pin<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        pin: Option<DrivePin>,
        persistent: bool,
    ) -> HostFuture<'a, Result<DriveStatus, SupError>>;
    /// One more (`on`) or one fewer management command that may drain QEMU's nodes: while
    /// any is held, the VM's relayed drives serve over NBD ([`Supervisor::hold_relay`]).
    fn hold_relay<'a>(&'a self, vm: &'a str, on: bool) -> HostFuture<'a, Result<(), SupError>>;
    /// A drive's throttle (None: none), in management's group `group`; `leave` ends the
    /// membership.
    fn set_throttle_in_group<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        limits: Option<ThrottleLimits>,
        group: Option<String>,
        leave: bool,
    ) -> HostFuture<'a, Result<DriveStatus, SupError>>;
    /// Runs `resize` (QEMU's `block_resize`) with acceld's export off the drive's node.
    fn with_export_off<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        resize: HostFuture<'a, Reply>,
    ) -> HostFuture<'a, Result<Reply, SupError>>;
    /// Serves a hot-plugged drive; its socket.
    fn plug<'a>(
        &'a self,
        vm: &'a str,
        spec: DriveSpec,
    ) -> HostFuture<'a, Result<PathBuf, SupError>>;
    /// QEMU answered the hot-plug: the drive's device (None: QEMU refused it).
    fn plugged<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        device: Option<&'a str>,
    ) -> HostFuture<'a, ()>;
    /// QEMU deleted `device`: ends its drive (if it is one); whether it was.
    fn unplug<'a>(&'a self, vm: &'a str, device: &'a str) -> HostFuture<'a, bool>;
    /// The VM's NBD server for acceld's exports (started if needed); its socket.
    fn ensure_nbd_server<'a>(&'a self, vm: &'a str) -> HostFuture<'a, Result<PathBuf, SupError>>;
}

/// The supervisor as the proxy's host.
pub struct SupHost(pub Arc<Supervisor>);

impl Host for SupHost {
    fn drives(&self, vm: &str) -> Vec<DriveStatus> {
        self.0.vm_drive_statuses(vm)
    }

    fn vm_names(&self) -> Vec<String> {
        self.0.vm_names()
    }

    fn vm_qmp(&self, vm: &str) -> Result<Arc<qmp_client::Qmp>, SupError> {
        self.0.vm_qmp(vm)
    }

    fn vm_owner(&self, vm: &str) -> Option<Owner> {
        self.0.vm_owner(vm)
    }

    fn vm_lends(&self, vm: &str) -> bool {
        self.0.vm_lends(vm)
    }

    fn run_dir(&self) -> PathBuf {
        self.0.cfg.run_dir.clone()
    }

    fn control_socket(&self) -> PathBuf {
        self.0.cfg.control_socket()
    }

    fn monitor_socket(&self, vm: &str) -> PathBuf {
        self.0.monitor_socket(vm)
    }

    fn management_owns_pause(&self, vm: &str) -> bool {
        self.0.management_owns_pause(vm)
    }

    fn management_set_pause(&self, vm: &str, on: bool, kept_on: bool) {
        self.0.management_set_pause(vm, on, kept_on)
    }

    fn pre_switchover_done<'a>(
        &'a self,
        vm: &'a str,
        event: (i64, i64),
        timeout: Duration,
    ) -> HostFuture<'a, bool> {
        Box::pin(self.0.pre_switchover_done(vm, event, timeout))
    }

    fn set_pin<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        pin: Option<DrivePin>,
        persistent: bool,
    ) -> HostFuture<'a, Result<DriveStatus, SupError>> {
        Box::pin(self.0.set_pin(vm, drive, pin, persistent))
    }

    fn hold_relay<'a>(&'a self, vm: &'a str, on: bool) -> HostFuture<'a, Result<(), SupError>> {
        Box::pin(self.0.hold_relay(vm, on))
    }

    fn set_throttle_in_group<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        limits: Option<ThrottleLimits>,
        group: Option<String>,
        leave: bool,
    ) -> HostFuture<'a, Result<DriveStatus, SupError>> {
        Box::pin(
            self.0
                .set_throttle_in_group(vm, drive, limits, group, leave),
        )
    }

    fn with_export_off<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        resize: HostFuture<'a, Reply>,
    ) -> HostFuture<'a, Result<Reply, SupError>> {
        Box::pin(self.0.with_export_off(vm, drive, || resize))
    }

    fn plug<'a>(
        &'a self,
        vm: &'a str,
        spec: DriveSpec,
    ) -> HostFuture<'a, Result<PathBuf, SupError>> {
        Box::pin(self.0.plug(vm, spec))
    }

    fn plugged<'a>(
        &'a self,
        vm: &'a str,
        drive: &'a str,
        device: Option<&'a str>,
    ) -> HostFuture<'a, ()> {
        Box::pin(self.0.plugged(vm, drive, device))
    }

    fn unplug<'a>(&'a self, vm: &'a str, device: &'a str) -> HostFuture<'a, bool> {
        Box::pin(self.0.unplug(vm, device))
    }

    fn ensure_nbd_server<'a>(&'a self, vm: &'a str) -> HostFuture<'a, Result<PathBuf, SupError>> {
        Box::pin(self.0.ensure_nbd_server(vm))
    }
}
