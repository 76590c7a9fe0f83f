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
//! names kept apart per client (`fds`). `exec-oob` is offered when QEMU offers it.
//!
//! Clients are untrusted (docs/security-proxy.md): at most [`MAX_CLIENTS`] per VM, at most
//! [`MAX_OOB_INFLIGHT`] `exec-oob` in flight per client (then the client is not read until one
//! completes), messages framed in linear time up to `MAX_MESSAGE`, and a client that does not
//! read (a write waits longer than `CLIENT_WRITE_TIMEOUT`, or it falls behind QEMU's events) is
//! dropped. Nothing a client does waits on another client's socket.

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
use accel_dataplane::util::LogLimit;
use host::{Host, SupHost};
use state::{Ctx, Shared};
use upstream::{forward, upstream, Via};

#[cfg(test)]
mod alone_tests;
mod fds;
mod hold;
mod host;
mod hotplug;
mod intercept;
mod message;
mod nbd;
mod nbd_filter;
mod state;
mod synth;
mod throttle;
mod upstream;

pub use message::{check_request, ErrorClass, QmpError, Reply, Request, Shape};

/// Largest message a client may send (QEMU's own parser allows 64 MiB per token; no
/// management command comes close to this).
const MAX_MESSAGE: usize = 4 << 20;

/// Clients of one VM's proxy at once; one more is told so and closed (QEMU would not greet
/// it at all).
pub const MAX_CLIENTS: usize = 16;

/// `exec-oob` commands of one client in flight at once; beyond it the proxy stops reading
/// the client until one completes.
pub const MAX_OOB_INFLIGHT: usize = 8;

/// Longest one write to a client may wait for the client to read: a client that does not
/// read its replies and events is dropped then.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

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
    let sup: Arc<dyn Host> = Arc::new(SupHost(sup));
    let path = sup.monitor_socket(&vm);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|source| ProxyError::Listen {
        path: path.clone(),
        source,
    })?;
    // 0600; QEMU's user's when it runs libvirt's monitor relay (permits).
    if let Err(e) = crate::supervisor::secure_own(&path, 0o600, sup.vm_owner(&vm), false) {
        warn!(vm = %vm, "{}", e.chain());
    }
    info!(vm = %vm, socket = %path.display(), "QMP proxy listening");
    let clients = Arc::new(AtomicU64::new(0));
    let log = Arc::new(LogLimit::default());
    let shared = Arc::new(Shared::default());
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        if let Some(k) = log.admit() {
                            warn!(vm = %vm, "QMP proxy: more than {MAX_CLIENTS} clients: refusing one{}", accel_dataplane::util::suppressed(k));
                        }
                        tokio::spawn(refuse(stream));
                        continue;
                    };
                    let n = clients.fetch_add(1, Ordering::Relaxed);
                    let ctx = Ctx { sup: sup.clone(), vm: vm.clone(), shared: shared.clone() };
                    let l = log.clone();
                    tokio::spawn(async move {
                        client(ctx, n, stream, l).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    if let Some(n) = log.admit() {
                        warn!(vm = %vm, "QMP proxy accept: {e}{}", accel_dataplane::util::suppressed(n));
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

/// A client over [`MAX_CLIENTS`]: an error instead of a greeting, and closed.
async fn refuse(mut stream: UnixStream) {
    let e = error_reply(
        "GenericError",
        &format!("acceld's QMP proxy: too many clients on this monitor (at most {MAX_CLIENTS})"),
        None,
    );
    let mut line = serde_json::to_vec(&e).expect("JSON values serialize");
    line.extend_from_slice(b"\r\n");
    let _ = tokio::time::timeout(CLIENT_WRITE_TIMEOUT, stream.write_all(&line)).await;
}

/// A client's write side, and its end: a write that fails or waits too long ends the client.
struct ClientOut {
    w: tokio::sync::Mutex<OwnedWriteHalf>,
    dead: AtomicBool,
    gone: tokio::sync::Notify,
}

type Writer = Arc<ClientOut>;

impl ClientOut {
    fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        self.gone.notify_waiters();
    }
    async fn killed(&self) {
        let n = self.gone.notified();
        if self.dead.load(Ordering::Acquire) {
            return;
        }
        n.await
    }
}

async fn send(w: &Writer, v: &Value) -> bool {
    if w.dead.load(Ordering::Acquire) {
        return false;
    }
    let mut line = serde_json::to_vec(v).expect("JSON values serialize");
    line.extend_from_slice(b"\r\n");
    let ok = tokio::time::timeout(CLIENT_WRITE_TIMEOUT, async {
        w.w.lock().await.write_all(&line).await.is_ok()
    })
    .await
    .unwrap_or(false);
    if !ok {
        w.kill();
    }
    ok
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

async fn client(ctx: Ctx, n: u64, stream: UnixStream, log: Arc<LogLimit>) {
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
    // oob is offered when acceld's own connection has it (QEMU offered it).
    let oob_offered = qmp.oob_enabled();
    let greeting = json!({"QMP": {
        "version": {"qemu": {"major": g.version.qemu.major, "minor": g.version.qemu.minor,
                              "micro": g.version.qemu.micro},
                    "package": g.version.package},
        "capabilities": if oob_offered { json!(["oob"]) } else { json!([]) }
    }});
    let (rd, wr) = stream.into_split();
    let w: Writer = Arc::new(ClientOut {
        w: tokio::sync::Mutex::new(wr),
        dead: AtomicBool::new(false),
        gone: tokio::sync::Notify::new(),
    });
    if !send(&w, &greeting).await {
        return;
    }
    debug!(vm = %vm, client = n, "QMP proxy client connected");
    let negotiated = Arc::new(AtomicBool::new(false));
    let oob_on = Arc::new(AtomicBool::new(false));
    let handled: Handled = Arc::new(AtomicU64::new(0));
    let events = {
        let (sup, vm, w, neg, log, h) = (
            sup.clone(),
            vm.clone(),
            w.clone(),
            negotiated.clone(),
            log.clone(),
            handled.clone(),
        );
        tokio::spawn(async move { forward_events(sup, vm, w, neg, log, h).await })
    };
    // In-band commands run one at a time, in order, in the worker; exec-oob ones at once.
    let (tx, rx) = tokio::sync::mpsc::channel::<Inband>(INBAND_QUEUE);
    let worker = {
        let st = ClientState {
            names: fds::Names::new(n),
            handled: handled.clone(),
            negotiated: negotiated.clone(),
            oob_offered,
            oob_on: oob_on.clone(),
        };
        let (ctx, w) = (ctx.again(), w.clone());
        tokio::spawn(async move { inband(ctx, w, st, rx).await })
    };
    let mut framer = message::Framer::default();
    let oob_slots = Arc::new(tokio::sync::Semaphore::new(MAX_OOB_INFLIGHT));
    let mut chunk = vec![0u8; 64 * 1024];
    let mut pending_fds = std::collections::VecDeque::new();
    // QEMU's monitor closes when QEMU ends, and so does the proxy's: libvirt learns that its
    // VM is gone from this EOF.
    let upstream_gone = async {
        while !qmp.is_closed() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::pin!(upstream_gone);
    'read: loop {
        let r = tokio::select! {
            r = fds::read(&rd, &mut chunk, &mut pending_fds) => r,
            _ = &mut upstream_gone => {
                debug!(vm = %vm, client = n, "QEMU's monitor closed: closing the client");
                break 'read;
            }
            _ = w.killed() => {
                if let Some(k) = log.admit() {
                    warn!(vm = %vm, client = n, "QMP proxy client does not read its replies and events: dropped{}", accel_dataplane::util::suppressed(k));
                }
                break 'read;
            }
        };
        let got = match r {
            Ok(0) | Err(_) => break,
            Ok(k) => k,
        };
        framer.push(&chunk[..got]);
        loop {
            let job = match framer.next() {
                message::Next::More => {
                    if framer.pending() > MAX_MESSAGE {
                        if let Some(k) = log.admit() {
                            warn!(vm = %vm, client = n, "QMP message longer than {MAX_MESSAGE} bytes: closing{}", accel_dataplane::util::suppressed(k));
                        }
                        break 'read;
                    }
                    break;
                }
                message::Next::ParseError(desc) => Inband::ParseError(desc),
                message::Next::Value(v) => {
                    if oob_on.load(Ordering::Acquire) && v.get("exec-oob").is_some() {
                        // Backpressure: at most MAX_OOB_INFLIGHT at once; the client's next
                        // bytes wait in its socket until one completes.
                        let slot = tokio::select! {
                            s = oob_slots.clone().acquire_owned() => s.expect("never closed"),
                            _ = w.killed() => break 'read,
                            _ = &mut upstream_gone => break 'read,
                        };
                        let (ctx, w) = (ctx.again(), w.clone());
                        tokio::spawn(async move {
                            if let Some(r) = out_of_band(&ctx, v).await {
                                send(&w, &r).await;
                            }
                            drop(slot);
                        });
                        continue;
                    }
                    // QEMU keeps a descriptor only for the command it came with.
                    let claims = matches!(v["execute"].as_str(), Some("getfd" | "add-fd"));
                    let fd = if claims {
                        pending_fds.pop_front()
                    } else {
                        None
                    };
                    pending_fds.clear();
                    Inband::Message(v, fd)
                }
            };
            if tx.send(job).await.is_err() {
                break 'read;
            }
        }
    }
    drop(tx);
    if w.dead.load(Ordering::Acquire) {
        // A dropped client sees its end now, not when its last command is done.
        shutdown(&rd);
    }
    // The commands already read still run (QEMU's would); then the client's state goes.
    let _ = worker.await;
    events.abort();
    shutdown(&rd);
    debug!(vm = %vm, client = n, "QMP proxy client gone");
}

/// Ends both directions of a client's socket (the write half may still be held by a task
/// that finishes a command).
fn shutdown(rd: &tokio::net::unix::OwnedReadHalf) {
    use std::os::fd::AsRawFd;
    let s: &UnixStream = rd.as_ref();
    // SAFETY: shutdown(2) on the socket `rd` keeps open; it touches no memory.
    unsafe { libc::shutdown(s.as_raw_fd(), libc::SHUT_RDWR) };
}

/// In-band messages waiting for their turn (QEMU queues 8 and then stops reading a monitor;
/// the proxy stops reading the client when this many wait).
const INBAND_QUEUE: usize = 64;

enum Inband {
    Message(Value, Option<std::os::fd::OwnedFd>),
    ParseError(String),
}

/// A client's in-band commands, one at a time, replies in order.
async fn inband(
    ctx: Ctx,
    w: Writer,
    mut st: ClientState,
    mut rx: tokio::sync::mpsc::Receiver<Inband>,
) {
    let mut writable = true;
    while let Some(job) = rx.recv().await {
        let reply = match job {
            Inband::ParseError(desc) => Some(error_reply("GenericError", &desc, None)),
            Inband::Message(v, fd) => handle(&ctx, &mut st, v, fd).await,
        };
        if let (Some(r), true) = (reply, writable) {
            events_before_reply(&ctx, &st.handled).await;
            writable = send(&w, &r).await;
        }
    }
    // The client's fd names die with it (QEMU's would with its monitor).
    for name in std::mem::take(&mut st.names.held) {
        let args = Map::from_iter([("fdname".to_string(), json!(st.names.upstream(&name)))]);
        let _ = forward(&ctx, "closefd", Some(args)).await;
    }
}

/// An `exec-oob` command of a client that enabled oob: to QEMU out of band at once, ahead of
/// the client's queued in-band commands.
async fn out_of_band(ctx: &Ctx, v: Value) -> Option<Value> {
    match message::check_request(v, true) {
        Shape::Request(r) => Some(run_oob(ctx, r).await),
        Shape::Invalid { desc, id } => Some(error_reply("GenericError", &desc, id.as_ref())),
    }
}

async fn run_oob(ctx: &Ctx, req: Request) -> Value {
    let id = req.id.as_ref();
    let yank = req.execute == "query-yank";
    match upstream(ctx, &req.execute, req.arguments, Via::OutOfBand).await {
        Ok(mut v) => {
            if yank {
                intercept::hide_own_yank(ctx, &mut v);
            }
            return_reply(v, id)
        }
        Err(e) => error_reply(e.class.as_str(), &e.desc, id),
    }
}

/// What the proxy keeps per client besides its socket.
struct ClientState {
    names: fds::Names,
    /// The client's event forwarder's progress (replies keep QEMU's order with events).
    handled: Handled,
    negotiated: Arc<AtomicBool>,
    /// The greeting offered oob, and the client enabled it.
    oob_offered: bool,
    oob_on: Arc<AtomicBool>,
}

/// One message from a client: the reply to send.
async fn handle(
    ctx: &Ctx,
    st: &mut ClientState,
    v: Value,
    fd: Option<std::os::fd::OwnedFd>,
) -> Option<Value> {
    let req = match check_request(v, st.oob_on.load(Ordering::Acquire)) {
        Shape::Request(r) => r,
        Shape::Invalid { desc, id } => {
            return Some(error_reply("GenericError", &desc, id.as_ref()))
        }
    };
    let id = req.id.as_ref();
    if !st.negotiated.load(Ordering::Acquire) {
        if req.execute != "qmp_capabilities" {
            return Some(error_reply(
                "CommandNotFound",
                "Expecting capabilities negotiation with 'qmp_capabilities'",
                id,
            ));
        }
        match message::check_capabilities(&req.arguments, st.oob_offered) {
            Err(e) => return Some(error_reply("GenericError", &e, id)),
            Ok(oob) => st.oob_on.store(oob, Ordering::Release),
        }
        st.negotiated.store(true, Ordering::Release);
        return Some(return_reply(json!({}), id));
    }
    if req.execute == "qmp_capabilities" && !req.oob {
        return Some(error_reply(
            "CommandNotFound",
            "Capabilities negotiation is already complete, command ignored",
            id,
        ));
    }
    if req.oob {
        // Queued before oob was on (it came right after the negotiation): still out of band.
        return Some(run_oob(ctx, req).await);
    }
    let name = req.execute.as_str();
    if let Some(s) = fds::forged(&req.arguments) {
        // Only another client's fd could have this name: as if it did not exist.
        return Some(error_reply(
            "GenericError",
            &format!(
                "acceld's QMP proxy: '{s}': names containing '{}' are reserved",
                fds::MARKER
            ),
            id,
        ));
    }
    let mut args = req.arguments.clone();
    st.names.rewrite(name, &mut args);
    let r = match name {
        "getfd" | "add-fd" => {
            let r = match &fd {
                Some(fd) => upstream(ctx, name, args, Via::Fd(fd)).await,
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
        Err(e) => error_reply(e.class.as_str(), &st.names.restore(&e.desc), id),
    })
}

/// Events this client's forwarder has passed on (or skipped), by `Event::seq`: a reply waits
/// for the events QEMU sent before it (QEMU's order; libvirt's `migrate-incoming` relies on
/// its MIGRATION `setup` event arriving before the reply).
type Handled = Arc<AtomicU64>;

/// Longest a `DEVICE_DELETED` event waits for the end of the drive whose device it names.
const UNPLUG_WAIT: Duration = Duration::from_secs(15);

/// Longest a reply waits for the events before it.
const EVENT_ORDER_WAIT: Duration = Duration::from_millis(200);

async fn events_before_reply(ctx: &Ctx, handled: &Handled) {
    let Ok(qmp) = ctx.sup.vm_qmp(&ctx.vm) else {
        return;
    };
    let mark = qmp.events_sent();
    let t0 = std::time::Instant::now();
    while handled.load(Ordering::Acquire) < mark && t0.elapsed() < EVENT_ORDER_WAIT {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn forward_events(
    sup: Arc<dyn Host>,
    vm: String,
    w: Writer,
    negotiated: Arc<AtomicBool>,
    log: Arc<LogLimit>,
    handled: Handled,
) {
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
        // Events before the subscription are not this client's to wait for.
        handled.store(qmp.events_sent(), Ordering::Release);
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    let seq = ev.seq;
                    let open = forward_one(&*sup, &vm, &w, &negotiated, &log, ev).await;
                    handled.fetch_max(seq, Ordering::Release);
                    if !open {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(k)) => {
                    // More events wait for this client than acceld keeps: it does not read.
                    // QEMU would buffer without bound; the proxy drops the client instead of
                    // losing events silently.
                    handled.fetch_max(qmp.events_sent(), Ordering::Release);
                    if negotiated.load(Ordering::Acquire) {
                        if let Some(n) = log.admit() {
                            warn!(vm = %vm, missed = k, "QMP proxy client fell behind QEMU's events{}", accel_dataplane::util::suppressed(n));
                        }
                        w.kill();
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Passes one event on (unless it is acceld's own); false when the client is gone.
async fn forward_one(
    sup: &dyn Host,
    vm: &str,
    w: &Writer,
    negotiated: &AtomicBool,
    log: &LogLimit,
    ev: qmp_client::Event,
) -> bool {
    if !negotiated.load(Ordering::Acquire) || own_event(&ev) {
        return true;
    }
    if ev.name == "MIGRATION" && ev.data["status"] == "pre-switchover" {
        if !sup.management_owns_pause(vm) {
            // acceld's own pause: management did not ask for it, and acceld continues the
            // migration itself.
            return true;
        }
        // Management continues the migration when it sees this: acceld's part (its
        // exports off the nodes) must be done first.
        if !sup
            .pre_switchover_done(vm, ev.timestamp, Duration::from_secs(30))
            .await
        {
            if let Some(k) = log.admit() {
                warn!(vm = %vm, "pre-switchover: acceld's part did not finish in 30 s; passing the event on{}", accel_dataplane::util::suppressed(k));
            }
        }
    }
    if ev.name == "DEVICE_DELETED" {
        if let Some(dev) = ev.data["device"].as_str() {
            // A drive's device: management deletes the drive's nodes when it sees this, so
            // the drive ends and QEMU has its nodes back first.
            if tokio::time::timeout(UNPLUG_WAIT, sup.unplug(vm, dev))
                .await
                .is_err()
            {
                if let Some(k) = log.admit() {
                    warn!(vm = %vm, device = dev, "DEVICE_DELETED: acceld's part did not finish in {UNPLUG_WAIT:?}; passing the event on{}", accel_dataplane::util::suppressed(k));
                }
            }
        }
    }
    let mut v = json!({"event": ev.name, "data": ev.data,
        "timestamp": {"seconds": ev.timestamp.0, "microseconds": ev.timestamp.1}});
    if v["data"].is_null() {
        v.as_object_mut().expect("object").remove("data");
    }
    send(w, &v).await
}
