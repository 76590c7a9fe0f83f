//! libvirt's monitor relay: a small process the wrapper leaves beside QEMU. It owns libvirt's
//! listening monitor socket (libvirt connected to it before QEMU started) and joins each of
//! libvirt's connections to the VM's QMP proxy (`RUN_DIR/VM/monitor.sock`), descriptors
//! included (`getfd` of a `virsh save`).
//!
//! Why a process of its own: libvirt takes its monitor's EOF for QEMU's end and stops the
//! domain. The relay outlives an acceld restart: it answers the commands that were in flight
//! with an error, reconnects, negotiates again on libvirt's behalf, and goes on. Only when
//! QEMU itself is gone does libvirt see the EOF. Events sent while acceld restarts are lost.
//!
//! Whole lines only cross: a reply cut off by a restart never reaches libvirt in part, and a
//! command libvirt sent in part is completed and sent to the next proxy.

use std::collections::{HashSet, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel_api::fdpass;
use serde_json::Value;

/// How long the relay waits for acceld's proxy to come back while QEMU runs.
const RECONNECT: Duration = Duration::from_secs(300);
/// Reads that wait for the proxy look at QEMU this often.
const TICK: Duration = Duration::from_secs(1);
/// The id of the relay's own `qmp_capabilities` after a reconnect.
const OWN_ID: &str = "accel-relay-negotiation";
/// Longest line the relay buffers (the proxy's own bound).
const MAX_LINE: usize = 16 << 20;

/// A process watched through a pidfd (no pid reuse).
#[derive(Debug)]
pub struct Process(OwnedFd);

impl Process {
    /// Opens a pidfd of `pid` (Linux 5.3).
    pub fn open(pid: i32) -> std::io::Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        Ok(Process(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    pub fn as_raw_fd(&self) -> i32 {
        self.0.as_raw_fd()
    }

    /// Whether it still runs (a pidfd is readable once the process has exited).
    pub fn alive(&self) -> bool {
        let mut p = [pfd(self.0.as_fd())];
        !matches!(poll(&mut p, Duration::ZERO), Ok(n) if n > 0)
    }
}

#[derive(Debug)]
pub struct Relay {
    pub listener: UnixListener,
    pub proxy: PathBuf,
    /// QEMU (the wrapper's process, which execs QEMU).
    pub qemu: Process,
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

fn transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

/// Takes the whole lines off the front of `buf`.
fn whole_lines(buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let end = buf.iter().rposition(|&b| b == b'\n')?;
    Some(buf.drain(..=end).collect())
}

/// Where the relay connects: the VM's QMP proxy socket in acceld's run directory.
pub fn proxy_socket(run_dir: &Path, vm: &str) -> PathBuf {
    run_dir.join(vm).join("monitor.sock")
}

impl Relay {
    /// Serves libvirt's connections until QEMU is gone.
    pub fn run(self) {
        loop {
            let mut p = [pfd(self.listener.as_fd()), pfd(self.qemu.0.as_fd())];
            if poll(&mut p, TICK).is_err() || p[1].revents != 0 {
                return;
            }
            if p[0].revents != 0 {
                match self.listener.accept() {
                    Ok((c, _)) => self.session(&c),
                    // EMFILE and the like: the listener stays readable; do not spin.
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        }
    }

    /// Connects to the proxy and reads its greeting, waiting as long as QEMU runs (the proxy
    /// greets once acceld attached to QEMU, which may take long for a big guest) or until
    /// `deadline`. Returns the socket and the bytes read: the greeting line and what followed.
    fn connect(&self, deadline: Option<Instant>) -> Option<(UnixStream, Vec<u8>)> {
        while deadline.is_none_or(|d| Instant::now() < d) && self.qemu.alive() {
            if let Ok(s) = UnixStream::connect(&self.proxy) {
                let mut got = Vec::new();
                if read_until_line(&s, &self.qemu, &mut got, |_| true).is_some() {
                    return Some((s, got));
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }

    /// One libvirt connection, to its EOF or QEMU's end.
    fn session(&self, client: &UnixStream) {
        let Some((mut up, greeting)) = self.connect(None) else {
            return;
        };
        let mut st = Session::default();
        if st.send_client(client, &greeting).is_err() {
            return;
        }
        loop {
            match st.pump(client, &up, &self.qemu) {
                Pumped::Client | Pumped::Qemu => return,
                Pumped::Proxy => {}
            }
            // acceld went away while QEMU runs: fail what was in flight, come back.
            let mut errors = Vec::new();
            for id in st.pending.drain() {
                errors.extend_from_slice(format!(
                    "{{\"id\": {id}, \"error\": {{\"class\": \"GenericError\", \"desc\": \"acceld restarted while the command ran; its outcome is unknown\"}}}}\r\n"
                ).as_bytes());
            }
            // A reply cut off by the restart is dropped whole (libvirt never saw a part).
            st.from_up.clear();
            if (&*client).write_all(&errors).is_err() {
                return;
            }
            let deadline = Some(Instant::now() + RECONNECT);
            let (s, rest) = loop {
                let Some((s, mut got)) = self.connect(deadline) else {
                    return;
                };
                // Drop the new greeting: libvirt has had one.
                let at = got.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
                got.drain(..at);
                if !st.negotiated {
                    break (s, got);
                }
                if let Some(rest) = renegotiate(&s, &self.qemu, got) {
                    break (s, rest);
                }
            };
            up = s;
            st.from_up = rest;
            if st.send_client_lines(client).is_err() {
                return;
            }
        }
    }
}

/// Reads from `s` into `got` until it holds a whole line `done` accepts, while QEMU runs.
fn read_until_line(
    s: &UnixStream,
    qemu: &Process,
    got: &mut Vec<u8>,
    mut done: impl FnMut(&[u8]) -> bool,
) -> Option<()> {
    let _ = s.set_read_timeout(Some(TICK));
    let mut buf = [0u8; 4096];
    let mut scanned = 0;
    loop {
        while let Some(i) = got[scanned..].iter().position(|&b| b == b'\n') {
            let end = scanned + i + 1;
            let line = &got[scanned..end];
            scanned = end;
            if done(line) {
                let _ = s.set_read_timeout(None);
                return Some(());
            }
        }
        if got.len() > MAX_LINE {
            return None;
        }
        match (&*s).read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if transient(&e) => {
                if !qemu.alive() {
                    return None;
                }
            }
            Err(_) => return None,
        }
    }
}

/// `qmp_capabilities` on libvirt's behalf after a reconnect; `got` holds what followed the
/// greeting. Returns what follows the reply (events may), or None to connect again.
fn renegotiate(s: &UnixStream, qemu: &Process, mut got: Vec<u8>) -> Option<Vec<u8>> {
    let mut w = s;
    w.write_all(
        format!("{{\"execute\": \"qmp_capabilities\", \"id\": \"{OWN_ID}\"}}\r\n").as_bytes(),
    )
    .ok()?;
    let mut ok = false;
    let mut reply_end = 0;
    let mut offset = 0;
    read_until_line(s, qemu, &mut got, |line| {
        offset += line.len();
        let v: Value = serde_json::from_slice(line).unwrap_or(Value::Null);
        if v["id"] == OWN_ID {
            ok = v.get("return").is_some();
            reply_end = offset;
            true
        } else {
            false
        }
    })?;
    ok.then(|| got.split_off(reply_end))
}

#[derive(Default)]
struct Session {
    /// Ids (as JSON text) of libvirt's commands without a reply yet.
    pending: HashSet<String>,
    /// The id of libvirt's `qmp_capabilities`, until its reply.
    negotiating: Option<String>,
    negotiated: bool,
    /// libvirt's bytes not sent yet (an unfinished line, or lines the proxy did not take).
    from_client: Vec<u8>,
    /// Descriptors that came with them.
    fds: VecDeque<OwnedFd>,
    /// The proxy's bytes after its last whole line.
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

    /// Sends `bytes` (from the proxy) on to libvirt, whole lines only.
    fn send_client(&mut self, client: &UnixStream, bytes: &[u8]) -> std::io::Result<()> {
        self.from_up.extend_from_slice(bytes);
        self.send_client_lines(client)
    }

    fn send_client_lines(&mut self, client: &UnixStream) -> std::io::Result<()> {
        let Some(lines) = whole_lines(&mut self.from_up) else {
            if self.from_up.len() > MAX_LINE {
                self.from_up.clear();
            }
            return Ok(());
        };
        for l in lines.split_inclusive(|&b| b == b'\n') {
            self.note_reply(l);
        }
        (&*client).write_all(&lines)
    }

    /// Sends libvirt's whole lines to the proxy, the descriptors with the first bytes.
    fn flush_to_up(&mut self, up: &UnixStream) -> std::io::Result<()> {
        let Some(end) = self.from_client.iter().rposition(|&b| b == b'\n') else {
            return Ok(());
        };
        let mut sent = 0;
        while sent <= end {
            let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(AsFd::as_fd).collect();
            match fdpass::send(up.as_raw_fd(), &self.from_client[sent..=end], &fds) {
                Ok(k) => {
                    sent += k;
                    self.fds.clear();
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Keep what the proxy did not take, for the next one.
                    self.from_client.drain(..sent);
                    return Err(e);
                }
            }
        }
        self.from_client.drain(..=end);
        Ok(())
    }

    /// Moves whole lines both ways until one side ends.
    fn pump(&mut self, client: &UnixStream, up: &UnixStream, qemu: &Process) -> Pumped {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let mut p = [pfd(client.as_fd()), pfd(up.as_fd()), pfd(qemu.0.as_fd())];
            if poll(&mut p, TICK).is_err() {
                return Pumped::Client;
            }
            if p[0].revents != 0 {
                match fdpass::recv(client.as_raw_fd(), &mut buf) {
                    Ok((0, _)) => return Pumped::Client,
                    Ok((n, fds)) => {
                        let start = self.from_client.len();
                        self.from_client.extend_from_slice(&buf[..n]);
                        self.fds.extend(fds);
                        // New whole lines: note the commands among them.
                        let scan_from = self.from_client[..start]
                            .iter()
                            .rposition(|&b| b == b'\n')
                            .map_or(0, |i| i + 1);
                        let tail = self.from_client[scan_from..].to_vec();
                        for l in tail.split_inclusive(|&b| b == b'\n') {
                            if l.ends_with(b"\n") {
                                self.note_command(l);
                            }
                        }
                        if self.from_client.len() > MAX_LINE {
                            return Pumped::Client;
                        }
                        if self.flush_to_up(up).is_err() {
                            return Self::proxy_gone(qemu);
                        }
                    }
                    Err(e) if transient(&e) => {}
                    Err(_) => return Pumped::Client,
                }
            }
            if p[1].revents != 0 {
                match (&*up).read(&mut buf) {
                    Ok(0) => return Self::proxy_gone(qemu),
                    Ok(n) => {
                        if self.send_client(client, &buf[..n]).is_err() {
                            return Pumped::Client;
                        }
                    }
                    Err(e) if transient(&e) => {}
                    Err(_) => return Self::proxy_gone(qemu),
                }
            }
            if p[2].revents != 0 && p[1].revents == 0 {
                // QEMU is gone: pass on what the proxy still sends (QEMU's last events) until
                // it closes, for at most 2 s.
                let t0 = Instant::now();
                let _ = up.set_read_timeout(Some(Duration::from_millis(200)));
                while t0.elapsed() < Duration::from_secs(2) {
                    match (&*up).read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if self.send_client(client, &buf[..n]).is_err() {
                                break;
                            }
                        }
                        Err(e) if transient(&e) => {}
                        Err(_) => break,
                    }
                }
                return Pumped::Qemu;
            }
        }
    }

    /// The proxy closed: QEMU ended (the proxy closes with QEMU's monitor), or acceld did.
    fn proxy_gone(qemu: &Process) -> Pumped {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            if !qemu.alive() {
                return Pumped::Qemu;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Pumped::Proxy
    }
}
