//! Management's NBD server, virtualized. QEMU has one NBD server, and acceld's qemu engine
//! uses it (on acceld's socket in the VM's run dir); a real `nbd-server-stop` would delete
//! every NBD export, acceld's included, and fail the guest's I/O. So the proxy answers
//! `nbd-server-start`/`-stop` itself: it listens on management's address and pipes each
//! connection to QEMU's server, where management's exports (`block-export-add`, forwarded)
//! live next to acceld's. Management's stop closes its listener and connections and deletes
//! the NBD exports management added, as QEMU's own stop would; acceld's stay.

use std::path::PathBuf;

use serde_json::{json, Map, Value};
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tracing::{debug, info};

use super::nbd_filter;
use super::state::{Ctx, MgmtNbd, Server};
use super::upstream::forward;

/// Connections of management's NBD server at once, whatever `max-connections` says (each is
/// a connection to QEMU and a task in acceld).
const MAX_CONNS: u64 = 64;
/// Longest the option phase of one connection may take (QEMU's own server allows 10 s).
const NEGOTIATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a unix path for management's server is refused: one of acceld's own sockets (or a
/// link, or not a socket), whose removal and re-binding would loop the proxy into acceld's
/// own upstream or take a socket acceld serves. QEMU-style text.
fn refused_path(ctx: &Ctx, upstream: &std::path::Path, path: &str) -> Option<String> {
    let p = std::path::Path::new(path);
    let in_use = || {
        Some(format!(
            "Failed to bind socket to {path}: Address already in use"
        ))
    };
    if let Ok(m) = std::fs::symlink_metadata(p) {
        use std::os::unix::fs::FileTypeExt;
        if !m.file_type().is_socket() {
            // A link, or a file that is no socket: QEMU's bind would fail on it too (acceld
            // does not remove it).
            return in_use();
        }
    }
    // The same file whatever the spelling: compare the canonical directory and the name.
    let canon = |q: &std::path::Path| -> Option<PathBuf> {
        let dir = q.parent().filter(|d| !d.as_os_str().is_empty())?;
        Some(std::fs::canonicalize(dir).ok()?.join(q.file_name()?))
    };
    let want = canon(p)?;
    let vm_dir = ctx.sup.run_dir().join(&ctx.vm);
    let mut own: Vec<PathBuf> = vec![
        upstream.to_path_buf(),
        ctx.sup.monitor_socket(&ctx.vm),
        vm_dir.join("control.sock"),
        vm_dir.join("qemu-qmp.sock"),
        vm_dir.join("nbd.sock"),
        ctx.sup.control_socket(),
    ];
    if let Ok(q) = ctx.sup.vm_qmp(&ctx.vm) {
        own.push(q.path().to_path_buf());
    }
    for d in ctx.drives() {
        own.push(d.socket.clone());
        own.push(vm_dir.join(format!("{}.sock", d.drive)));
        own.push(vm_dir.join(format!("lend-{}.sock", d.drive)));
    }
    let hit = own
        .iter()
        .any(|o| canon(o).is_some_and(|c| c == want) || o == p);
    hit.then(|| {
        format!("Failed to bind socket to {path}: acceld's QMP proxy: the path is one of acceld's own sockets")
    })
}

use super::message::{QmpError, Reply};

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// `nbd-server-start` from management.
pub async fn start(ctx: &Ctx, args: Option<Map<String, Value>>) -> Reply {
    let mut guard = ctx.shared.nbd.server.lock().await;
    // acceld's server runs on acceld's socket (started now if no drive needed it yet). QEMU
    // then checks the arguments (its own texts) and refuses the second start: that refusal
    // says the arguments are valid.
    let upstream = ctx.sup.ensure_nbd_server(&ctx.vm).await.map_err(|e| {
        QmpError::generic(format!(
            "acceld: cannot start QEMU's NBD server: {}",
            e.chain()
        ))
    })?;
    match forward(ctx, "nbd-server-start", args.clone()).await {
        Err(e) if e.is_generic("NBD server already running") => {}
        Err(e) => return Err(e),
        Ok(_) => return Err(QmpError::generic(
            "acceld: QEMU started a second NBD server (unexpected); stop it with nbd-server-stop",
        )),
    }
    if guard.is_some() {
        return Err(QmpError::generic("NBD server already running"));
    }
    let a = args.unwrap_or_default();
    for k in ["tls-creds", "tls-authz"] {
        if a.get(k).is_some_and(|v| !v.is_null()) {
            return Err(QmpError::generic(format!(
                "acceld's QMP proxy: '{k}' is not supported for management's NBD server on an accelerated VM yet"
            )));
        }
    }
    let max = a
        .get("max-connections")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let addr = &a["addr"];
    let data = &addr["data"];
    let (listener, unix_path) = match addr["type"].as_str() {
        Some("unix") => {
            let Some(path) = data["path"].as_str() else {
                return Err(QmpError::generic("acceld's QMP proxy: a unix address needs a path"));
            };
            if data["abstract"] == true {
                return Err(QmpError::generic(
                    "acceld's QMP proxy: abstract unix sockets are not supported yet",
                ));
            }
            // acceld binds as root: for a VM whose QEMU is not, only in the VM's own
            // directory (the parent is root's run dir, so no link leads elsewhere).
            if ctx.sup.vm_owner(&ctx.vm).is_some() {
                let dir = ctx.sup.run_dir().join(&ctx.vm);
                let p = std::path::Path::new(path);
                let plain = p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n != ".." && n != ".");
                if p.parent() != Some(dir.as_path()) || !plain {
                    return Err(QmpError::generic(format!(
                        "acceld's QMP proxy: QEMU does not run as root here: the NBD server's socket must be in {}",
                        dir.display()
                    )));
                }
            }
            if let Some(e) = refused_path(ctx, &upstream, path) {
                return Err(QmpError::generic(e));
            }
            let _ = std::fs::remove_file(path);
            let l = UnixListener::bind(path).map_err(|e| {
                QmpError::generic(format!("Failed to bind socket to {path}: {e}"))
            })?;
            (Listener::Unix(l), Some(PathBuf::from(path)))
        }
        Some("inet") => {
            let host = data["host"].as_str().unwrap_or("");
            let port = data["port"].as_str().unwrap_or("");
            let n = port.parse::<u16>().unwrap_or(0);
            if ctx.sup.vm_owner(&ctx.vm).is_some() && n != 0 && n < 1024 {
                return Err(QmpError::generic(format!(
                    "acceld's QMP proxy: QEMU does not run as root here: port {n} is privileged"
                )));
            }
            let l = TcpListener::bind((host, port.parse::<u16>().unwrap_or(0)))
                .await
                .map_err(|e| QmpError::generic(format!("Failed to bind socket to {host}:{port}: {e}")))?;
            (Listener::Tcp(l), None)
        }
        other => {
            return Err(QmpError::generic(format!(
                "acceld's QMP proxy: NBD server address type {} is not supported yet (unix and inet are)",
                other.unwrap_or("?")
            )))
        }
    };
    if let Some(n) = ctx.shared.log.admit() {
        info!(vm = %ctx.vm, ?unix_path, "management's NBD server starts (piped to QEMU's server){}", accel_dataplane::util::suppressed(n));
    }
    let task = tokio::spawn(serve(listener, upstream, max));
    *guard = Some(Server {
        task,
        unix_path,
        exports: Vec::new(),
    });
    Ok(json!({}))
}

async fn serve(l: Listener, upstream: PathBuf, max: u64) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let client: Box<dyn Pipe> = match &l {
            Listener::Unix(u) => match u.accept().await {
                Ok((s, _)) => Box::new(s),
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            Listener::Tcp(t) => match t.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    Box::new(s)
                }
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let cap = if max > 0 {
            max.min(MAX_CONNS)
        } else {
            MAX_CONNS
        };
        if conns.len() as u64 >= cap {
            // QEMU stops listening at the limit; a client past it is closed at once.
            drop(client);
            continue;
        }
        let up = upstream.clone();
        conns.spawn(async move {
            let mut client = client;
            match UnixStream::connect(&up).await {
                Ok(mut server) => {
                    // acceld's own exports do not exist for management (nbd_filter).
                    let r = tokio::time::timeout(
                        NEGOTIATION_TIMEOUT,
                        nbd_filter::negotiate(&mut client, &mut server),
                    )
                    .await;
                    match r {
                        Ok(Ok(())) => {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                        Ok(Err(e)) => debug!("management NBD client: {e}"),
                        Err(_) => debug!("management NBD client: option phase too long"),
                    }
                }
                Err(e) => debug!("management NBD client: QEMU's server: {e}"),
            }
        });
    }
    // JoinSet aborts the connections when the task is aborted (dropped).
}

trait Pipe: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Pipe for T {}

/// `nbd-server-stop` from management.
pub async fn stop(ctx: &Ctx) -> Reply {
    let Some(s) = ctx.shared.nbd.server.lock().await.take() else {
        return Err(QmpError::generic("NBD server not running"));
    };
    s.task.abort();
    let _ = s.task.await;
    if let Some(p) = &s.unix_path {
        let _ = std::fs::remove_file(p);
    }
    for id in &s.exports {
        let r = forward(
            ctx,
            "block-export-del",
            Some(Map::from_iter([
                ("id".to_string(), json!(id)),
                ("mode".to_string(), json!("hard")),
            ])),
        )
        .await;
        if let Err(e) = r {
            debug!(vm = %ctx.vm, export = %id, "management's export at NBD stop: {e}");
        }
    }
    if let Some(n) = ctx.shared.log.admit() {
        info!(vm = %ctx.vm, "management's NBD server stopped{}", accel_dataplane::util::suppressed(n));
    }
    Ok(json!({}))
}

/// Stops management's server when the VM goes away.
pub async fn shutdown(n: &MgmtNbd) {
    if let Some(s) = n.server.lock().await.take() {
        s.task.abort();
        if let Some(p) = &s.unix_path {
            let _ = std::fs::remove_file(p);
        }
    }
}
