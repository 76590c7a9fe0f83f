//! The control socket's requests (`accel_api::control`): one JSON object per line, answered
//! by the supervisor. acceld's own socket (root's) takes every request; a VM's own socket
//! (`RUN_DIR/VM/control.sock`, served to QEMU's user while the VM has a permit) takes only
//! that VM's `register`, `unregister` and `status`.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tracing::{info, warn};

use crate::control::{ErrorKind, Reply, Request};
use crate::supervisor::offload::blocking;
use crate::supervisor::{Owner, SupError, Supervisor};
use accel_dataplane::util::LogLimit;

/// Which socket a client came on.
#[derive(Clone, Debug)]
pub(super) enum Scope {
    /// acceld's own control socket (root only).
    Root,
    /// The VM's own socket, for the permit of this generation only.
    Vm(String, u64),
}

/// Longest request line on a VM's own socket (a registration is a few KiB).
const MAX_VM_REQUEST: usize = 64 << 10;
/// Clients at once on a VM's own socket (the wrapper uses one).
const MAX_VM_CLIENTS: usize = 4;
/// A client of a VM's own socket that sends nothing this long is dropped.
const VM_IDLE: Duration = Duration::from_secs(60);

/// Longest request line; a client that sends more gets an error and is disconnected.
pub const MAX_REQUEST: usize = 1 << 20;

/// Parses one request line into a request, or the reply that refuses it.
pub fn parse_request(line: &[u8]) -> Result<Request, Reply> {
    serde_json::from_slice::<Request>(line)
        .map_err(|e| Reply::err(ErrorKind::Invalid, format!("bad request: {e}")))
}

pub(super) async fn handle_client(stream: UnixStream, sup: Arc<Supervisor>, scope: Scope) {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    let max = match scope {
        Scope::Root => MAX_REQUEST,
        Scope::Vm(..) => MAX_VM_REQUEST,
    };
    loop {
        line.clear();
        let mut limited = (&mut r).take(max as u64 + 1);
        let read = limited.read_until(b'\n', &mut line);
        let n = match &scope {
            Scope::Root => read.await,
            Scope::Vm(..) => tokio::time::timeout(VM_IDLE, read).await.unwrap_or(Ok(0)),
        };
        let n = match n {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let too_long = n > max;
        if line.iter().all(u8::is_ascii_whitespace) && !too_long {
            continue;
        }
        let reply = if too_long {
            Reply::err(
                ErrorKind::Invalid,
                format!("request longer than {max} bytes"),
            )
        } else {
            match parse_request(&line) {
                Ok(req) => match &scope {
                    Scope::Root => dispatch(&sup, req).await,
                    Scope::Vm(vm, generation) => dispatch_vm(&sup, vm, *generation, req).await,
                },
                Err(reply) => reply,
            }
        };
        let mut out = serde_json::to_string(&reply).expect("replies serialize");
        out.push('\n');
        if w.write_all(out.as_bytes()).await.is_err() || too_long {
            return;
        }
    }
}

fn json<T: serde::Serialize>(r: Result<T, SupError>) -> Result<serde_json::Value, SupError> {
    r.map(|v| serde_json::to_value(v).expect("replies serialize"))
}

pub async fn dispatch(sup: &Arc<Supervisor>, req: Request) -> Reply {
    use policy::Pin;
    let res = match req {
        Request::Register {
            vm,
            qmp,
            drives,
            cont,
            incoming,
        } => {
            let s = sup.clone();
            json(blocking(move || s.register(vm, qmp, drives, cont, incoming, None)).await)
        }
        Request::Unregister { vm } => json(sup.unregister(&vm, false).await),
        Request::Permit {
            vm,
            uid,
            gid,
            images,
        } => {
            // It resolves and stats the images (a path may be slow to resolve).
            let (s, v) = (sup.clone(), vm.clone());
            let r = blocking(move || s.permit(&v, Owner { uid, gid }, &images)).await;
            if let Ok(p) = &r {
                // Bound before the reply: the wrapper may connect as soon as the hook returns.
                match bind_vm_socket(&p.socket, Owner { uid, gid }) {
                    Ok(l) => {
                        tokio::spawn(serve_vm_socket(sup.clone(), vm, p.generation, l));
                    }
                    Err(e) => {
                        sup.end_permit(&vm);
                        return Reply::err(ErrorKind::Failed, crate::error_chain(&e));
                    }
                }
            }
            json(r)
        }
        Request::Migrate { vm, uri } => json(sup.migrate(&vm, &uri).await),
        Request::MigrationStatus { vm } => json(sup.migration_status(&vm).await),
        Request::MirrorTarget { vm, drive } => json(sup.mirror_target_export(&vm, &drive).await),
        Request::MirrorTo {
            vm,
            drive,
            socket,
            export,
        } => json(sup.mirror_to(&vm, &drive, &socket, &export).await),
        Request::QuitMigrated { vm } => json(sup.quit_migrated(&vm).await),
        Request::Attach { vm } => json(sup.attach(&vm)),
        Request::Detach { vm } => json(sup.detach(&vm)),
        Request::Status => json(Ok(sup.status())),
        Request::Explain { vm, drive } => json(sup.explain(&vm, &drive).await),
        Request::Accelerate { vm, drive, pin } => {
            let p = if pin { Some(Pin::Direct) } else { None };
            json(sup.set_pin(&vm, &drive, p, pin).await)
        }
        Request::Handback { vm, drive, pin } => {
            json(sup.set_pin(&vm, &drive, Some(Pin::Qemu), pin).await)
        }
        Request::Resume { vm, drive } => json(sup.resume(&vm, &drive)),
        Request::Throttle { vm, drive, limits } => {
            json(sup.set_throttle(&vm, &drive, limits).await)
        }
        Request::QemuArgs { vm, memory } => json(sup.qemu_args(&vm, &memory)),
    };
    match res {
        Ok(v) => Reply::ok(v),
        Err(e) => Reply::err(e.kind(), e.chain()),
    }
}

/// A request on VM `vm`'s own socket: its registration (checked against its permit), its
/// unregistration (the wrapper replacing a lost one; the permit stays) and its status.
pub async fn dispatch_vm(sup: &Arc<Supervisor>, vm: &str, generation: u64, req: Request) -> Reply {
    // Every request, not just the registration: a connection outlives its permit.
    if sup.permit_of(vm).is_none_or(|p| p.generation != generation) {
        return Reply::err(
            ErrorKind::Denied,
            format!("VM {vm}'s permit this connection was made under has ended"),
        );
    }
    let res = match req {
        Request::Register {
            vm: name,
            qmp,
            mut drives,
            cont,
            incoming,
        } if name == vm => {
            // Both resolve and stat the images, off the runtime.
            let s = sup.clone();
            json(
                blocking(move || {
                    let owner = s.check_permitted(&name, &qmp, &mut drives)?;
                    s.register(name, qmp, drives, cont, incoming, Some(owner))
                })
                .await,
            )
        }
        Request::Unregister { vm: name } if name == vm => json(sup.unregister(vm, true).await),
        Request::Status => {
            let mut st = sup.status();
            st.vms.retain(|v| v.vm == vm);
            json(Ok(st))
        }
        _ => Err(SupError::Denied(format!(
            "VM {vm}'s control socket takes only register, unregister and status of {vm}"
        ))),
    };
    match res {
        Ok(v) => Reply::ok(v),
        Err(e) => Reply::err(e.kind(), e.chain()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmSocketError {
    #[error("cannot listen on {path}")]
    Listen {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot give {path} to uid {uid}")]
    Chown {
        path: std::path::PathBuf,
        uid: u32,
        #[source]
        source: std::io::Error,
    },
}

/// Binds the VM's own control socket, the owner's alone (0600).
fn bind_vm_socket(path: &std::path::Path, owner: Owner) -> Result<UnixListener, VmSocketError> {
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path).map_err(|source| VmSocketError::Listen {
        path: path.to_path_buf(),
        source,
    })?;
    crate::supervisor::secure_own(path, 0o600, Some(owner), false).map_err(|e| {
        VmSocketError::Chown {
            path: path.to_path_buf(),
            uid: owner.uid,
            source: std::io::Error::other(e.chain()),
        }
    })?;
    Ok(l)
}

/// Serves the VM's own control socket while its permit (this generation of it) lasts. Only
/// the permit's user (or root) may talk on it, whatever the file's mode. (A boxed future: it
/// spawns `handle_client`, whose `dispatch` spawns it.)
fn serve_vm_socket(
    sup: Arc<Supervisor>,
    vm: String,
    generation: u64,
    l: UnixListener,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(serve_vm_socket_loop(sup, vm, generation, l))
}

async fn serve_vm_socket_loop(sup: Arc<Supervisor>, vm: String, generation: u64, l: UnixListener) {
    let log = LogLimit::default();
    let clients = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            r = l.accept() => match r {
                Ok((stream, _)) => {
                    let Some(p) = sup.permit_of(&vm).filter(|p| p.generation == generation) else {
                        break;
                    };
                    match stream.peer_cred() {
                        Ok(c) if c.uid() == 0 || c.uid() == p.owner.uid => {
                            use std::sync::atomic::Ordering;
                            if clients.fetch_add(1, Ordering::AcqRel) >= MAX_VM_CLIENTS {
                                clients.fetch_sub(1, Ordering::AcqRel);
                                continue;
                            }
                            let (s, scope) = (sup.clone(), Scope::Vm(vm.clone(), generation));
                            let n = clients.clone();
                            tokio::spawn(async move {
                                handle_client(stream, s, scope).await;
                                n.fetch_sub(1, Ordering::AcqRel);
                            });
                        }
                        Ok(c) => {
                            if let Some(n) = log.admit() {
                                warn!(vm = %vm, uid = c.uid(), "VM control socket: refused a client of another user{}", accel_dataplane::util::suppressed(n));
                            }
                        }
                        Err(e) => {
                            if let Some(n) = log.admit() {
                                warn!(vm = %vm, "VM control socket: no peer credentials: {e}{}", accel_dataplane::util::suppressed(n));
                            }
                        }
                    }
                }
                Err(e) => {
                    if let Some(n) = log.admit() {
                        warn!(vm = %vm, "VM control socket accept: {e}{}", accel_dataplane::util::suppressed(n));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = tick.tick() => {
                if sup.permit_of(&vm).is_none_or(|p| p.generation != generation) {
                    break;
                }
            }
        }
    }
    info!(vm = %vm, "VM control socket closed");
}
