//! The control socket's requests (`accel_api::control`): one JSON object per line, answered
//! by the supervisor.

use std::sync::Arc;

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedReadHalf;
use tokio::net::UnixStream;

use crate::control::{ErrorKind, Reply, Request};
use crate::supervisor::{SupError, Supervisor};

/// Longest request line; a client that sends more gets an error and is disconnected.
pub const MAX_REQUEST: usize = 1 << 20;

/// Parses one request line into a request, or the reply that refuses it.
pub fn parse_request(line: &[u8]) -> Result<Request, Reply> {
    serde_json::from_slice::<Request>(line)
        .map_err(|e| Reply::err(ErrorKind::Invalid, format!("bad request: {e}")))
}

/// Reads one request line (without the newline); descriptors sent with it (SCM_RIGHTS) go to
/// `fds`. None at EOF; `Err(())` for a line longer than [`MAX_REQUEST`].
async fn read_line(
    r: &OwnedReadHalf,
    buf: &mut Vec<u8>,
    fds: &mut VecDeque<OwnedFd>,
) -> Option<Result<Vec<u8>, ()>> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            return Some(if line.len() > MAX_REQUEST + 1 {
                Err(())
            } else {
                Ok(line)
            });
        }
        if buf.len() > MAX_REQUEST {
            return Some(Err(()));
        }
        match crate::qmp_proxy::fds::read(r, &mut chunk, fds).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

pub(super) async fn handle_client(stream: UnixStream, sup: Arc<Supervisor>) {
    let (r, mut w) = stream.into_split();
    let mut buf = Vec::new();
    let mut fds = VecDeque::new();
    loop {
        let Some(line) = read_line(&r, &mut buf, &mut fds).await else {
            return;
        };
        let too_long = line.is_err();
        let line = line.unwrap_or_default();
        if line.iter().all(u8::is_ascii_whitespace) && !too_long {
            continue;
        }
        let reply = if too_long {
            Reply::err(
                ErrorKind::Invalid,
                format!("request longer than {MAX_REQUEST} bytes"),
            )
        } else {
            match parse_request(&line) {
                // libvirt's monitor socket comes with the emulator wrapper's registration.
                Ok(req) => dispatch_with_fd(&sup, req, fds.pop_front()).await,
                Err(reply) => reply,
            }
        };
        // A descriptor is only for the request it came with.
        fds.clear();
        let mut out = serde_json::to_string(&reply).expect("replies serialize");
        out.push('\n');
        if w.write_all(out.as_bytes()).await.is_err() || too_long {
            return;
        }
    }
}

pub async fn dispatch(sup: &Arc<Supervisor>, req: Request) -> Reply {
    dispatch_with_fd(sup, req, None).await
}

/// A request and the descriptor that came with it (only `register` takes one: libvirt's
/// listening monitor socket).
async fn dispatch_with_fd(sup: &Arc<Supervisor>, req: Request, fd: Option<OwnedFd>) -> Reply {
    use policy::Pin;
    fn json<T: serde::Serialize>(r: Result<T, SupError>) -> Result<serde_json::Value, SupError> {
        r.map(|v| serde_json::to_value(v).expect("replies serialize"))
    }
    let res = match req {
        Request::Register {
            vm,
            qmp,
            drives,
            cont,
            incoming,
            monitor,
        } => {
            let s = sup.clone();
            json(tokio::task::block_in_place(move || {
                let monitor = monitor.map(|path| crate::supervisor::MonitorSocket { path, fd });
                s.register(vm, qmp, drives, cont, incoming, monitor)
            }))
        }
        Request::Unregister { vm } => json(sup.unregister(&vm).await),
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
