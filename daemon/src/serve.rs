//! `acceld serve`: one disk on one vhost-user-blk socket: an image on the direct engine, or
//! the qemu engine over an NBD export (`--nbd-socket`) or through QEMU's vhost-user-blk export
//! (`--relay-to`).

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use thiserror::Error;
use tracing::info;

use accel_dataplane::drive::DEFAULT_POLL_US;
use accel_dataplane::drive::{DiscardMode, Drive, DriveConfig, DriveConfigError, ErrorPolicy};
use accel_dataplane::engine::nbd::{NbdEngine, NbdError};
use accel_dataplane::engine::relay::{RelayEngine, RelayError};
use accel_dataplane::engine::{Engine, EngineError, FileEngine, FileEngineConfig, IoMode};
use accel_dataplane::vhost::{ServeError, Server, ShutdownHandle};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// Serve one raw image or block device on a vhost-user-blk socket.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// Raw image file or block device.
    #[arg(long, required_unless_present_any = ["nbd_socket", "relay_to"])]
    pub image: Option<PathBuf>,
    /// Serve through an NBD export instead of a file (the qemu engine): the NBD server's
    /// unix socket, e.g. QEMU's `nbd-server-start` address. For tests and benchmarks.
    #[arg(long, conflicts_with = "image", requires = "nbd_export")]
    pub nbd_socket: Option<PathBuf>,
    /// The NBD export's name (with --nbd-socket).
    #[arg(long)]
    pub nbd_export: Option<String>,
    /// Lend the guest's rings to QEMU's vhost-user-blk export of the same node, listening on
    /// this socket, whenever the queues run (with --nbd-socket, which serves them when they
    /// are taken back). The export then serves the guest directly; see `drive::lend` for
    /// what the guest can tell.
    #[arg(long, requires = "nbd_socket")]
    pub lend_to: Option<PathBuf>,
    /// Serve through QEMU's vhost-user-blk export listening on this socket (the qemu engine's
    /// relay: acceld keeps the guest's rings and posts each request on a ring of its own in
    /// the export, zero copy). No NBD needed. For tests and benchmarks.
    #[arg(long, conflicts_with_all = ["image", "nbd_socket"])]
    pub relay_to: Option<PathBuf>,
    /// vhost-user socket to listen on (QEMU: -chardev socket,path=...).
    #[arg(long)]
    pub socket: PathBuf,
    /// Number of virtqueues (QEMU: vhost-user-blk-pci,num-queues=N).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queues: u16,
    /// Largest virtqueue size the frontend may use (a power of two, at most 1024).
    #[arg(long, default_value_t = 1024, value_parser = parse_queue_size)]
    pub queue_size: u16,
    /// Refuse writes, and show the disk read-only to the guest.
    #[arg(long)]
    pub read_only: bool,
    /// Serial number the guest reads (GET_ID; 20 bytes at most). Default: the image's file
    /// name.
    #[arg(long)]
    pub serial: Option<String>,
    /// Logical block size shown to the guest.
    #[arg(long, default_value_t = 512, value_parser = parse_block_size)]
    pub logical_block_size: u32,
    /// O_DIRECT I/O (bypass the host page cache).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub direct: OnOff,
    /// What DISCARD does: punch a hole in the image, or nothing.
    #[arg(long, default_value_t = DiscardMode::Unmap, value_parser = parse_discard)]
    pub discard: DiscardMode,
    /// Most microseconds a queue busy-polls before sleeping (0: never). Adaptive, like QEMU's
    /// poll-max-ns: a queue whose requests come close together polls (no wake-up latency),
    /// an idle one sleeps and costs nothing.
    #[arg(long, default_value_t = DEFAULT_POLL_US, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub poll_us: u32,
    /// How requests reach the image: auto (inline for files in memory, tmpfs and the like;
    /// io_uring otherwise), io_uring, or inline (preadv2/pwritev2 on the queue's thread).
    #[arg(long, value_enum, default_value_t = IoArg::Auto)]
    pub io: IoArg,
    /// What a failed write does: report (IOERR), enospc (hold while out of space, QEMU's
    /// default), stop (hold on any error), ignore.
    #[arg(long, default_value = "enospc", value_parser = parse_policy)]
    pub werror: ErrorPolicy,
    /// What a failed read does: report, stop, ignore.
    #[arg(long, default_value = "report", value_parser = parse_policy)]
    pub rerror: ErrorPolicy,
    /// On SIGTERM or SIGINT, how long to wait for requests in flight before exiting anyway.
    #[arg(long, default_value_t = 10_000)]
    pub shutdown_timeout_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IoArg {
    Auto,
    #[value(name = "io_uring")]
    IoUring,
    Inline,
}

impl From<IoArg> for IoMode {
    fn from(a: IoArg) -> Self {
        match a {
            IoArg::Auto => IoMode::Auto,
            IoArg::IoUring => IoMode::Uring,
            IoArg::Inline => IoMode::Inline,
        }
    }
}

fn parse_queue_size(s: &str) -> Result<u16, String> {
    let n: u16 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
    if n == 0 || n > 1024 || !n.is_power_of_two() {
        return Err(format!("{n} is not a power of two between 1 and 1024"));
    }
    Ok(n)
}

fn parse_discard(s: &str) -> Result<DiscardMode, String> {
    s.parse()
        .map_err(|_| format!("'{s}' is not unmap or ignore"))
}

fn parse_policy(s: &str) -> Result<ErrorPolicy, String> {
    s.parse().map_err(|e: accel_api::control::SpecError| e.0)
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    match s {
        "512" => Ok(512),
        "4096" => Ok(4096),
        _ => Err(format!("'{s}' is not 512 or 4096")),
    }
}

#[derive(Debug, Error)]
pub enum ServeCmdError {
    #[error("image {0} does not exist")]
    NoImage(PathBuf),
    #[error("image {path} holds {size} bytes, less than one {block}-byte block")]
    TooSmall {
        path: PathBuf,
        size: u64,
        block: u32,
    },
    #[error("serial '{0}' is longer than 20 bytes")]
    SerialTooLong(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Nbd(#[from] NbdError),
    #[error(transparent)]
    Relay(#[from] RelayError),
    #[error("the export's logical block size is {export}, not {asked} (--logical-block-size)")]
    BlockSize { export: u32, asked: u32 },
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("cannot install the signal handler")]
    Signals(#[source] std::io::Error),
    #[error("cannot start the lender thread")]
    Lender(#[source] std::io::Error),
}

impl ServeArgs {
    /// The drive and its engine (direct, or NBD with --nbd-socket), every argument checked.
    pub fn build(&self) -> Result<Arc<Drive>, ServeCmdError> {
        let mut read_only = self.read_only;
        let (engine, size, path, label): (Arc<dyn Engine>, u64, PathBuf, String) =
            match (&self.image, &self.nbd_socket) {
                _ if self.relay_to.is_some() => {
                    let sock = self.relay_to.clone().unwrap_or_default();
                    let e = RelayEngine::connect(&sock, None, usize::from(self.queues))?;
                    let c = e.config();
                    if c.blk_size != self.logical_block_size {
                        return Err(ServeCmdError::BlockSize {
                            export: c.blk_size,
                            asked: self.logical_block_size,
                        });
                    }
                    read_only |= c.read_only;
                    let label = sock
                        .file_stem()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "disk".into());
                    (Arc::new(e), c.capacity, sock, label)
                }
                (_, Some(sock)) => {
                    let export = self.nbd_export.clone().unwrap_or_default();
                    // One connection per queue now; a queue that opens again later (the
                    // frontend reconnected) connects from a thread of its own.
                    let e = NbdEngine::connect_ahead(sock, &export, usize::from(self.queues))?;
                    let size = e.info().size;
                    (Arc::new(e), size, sock.clone(), export)
                }
                (Some(image), None) => {
                    if !image.exists() {
                        return Err(ServeCmdError::NoImage(image.clone()));
                    }
                    let mut cfg = FileEngineConfig::new(
                        image.clone(),
                        self.read_only,
                        self.direct == OnOff::On,
                        self.logical_block_size,
                    );
                    cfg.io = self.io.into();
                    let e = FileEngine::open_waiting(&cfg, std::time::Duration::from_secs(2))?;
                    let size = e.size();
                    let label = image
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "disk".into());
                    (Arc::new(e), size, image.clone(), label)
                }
                (None, None) => return Err(ServeCmdError::NoImage(PathBuf::new())),
            };
        let name = label
            .split('.')
            .next()
            .filter(|n| !n.is_empty())
            .unwrap_or("disk")
            .to_string();
        let cfg = DriveConfig {
            name,
            serial: self
                .serial
                .clone()
                .unwrap_or_else(|| label.chars().take(20).collect()),
            capacity_bytes: size,
            logical_block_size: self.logical_block_size,
            read_only,
            num_queues: self.queues,
            queue_size: self.queue_size,
            discard: self.discard,
            poll_us: self.poll_us,
            werror: self.werror,
            rerror: self.rerror,
            // A standalone server: QEMU's vhost-user-blk export's device, as before.
            model: accel_dataplane::drive::DeviceModel::Export,
            chs: None,
        }
        .checked()
        .map_err(|e| match e {
            DriveConfigError::SerialTooLong(s) => ServeCmdError::SerialTooLong(s),
            DriveConfigError::TooSmall { size, block } => {
                ServeCmdError::TooSmall { path, size, block }
            }
        })?;
        Ok(Drive::new(cfg, engine))
    }
}

/// Runs `acceld serve` until SIGTERM or SIGINT, then drains and exits.
pub fn run(args: &ServeArgs) -> Result<(), ServeCmdError> {
    // A live server on the socket is the clearer error; check it before the image lock.
    if accel_dataplane::util::socket_listening(&args.socket) {
        return Err(ServeError::SocketInUse(args.socket.clone()).into());
    }
    let drive = args.build()?;
    let mut server = Server::bind(&args.socket, drive.clone())?;
    let stop = server.shutdown_handle();
    install_signals(
        stop,
        std::time::Duration::from_millis(args.shutdown_timeout_ms),
    )?;
    info!(
        image = %args.image.as_deref().or(args.nbd_socket.as_deref()).or(args.relay_to.as_deref()).unwrap_or(std::path::Path::new("")).display(),
        socket = %args.socket.display(),
        queues = args.queues,
        capacity = drive.config().capacity_bytes,
        engine = drive.engine().io_path(),
        "serving"
    );
    let lender = match &args.lend_to {
        Some(p) => Some(
            drive
                .spawn_lender(p.clone(), None)
                .map_err(ServeCmdError::Lender)?,
        ),
        None => None,
    };
    server.run()?;
    drop(lender);
    // Drop the image locks now, not when the kernel tears the rings down after exit.
    drive.engine().release();
    info!(connections = server.connections, "drained, exiting");
    Ok(())
}

fn install_signals(stop: ShutdownHandle, bound: std::time::Duration) -> Result<(), ServeCmdError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).map_err(ServeCmdError::Signals)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                info!(
                    signal = sig,
                    bound_ms = bound.as_millis() as u64,
                    "shutting down"
                );
                accel_dataplane::drive::queue_ctl::abandon_drains_at(
                    std::time::Instant::now() + bound,
                );
                stop.shutdown();
            }
        })
        .map_err(ServeCmdError::Signals)?;
    Ok(())
}
