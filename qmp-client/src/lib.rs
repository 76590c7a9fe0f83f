//! An async QMP client for the accel supervisor.
//!
//! - [`connect`] reads QEMU's greeting and returns a [`Handshake`]: nothing but
//!   `qmp_capabilities` can be sent before [`Handshake::negotiate`] turns it into a [`Qmp`]
//!   (a typestate).
//! - [`Qmp`] is cheap to clone; many tasks can have commands in flight at once. Each command
//!   carries a unique `id` and its reply is matched by that id, so replies may come in any
//!   order.
//! - Events go to a broadcast channel. Unknown events and unknown fields are kept as JSON, never
//!   an error; a subscriber that falls behind learns how many it missed
//!   (`RecvError::Lagged`) instead of losing them silently.
//! - Errors keep QEMU's `class` and `desc`. A disconnect, or garbage from the peer, fails every
//!   pending command with a clear error. Every command has a timeout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};
use tracing::{debug, warn};

pub mod commands;
pub mod wire;

use wire::MAX_LINE;
/// Events buffered per subscriber before it is told it lagged. With [`MAX_EVENT`], what a
/// peer can make acceld hold in events is bounded (1024 × 64 KiB per connection).
const EVENT_BUFFER: usize = 1024;
/// Longest event line passed on; a longer one is dropped (QEMU's events are a few hundred
/// bytes; a peer that sends more is not QEMU).
pub const MAX_EVENT: usize = 64 << 10;
/// Longest greeting accepted (QEMU's is about 150 bytes).
pub const MAX_GREETING: usize = 64 << 10;
/// Longest wait for the greeting after the connect (QEMU greets at once, even under `-S`).
pub const GREETING_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Error, Clone)]
pub enum QmpError {
    #[error("cannot connect to QMP socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("QMP connection closed{}", .0.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    Closed(Option<String>),
    #[error("QEMU refused {command}: {class}: {desc}")]
    Qemu {
        command: String,
        class: String,
        desc: String,
    },
    #[error("{command}: no reply within {timeout:?}")]
    Timeout { command: String, timeout: Duration },
    #[error("QMP protocol error: {0}")]
    Protocol(String),
    #[error("{command}: cannot decode QEMU's reply: {msg}")]
    Decode { command: String, msg: String },
    #[error("QMP I/O error")]
    Io(#[source] Arc<std::io::Error>),
}

impl QmpError {
    /// QEMU's error class, when QEMU refused the command.
    pub fn class(&self) -> Option<&str> {
        match self {
            QmpError::Qemu { class, .. } => Some(class),
            _ => None,
        }
    }
}

/// QEMU's version, from the greeting.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct VersionTriple {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct VersionInfo {
    pub qemu: VersionTriple,
    #[serde(default)]
    pub package: String,
}

#[derive(Clone, Debug)]
pub struct Greeting {
    pub version: VersionInfo,
    pub capabilities: Vec<String>,
}

/// An asynchronous event from QEMU. `data` is kept as JSON: unknown events and fields are fine.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub name: String,
    pub data: Value,
    /// (seconds, microseconds) as QEMU stamped it.
    pub timestamp: (i64, i64),
    /// Its place among this connection's events: 1, 2, … (0 before dispatch).
    pub seq: u64,
}

/// A typed QMP command: its name, its arguments (the struct itself) and its reply type.
pub trait Command: Serialize {
    const NAME: &'static str;
    type Ok: DeserializeOwned;
    /// Whether the command has arguments (unit structs serialize to null).
    fn has_args(&self) -> bool {
        true
    }
}

/// A connected socket whose greeting was read; only negotiation is possible.
pub struct Handshake {
    greeting: Greeting,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    path: PathBuf,
    peer: Option<(u32, u32)>,
    peer_pid: Option<i32>,
}

/// Connects and reads the greeting (within [`GREETING_TIMEOUT`]).
pub async fn connect(path: &Path) -> Result<Handshake, QmpError> {
    connect_within(path, GREETING_TIMEOUT).await
}

/// [`connect`], the greeting due within `greeting_timeout`.
pub async fn connect_within(
    path: &Path,
    greeting_timeout: Duration,
) -> Result<Handshake, QmpError> {
    let stream = UnixStream::connect(path)
        .await
        .map_err(|e| QmpError::Connect {
            path: path.to_path_buf(),
            source: Arc::new(e),
        })?;
    let cred = stream.peer_cred().ok();
    let peer = cred.map(|c| (c.uid(), c.gid()));
    let peer_pid = cred.and_then(|c| c.pid());
    let (r, w) = stream.into_split();
    let mut reader = BufReader::new(r);
    // A peer that never greets, or greets without end, must not hold acceld.
    let v = tokio::time::timeout(greeting_timeout, read_message(&mut reader, MAX_GREETING))
        .await
        .map_err(|_| QmpError::Timeout {
            command: "the greeting".into(),
            timeout: greeting_timeout,
        })??
        .ok_or_else(|| QmpError::Closed(Some("before the greeting".into())))?
        .0;
    let qmp = v
        .get("QMP")
        .ok_or_else(|| QmpError::Protocol(format!("expected a greeting, got {v}")))?;
    let version: VersionInfo = serde_json::from_value(qmp["version"].clone())
        .map_err(|e| QmpError::Protocol(format!("bad greeting version: {e}")))?;
    let capabilities = qmp["capabilities"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    Ok(Handshake {
        greeting: Greeting {
            version,
            capabilities,
        },
        reader,
        writer: w,
        path: path.to_path_buf(),
        peer,
        peer_pid,
    })
}

/// Connects, negotiates and returns the client, retrying while the socket is not there yet
/// (QEMU starting) up to `attempts` times, `delay` apart.
pub async fn connect_with_retry(
    path: &Path,
    attempts: u32,
    delay: Duration,
) -> Result<Qmp, QmpError> {
    connect_with_retry_oob(path, attempts, delay, false).await
}

/// [`connect_with_retry`], enabling out-of-band execution when `oob` and QEMU offers it.
pub async fn connect_with_retry_oob(
    path: &Path,
    attempts: u32,
    delay: Duration,
    oob: bool,
) -> Result<Qmp, QmpError> {
    let mut last = None;
    for _ in 0..attempts.max(1) {
        match connect(path).await {
            Ok(h) if oob => return h.negotiate_oob().await,
            Ok(h) => return h.negotiate().await,
            Err(e @ QmpError::Connect { .. }) => last = Some(e),
            Err(e) => return Err(e),
        }
        tokio::time::sleep(delay).await;
    }
    Err(last.expect("at least one attempt"))
}

impl Handshake {
    pub fn greeting(&self) -> &Greeting {
        &self.greeting
    }

    /// Sends `qmp_capabilities` and waits for its reply; then commands can flow.
    pub async fn negotiate(self) -> Result<Qmp, QmpError> {
        self.negotiate_caps(false).await
    }

    /// [`Handshake::negotiate`], enabling `oob` if QEMU offers it ([`Qmp::execute_oob_raw`]).
    pub async fn negotiate_oob(self) -> Result<Qmp, QmpError> {
        let offered = self.greeting.capabilities.iter().any(|c| c == "oob");
        self.negotiate_caps(offered).await
    }

    async fn negotiate_caps(mut self, oob: bool) -> Result<Qmp, QmpError> {
        let mut msg = json!({"execute": "qmp_capabilities", "id": 0});
        if oob {
            msg["arguments"] = json!({"enable": ["oob"]});
        }
        write_message(&mut self.writer, &msg).await?;
        loop {
            let v = read_message(&mut self.reader, MAX_LINE)
                .await?
                .ok_or_else(|| QmpError::Closed(Some("during negotiation".into())))?
                .0;
            if v.get("event").is_some() {
                continue;
            }
            if let Some(e) = v.get("error") {
                return Err(qemu_error("qmp_capabilities", e));
            }
            if v.get("return").is_some() {
                break;
            }
            return Err(QmpError::Protocol(format!(
                "unexpected reply to qmp_capabilities: {v}"
            )));
        }
        Ok(Qmp::start(self, oob))
    }
}

fn qemu_error(command: &str, e: &Value) -> QmpError {
    QmpError::Qemu {
        command: command.to_string(),
        class: e["class"].as_str().unwrap_or("GenericError").to_string(),
        desc: e["desc"].as_str().unwrap_or("").to_string(),
    }
}

/// The next message and its length on the wire; at most `max` bytes are read for a line.
async fn read_message(
    r: &mut BufReader<OwnedReadHalf>,
    max: usize,
) -> Result<Option<(Value, usize)>, QmpError> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut *r)
            .take(max as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| QmpError::Io(Arc::new(e)))?;
        if n == 0 {
            return Ok(None);
        }
        if n > max {
            return Err(QmpError::Protocol(format!(
                "message longer than {max} bytes"
            )));
        }
        match wire::decode_line(&line)? {
            None => continue,
            Some(v) => return Ok(Some((v, n))),
        }
    }
}

async fn write_message(w: &mut OwnedWriteHalf, v: &Value) -> Result<(), QmpError> {
    let mut s = serde_json::to_vec(v).map_err(|e| QmpError::Protocol(e.to_string()))?;
    s.push(b'\n');
    w.write_all(&s).await.map_err(|e| QmpError::Io(Arc::new(e)))
}

/// Sends `buf` with `fd` attached (SCM_RIGHTS) to its first byte, the way QEMU's monitor
/// takes a file descriptor for the command it arrives with (`getfd`, `add-fd`).
async fn write_with_fd(
    w: &mut OwnedWriteHalf,
    buf: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> Result<(), QmpError> {
    use std::os::fd::AsRawFd;
    let io = |e: std::io::Error| QmpError::Io(Arc::new(e));
    let stream: &tokio::net::UnixStream = w.as_ref();
    let sent = loop {
        stream.writable().await.map_err(io)?;
        match stream.try_io(tokio::io::Interest::WRITABLE, || {
            send_fd(stream.as_raw_fd(), buf, fd.as_raw_fd())
        }) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(io(e)),
        }
    };
    w.write_all(&buf[sent..]).await.map_err(io)
}

/// One `sendmsg` of (a prefix of) `buf` with `fd` in an SCM_RIGHTS message.
fn send_fd(sock: i32, buf: &[u8], fd: i32) -> std::io::Result<usize> {
    const FD_SIZE: u32 = std::mem::size_of::<i32>() as u32;
    // Room for one fd's control message, aligned as cmsghdr needs.
    let mut cmsg = [0u64; 4];
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(FD_SIZE) } as usize;
    assert!(space <= std::mem::size_of_val(&cmsg));
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `cmsg`, which has room for one header (checked above),
    // so CMSG_FIRSTHDR returns a pointer into it.
    let hdr = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: CMSG_LEN only computes a size from its argument.
    let len = unsafe { libc::CMSG_LEN(FD_SIZE) };
    // SAFETY: cmsghdr is plain data; all-zero is valid before the fields are set.
    let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
    h.cmsg_level = libc::SOL_SOCKET;
    h.cmsg_type = libc::SCM_RIGHTS;
    h.cmsg_len = len as _;
    // SAFETY: `hdr` points into `cmsg` (above), which has room for the header.
    unsafe { std::ptr::write_unaligned(hdr, h) };
    // SAFETY: the header inside `cmsg` says one i32 follows: CMSG_DATA points at it.
    let data = unsafe { libc::CMSG_DATA(hdr) };
    // SAFETY: `data` points at room for one i32 inside `cmsg`; no alignment needed.
    unsafe { std::ptr::write_unaligned(data.cast::<i32>(), fd) };
    // SAFETY: `msg` points at `iov` (over `buf`) and `cmsg`, both alive for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

type Reply = Result<Value, QmpError>;

struct Inner {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Mutex<HashMap<u64, (String, oneshot::Sender<Reply>)>>,
    next_id: AtomicU64,
    events: broadcast::Sender<Event>,
    /// Events dispatched so far (the last one's `seq`).
    events_sent: AtomicU64,
    closed: AtomicBool,
    close_reason: Mutex<Option<String>>,
    timeout: Mutex<Duration>,
    greeting: Greeting,
    path: PathBuf,
    oob: bool,
    /// The uid and gid of the process listening on the socket (SO_PEERCRED).
    peer: Option<(u32, u32)>,
    peer_pid: Option<i32>,
}

/// A negotiated QMP connection. Clone it to share it between tasks.
#[derive(Clone)]
pub struct Qmp {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Qmp {
    fn start(h: Handshake, oob: bool) -> Self {
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let inner = Arc::new(Inner {
            writer: tokio::sync::Mutex::new(h.writer),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            events,
            events_sent: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            timeout: Mutex::new(Duration::from_secs(30)),
            greeting: h.greeting,
            path: h.path,
            peer: h.peer,
            peer_pid: h.peer_pid,
            oob,
        });
        tokio::spawn(reader_task(h.reader, inner.clone()));
        Qmp { inner }
    }

    /// The uid of the process that serves this QMP socket, as the kernel says (SO_PEERCRED).
    pub fn peer_uid(&self) -> Option<u32> {
        self.inner.peer.map(|p| p.0)
    }

    /// The uid and gid of the process that serves this QMP socket (SO_PEERCRED, as it was
    /// when that process made the socket).
    pub fn peer(&self) -> Option<(u32, u32)> {
        self.inner.peer
    }

    /// The pid of the process that serves this QMP socket (SO_PEERCRED). While this
    /// connection is open that process lives, so the pid is not reused.
    pub fn peer_pid(&self) -> Option<i32> {
        self.inner.peer_pid
    }

    pub fn greeting(&self) -> &Greeting {
        &self.inner.greeting
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Out-of-band execution was negotiated.
    pub fn oob_enabled(&self) -> bool {
        self.inner.oob
    }

    /// Runs a command out of band (`exec-oob`): QEMU's monitor thread runs it at once, even
    /// while the main loop is busy. Needs [`Qmp::oob_enabled`].
    pub async fn execute_oob_raw(
        &self,
        name: &str,
        args: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        if !self.inner.oob {
            return Err(QmpError::Protocol(
                "out-of-band execution was not negotiated".into(),
            ));
        }
        self.execute_msg(name, args, timeout, None, "exec-oob")
            .await
    }

    /// The timeout of every later command (default 30 s).
    pub fn set_timeout(&self, t: Duration) {
        *lock(&self.inner.timeout) = t;
    }

    /// How many events QEMU sent so far on this connection. Read after a reply arrived, it
    /// covers every event QEMU sent before that reply (QEMU's order on the wire): a relay
    /// that must keep that order passes events up to here on before the reply.
    pub fn events_sent(&self) -> u64 {
        self.inner.events_sent.load(Ordering::Acquire)
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// A new subscription to events, from now on.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    /// Runs a typed command.
    pub async fn execute<C: Command>(&self, cmd: &C) -> Result<C::Ok, QmpError> {
        let args = if cmd.has_args() {
            Some(serde_json::to_value(cmd).map_err(|e| QmpError::Protocol(e.to_string()))?)
        } else {
            None
        };
        let v = self.execute_raw(C::NAME, args).await?;
        serde_json::from_value(v).map_err(|e| QmpError::Decode {
            command: C::NAME.to_string(),
            msg: e.to_string(),
        })
    }

    /// Runs any command by name with JSON arguments; returns the `return` value.
    pub async fn execute_raw(&self, name: &str, args: Option<Value>) -> Result<Value, QmpError> {
        let timeout = *lock(&self.inner.timeout);
        self.execute_raw_timeout(name, args, timeout).await
    }

    /// [`Qmp::execute_raw`] with this command's own timeout.
    pub async fn execute_raw_timeout(
        &self,
        name: &str,
        args: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.execute_msg(name, args, timeout, None, "execute").await
    }

    /// Runs a command with a file descriptor passed along (SCM_RIGHTS), as `getfd` and
    /// `add-fd` need it.
    pub async fn execute_raw_with_fd(
        &self,
        name: &str,
        args: Option<Value>,
        timeout: Duration,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        self.execute_msg(name, args, timeout, Some(fd), "execute")
            .await
    }

    async fn execute_msg(
        &self,
        name: &str,
        args: Option<Value>,
        timeout: Duration,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        key: &str,
    ) -> Result<Value, QmpError> {
        if self.is_closed() {
            return Err(QmpError::Closed(lock(&self.inner.close_reason).clone()));
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.inner.pending).insert(id, (name.to_string(), tx));
        let mut msg = json!({ key: name, "id": id });
        if let Some(a) = args.filter(|a| !a.is_null()) {
            msg["arguments"] = a;
        }
        let sent = {
            let mut w = self.inner.writer.lock().await;
            match fd {
                None => write_message(&mut w, &msg).await,
                Some(fd) => {
                    let mut s =
                        serde_json::to_vec(&msg).map_err(|e| QmpError::Protocol(e.to_string()))?;
                    s.push(b'\n');
                    write_with_fd(&mut w, &s, fd).await
                }
            }
        };
        if let Err(e) = sent {
            lock(&self.inner.pending).remove(&id);
            return Err(e);
        }
        // A reader that ended between the insert and now has already failed this entry.
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(QmpError::Closed(lock(&self.inner.close_reason).clone())),
            Err(_) => {
                lock(&self.inner.pending).remove(&id);
                Err(QmpError::Timeout {
                    command: name.to_string(),
                    timeout,
                })
            }
        }
    }
}

async fn reader_task(mut r: BufReader<OwnedReadHalf>, inner: Arc<Inner>) {
    let reason = loop {
        match read_message(&mut r, MAX_LINE).await {
            Ok(None) => break "QEMU closed the socket".to_string(),
            Err(e) => break e.to_string(),
            Ok(Some((v, len))) => dispatch(&inner, v, len),
        }
    };
    debug!(path = %inner.path.display(), %reason, "QMP reader ended");
    *lock(&inner.close_reason) = Some(reason.clone());
    inner.closed.store(true, Ordering::Release);
    let pending: Vec<_> = lock(&inner.pending).drain().collect();
    for (_, (_, tx)) in pending {
        let _ = tx.send(Err(QmpError::Closed(Some(reason.clone()))));
    }
}

fn dispatch(inner: &Inner, v: Value, len: usize) {
    match wire::classify(v) {
        wire::Message::Event(ev) if len > MAX_EVENT => {
            if admit_warning() {
                warn!(event = %ev.name, len, "QMP event longer than {MAX_EVENT} bytes dropped");
            }
        }
        wire::Message::Event(mut ev) => {
            ev.seq = inner.events_sent.load(Ordering::Relaxed) + 1;
            // No subscriber is fine: nobody asked for events.
            let _ = inner.events.send(ev);
            // After the send: a reader of the count finds every event up to it broadcast.
            inner.events_sent.fetch_add(1, Ordering::Release);
        }
        wire::Message::Reply { id, result } => {
            let Some((command, tx)) = lock(&inner.pending).remove(&id) else {
                if admit_warning() {
                    warn!(id, "QMP reply for no pending command (timed out?)");
                }
                return;
            };
            let reply = result.map_err(|(class, desc)| QmpError::Qemu {
                command,
                class,
                desc,
            });
            let _ = tx.send(reply);
        }
        wire::Message::Unexpected(v) => {
            if admit_warning() {
                let text = v.to_string();
                warn!(
                    "QMP message without a command id or an event ignored: {}",
                    &text[..text.len().min(200)]
                );
            }
        }
    }
}

/// The peer decides how many odd messages it sends: the first few are logged, then one in
/// a thousand.
fn admit_warning() -> bool {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let n = SEEN.fetch_add(1, Ordering::Relaxed);
    n < 5 || n % 1000 == 0
}
