//! accel's policy: given what QEMU says about a drive, may acceld serve it directly (io_uring on
//! the raw file), or must QEMU's block layer serve it — and why. Pure: no I/O, no async.
//!
//! The policy never guesses: anything it does not understand keeps the drive in QEMU with a
//! reason that names it. Every reason has a stable machine code and a sentence; see
//! `docs/policy.md`.

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

pub mod qemu;

/// One block node as the policy needs it (built from `query-named-block-nodes`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct NodeView {
    pub name: String,
    pub driver: String,
    pub read_only: bool,
    /// The file name QEMU reports for the node.
    pub filename: String,
    pub virtual_size: u64,
    /// `detect-zeroes`: "off", "on" or "unmap".
    pub detect_zeroes: String,
    pub encrypted: bool,
    pub backing_depth: u64,
    pub cache_direct: bool,
    pub cache_no_flush: bool,
    pub cache_writeback: bool,
    pub dirty_bitmaps: usize,
    /// `block-set-write-threshold` armed on the node (bytes; 0: none).
    pub write_threshold: u64,
    /// False after `blockdev-set-active false` or on a migration target before it takes over.
    pub active: bool,
    /// Legacy I/O limits on the node (`-drive throttling.*`): any non-zero limit.
    pub throttled: bool,
}

/// Something above the drive's node in QEMU's graph.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Parent {
    /// A filter driver (throttle, copy-on-read, …) on top of the node.
    Filter(String),
    /// A block job (mirror, commit, stream, backup, …) using the node.
    Job(String),
    /// A block backend: a QEMU device or an export using the node.
    Backend(String),
}

/// The VM's run and migration state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VmState {
    /// `query-status` status ("prelaunch", "running", "paused", "inmigrate", …).
    pub run_state: String,
    /// `query-migrate` status, if any ("active", "completed", …).
    pub migration: Option<String>,
}

/// An operator's pin of a drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Pin {
    /// Always QEMU's block layer.
    Qemu,
    /// Accelerate whenever the rules allow (the default, made explicit).
    Direct,
}

/// Options of the drive that QEMU's queries do not show, recorded when the drive was set up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedOptions {
    /// The raw/file `discard` option: "ignore" (QEMU's default) or "unmap".
    pub discard: String,
    pub logical_block_size: u32,
    pub queues: u16,
    pub serial: Option<String>,
}

impl Default for RecordedOptions {
    fn default() -> Self {
        RecordedOptions {
            discard: "ignore".into(),
            logical_block_size: 512,
            queues: 1,
            serial: None,
        }
    }
}

/// Everything the policy looks at for one drive.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DriveView {
    /// The drive id: the device id and the node-name of the drive's top node (VM contract).
    pub drive: String,
    /// The node named after the drive (normally `raw`).
    pub node: Option<NodeView>,
    /// Its `file` child (normally `file` or `host_device`).
    pub protocol: Option<NodeView>,
    /// What uses the node, from QEMU's block graph.
    pub parents: Vec<Parent>,
    /// Children other than `file` (e.g. `backing`).
    pub other_children: Vec<String>,
    pub vm: VmState,
    pub memory_shared: bool,
    pub pin: Option<Pin>,
    pub options: RecordedOptions,
}

/// What acceld needs to serve a drive directly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServeSpec {
    pub image: PathBuf,
    pub read_only: bool,
    /// O_DIRECT (from the protocol node's `cache.direct`).
    pub direct: bool,
    /// "unmap" or "ignore".
    pub discard: String,
    pub logical_block_size: u32,
    pub queues: u16,
    pub serial: Option<String>,
    pub block_device: bool,
}

/// Why a drive stays in QEMU's block layer. [`Reason::code`] is stable for scripts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Reason {
    /// The drive's node is a format other than raw.
    Format(String),
    /// The storage is reached through a protocol other than a local file or device.
    Protocol(String),
    BackingChain,
    Filter(String),
    BlockJob(String),
    DirtyBitmap,
    /// A write threshold is armed (only QEMU raises its event).
    WriteThreshold,
    Encryption,
    DetectZeroes(String),
    /// Legacy I/O limits on the node.
    Throttle,
    /// The raw driver's `offset`/`size` select a sub-range of the file.
    RawSubrange,
    /// `cache.no-flush=on`: QEMU drops flushes; acceld would not.
    CacheNoFlush,
    /// Another QEMU user (a device or an export) has the node.
    NodeInUse(String),
    /// The node is inactive (migration handover, `blockdev-set-active false`).
    InactiveNode,
    MigrationInProgress,
    OperatorPin,
    MemoryNotShared,
    /// No node named after the drive.
    NodeMissing,
    /// A driver the policy does not know.
    UnknownNodeDriver(String),
    /// The VM is in a state the policy does not know.
    UnknownVmState(String),
}

const FORMATS: &[&str] = &[
    "qcow2",
    "qcow",
    "qed",
    "vmdk",
    "vdi",
    "vhdx",
    "vpc",
    "parallels",
    "luks",
    "dmg",
    "bochs",
    "cloop",
];
const PROTOCOLS: &[&str] = &[
    "nbd",
    "iscsi",
    "rbd",
    "ssh",
    "http",
    "https",
    "ftp",
    "ftps",
    "gluster",
    "nfs",
    "nvme",
    "null-co",
    "null-aio",
    "host_cdrom",
    "vvfat",
    "io_uring",
    "virtio-blk-vhost-user",
    "virtio-blk-vfio-pci",
    "virtio-blk-vhost-vdpa",
];
const FILTERS: &[&str] = &[
    "throttle",
    "copy-on-read",
    "blkdebug",
    "blkverify",
    "blklogwrites",
    "compress",
    "preallocate",
    "copy-before-write",
    "snapshot-access",
    "quorum",
    "replication",
    // Implicit filters that block jobs insert above their node (QEMU 10 names them so).
    "mirror_top",
    "commit_top",
];
const MIGRATING: &[&str] = &[
    "setup",
    "active",
    "pre-switchover",
    "device",
    "postcopy-active",
    "postcopy-paused",
    "postcopy-recover-setup",
    "postcopy-recover",
    "wait-unplug",
    "cancelling",
];
const RUN_STATES: &[&str] = &[
    "prelaunch",
    "running",
    "paused",
    "suspended",
    "io-error",
    "watchdog",
    "guest-panicked",
    "debug",
    "restore-vm",
    "save-vm",
    "postmigrate",
    "finish-migrate",
    "internal-error",
    "shutdown",
    "colo",
    "inmigrate",
];

impl Reason {
    /// The stable machine code, e.g. `format:qcow2`, `filter:throttle`, `backing-chain`.
    pub fn code(&self) -> String {
        match self {
            Reason::Format(f) => format!("format:{f}"),
            Reason::Protocol(p) => format!("protocol:{p}"),
            Reason::BackingChain => "backing-chain".into(),
            Reason::Filter(f) => format!("filter:{f}"),
            Reason::BlockJob(j) => format!("block-job:{j}"),
            Reason::DirtyBitmap => "dirty-bitmap".into(),
            Reason::WriteThreshold => "write-threshold".into(),
            Reason::Encryption => "encryption".into(),
            Reason::DetectZeroes(_) => "detect-zeroes".into(),
            Reason::Throttle => "throttle".into(),
            Reason::RawSubrange => "raw-subrange".into(),
            Reason::CacheNoFlush => "cache-no-flush".into(),
            Reason::NodeInUse(_) => "node-in-use".into(),
            Reason::InactiveNode => "inactive-node".into(),
            Reason::MigrationInProgress => "migration-in-progress".into(),
            Reason::OperatorPin => "operator-pin".into(),
            Reason::MemoryNotShared => "memory-not-shared".into(),
            Reason::NodeMissing => "node-missing".into(),
            Reason::UnknownNodeDriver(d) => format!("unknown-node-driver:{d}"),
            Reason::UnknownVmState(s) => format!("unknown-vm-state:{s}"),
        }
    }

    /// A sentence for operators.
    pub fn sentence(&self) -> String {
        match self {
            Reason::Format(f) => format!("the image is {f}, which only QEMU's block layer reads"),
            Reason::Protocol(p) => {
                format!("the storage is reached over {p}, not a local file or block device")
            }
            Reason::BackingChain => {
                "the image has a backing file (snapshot or overlay chain)".into()
            }
            Reason::Filter(f) => format!("a {f} filter sits on the drive's node"),
            Reason::BlockJob(j) => format!("a {j} block job is using the drive"),
            Reason::DirtyBitmap => "the node has dirty bitmaps that only QEMU maintains".into(),
            Reason::WriteThreshold => {
                "a write threshold is set on the node; only QEMU raises its event".into()
            }
            Reason::Encryption => "the image is encrypted".into(),
            Reason::DetectZeroes(m) => {
                format!("detect-zeroes={m} is set, which acceld does not do")
            }
            Reason::Throttle => "I/O limits are set on the drive".into(),
            Reason::RawSubrange => {
                "the raw driver exposes a sub-range (offset/size) of the file".into()
            }
            Reason::CacheNoFlush => {
                "cache.no-flush is on (QEMU drops flushes; acceld would not)".into()
            }
            Reason::NodeInUse(u) => format!("the node is already used by {u}"),
            Reason::InactiveNode => "the node is inactive (migration handover)".into(),
            Reason::MigrationInProgress => "the VM is migrating".into(),
            Reason::OperatorPin => "an operator pinned the drive to QEMU".into(),
            Reason::MemoryNotShared => {
                "guest memory is not shared (needs memory-backend-memfd,share=on)".into()
            }
            Reason::NodeMissing => "QEMU has no block node named after the drive".into(),
            Reason::UnknownNodeDriver(d) => {
                format!("the node driver {d} is not known to accel's policy")
            }
            Reason::UnknownVmState(s) => format!("the VM state {s} is not known to accel's policy"),
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code(), self.sentence())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Decision {
    Accelerate(ServeSpec),
    Qemu(Vec<Reason>),
}

impl Decision {
    pub fn is_accelerated(&self) -> bool {
        matches!(self, Decision::Accelerate(_))
    }
    pub fn reason_codes(&self) -> Vec<String> {
        match self {
            Decision::Accelerate(_) => vec![],
            Decision::Qemu(r) => r.iter().map(Reason::code).collect(),
        }
    }
}

/// Whether QEMU is in a migration or a migration's state: incoming, finishing, migrated away,
/// or a migration under way. No drive changes engine then (see the supervisor's plan).
pub fn migrating(vm: &VmState) -> bool {
    matches!(
        vm.run_state.as_str(),
        "inmigrate" | "finish-migrate" | "postmigrate"
    ) || vm
        .migration
        .as_deref()
        .is_some_and(|m| MIGRATING.contains(&m))
}

/// The rules (documented one by one in `docs/policy.md`). All reasons are collected, not just
/// the first, so `accelctl explain` can list everything standing in the way.
pub fn decide(v: &DriveView) -> Decision {
    let mut r = Vec::new();
    if v.pin == Some(Pin::Qemu) {
        r.push(Reason::OperatorPin);
    }
    if !v.memory_shared {
        r.push(Reason::MemoryNotShared);
    }
    if !RUN_STATES.contains(&v.vm.run_state.as_str()) {
        r.push(Reason::UnknownVmState(v.vm.run_state.clone()));
    }
    if v.vm.run_state == "inmigrate"
        || v.vm
            .migration
            .as_deref()
            .is_some_and(|m| MIGRATING.contains(&m))
    {
        r.push(Reason::MigrationInProgress);
    }
    for p in &v.parents {
        r.push(match p {
            Parent::Filter(f) if FILTERS.contains(&f.as_str()) => Reason::Filter(f.clone()),
            Parent::Filter(f) => Reason::UnknownNodeDriver(f.clone()),
            Parent::Job(j) => Reason::BlockJob(j.clone()),
            Parent::Backend(b) => Reason::NodeInUse(b.clone()),
        });
    }
    for c in &v.other_children {
        r.push(if c == "backing" {
            Reason::BackingChain
        } else {
            Reason::UnknownNodeDriver(format!("child {c}"))
        });
    }
    let Some(node) = &v.node else {
        r.push(Reason::NodeMissing);
        return Decision::Qemu(dedup(r));
    };
    node_rules(node, &mut r);
    // A file or block device node right under the device, with no format layer: libvirt
    // names a raw disk's node so (`libvirt-N-storage`). It is its own protocol layer.
    let bare = matches!(node.driver.as_str(), "file" | "host_device");
    match node.driver.as_str() {
        "raw" => {}
        _ if bare => {}
        d if FORMATS.contains(&d) => r.push(Reason::Format(d.to_string())),
        d if FILTERS.contains(&d) => r.push(Reason::Filter(d.to_string())),
        d if PROTOCOLS.contains(&d) => r.push(Reason::Protocol(d.to_string())),
        d => r.push(Reason::UnknownNodeDriver(d.to_string())),
    }
    let mut block_device = node.driver == "host_device";
    match &v.protocol {
        None if node.driver == "raw" => {
            r.push(Reason::UnknownNodeDriver("raw without file".into()))
        }
        // Only a raw node's child is the protocol layer acceld would open; the children of
        // formats and filters are QEMU's business (the node's own reason says why).
        _ if node.driver != "raw" => {}
        None => {}
        Some(p) => {
            node_rules(p, &mut r);
            match p.driver.as_str() {
                "file" => {}
                "host_device" => block_device = true,
                d if PROTOCOLS.contains(&d) => r.push(Reason::Protocol(d.to_string())),
                d if FORMATS.contains(&d) => r.push(Reason::Format(d.to_string())),
                d => r.push(Reason::UnknownNodeDriver(d.to_string())),
            }
            if node.driver == "raw" && p.virtual_size != node.virtual_size {
                r.push(Reason::RawSubrange);
            }
        }
    }
    if !r.is_empty() {
        return Decision::Qemu(dedup(r));
    }
    let p = if bare {
        node
    } else {
        v.protocol.as_ref().expect("checked above")
    };
    let discard = match v.options.discard.as_str() {
        "unmap" | "on" => "unmap",
        _ => "ignore",
    };
    Decision::Accelerate(ServeSpec {
        image: PathBuf::from(&p.filename),
        read_only: node.read_only || p.read_only,
        direct: p.cache_direct,
        discard: discard.into(),
        logical_block_size: v.options.logical_block_size,
        queues: v.options.queues,
        serial: v.options.serial.clone(),
        block_device,
    })
}

fn node_rules(n: &NodeView, r: &mut Vec<Reason>) {
    if n.backing_depth > 0 {
        r.push(Reason::BackingChain);
    }
    if n.dirty_bitmaps > 0 {
        r.push(Reason::DirtyBitmap);
    }
    if n.write_threshold > 0 {
        r.push(Reason::WriteThreshold);
    }
    if n.encrypted {
        r.push(Reason::Encryption);
    }
    if n.detect_zeroes != "off" && !n.detect_zeroes.is_empty() {
        r.push(Reason::DetectZeroes(n.detect_zeroes.clone()));
    }
    if n.throttled {
        r.push(Reason::Throttle);
    }
    if n.cache_no_flush {
        r.push(Reason::CacheNoFlush);
    }
    if !n.active {
        r.push(Reason::InactiveNode);
    }
}

fn dedup(mut r: Vec<Reason>) -> Vec<Reason> {
    let mut seen = Vec::new();
    r.retain(|x| {
        let c = x.code();
        if seen.contains(&c) {
            false
        } else {
            seen.push(c);
            true
        }
    });
    r
}
