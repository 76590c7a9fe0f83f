//! `acceld run`: the daemon. Loads the config, restores the registry from the state file,
//! serves the control socket (`run/control.rs`), optional Prometheus metrics, and stops cleanly on
//! SIGTERM (every drive drained; QEMU left as it is for the next start). Under systemd
//! (`Type=notify`) it says when it serves and when it stops (`run/notify.rs`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use thiserror::Error;
use tokio::net::UnixListener;
use tracing::{info, warn};

use crate::supervisor::{Config, SupError, Supervisor};

mod control;
mod metrics;
pub mod notify;

pub use control::{dispatch, parse_request, MAX_REQUEST};
use control::{handle_client, Scope};
use metrics::serve_metrics;
use notify::{tell, Notifier};

/// Run the supervisor daemon.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// TOML config file (every key optional; see docs/operator-guide.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run directory (overrides the config's run-dir).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
}

#[derive(Debug, Error)]
pub enum RunError {
    #[error("cannot read config {path}")]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path} is invalid: {msg}")]
    BadConfig { path: PathBuf, msg: String },
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot listen on the control socket {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("another acceld serves {0}")]
    AlreadyRunning(PathBuf),
    #[error("cannot listen for metrics on {addr}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Supervisor(#[from] SupError),
}

/// How long the control socket's accept loop waits after a failed accept.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// Failed accepts of the control socket logged (5 per 10 s).
static ACCEPT_LOG: accel_dataplane::util::LogLimit =
    accel_dataplane::util::LogLimit::new(5, Duration::from_secs(10));

pub fn load_config(args: &RunArgs) -> Result<Config, RunError> {
    let mut cfg = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| RunError::ReadConfig {
                path: path.clone(),
                source,
            })?;
            toml::from_str::<Config>(&text).map_err(|e| RunError::BadConfig {
                path: path.clone(),
                msg: e.to_string(),
            })?
        }
        None => Config::default(),
    };
    if let Some(d) = &args.run_dir {
        cfg.run_dir = d.clone();
    }
    if !cfg.run_dir.is_absolute() {
        cfg.run_dir = std::env::current_dir()
            .map(|c| c.join(&cfg.run_dir))
            .unwrap_or_else(|_| cfg.run_dir.clone());
    }
    Ok(cfg)
}

pub fn run(args: &RunArgs) -> Result<(), RunError> {
    let cfg = load_config(args)?;
    // Before the runtime's threads start: this takes NOTIFY_SOCKET out of the environment.
    let notifier = Notifier::take_from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("acceld-sup")
        .build()
        .map_err(RunError::Runtime)?;
    let r = rt.block_on(run_async(cfg, notifier.as_ref()));
    // Tasks still blocked in a drain have been given up on (the shutdown bound).
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

async fn run_async(cfg: Config, notifier: Option<&Notifier>) -> Result<(), RunError> {
    std::fs::create_dir_all(&cfg.run_dir).map_err(|source| RunError::Listen {
        path: cfg.run_dir.clone(),
        source,
    })?;
    {
        use std::os::unix::fs::PermissionsExt;
        // Traversable, not listable: QEMU's user reaches its VM's directory (permits);
        // everything else in it is root's alone.
        let _ = std::fs::set_permissions(&cfg.run_dir, std::fs::Permissions::from_mode(0o711));
    }
    let ctl_path = cfg.control_socket();
    if accel_dataplane::util::socket_listening(&ctl_path) {
        return Err(RunError::AlreadyRunning(ctl_path));
    }
    let _ = std::fs::remove_file(&ctl_path);
    let listener = UnixListener::bind(&ctl_path).map_err(|source| RunError::Listen {
        path: ctl_path.clone(),
        source,
    })?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&ctl_path, std::fs::Permissions::from_mode(0o600));
    }
    let metrics_addr = cfg.metrics_addr;
    let shutdown_timeout_ms = cfg.shutdown_timeout_ms;
    let sup = Supervisor::new(cfg);
    // Every registered VM gets its QMP proxy socket (RUN_DIR/VM/monitor.sock).
    {
        let s = sup.clone();
        let rt = tokio::runtime::Handle::current();
        sup.on_register(Box::new(move |vm: &str| {
            let (s, vm) = (s.clone(), vm.to_string());
            rt.spawn(async move {
                if let Err(e) = crate::qmp_proxy::serve(s, vm.clone()).await {
                    warn!(vm = %vm, "QMP proxy: {}", crate::error_chain(&e));
                }
            });
        }));
    }
    let restored = sup.restore()?;
    info!(control = %ctl_path.display(), restored, "acceld running");

    if let Some(addr) = metrics_addr {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Metrics { addr, source })?;
        let s = sup.clone();
        tokio::spawn(async move { serve_metrics(l, s).await });
        info!(%addr, "metrics on /metrics");
    }
    let s = sup.clone();
    tokio::spawn(async move {
        let mut t = tokio::time::interval(Duration::from_secs(1));
        loop {
            t.tick().await;
            s.sample_rates();
        }
    });

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(RunError::Runtime)?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(RunError::Runtime)?;
    // The control socket is bound, the registry restored, SIGTERM handled: from here on the
    // loop below accepts (what connected meanwhile waits in the listener's backlog).
    tell(notifier, Notifier::ready);
    loop {
        tokio::select! {
            c = listener.accept() => match c {
                Ok((stream, _)) => {
                    // Root's socket (0600), and root's (or acceld's own user's) clients only,
                    // whatever happens to the file's mode or owner.
                    // SAFETY: geteuid has no preconditions and cannot fail.
                    let me = unsafe { libc::geteuid() };
                    match stream.peer_cred() {
                        Ok(c) if c.uid() == 0 || c.uid() == me => {
                            let s = sup.clone();
                            tokio::spawn(async move { handle_client(stream, s, Scope::Root).await });
                        }
                        Ok(c) => warn!(uid = c.uid(), "control socket: refused a client of another user"),
                        Err(e) => warn!("control socket: no peer credentials: {e}"),
                    }
                }
                Err(e) => {
                    // Out of descriptors (or memory), the connection stays in the backlog
                    // and the next accept fails at once: wait instead of spinning.
                    if let Some(n) = ACCEPT_LOG.admit() {
                        warn!("control socket accept: {e}{}", accel_dataplane::util::suppressed(n));
                    }
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
            },
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    tell(notifier, Notifier::stopping);
    let bound = Duration::from_millis(shutdown_timeout_ms);
    info!(
        bound_ms = shutdown_timeout_ms,
        "shutting down: draining every drive"
    );
    accel_dataplane::drive::queue_ctl::abandon_drains_at(std::time::Instant::now() + bound);
    let s = sup.clone();
    let _ = tokio::task::spawn_blocking(move || s.shutdown()).await;
    let _ = std::fs::remove_file(&ctl_path);
    info!("stopped");
    Ok(())
}
