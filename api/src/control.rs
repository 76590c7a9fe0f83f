//! The control API of `acceld run`: one JSON object per line over the unix socket
//! `RUNDIR/acceld.sock` (mode 0600). `accelctl` is its client; scripts may speak it directly.
//!
//! Request: `{"op":"status"}`, `{"op":"register","vm":"demo","qmp":"/run/…","drives":[…]}`, …
//! Reply: `{"ok":true,"result":…}` or `{"ok":false,"kind":"not-found","error":"…"}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

/// One drive of a VM, as registered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveSpec {
    /// The drive id: the socket's name, and the name of acceld's objects in QEMU
    /// (`accel-ID`); QEMU's node-name too unless `node` says otherwise.
    pub id: String,
    /// QEMU's node-name of the drive's image (default: the id). A raw node over a file node,
    /// or the file node itself (libvirt's raw disks: `libvirt-N-storage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub image: PathBuf,
    /// Image format: raw, qcow2, … (anything but raw is served by QEMU's block layer).
    #[serde(default = "default_format")]
    pub format: String,
    #[serde(default)]
    pub read_only: bool,
    /// GET_ID answer; none by default, as QEMU's virtio-blk without `serial=` (the guest's
    /// `/sys/block/vdX/serial` is empty, udev makes no serial-based `by-id` link).
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default = "default_queues")]
    pub queues: u16,
    /// What DISCARD does: "unmap" or "ignore".
    #[serde(default)]
    pub discard: DiscardMode,
    /// O_DIRECT (QEMU: cache.direct=on).
    #[serde(default = "default_true")]
    pub direct: bool,
    /// Logical block size shown to the guest.
    #[serde(default = "default_lbs")]
    pub logical_block_size: u32,
    /// What a failed write (or flush, discard, write-zeroes) does: QEMU's `werror`.
    #[serde(default = "default_werror")]
    pub werror: ErrorPolicy,
    /// What a failed read does: QEMU's `rerror`.
    #[serde(default = "default_rerror")]
    pub rerror: ErrorPolicy,
    /// The write cache the guest sees at start (config `writeback`); default on, as QEMU's
    /// virtio-blk. A migration's destination takes the source's current value: the guest may
    /// have changed it (CONFIG_WCE), and it sees the destination's config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writeback: Option<bool>,
    /// I/O limits to apply from the start (a migration's destination takes the source's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<ThrottleLimits>,
    /// While the drive is on the qemu engine, lend its rings to QEMU's own vhost-user-blk
    /// export of the drive's node (QEMU's export speed; the guest then sees that export's
    /// answers: GET_ID `vhost_user_blk`, errors reported at once). See docs/qemu-engine.md.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lend: bool,
    /// While the drive is on the qemu engine, relay its requests through QEMU's own
    /// vhost-user-blk export of the drive's node (rings of acceld's own in the export: the
    /// guest still sees acceld's device, counters and error policy); NBD when the export
    /// cannot be made, and while a block job runs or the QMP proxy holds a management
    /// command (QEMU 10.0.2's vhost-user-blk export aborts or hangs when its node is drained
    /// under I/O). On by default; `relay=off` (or `nbd=on`) serves the qemu engine over NBD
    /// only, and `lend=on` lends the rings instead. See docs/qemu-engine.md.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub relay: bool,
    /// `relay=on` said so: relay even when QEMU has a monitor acceld does not see (by
    /// default such a VM's drives serve over NBD: a block command sent there would drain a
    /// relayed node behind acceld's back, which QEMU 10.0.2 does not survive).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub relay_asked: bool,
}

/// What a failed request does, as QEMU's `werror`/`rerror` (`BlockdevOnError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorPolicy {
    /// IOERR to the guest.
    Report,
    /// Hold the request (and stop taking new ones from its queue) while the error is ENOSPC,
    /// retrying until it succeeds; other errors are reported. QEMU's default for writes.
    Enospc,
    /// Hold the request on any error, retrying until it succeeds or an operator resumes.
    Stop,
    /// Complete the request as if it succeeded.
    Ignore,
}

impl ErrorPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorPolicy::Report => "report",
            ErrorPolicy::Enospc => "enospc",
            ErrorPolicy::Stop => "stop",
            ErrorPolicy::Ignore => "ignore",
        }
    }
}

impl std::str::FromStr for ErrorPolicy {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "report" => Ok(ErrorPolicy::Report),
            "enospc" => Ok(ErrorPolicy::Enospc),
            "stop" => Ok(ErrorPolicy::Stop),
            "ignore" => Ok(ErrorPolicy::Ignore),
            _ => Err(SpecError(format!(
                "'{s}': expected report, enospc, stop or ignore"
            ))),
        }
    }
}

fn default_werror() -> ErrorPolicy {
    ErrorPolicy::Enospc
}
fn default_rerror() -> ErrorPolicy {
    ErrorPolicy::Report
}

fn default_format() -> String {
    "raw".into()
}
fn default_queues() -> u16 {
    1
}
/// What a DISCARD request does (QEMU's `discard` option, same spelling).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscardMode {
    /// Punch a hole in the image (the space is freed; reads return zeroes).
    #[default]
    Unmap,
    /// Answer OK and do nothing (discard is a hint).
    Ignore,
}

impl DiscardMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DiscardMode::Unmap => "unmap",
            DiscardMode::Ignore => "ignore",
        }
    }
}

impl std::fmt::Display for DiscardMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DiscardMode {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "unmap" => Ok(DiscardMode::Unmap),
            "ignore" => Ok(DiscardMode::Ignore),
            _ => Err(SpecError(format!("discard={s}: expected unmap or ignore"))),
        }
    }
}
fn is_true(b: &bool) -> bool {
    *b
}

fn default_true() -> bool {
    true
}
fn default_lbs() -> u32 {
    512
}

/// Longest serial a virtio-blk GET_ID answer carries (VIRTIO 1.2 §5.2.6: 20 bytes).
pub const MAX_SERIAL_BYTES: usize = 20;

/// A drive spec, name or option that is not valid; the text says why.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct SpecError(pub String);

fn on_off(key: &str, v: &str) -> Result<bool, SpecError> {
    match v {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => Err(SpecError(format!("{key}={v}: expected on or off"))),
    }
}

/// Drive ids become QEMU node names and file names: letters, digits, '-', '_', starting
/// with a letter, at most 31 bytes (QEMU's id rules, minus '.').
pub fn check_id(kind: &str, id: &str) -> Result<(), SpecError> {
    let ok = !id.is_empty()
        && id.len() <= 31
        && id.starts_with(|c: char| c.is_ascii_alphabetic())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(SpecError(format!(
            "{kind} '{id}' is not a valid name: use 1-31 letters, digits, '-' or '_', starting \
             with a letter"
        )))
    }
}

impl DriveSpec {
    /// Parses `id=D,image=PATH[,node=N][,format=raw][,read-only=on][,serial=S][,queues=N]
    /// [,discard=unmap|ignore][,direct=on|off][,logical-block-size=512|4096][,lend=on|off]
    /// [,relay=on|off]`.
    pub fn parse(s: &str) -> Result<Self, SpecError> {
        let mut id = None;
        let mut image = None;
        let mut d = DriveSpec {
            id: String::new(),
            node: None,
            image: PathBuf::new(),
            format: default_format(),
            read_only: false,
            serial: None,
            queues: 1,
            discard: DiscardMode::Unmap,
            direct: true,
            logical_block_size: 512,
            werror: default_werror(),
            rerror: default_rerror(),
            writeback: None,
            throttle: None,
            lend: false,
            relay: true,
            relay_asked: false,
        };
        for kv in s.split(',') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| SpecError(format!("'{kv}' is not key=value")))?;
            match k {
                "id" => id = Some(v.to_string()),
                "node" => d.node = Some(v.to_string()),
                "image" => image = Some(PathBuf::from(v)),
                "format" => d.format = v.to_string(),
                "read-only" => d.read_only = on_off(k, v)?,
                "serial" => d.serial = Some(v.to_string()),
                "queues" => {
                    d.queues = v
                        .parse()
                        .ok()
                        .filter(|q| (1..=64).contains(q))
                        .ok_or_else(|| SpecError(format!("queues={v}: expected 1 to 64")))?
                }
                "discard" => d.discard = v.parse()?,
                "werror" => d.werror = v.parse()?,
                "rerror" => {
                    d.rerror = v.parse()?;
                    if d.rerror == ErrorPolicy::Enospc {
                        return Err(SpecError(
                            "rerror=enospc: reads do not run out of space".into(),
                        ));
                    }
                }
                "direct" => d.direct = on_off(k, v)?,
                "lend" => d.lend = on_off(k, v)?,
                "relay" => {
                    d.relay = on_off(k, v)?;
                    d.relay_asked = d.relay;
                }
                "nbd" => {
                    d.relay = !on_off(k, v)?;
                    d.relay_asked &= d.relay;
                }
                "writeback" => d.writeback = Some(on_off(k, v)?),
                "logical-block-size" => {
                    d.logical_block_size = match v {
                        "512" => 512,
                        "4096" => 4096,
                        _ => {
                            return Err(SpecError(format!(
                                "logical-block-size={v}: expected 512 or 4096"
                            )))
                        }
                    }
                }
                _ => return Err(SpecError(format!("unknown drive option '{k}'"))),
            }
        }
        d.id = id.ok_or_else(|| SpecError("missing id=".into()))?;
        d.image = image.ok_or_else(|| SpecError("missing image=".into()))?;
        if d.lend && d.relay_asked {
            return Err(SpecError(
                "lend=on and relay=on: QEMU's export takes one front-end, choose one".into(),
            ));
        }
        d.validate()?;
        Ok(d)
    }

    /// Whether the qemu engine relays through QEMU's vhost-user-blk export (`relay`, unless
    /// the rings are lent).
    pub fn relays(&self) -> bool {
        self.relay && !self.lend
    }

    /// QEMU's node-name of the drive's image.
    pub fn node_name(&self) -> &str {
        self.node.as_deref().unwrap_or(&self.id)
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        check_id("drive id", &self.id)?;

        if let Some(n) = &self.node {
            check_id("node name", n)?;
        }
        if !self.image.is_absolute() {
            return Err(SpecError(format!(
                "image {} is not an absolute path",
                self.image.display()
            )));
        }
        if let Some(s) = &self.serial {
            if s.len() > MAX_SERIAL_BYTES {
                return Err(SpecError(format!(
                    "serial '{s}' is longer than {MAX_SERIAL_BYTES} bytes"
                )));
            }
        }
        if !self
            .format
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
            || self.format.is_empty()
        {
            return Err(SpecError(format!(
                "format '{}' is not a QEMU driver name",
                self.format
            )));
        }
        if self.rerror == ErrorPolicy::Enospc {
            return Err(SpecError(
                "rerror=enospc: reads do not run out of space".into(),
            ));
        }
        if self.queues == 0 || self.queues > 64 {
            return Err(SpecError(format!(
                "queues={}: expected 1 to 64",
                self.queues
            )));
        }
        Ok(())
    }
}

/// I/O limits for `throttle` (QEMU's throttle-group `limits`; absent = unlimited).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ThrottleLimits {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_total: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_read: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_write: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bps_total: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bps_read: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bps_write: Option<u64>,
}

impl ThrottleLimits {
    pub fn is_empty(&self) -> bool {
        *self == ThrottleLimits::default()
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Serve the drives' sockets now and attach to the VM's QMP when it appears.
    Register {
        vm: String,
        qmp: PathBuf,
        drives: Vec<DriveSpec>,
        /// `cont` the VM once every drive has an engine, if it waits in prelaunch (-S), or
        /// paused after an incoming migration.
        #[serde(default)]
        cont: bool,
        /// The VM is a migration's destination (QEMU runs with -incoming): its drives stay
        /// held, no image is opened and QEMU's graph is not touched until the migration
        /// completed.
        #[serde(default)]
        incoming: bool,
    },
    Unregister {
        vm: String,
    },
    /// Start a live migration of the VM to `uri` (QEMU's `migrate`); the destination must
    /// wait with -incoming, its acceld registered `incoming`.
    Migrate {
        vm: String,
        uri: String,
    },
    /// Copy-storage, destination side: export the drive's node (its new image) over NBD for the
    /// source's mirror; answers the socket and export name.
    MirrorTarget {
        vm: String,
        drive: String,
    },
    /// Copy-storage, source side: mirror the drive (on the qemu engine) into an NBD export;
    /// answers once the mirror is in sync.
    MirrorTo {
        vm: String,
        drive: String,
        socket: PathBuf,
        export: String,
    },
    /// QEMU's `query-migrate` of the VM, as QEMU answers it.
    MigrationStatus {
        vm: String,
    },
    /// `quit` the VM's QEMU after it migrated away (refused unless it is `postmigrate`).
    QuitMigrated {
        vm: String,
    },
    Attach {
        vm: String,
    },
    Detach {
        vm: String,
    },
    Status,
    Explain {
        vm: String,
        drive: String,
    },
    /// Clear a qemu pin (`pin`: also pin to direct) and accelerate if the rules allow.
    Accelerate {
        vm: String,
        drive: String,
        #[serde(default)]
        pin: bool,
    },
    /// Move to QEMU's block layer (`pin`: keep it there until accelerate).
    Handback {
        vm: String,
        drive: String,
        #[serde(default)]
        pin: bool,
    },
    /// Retry the drive's held requests now (werror=enospc or stop), e.g. after space was
    /// freed.
    Resume {
        vm: String,
        drive: String,
    },
    /// Set (limits) or clear (none) a throttle on the drive.
    Throttle {
        vm: String,
        drive: String,
        limits: Option<ThrottleLimits>,
    },
    QemuArgs {
        vm: String,
        #[serde(default = "default_memory")]
        memory: String,
    },
    /// Let QEMU's user (`uid`, `gid`) register the VM itself (libvirt's hook, for a QEMU that
    /// does not run as root): acceld makes `RUN_DIR/VM/` that user's and serves
    /// `RUN_DIR/VM/control.sock` for it, which takes `register` (of this VM, with its QMP at
    /// `RUN_DIR/VM/qemu-qmp.sock` and only the `images` named here), `unregister` and
    /// `status` of this VM and nothing else. The VM's sockets are then that user's.
    /// `unregister` of the VM ends the permit.
    Permit {
        vm: String,
        uid: u32,
        gid: u32,
        images: Vec<PermitImage>,
    },
}

/// One image a permit names: a path (then writable, format not given) or
/// `{"path", "read_only", "format"}` as libvirt's domain XML says (a disk's `<readonly/>`,
/// a backing file, its `<driver type>` or `<format type>`). A drive registered on it must be
/// read-only if it is, and of its format if one is given; acceld never probes its format.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PermitImage {
    Path(PathBuf),
    Spec {
        path: PathBuf,
        #[serde(default)]
        read_only: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        format: Option<String>,
    },
}

impl PermitImage {
    pub fn path(&self) -> &Path {
        match self {
            PermitImage::Path(p) | PermitImage::Spec { path: p, .. } => p,
        }
    }

    pub fn read_only(&self) -> bool {
        matches!(
            self,
            PermitImage::Spec {
                read_only: true,
                ..
            }
        )
    }

    pub fn format(&self) -> Option<&str> {
        match self {
            PermitImage::Spec {
                format: Some(f), ..
            } => Some(f),
            _ => None,
        }
    }
}

impl From<PathBuf> for PermitImage {
    fn from(p: PathBuf) -> Self {
        PermitImage::Path(p)
    }
}

fn default_memory() -> String {
    "512M".into()
}

/// Why a request failed, for scripts (accelctl maps these to exit codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// The request is malformed or names something impossible.
    Invalid,
    /// No such VM or drive.
    NotFound,
    /// Something of the same name exists already.
    Exists,
    /// The operation was tried and failed (QMP, switch, I/O); nothing was left half done.
    Failed,
    /// Not allowed to this client (a VM's own control socket takes only that VM's requests).
    Denied,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ErrorKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    pub fn ok(result: Value) -> Self {
        Reply {
            ok: true,
            result: Some(result),
            kind: None,
            error: None,
        }
    }
    pub fn err(kind: ErrorKind, error: String) -> Self {
        Reply {
            ok: false,
            result: None,
            kind: Some(kind),
            error: Some(error),
        }
    }
}

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot reach acceld at {path} (is `acceld run` running?)")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("talking to acceld")]
    Io(#[from] std::io::Error),
    #[error("acceld sent a reply that is not JSON: {0}")]
    Decode(String),
}

/// Sends one request and waits for its reply (blocking; for accelctl and tests).
pub fn call(socket: &Path, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
    let s = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_string(req).expect("requests serialize");
    line.push('\n');
    (&s).write_all(line.as_bytes())?;
    let mut r = BufReader::new(&s);
    let mut reply = String::new();
    r.read_line(&mut reply)?;
    serde_json::from_str(&reply).map_err(|e| ClientError::Decode(format!("{e}: {reply}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drive_spec_parses_and_rejects() {
        let d = DriveSpec::parse("id=d0,image=/x/d.raw,queues=2,read-only=on,serial=S1").unwrap();
        assert_eq!(d.id, "d0");
        assert_eq!(d.queues, 2);
        assert!(d.read_only);
        assert_eq!(d.serial.as_deref(), Some("S1"));
        assert_eq!(d.format, "raw");
        assert!(d.relays(), "the relay is the qemu engine's default");
        assert!(!d.relay_asked, "relayed by default, not asked for");
        for (spec, relays, asked) in [
            ("id=d0,image=/x/d.qcow2,format=qcow2,relay=on", true, true),
            ("id=d0,image=/x/d.qcow2,relay=off", false, false),
            ("id=d0,image=/x/d.qcow2,nbd=on", false, false),
            ("id=d0,image=/x/d.qcow2,relay=on,nbd=off", true, true),
            ("id=d0,image=/x/d.qcow2,relay=on,nbd=on", false, false),
            ("id=d0,image=/x/d.qcow2,lend=on", false, false),
        ] {
            let r = DriveSpec::parse(spec).unwrap();
            assert_eq!((r.relays(), r.relay_asked), (relays, asked), "{spec}");
            // Kept through the JSON the supervisor persists and hands a migration's
            // destination.
            let back: DriveSpec =
                serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
            assert_eq!((back.relays(), back.relay_asked), (relays, asked), "{spec}");
        }
        // A spec persisted before the relay existed relays (the default), and one persisted
        // while the relay was opt-in keeps what it said.
        let old: DriveSpec = serde_json::from_str(r#"{"id":"d0","image":"/x"}"#).unwrap();
        assert!(old.relays());
        let off: DriveSpec =
            serde_json::from_str(r#"{"id":"d0","image":"/x","relay":false}"#).unwrap();
        assert!(!off.relays());
        for (bad, why) in [
            ("image=/x", "missing id"),
            ("id=d0", "missing image"),
            ("id=d0,image=rel.raw", "absolute"),
            ("id=0d,image=/x", "not a valid name"),
            ("id=d.0,image=/x", "not a valid name"),
            ("id=d0,image=/x,queues=0", "1 to 64"),
            ("id=d0,image=/x,read-only=maybe", "on or off"),
            ("id=d0,image=/x,colour=red", "unknown drive option"),
            (
                "id=d0,image=/x,serial=123456789012345678901",
                "longer than 20",
            ),
            ("id=d0,image=/x,format=qcow2;rm", "not a QEMU driver"),
            ("id=d0,image", "not key=value"),
            ("id=d0,image=/x,lend=on,relay=on", "choose one"),
        ] {
            let e = DriveSpec::parse(bad).unwrap_err();
            assert!(e.0.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn requests_round_trip() {
        let r: Request = serde_json::from_str(
            r#"{"op":"throttle","vm":"v","drive":"d","limits":{"iops-total":100}}"#,
        )
        .unwrap();
        match r {
            Request::Throttle {
                limits: Some(l), ..
            } => assert_eq!(l.iops_total, Some(100)),
            other => panic!("{other:?}"),
        }
    }
}
