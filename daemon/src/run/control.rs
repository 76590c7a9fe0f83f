//! The control socket's requests (`accel_api::control`): one JSON object per line, answered
//! by the supervisor.

use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
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

pub(super) async fn handle_client(stream: UnixStream, sup: Arc<Supervisor>) {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = match (&mut r)
            .take(MAX_REQUEST as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let too_long = n > MAX_REQUEST;
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
                Ok(req) => dispatch(&sup, req).await,
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

pub async fn dispatch(sup: &Arc<Supervisor>, req: Request) -> Reply {
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
        } => {
            let s = sup.clone();
            json(tokio::task::block_in_place(move || {
                s.register(vm, qmp, drives, cont, incoming)
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
