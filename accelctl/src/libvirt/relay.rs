//! libvirt's monitor relay: a small process the wrapper leaves beside QEMU. It owns libvirt's
//! listening monitor socket (libvirt connected to it before QEMU started) and joins each of
//! libvirt's connections to the VM's QMP proxy (`RUN_DIR/VM/monitor.sock`), descriptors
//! included (`getfd` of a `virsh save`).
//!
//! Why a process of its own: libvirt takes its monitor's EOF for QEMU's end and stops the
//! domain. The relay outlives an acceld restart: it answers the commands that were in flight
//! with an error, reconnects, negotiates again on libvirt's behalf, and goes on. Only when
//! QEMU itself is gone does libvirt see the EOF. Events sent while acceld restarts are lost.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel_api::fdpass;
use serde_json::Value;

/// How long the relay waits for acceld's proxy to come back while QEMU runs.
const RECONNECT: Duration = Duration::from_secs(300);
/// A greeting or the renegotiation's reply from a proxy that just accepted.
const HANDSHAKE: Duration = Duration::from_secs(60);
/// The id of the relay's own `qmp_capabilities` after a reconnect.
const OWN_ID: &str = "accel-relay-negotiation";
/// Longest line the relay buffers (the proxy's own bound).
const MAX_LINE: usize = 16 << 20;

#[derive(Debug)]
pub struct Relay {
    pub listener: UnixListener,
    pub proxy: PathBuf,
    /// QEMU's pid (the wrapper's, which execs QEMU).
    pub qemu: i32,
}

/// Whether a process runs (not gone, not a zombie).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> std::io::Result<usize> {
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd for the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, timeout.as_millis() as i32) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

fn pfd(fd: BorrowedFd<'_>) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

impl Relay {
    /// Serves libvirt's connections until QEMU is gone.
    pub fn run(self) {
        loop {
            let mut p = [pfd(self.listener.as_fd())];
            if poll(&mut p, Duration::from_millis(500)).is_err() {
                return;
            }
            if p[0].revents != 0 {
                if let Ok((c, _)) = self.listener.accept() {
                    self.session(&c);
                }
            }
            if !alive(self.qemu) {
                return;
            }
        }
    }

    /// Connects to the proxy and reads its greeting (retrying while QEMU runs).
    fn connect(&self, deadline: Instant) -> Option<(UnixStream, String)> {
        while Instant::now() < deadline && alive(self.qemu) {
            if let Ok(s) = UnixStream::connect(&self.proxy) {
                let _ = s.set_read_timeout(Some(HANDSHAKE));
                let mut r = BufReader::new(&s);
                let mut greeting = String::new();
                if r.read_line(&mut greeting).is_ok_and(|n| n > 0) && r.buffer().is_empty() {
                    let _ = s.set_read_timeout(None);
                    return Some((s, greeting));
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }

    /// One libvirt connection, to its EOF or QEMU's end.
    fn session(&self, client: &UnixStream) {
        let Some((mut up, greeting)) = self.connect(Instant::now() + RECONNECT) else {
            return;
        };
        if (&*client).write_all(greeting.as_bytes()).is_err() {
            return;
        }
        let mut st = Session::default();
        loop {
            match st.pump(client, &up, self.qemu) {
                Pumped::Client | Pumped::Qemu => return,
                Pumped::Proxy => {}
            }
            // acceld went away while QEMU runs: fail what was in flight, come back.
            for id in st.pending.drain() {
                let err = format!(
                    "{{\"id\": {id}, \"error\": {{\"class\": \"GenericError\", \"desc\": \"acceld restarted while the command ran; its outcome is unknown\"}}}}\r\n"
                );
                if (&*client).write_all(err.as_bytes()).is_err() {
                    return;
                }
            }
            st.from_up.clear();
            let Some((s, _)) = self.connect(Instant::now() + RECONNECT) else {
                return;
            };
            if st.negotiated && renegotiate(&s).is_err() {
                return;
            }
            up = s;
        }
    }
}

fn renegotiate(s: &UnixStream) -> std::io::Result<()> {
    let _ = s.set_read_timeout(Some(HANDSHAKE));
    let mut w = s;
    w.write_all(
        format!("{{\"execute\": \"qmp_capabilities\", \"id\": \"{OWN_ID}\"}}\r\n").as_bytes(),
    )?;
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if v["id"] == OWN_ID {
            if !r.buffer().is_empty() {
                // Nothing but the reply can come before it (events need negotiation).
                return Err(std::io::ErrorKind::InvalidData.into());
            }
            let _ = s.set_read_timeout(None);
            return Ok(());
        }
    }
}

#[derive(Default)]
struct Session {
    /// Ids (as JSON text) of libvirt's commands without a reply yet.
    pending: HashSet<String>,
    /// The id of libvirt's `qmp_capabilities`, until its reply.
    negotiating: Option<String>,
    negotiated: bool,
    from_client: Vec<u8>,
    from_up: Vec<u8>,
}

/// Why a pump ended: which side is gone.
enum Pumped {
    Client,
    Proxy,
    Qemu,
}

impl Session {
    fn note_command(&mut self, line: &[u8]) {
        let Ok(v) = serde_json::from_slice::<Value>(line) else {
            return;
        };
        let Some(id) = v.get("id").map(Value::to_string) else {
            return;
        };
        let cmd = v.get("execute").or_else(|| v.get("exec-oob"));
        if cmd.and_then(Value::as_str) == Some("qmp_capabilities") {
            self.negotiating = Some(id.clone());
        }
        if cmd.is_some() {
            self.pending.insert(id);
        }
    }

    fn note_reply(&mut self, line: &[u8]) {
        let Ok(v) = serde_json::from_slice::<Value>(line) else {
            return;
        };
        let (Some(id), true) = (
            v.get("id").map(Value::to_string),
            v.get("return").is_some() || v.get("error").is_some(),
        ) else {
            return;
        };
        self.pending.remove(&id);
        if self.negotiating.as_deref() == Some(id.as_str()) {
            self.negotiating = None;
            self.negotiated |= v.get("return").is_some();
        }
    }

    fn lines(buf: &mut Vec<u8>, mut f: impl FnMut(&[u8])) {
        while let Some(i) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            f(&line);
        }
        if buf.len() > MAX_LINE {
            buf.clear();
        }
    }

    /// Moves bytes both ways until one side ends.
    fn pump(&mut self, client: &UnixStream, up: &UnixStream, qemu: i32) -> Pumped {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let mut p = [pfd(client.as_fd()), pfd(up.as_fd())];
            if poll(&mut p, Duration::from_millis(500)).is_err() {
                return Pumped::Client;
            }
            if p[0].revents != 0 {
                let (n, fds): (usize, Vec<OwnedFd>) =
                    match fdpass::recv(client.as_raw_fd(), &mut buf) {
                        Ok((0, _)) | Err(_) => return Pumped::Client,
                        Ok(x) => x,
                    };
                self.from_client.extend_from_slice(&buf[..n]);
                let mut taken = std::mem::take(&mut self.from_client);
                Self::lines(&mut taken, |l| self.note_command(l));
                self.from_client = taken;
                let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
                let mut rest = &buf[..n];
                let mut first = true;
                while !rest.is_empty() {
                    let f: &[BorrowedFd<'_>] = if first { &borrowed } else { &[] };
                    match fdpass::send(up.as_raw_fd(), rest, f) {
                        Ok(k) => rest = &rest[k..],
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => return Self::proxy_gone(qemu),
                    }
                    first = false;
                }
            }
            if p[1].revents != 0 {
                let n = match (&*up).read(&mut buf) {
                    Ok(0) | Err(_) => return Self::proxy_gone(qemu),
                    Ok(n) => n,
                };
                self.from_up.extend_from_slice(&buf[..n]);
                let mut taken = std::mem::take(&mut self.from_up);
                Self::lines(&mut taken, |l| self.note_reply(l));
                self.from_up = taken;
                if (&*client).write_all(&buf[..n]).is_err() {
                    return Pumped::Client;
                }
            }
            if p[0].revents == 0 && p[1].revents == 0 && !alive(qemu) {
                return Pumped::Qemu;
            }
        }
    }

    /// The proxy closed: QEMU ended (the proxy closes with QEMU's monitor), or acceld did.
    fn proxy_gone(qemu: i32) -> Pumped {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            if !alive(qemu) {
                return Pumped::Qemu;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Pumped::Proxy
    }
}

/// Where the relay connects: the VM's QMP proxy socket in acceld's run directory.
pub fn proxy_socket(run_dir: &Path, vm: &str) -> PathBuf {
    run_dir.join(vm).join("monitor.sock")
}
