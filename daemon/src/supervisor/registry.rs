//! The VM map: register (serve the sockets at once), restore after a restart, unregister.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use accel_api::control::{check_id, DriveSpec};
use accel_api::status::EngineKind;
use serde::Serialize;
use tracing::{error, info, warn};

use super::drive_state::{GraphRecord, Intent, ManagedDrive, Placement};
use super::offload;
use super::persist::{self, SavedDrive};
use super::vm::Vm;
use super::{SupError, Supervisor};
use accel_dataplane::drive::{DeviceModel, Drive, DriveConfig, DriveConfigError};
use accel_dataplane::engine::{image_size, Engine, FileEngine, HeldEngine};
use accel_dataplane::util::lock;
use accel_dataplane::vhost::Server;

/// Longest an unregister waits for QEMU to take its drives back.
const HANDBACK_DEADLINE: Duration = Duration::from_secs(15);
/// Longest an unregister (or QEMU's end) waits for the VM's drives to stop serving.
const TEARDOWN_DEADLINE: Duration = Duration::from_secs(15);
/// Longest a hot-plugged disk's open (as QEMU's user) and start may take.
const OPEN_DEADLINE: Duration = Duration::from_secs(15);
/// Most drives one VM has (registered and hot-plugged): a PCI bus of QEMU's holds fewer.
const MAX_DRIVES: usize = 256;

/// What `register` answers.
#[derive(Clone, Debug, Serialize)]
pub struct Registered {
    pub vm: String,
    pub sockets: Vec<PathBuf>,
}

/// What `unregister` answers.
#[derive(Clone, Debug, Serialize)]
pub struct Unregistered {
    pub vm: String,
    /// Drives whose nodes acceld gave back to QEMU.
    pub nodes_restored: Vec<String>,
}

/// What `attach` and `detach` answer.
#[derive(Clone, Debug, Serialize)]
pub struct AttachState {
    pub vm: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attached: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attaching: Option<bool>,
}

impl Supervisor {
    /// Registers again every VM of the state file (after a restart). Drives that were direct
    /// are served directly at once; the others wait for the re-attach.
    pub fn restore(self: &Arc<Self>) -> Result<usize, SupError> {
        let st = persist::load(self.state.path())?;
        let n = st.vms.len();
        for vm in st.vms {
            let name = vm.name.clone();
            match self.register_inner(vm.name, vm.qmp, vm.cont, vm.incoming, vm.owner, vm.drives) {
                Ok(v) if vm.pause_owned => {
                    *lock(&v.pause_owner) = super::migration::PauseOwner::Restored;
                }
                Ok(_) => {}
                Err(e) => warn!(vm = %name, "cannot restore: {}", e.chain()),
            }
        }
        Ok(n)
    }

    pub fn register(
        self: &Arc<Self>,
        vm: String,
        qmp: PathBuf,
        drives: Vec<DriveSpec>,
        cont: bool,
        incoming: bool,
        owner: Option<super::Owner>,
    ) -> Result<Registered, SupError> {
        check_id("VM name", &vm).map_err(|e| SupError::Invalid(e.0))?;
        if drives.is_empty() {
            return Err(SupError::Invalid(format!("VM {vm}: no drive given")));
        }
        for (i, d) in drives.iter().enumerate() {
            d.validate().map_err(|e| SupError::Invalid(e.0))?;
            if drives[..i].iter().any(|o| o.id == d.id) {
                return Err(SupError::Invalid(format!("drive id {} given twice", d.id)));
            }
        }
        if !qmp.is_absolute() {
            return Err(SupError::Invalid(format!(
                "QMP socket {} is not an absolute path",
                qmp.display()
            )));
        }
        let saved = drives.into_iter().map(SavedDrive::new).collect();
        let vmr = self.register_inner(vm, qmp, cont, incoming, owner, saved)?;
        self.save();
        Ok(Registered {
            vm: vmr.name.clone(),
            sockets: vmr.drives().iter().map(|d| d.socket.clone()).collect(),
        })
    }

    fn register_inner(
        self: &Arc<Self>,
        name: String,
        qmp: PathBuf,
        cont: bool,
        incoming: bool,
        owner: Option<super::Owner>,
        drives: Vec<SavedDrive>,
    ) -> Result<Arc<Vm>, SupError> {
        {
            let vms = lock(&self.vms);
            if vms.contains_key(&name) || !lock(&self.registering).insert(name.clone()) {
                return Err(SupError::Exists(format!("VM {name} is already registered")));
            }
        }
        struct Reserved<'a>(&'a Supervisor, String);
        impl Drop for Reserved<'_> {
            fn drop(&mut self) {
                lock(&self.0.registering).remove(&self.1);
            }
        }
        let _reserved = Reserved(self, name.clone());
        let dir = self.cfg.run_dir.join(&name);
        create_owned_dir(&dir, owner)?;
        let mut slots = BTreeMap::new();
        for sd in drives {
            match self.start_drive(&name, &dir, sd, owner, false) {
                Ok(s) => {
                    slots.insert(s.spec.id.clone(), s);
                }
                Err(e) => {
                    for s in slots.values() {
                        s.stop_server();
                    }
                    return Err(e);
                }
            }
        }
        info!(vm = %name, drives = slots.len(), "registered");
        let vm = Arc::new(Vm::new(name, qmp, cont, incoming, dir, owner, slots));
        lock(&self.vms).insert(vm.name.clone(), vm.clone());
        self.spawn_vm_task(&vm);
        if let Some(h) = lock(&self.register_hook).as_ref() {
            h(&vm.name);
        }
        Ok(vm)
    }

    fn start_drive(
        &self,
        vm: &str,
        dir: &Path,
        sd: SavedDrive,
        owner: Option<super::Owner>,
        by_identity: bool,
    ) -> Result<Arc<ManagedDrive>, SupError> {
        let spec = sd.spec;
        if !spec.image.exists() {
            return Err(SupError::Invalid(format!(
                "drive {}: image {} does not exist",
                spec.id,
                spec.image.display()
            )));
        }
        // The image as registered: saved with the drive, else the permit's (QEMU not root),
        // else resolved now (root's registration).
        let image = match sd.image {
            Some(i) => i,
            // check_permitted made the drive's image path the permitted (canonical) one.
            None => match owner.and_then(|_| self.permit_of(vm)) {
                Some(p) => p
                    .images
                    .into_iter()
                    .find(|i| i.path == spec.image)
                    .ok_or_else(|| {
                        SupError::Denied(format!(
                            "drive {}: image {} is not one of the domain's images",
                            spec.id,
                            spec.image.display()
                        ))
                    })?,
                None => super::permit::ImageRef::resolve(&spec.image)?,
            },
        };
        let size = if spec.format == "raw" && by_identity {
            // A path QEMU's user named: read through a descriptor of the image's identity.
            image_bytes(&image).ok_or_else(|| {
                SupError::Denied(format!(
                    "drive {}: {} is no longer the file QEMU's user opened",
                    spec.id,
                    image.path.display()
                ))
            })?
        } else if spec.format == "raw" {
            image_size(&spec.image).map_err(|source| SupError::Io {
                what: format!("cannot read the size of {}", spec.image.display()),
                source,
            })?
        } else {
            qemu_img_virtual_size(&image.path, &spec.format, owner)?
        };
        // The geometry QEMU's virtio-blk would show: from the disk's first sector (a raw
        // image's own; other formats: by size), kept once shown.
        let chs = sd.chs.or_else(|| {
            let first = (spec.format == "raw")
                .then(|| first_sector(&image))
                .flatten();
            first
                .as_ref()
                .map(|b| accel_dataplane::virtio_blk::guess_chs(size >> 9, Some(b)))
        });
        let socket = dir.join(format!("{}.sock", spec.id));
        if socket.as_os_str().len() >= 108 {
            return Err(SupError::Invalid(format!(
                "socket path {} is too long for a unix socket; use a shorter run dir",
                socket.display()
            )));
        }
        let cfg = DriveConfig {
            name: spec.id.clone(),
            // No serial unless one is configured: QEMU's rule (GET_ID of a virtio-blk disk
            // without `serial=` answers an empty id).
            serial: spec.serial.clone().unwrap_or_default(),
            capacity_bytes: size,
            logical_block_size: spec.logical_block_size,
            read_only: spec.read_only,
            num_queues: spec.queues,
            queue_size: 1024,
            discard: spec.discard,
            poll_us: self.cfg.poll_us,
            werror: spec.werror,
            rerror: spec.rerror,
            // The guest sees QEMU's virtio-blk, as before its disk was converted; a drive
            // whose rings may be lent to QEMU's vhost-user-blk export sees the export's
            // device (its limits hold while lent).
            model: if spec.lend {
                DeviceModel::Export
            } else {
                DeviceModel::VirtioBlk
            },
            chs,
        }
        .checked()
        .map_err(|e| match e {
            DriveConfigError::TooSmall { size, .. } => SupError::Invalid(format!(
                "drive {}: image {} holds {size} bytes, less than one block",
                spec.id,
                spec.image.display()
            )),
            e => SupError::Invalid(format!("drive {}: {e}", spec.id)),
        })?;
        // A drive that was direct before a restart goes on directly at once (its QEMU nodes
        // are still removed); everything else waits for the supervisor.
        let mut direct_spec = None;
        let (engine, kind): (Arc<dyn Engine>, EngineKind) = match (&sd.recorded, sd.engine) {
            (Some(rec), EngineKind::Direct) if sd.nodes_removed => {
                let path = rec
                    .protocol
                    .as_ref()
                    .map(|p| PathBuf::from(&p.filename))
                    .unwrap_or_else(|| PathBuf::from(&rec.node.filename));
                super::permit::check_qemu_image(&image, &path)?;
                let serve = policy::ServeSpec {
                    image: path,
                    read_only: spec.read_only,
                    direct: spec.direct,
                    discard: spec.discard.as_str().into(),
                    logical_block_size: spec.logical_block_size,
                    queues: spec.queues,
                    serial: spec.serial.clone(),
                    block_device: false,
                };
                let fcfg = super::switch::file_config(&spec, &image, &serve);
                direct_spec = Some(serve);
                let e = FileEngine::open_waiting(&fcfg, Duration::from_secs(5))?;
                (Arc::new(e), EngineKind::Direct)
            }
            _ => (Arc::new(HeldEngine), EngineKind::Held),
        };
        let drive = Drive::new(cfg, engine);
        if let Some(w) = spec.writeback {
            drive.set_writeback(w && !spec.read_only);
        }
        let server = Server::bind(&socket, drive.clone())?;
        super::permit::secure_own(&socket, 0o600, owner, false)?;
        let stop = server.shutdown_handle();
        let id = spec.id.clone();
        let mut server = server;
        let thread = std::thread::Builder::new()
            .name(format!("vu-{}", id.chars().take(12).collect::<String>()))
            .spawn(move || {
                if let Err(e) = server.run() {
                    warn!(drive = %id, "vhost-user server ended: {e}");
                }
            })
            .map_err(|source| SupError::Io {
                what: "cannot spawn a server thread".into(),
                source,
            })?;
        info!(drive = %spec.id, socket = %socket.display(), engine = kind.as_str(), "serving");
        Ok(Arc::new(ManagedDrive::new(
            spec,
            image,
            socket,
            drive,
            (stop, thread),
            Placement {
                engine: kind,
                since: SystemTime::now(),
                direct_spec,
                accel_since: None,
            },
            Intent {
                pin: sd.pin,
                pin_persistent: sd.pin.is_some(),
                throttle: sd.throttle,
                throttle_group: None,
            },
            GraphRecord {
                device: None,
                nodes_removed: sd.nodes_removed,
                recorded: sd.recorded,
                applied_throttle: None,
                data_node: None,
                group_external: false,
                applied_group: None,
                lend_socket: None,
                relay_socket: None,
                relay_allowed: false,
                relay_lost_at: None,
            },
        )))
    }

    /// Hands the drives back to QEMU (when it is reachable) and stops serving them. Ends the
    /// VM's permit unless `keep_permit` (the VM's own socket replacing a lost registration).
    pub async fn unregister(
        self: &Arc<Self>,
        name: &str,
        keep_permit: bool,
    ) -> Result<Unregistered, SupError> {
        if !keep_permit {
            self.end_permit(name);
        }
        let vm = self.vm(name)?;
        vm.stop_task();
        let mut handed = Vec::new();
        if let Ok(qmp) = vm.qmp() {
            // A QEMU that stops answering (each command waits its QMP timeout) does not hold
            // its unregister for long: past the bound the drives stop without the hand-back.
            match tokio::time::timeout(HANDBACK_DEADLINE, self.hand_back(&vm, &qmp, &mut handed))
                .await
            {
                Ok(r) => r?,
                Err(_) => {
                    warn!(vm = %vm.name, "QEMU did not take its drives back within {HANDBACK_DEADLINE:?}; they stop without it");
                }
            }
        }
        self.forget(&vm, keep_permit).await;
        Ok(Unregistered {
            vm: name.to_string(),
            nodes_restored: handed,
        })
    }

    /// Gives QEMU its nodes back (direct drives) and takes acceld's export and filter away
    /// (qemu engine); `handed` gets each drive QEMU serves again.
    async fn hand_back(
        &self,
        vm: &Arc<Vm>,
        qmp: &Arc<qmp_client::Qmp>,
        handed: &mut Vec<String>,
    ) -> Result<(), SupError> {
        for d in &vm.drives() {
            let _g = d.op.lock().await;
            if self.give_back(d, qmp).await? {
                handed.push(d.spec.id.clone());
            }
        }
        Ok(())
    }

    /// One drive back to QEMU (its `op` lock held): a direct drive's nodes are re-created
    /// (true), acceld's export and filter of a drive on the qemu engine go; the drive is held
    /// after.
    async fn give_back(
        &self,
        d: &Arc<ManagedDrive>,
        qmp: &qmp_client::Qmp,
    ) -> Result<bool, SupError> {
        d.stop_lending().await;
        match d.engine_kind() {
            EngineKind::Direct => {
                // Give QEMU its nodes back; the guest's device loses its server anyway.
                let dr = d.drive.clone();
                let paused = offload::blocking(move || dr.pause()).await?;
                d.drive.engine().release();
                let r = self.restore_nodes(d, qmp).await;
                let _ = offload::blocking(move || paused.resume(Arc::new(HeldEngine))).await;
                d.set_engine(EngineKind::Held);
                r?;
                Ok(true)
            }
            EngineKind::Qemu => {
                d.drive.engine().release();
                let _ = self.qemu_down(d, qmp).await;
                Ok(false)
            }
            EngineKind::Held => Ok(false),
        }
    }

    /// Serves a disk management hot-plugs (the QMP proxy's `device_add` of a virtio-blk-pci
    /// device on a node it added): a drive of the VM, held until [`Supervisor::plugged`]
    /// says whether QEMU took the vhost-user-blk-pci device. The image is opened as QEMU's
    /// user could (its credentials, on a thread of its own): management's client, or QEMU's
    /// user through the monitor relay, can name any path. Returns the drive's socket.
    pub async fn plug(
        self: &Arc<Self>,
        vm: &str,
        mut spec: DriveSpec,
    ) -> Result<PathBuf, SupError> {
        let vmr = self.vm(vm)?;
        spec.validate().map_err(|e| SupError::Invalid(e.0))?;
        let _g = vmr.plugging.lock().await;
        if vmr.drive(&spec.id).is_ok() {
            return Err(SupError::Exists(format!(
                "VM {vm} has a drive {} already",
                spec.id
            )));
        }
        if vmr.drives().len() >= MAX_DRIVES {
            return Err(SupError::Invalid(format!(
                "VM {vm} has {MAX_DRIVES} drives already"
            )));
        }
        let qmp = vmr.qmp()?;
        let who = super::permit::Creds::of_qemu(vmr.owner, qmp.peer_pid())
            .map_err(|why| SupError::Denied(format!("drive {}: QEMU: {why}", spec.id)))?;
        let image = super::permit::ImageRef::resolve_as_within(
            spec.image.clone(),
            who,
            spec.read_only,
            OPEN_DEADLINE,
        )
        .await
        .map_err(|e| {
            SupError::Denied(format!(
                "drive {}: QEMU's user cannot open {}: {}",
                spec.id,
                spec.image.display(),
                e.chain()
            ))
        })?;
        spec.image = image.path.clone();
        let mut sd = SavedDrive::new(spec);
        sd.image = Some(image);
        let (sup, name, dir, owner) = (self.clone(), vmr.name.clone(), vmr.dir.clone(), vmr.owner);
        let d = offload::blocking_within(OPEN_DEADLINE, move || {
            sup.start_drive(&name, &dir, sd, owner, true)
        })
        .await
        .unwrap_or_else(|| {
            Err(SupError::Invalid(format!(
                "the drive did not start within {OPEN_DEADLINE:?}"
            )))
        })?;
        let socket = d.socket.clone();
        if !vmr.add_drive(d.clone()) {
            offload::blocking(move || d.stop_server()).await;
            return Err(SupError::Exists(format!("VM {vm} has that drive already")));
        }
        info!(vm = %vm, drive = %d.spec.id, image = %d.image().path.display(), "hot-plugged disk: serving it");
        Ok(socket)
    }

    /// Whether the VM's drives lend their rings (`lend=on`): a hot-plugged disk does as
    /// they do.
    pub fn vm_lends(&self, vm: &str) -> bool {
        self.vm(vm)
            .is_ok_and(|v| v.drives().iter().any(|d| d.spec.lend))
    }

    /// QEMU took the hot-plugged drive's device (`device` is its id), or refused it (None:
    /// the drive goes).
    pub async fn plugged(&self, vm: &str, drive: &str, device: Option<&str>) {
        let Ok(vmr) = self.vm(vm) else { return };
        let Ok(d) = vmr.drive(drive) else { return };
        match device {
            Some(dev) => {
                lock(&d.graph).device = Some(dev.to_string());
                self.save();
                vmr.kick.notify_one();
            }
            None => {
                let _g = vmr.plugging.lock().await;
                vmr.remove_drive(&d);
                offload::blocking(move || d.stop_server()).await;
            }
        }
    }

    /// QEMU deleted a drive's device (`DEVICE_DELETED`: management's `device_del` or
    /// `detach-disk`, or the guest's own eject): the drive ends. QEMU gets back what a
    /// virtio-blk-pci device's removal leaves, so that management's `blockdev-del` of the
    /// nodes finds them: a direct drive's nodes, and no export or filter of acceld's, nor
    /// the device's chardev. Idempotent (each proxy client and the VM's task call it); false
    /// when no drive of the VM had that device.
    pub async fn unplug(&self, vm: &str, device: &str) -> bool {
        let Ok(vmr) = self.vm(vm) else { return false };
        let t0 = std::time::Instant::now();
        let find = || {
            vmr.drives()
                .into_iter()
                .find(|d| lock(&d.graph).device.as_deref() == Some(device))
        };
        // Another device's event (a NIC's) does not wait for a plug in progress.
        if find().is_none() {
            return false;
        }
        let _g = vmr.plugging.lock().await;
        let Some(d) = find() else {
            return false;
        };
        {
            let _op = d.op.lock().await;
            if let Ok(qmp) = vmr.qmp() {
                if let Err(e) = self.give_back(&d, &qmp).await {
                    warn!(vm = %vm, drive = %d.spec.id, "unplugged, but QEMU did not take its nodes back: {}", e.chain());
                }
                let id = accel_api::convert::chardev_id(d.id());
                let rm = qmp_client::commands::ChardevRemove { id };
                let _ = super::qmp_run(&qmp, &rm).await;
            }
            lock(&d.graph).device = None;
        }
        vmr.remove_drive(&d);
        let d2 = d.clone();
        offload::blocking(move || d2.stop_server()).await;
        self.save();
        info!(vm = %vm, drive = %d.spec.id, device, took_ms = t0.elapsed().as_millis() as u64, "device deleted: the drive is no longer served");
        true
    }

    /// Stops serving the VM and ends its permit (QEMU is gone).
    pub(super) async fn forget_vm(self: &Arc<Self>, vm: &Arc<Vm>) {
        self.forget(vm, false).await;
    }

    /// [`Supervisor::forget_vm_keeping`] off the runtime, bounded. Requests still in flight
    /// on the qemu engine fail first: an export that stopped answering (a wedged or
    /// compromised QEMU) would hold the drain, and so the teardown, for good.
    async fn forget(self: &Arc<Self>, vm: &Arc<Vm>, keep_permit: bool) {
        for d in &vm.drives() {
            let e = d.drive.engine();
            if e.kind() == EngineKind::Qemu {
                e.release();
            }
        }
        let (sup, vm2) = (self.clone(), vm.clone());
        let done = offload::blocking_within(TEARDOWN_DEADLINE, move || {
            sup.forget_vm_keeping(&vm2, keep_permit)
        })
        .await;
        if done.is_none() {
            error!(vm = %vm.name, "the VM's drives did not stop within {TEARDOWN_DEADLINE:?}; acceld goes on stopping them, and lists the VM until they have");
        }
    }

    fn forget_vm_keeping(&self, vm: &Arc<Vm>, keep_permit: bool) {
        vm.set_qmp(None);
        for d in &vm.drives() {
            d.stop_server();
        }
        let _ = std::fs::remove_file(vm.nbd_socket());
        let _ = std::fs::remove_file(self.monitor_socket(&vm.name));
        // Ending the permit removes the directory too (once empty); a kept permit keeps its
        // control socket, and so the directory.
        if !keep_permit {
            self.end_permit(&vm.name);
        }
        {
            let mut vms = lock(&self.vms);
            if vms.get(&vm.name).is_some_and(|v| Arc::ptr_eq(v, vm)) {
                vms.remove(&vm.name);
            }
        }
        self.save();
        info!(vm = %vm.name, "unregistered; sockets removed");
    }

    pub fn detach(&self, name: &str) -> Result<AttachState, SupError> {
        let vm = self.vm(name)?;
        vm.stop_task();
        Ok(AttachState {
            vm: name.to_string(),
            attached: Some(false),
            attaching: None,
        })
    }

    pub fn attach(self: &Arc<Self>, name: &str) -> Result<AttachState, SupError> {
        let vm = self.vm(name)?;
        vm.stop_task();
        self.spawn_vm_task(&vm);
        Ok(AttachState {
            vm: name.to_string(),
            attached: None,
            attaching: Some(true),
        })
    }
}

/// The VM's directory: root's, or its QEMU user's (who creates the QMP and NBD sockets in
/// it); nobody else's.
pub(super) fn create_owned_dir(dir: &Path, owner: Option<super::Owner>) -> Result<(), SupError> {
    use std::os::unix::fs::MetadataExt;
    // A directory left by another owner (a VM whose QEMU ran as another user, who may have
    // left files, links or sockets in it) is never reused: it goes, with what it holds
    // (remove_dir_all does not follow links), and a new one is made.
    let want = owner.map_or((0, 0), |o| (o.uid, o.gid));
    if let Ok(m) = dir.symlink_metadata() {
        let mine = m.file_type().is_dir() && (m.uid(), m.gid()) == want;
        if !mine {
            let r = if m.file_type().is_dir() {
                std::fs::remove_dir_all(dir)
            } else {
                std::fs::remove_file(dir)
            };
            r.map_err(|source| SupError::Io {
                what: format!("cannot remove {} (another owner's)", dir.display()),
                source,
            })?;
            info!(dir = %dir.display(), uid = m.uid(), "a VM directory of another owner removed");
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| SupError::Io {
        what: format!("cannot create {}", dir.display()),
        source,
    })?;
    super::permit::secure_own(dir, 0o700, owner, true)
}

/// The guest-visible size of a non-raw image (`qemu-img info -U`), of the drive's format
/// (never probed: the guest writes the image's content, and a probe of a raw image that
/// looks like a qcow2 one would follow its backing file name). It runs as QEMU's user when
/// the VM has one (it reads only what QEMU could), with no descriptor of acceld's.
fn qemu_img_virtual_size(
    image: &Path,
    format: &str,
    owner: Option<super::Owner>,
) -> Result<u64, SupError> {
    use std::os::unix::process::CommandExt;
    check_id("image format", format).map_err(|e| SupError::Invalid(e.0))?;
    let mut cmd = std::process::Command::new("qemu-img");
    cmd.args(["info", "-U", "--output=json", "-f", format])
        .arg("--")
        .arg(image)
        .stdin(std::process::Stdio::null());
    if let Some(o) = owner {
        // As root, std drops the supplementary groups with the uid.
        cmd.uid(o.uid).gid(o.gid);
    }
    // SAFETY: the closure runs in the child between fork and exec and only makes one
    // async-signal-safe system call (close_range).
    unsafe {
        cmd.pre_exec(close_inherited_fds);
    }
    let out = cmd.output().map_err(|source| SupError::Io {
        what: "cannot run qemu-img (qemu-utils)".into(),
        source,
    })?;
    if !out.status.success() {
        return Err(SupError::Invalid(format!(
            "qemu-img info {}: {}",
            image.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| SupError::Parse(format!("qemu-img info: {e}")))?;
    v["virtual-size"]
        .as_u64()
        .ok_or_else(|| SupError::Parse("qemu-img info has no virtual-size".into()))
}

/// For a child between fork and exec: closes every descriptor above stderr, so that none
/// of acceld's (guest memory, images, QEMU's fds received without `O_CLOEXEC` by the vhost
/// crate) reaches the program. Only `close_range`, async-signal-safe.
fn close_inherited_fds() -> std::io::Result<()> {
    // SAFETY: close_range takes plain integers; closing descriptors in a child about to
    // exec touches no memory of this process.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The image opened read-only without following links, if it is still the file of the
/// image's identity (no link or rename makes the caller read another file).
fn open_identified(image: &super::permit::ImageRef) -> Option<(std::fs::File, std::fs::Metadata)> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW)
        .open(&image.path)
        .ok()?;
    let m = f.metadata().ok()?;
    let kind_ok = m.is_file() || m.file_type().is_block_device();
    if !kind_ok || accel_dataplane::engine::file::ImageId::of(&m) != image.id {
        return None;
    }
    Some((f, m))
}

/// The image's size in bytes (a block device's too), read through [`open_identified`].
fn image_bytes(image: &super::permit::ImageRef) -> Option<u64> {
    use std::io::{Seek, SeekFrom};
    let (mut f, m) = open_identified(image)?;
    if m.is_file() {
        return Some(m.len());
    }
    f.seek(SeekFrom::End(0)).ok()
}

/// The first 512 bytes of the image, read through [`open_identified`]; None if it cannot
/// be read.
fn first_sector(image: &super::permit::ImageRef) -> Option<[u8; 512]> {
    use std::io::Read;
    let (mut f, _) = open_identified(image)?;
    let mut b = [0u8; 512];
    f.read_exact(&mut b).ok()?;
    Some(b)
}
