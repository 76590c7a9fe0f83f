//! The QMP proxy: management talks to `RUN_DIR/VM/monitor.sock` as if it were QEMU's monitor.
//!
//! Per client: QEMU's own greeting, negotiation on its own (`qmp_capabilities`), commands in
//! order, each forwarded over acceld's one QMP connection to QEMU with a proxy-unique id (the
//! client's id, any JSON value or none, comes back exactly), events from QEMU to every
//! negotiated client except those acceld's own work causes. Many clients at once (QEMU takes
//! one per monitor socket). Commands that name an accelerated drive where QEMU would fail or
//! answer for nothing go to `intercept` (docs/qmp-proxy.md).
//!
//! File descriptors (SCM_RIGHTS) go to QEMU with the `getfd`/`add-fd` that claims them, fd
//! names kept apart per client (`fds`). Not yet: `exec-oob` (the greeting offers no `oob`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};
use thiserror::Error;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

use crate::supervisor::Supervisor;
use crate::util::LogLimit;

mod fds;
mod hold;
mod intercept;
mod message;
mod nbd;
mod synth;
mod throttle;

/// What every client of a VM's proxy shares: the drives held on QEMU's block layer and
/// management's NBD server.
#[derive(Default)]
pub struct Shared {
    holds: hold::Holds,
    nbd: nbd::MgmtNbd,
}

pub use message::{check_request, Request, Shape};

/// Largest message a client may send (QEMU's own parser allows 64 MiB per token; no
/// management command comes close to this).
const MAX_MESSAGE: usize = 16 << 20;

/// A forwarded command may take long (savevm, a big transaction): QEMU's own monitor has no
/// timeout at all.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(3600);

#[derive(Debug, Error)]
pub enum ProxyError {
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Serves a VM's proxy socket until the VM is unregistered.
pub async fn serve(sup: Arc<Supervisor>, vm: String) -> Result<(), ProxyError> {
    let path = sup.monitor_socket(&vm);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|source| ProxyError::Listen {
        path: path.clone(),
        source,
    })?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    }
    info!(vm = %vm, socket = %path.display(), "QMP proxy listening");
    let clients = Arc::new(AtomicU64::new(0));
    let log = Arc::new(LogLimit::default());
    let shared = Arc::new(Shared::default());
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let n = clients.fetch_add(1, Ordering::Relaxed);
                    let ctx = intercept::Ctx { sup: sup.clone(), vm: vm.clone(), shared: shared.clone() };
                    let l = log.clone();
                    tokio::spawn(async move { client(ctx, n, stream, l).await });
                }
                Err(e) => {
                    if let Some(n) = log.admit() {
                        warn!(vm = %vm, "QMP proxy accept: {e}{}", crate::util::suppressed(n));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = tick.tick() => {
                if !sup.vm_names().contains(&vm) {
                    // forget_vm removed the socket; a re-registration started a new proxy.
                    debug!(vm = %vm, "QMP proxy ends: VM unregistered");
                    nbd::shutdown(&shared.nbd).await;
                    return Ok(());
                }
            }
        }
    }
}

type Writer = Arc<tokio::sync::Mutex<OwnedWriteHalf>>;

async fn send(w: &Writer, v: &Value) -> bool {
    let mut line = serde_json::to_vec(v).expect("JSON values serialize");
    line.extend_from_slice(b"\r\n");
    w.lock().await.write_all(&line).await.is_ok()
}

/// `{"error": …}` with the client's id (when it gave one).
fn error_reply(class: &str, desc: &str, id: Option<&Value>) -> Value {
    let mut r = json!({"error": {"class": class, "desc": desc}});
    if let Some(id) = id {
        r["id"] = id.clone();
    }
    r
}

fn return_reply(v: Value, id: Option<&Value>) -> Value {
    let mut r = Value::Object(Map::from_iter([("return".to_string(), v)]));
    if let Some(id) = id {
        r["id"] = id.clone();
    }
    r
}

/// Events acceld's own work on QEMU causes (its exports, mirror jobs): not management's.
fn own_event(ev: &qmp_client::Event) -> bool {
    let named = |k: &str| ev.data[k].as_str().is_some_and(|s| s.starts_with("accel-"));
    match ev.name.as_str() {
        "BLOCK_EXPORT_DELETED" => named("id"),
        "JOB_STATUS_CHANGE" => named("id"),
        "BLOCK_JOB_READY"
        | "BLOCK_JOB_COMPLETED"
        | "BLOCK_JOB_CANCELLED"
        | "BLOCK_JOB_ERROR"
        | "BLOCK_JOB_PENDING" => named("device") || named("id"),
        _ => false,
    }
}

async fn client(ctx: intercept::Ctx, n: u64, stream: UnixStream, log: Arc<LogLimit>) {
    let (sup, vm) = (ctx.sup.clone(), ctx.vm.clone());
    // QEMU's greeting needs QEMU: wait for acceld to be attached (the client waits as it would
    // for a QEMU that is starting).
    let qmp = loop {
        match sup.vm_qmp(&vm) {
            Ok(q) => break q,
            Err(_) if sup.vm_names().contains(&vm) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(_) => return,
        }
    };
    let g = qmp.greeting();
    let greeting = json!({"QMP": {
        "version": {"qemu": {"major": g.version.qemu.major, "minor": g.version.qemu.minor,
                              "micro": g.version.qemu.micro},
                    "package": g.version.package},
        // oob is not offered: the proxy does not forward exec-oob yet.
        "capabilities": []
    }});
    let (rd, wr) = stream.into_split();
    let w: Writer = Arc::new(tokio::sync::Mutex::new(wr));
    if !send(&w, &greeting).await {
        return;
    }
    debug!(vm = %vm, client = n, "QMP proxy client connected");
    let negotiated = Arc::new(AtomicBool::new(false));
    let events = {
        let (sup, vm, w, neg) = (sup.clone(), vm.clone(), w.clone(), negotiated.clone());
        tokio::spawn(async move { forward_events(sup, vm, w, neg).await })
    };
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut st = ClientState {
        fds: std::collections::VecDeque::new(),
        names: fds::Names::new(n),
    };
    'read: loop {
        let got = match fds::read(&rd, &mut chunk, &mut st.fds).await {
            Ok(0) | Err(_) => break,
            Ok(k) => k,
        };
        buf.extend_from_slice(&chunk[..got]);
        loop {
            match message::next(&mut buf) {
                message::Next::More => {
                    if buf.len() > MAX_MESSAGE {
                        if let Some(k) = log.admit() {
                            warn!(vm = %vm, client = n, "QMP message longer than {MAX_MESSAGE} bytes: closing{}", crate::util::suppressed(k));
                        }
                        break 'read;
                    }
                    break;
                }
                message::Next::ParseError(desc) => {
                    if !send(&w, &error_reply("GenericError", &desc, None)).await {
                        break 'read;
                    }
                }
                message::Next::Value(v) => {
                    let reply = handle(&ctx, &negotiated, &mut st, v).await;
                    if let Some(r) = reply {
                        if !send(&w, &r).await {
                            break 'read;
                        }
                    }
                }
            }
        }
    }
    events.abort();
    // The client's fd names die with it (QEMU's would with its monitor).
    for name in std::mem::take(&mut st.names.held) {
        let args = Map::from_iter([("fdname".to_string(), json!(st.names.upstream(&name)))]);
        let _ = forward(&ctx, "closefd", Some(args)).await;
    }
    debug!(vm = %vm, client = n, "QMP proxy client gone");
}

/// What the proxy keeps per client besides its socket.
struct ClientState {
    /// Descriptors received and not claimed yet.
    fds: std::collections::VecDeque<std::os::fd::OwnedFd>,
    names: fds::Names,
}

/// One message from a client: the reply to send.
async fn handle(
    ctx: &intercept::Ctx,
    negotiated: &AtomicBool,
    st: &mut ClientState,
    v: Value,
) -> Option<Value> {
    let req = match check_request(v) {
        Shape::Request(r) => r,
        Shape::Invalid { desc, id } => {
            return Some(error_reply("GenericError", &desc, id.as_ref()))
        }
    };
    let id = req.id.as_ref();
    if !negotiated.load(Ordering::Acquire) {
        if req.execute != "qmp_capabilities" {
            return Some(error_reply(
                "CommandNotFound",
                "Expecting capabilities negotiation with 'qmp_capabilities'",
                id,
            ));
        }
        if let Some(e) = message::check_capabilities(&req.arguments) {
            return Some(error_reply("GenericError", &e, id));
        }
        negotiated.store(true, Ordering::Release);
        return Some(return_reply(json!({}), id));
    }
    if req.execute == "qmp_capabilities" {
        return Some(error_reply(
            "CommandNotFound",
            "Capabilities negotiation is already complete, command ignored",
            id,
        ));
    }
    let name = req.execute.as_str();
    let mut args = req.arguments.clone();
    st.names.rewrite(name, &mut args);
    let r = match name {
        "getfd" | "add-fd" => {
            let r = match st.fds.pop_front() {
                Some(fd) => forward_with_fd(ctx, name, args, &fd).await,
                // QEMU's own answer: no descriptor came.
                None => forward(ctx, name, args).await,
            };
            if let (Ok(_), "getfd") = (&r, name) {
                if let Some(n) = req.arguments.as_ref().and_then(|a| a["fdname"].as_str()) {
                    if !st.names.held.iter().any(|h| h == n) {
                        st.names.held.push(n.to_string());
                    }
                }
            }
            r
        }
        _ => {
            // QEMU keeps a descriptor only for the command it came with.
            st.fds.clear();
            let r = intercept::command(ctx, name, args).await;
            if let (Ok(_), "closefd") = (&r, name) {
                if let Some(n) = req.arguments.as_ref().and_then(|a| a["fdname"].as_str()) {
                    st.names.held.retain(|h| h != n);
                }
            }
            r
        }
    };
    Some(match r {
        Ok(v) => return_reply(v, id),
        Err((class, desc)) => error_reply(&class, &st.names.restore(&desc), id),
    })
}

/// [`forward`] with a file descriptor passed along.
async fn forward_with_fd(
    ctx: &intercept::Ctx,
    name: &str,
    args: Option<Map<String, Value>>,
    fd: &std::os::fd::OwnedFd,
) -> Result<Value, (String, String)> {
    use std::os::fd::AsFd;
    let qmp = ctx.sup.vm_qmp(&ctx.vm).map_err(|e| {
        (
            "GenericError".to_string(),
            format!("acceld's QMP proxy: {}", e.chain()),
        )
    })?;
    match qmp
        .execute_raw_with_fd(name, args.map(Value::Object), FORWARD_TIMEOUT, fd.as_fd())
        .await
    {
        Ok(v) => Ok(v),
        Err(qmp_client::QmpError::Qemu { class, desc, .. }) => Err((class, desc)),
        Err(e) => Err((
            "GenericError".to_string(),
            format!("acceld's QMP proxy: QEMU did not answer: {e}"),
        )),
    }
}

/// Forwards a command to QEMU as it is; QEMU's answer, error class and text included.
pub(crate) async fn forward(
    ctx: &intercept::Ctx,
    name: &str,
    args: Option<Map<String, Value>>,
) -> Result<Value, (String, String)> {
    let qmp = ctx.sup.vm_qmp(&ctx.vm).map_err(|e| {
        (
            "GenericError".to_string(),
            format!("acceld's QMP proxy: {}", e.chain()),
        )
    })?;
    match qmp
        .execute_raw_timeout(name, args.map(Value::Object), FORWARD_TIMEOUT)
        .await
    {
        Ok(v) => Ok(v),
        Err(qmp_client::QmpError::Qemu { class, desc, .. }) => Err((class, desc)),
        Err(e) => Err((
            "GenericError".to_string(),
            format!("acceld's QMP proxy: QEMU did not answer: {e}"),
        )),
    }
}

async fn forward_events(sup: Arc<Supervisor>, vm: String, w: Writer, negotiated: Arc<AtomicBool>) {
    loop {
        // The connection to QEMU can be replaced (acceld re-attached): follow the current one.
        let Ok(qmp) = sup.vm_qmp(&vm) else {
            if !sup.vm_names().contains(&vm) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut rx = qmp.events();
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    if !negotiated.load(Ordering::Acquire) || own_event(&ev) {
                        continue;
                    }
                    if ev.name == "MIGRATION" && ev.data["status"] == "pre-switchover" {
                        if !sup.management_owns_pause(&vm) {
                            // acceld's own pause: management did not ask for it, and acceld
                            // continues the migration itself.
                            continue;
                        }
                        // Management continues the migration when it sees this: acceld's
                        // part (its exports off the nodes) must be done first.
                        if !sup
                            .pre_switchover_done(&vm, ev.timestamp, Duration::from_secs(30))
                            .await
                        {
                            warn!(vm = %vm, "pre-switchover: acceld's part did not finish in 30 s; passing the event on");
                        }
                    }
                    let v = json!({"event": ev.name, "data": ev.data,
                        "timestamp": {"seconds": ev.timestamp.0, "microseconds": ev.timestamp.1}});
                    let v = if v["data"].is_null() {
                        let mut v = v;
                        v.as_object_mut().expect("object").remove("data");
                        v
                    } else {
                        v
                    };
                    if !send(&w, &v).await {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
