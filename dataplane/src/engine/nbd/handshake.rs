//! The NBD handshake: fixed newstyle, structured replies, OPT_GO with block sizes.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use super::proto::{
    CMD_DISC, FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, INFO_BLOCK_SIZE, INFO_EXPORT,
    NBDMAGIC, OPT_GO, OPT_REPLY_MAGIC, OPT_STRUCTURED_REPLY, REP_ACK, REP_ERR_BIT, REP_INFO,
    REQUEST_MAGIC, TF_READ_ONLY,
};

/// The payload limit when the server names none (the spec's recommended 32 MiB).
pub(super) const DEFAULT_MAX_PAYLOAD: u32 = 32 << 20;
/// Longest option reply payload read during the handshake.
pub(super) const MAX_OPT_REPLY: u32 = 64 << 10;
/// Socket send timeout: a server that stops reading fails the connection instead of
/// blocking the worker.
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum NbdError {
    #[error("cannot connect to NBD socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("NBD handshake I/O failed")]
    Io(#[from] io::Error),
    #[error("NBD server broke the protocol: {0}")]
    Protocol(String),
    #[error("NBD server refused export '{export}': {message} (reply type {code:#x})")]
    Refused {
        export: String,
        code: u32,
        message: String,
    },
    #[error("NBD export '{export}' changed size from {was} to {now} bytes")]
    SizeChanged { export: String, was: u64, now: u64 },
}

/// What the server told us about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
    /// Largest payload of one request.
    pub max_payload: u32,
    pub structured: bool,
}

impl ExportInfo {
    pub fn read_only(&self) -> bool {
        self.flags & TF_READ_ONLY != 0
    }
}

pub(super) fn rd_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}
pub(super) fn rd_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
pub(super) fn rd_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn send_option(w: &mut impl Write, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    w.write_all(&m)
}

/// Reads one option reply: (type, payload).
fn read_option_reply(r: &mut impl Read, opt: u32) -> Result<(u32, Vec<u8>), NbdError> {
    let magic = rd_u64(r)?;
    if magic != OPT_REPLY_MAGIC {
        return Err(NbdError::Protocol(format!("option reply magic {magic:#x}")));
    }
    let got = rd_u32(r)?;
    if got != opt {
        return Err(NbdError::Protocol(format!(
            "reply to option {got} while waiting for option {opt}"
        )));
    }
    let typ = rd_u32(r)?;
    let len = rd_u32(r)?;
    if len > MAX_OPT_REPLY {
        return Err(NbdError::Protocol(format!("option reply of {len} bytes")));
    }
    let mut data = vec![0; len as usize];
    r.read_exact(&mut data)?;
    Ok((typ, data))
}

/// Most replies to one option a server may send before its final one (QEMU sends 2–4 INFO
/// replies to NBD_OPT_GO).
const MAX_OPT_REPLIES: usize = 32;
/// Longest the whole handshake may take: a server that trickles bytes cannot hold the
/// connecting thread longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for room in the server's backlog, within the handshake's deadline: QEMU's
/// NBD server accepts from its main loop at once, while a listener that never accepts (one
/// QEMU's user plants at `RUN_DIR/VM/nbd.sock`) would otherwise hold `connect` for ever. As
/// long as the lend client's connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads from the socket until a deadline: every read gets the time left as its timeout.
struct Deadline<'a> {
    s: &'a UnixStream,
    until: std::time::Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self
            .until
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "NBD handshake took too long",
            ));
        }
        self.s.set_read_timeout(Some(left))?;
        match (&mut &*self.s).read(buf) {
            // SO_RCVTIMEO expired: EAGAIN.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "NBD handshake took too long",
            )),
            r => r,
        }
    }
}

/// Whether an NBD server greets on `path` (a fixed-newstyle greeting within `timeout`). The
/// connection is dropped before any option is sent.
pub fn greets(path: &Path, timeout: Duration) -> bool {
    let Ok(mut s) = crate::util::connect_unix(path, timeout.min(CONNECT_TIMEOUT)) else {
        return false;
    };
    if s.set_read_timeout(Some(timeout)).is_err() {
        return false;
    }
    matches!(
        (rd_u64(&mut s), rd_u64(&mut s)),
        (Ok(NBDMAGIC), Ok(IHAVEOPT))
    )
}

/// Connects to `path` and negotiates `export`; returns the connection, ready for
/// transmission, and the export's parameters.
pub fn connect(path: &Path, export: &str) -> Result<(UnixStream, ExportInfo), NbdError> {
    connect_within(path, export, HANDSHAKE_TIMEOUT)
}

fn connect_within(
    path: &Path,
    export: &str,
    timeout: Duration,
) -> Result<(UnixStream, ExportInfo), NbdError> {
    let until = std::time::Instant::now() + timeout;
    let sock = crate::util::connect_unix(path, timeout.min(CONNECT_TIMEOUT)).map_err(|source| {
        NbdError::Connect {
            path: path.to_path_buf(),
            source,
        }
    })?;
    sock.set_write_timeout(Some(SEND_TIMEOUT))?;
    let mut s = Deadline { s: &sock, until };
    let mut w = &sock;
    let magic = rd_u64(&mut s)?;
    let opt_magic = rd_u64(&mut s)?;
    if magic != NBDMAGIC || opt_magic != IHAVEOPT {
        return Err(NbdError::Protocol(format!(
            "greeting {magic:#x} {opt_magic:#x} is not fixed newstyle"
        )));
    }
    let hflags = rd_u16(&mut s)?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::Protocol(
            "server does not offer fixed newstyle negotiation".into(),
        ));
    }
    let cflags = u32::from(FLAG_FIXED_NEWSTYLE | (hflags & FLAG_NO_ZEROES));
    w.write_all(&cflags.to_be_bytes())?;

    send_option(&mut w, OPT_STRUCTURED_REPLY, &[])?;
    let (typ, _) = read_option_reply(&mut s, OPT_STRUCTURED_REPLY)?;
    let structured = typ == REP_ACK;

    let mut go = Vec::new();
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(&mut w, OPT_GO, &go)?;
    let mut size = None;
    let mut flags = 0;
    let mut max_payload = DEFAULT_MAX_PAYLOAD;
    let mut replies = 0;
    loop {
        replies += 1;
        if replies > MAX_OPT_REPLIES {
            return Err(NbdError::Protocol(format!(
                "more than {MAX_OPT_REPLIES} replies to NBD_OPT_GO"
            )));
        }
        let (typ, data) = read_option_reply(&mut s, OPT_GO)?;
        if typ & REP_ERR_BIT != 0 {
            return Err(NbdError::Refused {
                export: export.to_string(),
                code: typ,
                message: String::from_utf8_lossy(&data).into_owned(),
            });
        }
        match typ {
            REP_ACK => break,
            REP_INFO if data.len() >= 2 => {
                let info = u16::from_be_bytes([data[0], data[1]]);
                match info {
                    INFO_EXPORT if data.len() >= 12 => {
                        size = Some(u64::from_be_bytes(data[2..10].try_into().expect("8")));
                        flags = u16::from_be_bytes([data[10], data[11]]);
                    }
                    INFO_BLOCK_SIZE if data.len() >= 14 => {
                        let max = u32::from_be_bytes(data[10..14].try_into().expect("4"));
                        if max > 0 {
                            max_payload = max.min(DEFAULT_MAX_PAYLOAD);
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    let size =
        size.ok_or_else(|| NbdError::Protocol("NBD_OPT_GO ended without export info".into()))?;
    sock.set_read_timeout(None)?;
    Ok((
        sock,
        ExportInfo {
            size,
            flags,
            max_payload,
            structured,
        },
    ))
}

pub(super) fn disconnect(s: &UnixStream) {
    let mut req = [0u8; 28];
    req[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    req[6..8].copy_from_slice(&CMD_DISC.to_be_bytes());
    let _ = (&*s).write_all(&req);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A hostile NBD server: greets, acks structured replies, then answers NBD_OPT_GO with
    /// `info` for every reply until the client hangs up.
    fn hostile(
        info: impl Fn(&mut UnixStream) -> io::Result<()> + Send + 'static,
    ) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("nbd.sock");
        let l = UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut g = Vec::new();
            g.extend_from_slice(&NBDMAGIC.to_be_bytes());
            g.extend_from_slice(&IHAVEOPT.to_be_bytes());
            g.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
            s.write_all(&g).unwrap();
            let _ = rd_u32(&mut s);
            let mut opt = [0u8; 16];
            s.read_exact(&mut opt).unwrap();
            reply(&mut s, OPT_STRUCTURED_REPLY, REP_ACK, &[]).unwrap();
            let mut go = [0u8; 16];
            s.read_exact(&mut go).unwrap();
            let len = u32::from_be_bytes(go[12..16].try_into().unwrap());
            let mut data = vec![0; len as usize];
            s.read_exact(&mut data).unwrap();
            while info(&mut s).is_ok() {}
        });
        (dir, p)
    }

    fn reply(s: &mut UnixStream, opt: u32, typ: u32, data: &[u8]) -> io::Result<()> {
        let mut m = Vec::new();
        m.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&typ.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m)
    }

    /// `connect` in a thread: its result, or None if it did not return within 20 s.
    fn try_connect(
        p: std::path::PathBuf,
        timeout: Duration,
    ) -> Option<Result<(UnixStream, ExportInfo), NbdError>> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(connect_within(&p, "x", timeout));
        });
        rx.recv_timeout(Duration::from_secs(20)).ok()
    }

    #[test]
    fn endless_info_replies_are_refused() {
        let (_d, p) = hostile(|s| {
            let mut d = vec![0u8; 14];
            d[1] = INFO_BLOCK_SIZE as u8;
            reply(s, OPT_GO, REP_INFO, &d)
        });
        match try_connect(p, HANDSHAKE_TIMEOUT).expect("the handshake must end") {
            Err(NbdError::Protocol(m)) => assert!(m.contains("replies"), "{m}"),
            other => panic!("expected a protocol error, got {:?}", other.map(|c| c.1)),
        }
    }

    #[test]
    fn a_huge_info_length_is_refused() {
        let (_d, p) = hostile(|s| {
            let mut m = Vec::new();
            m.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
            m.extend_from_slice(&OPT_GO.to_be_bytes());
            m.extend_from_slice(&REP_INFO.to_be_bytes());
            m.extend_from_slice(&u32::MAX.to_be_bytes());
            s.write_all(&m)?;
            // Then nothing: the client must not wait for 4 GiB.
            std::thread::sleep(Duration::from_secs(30));
            Err(io::ErrorKind::Other.into())
        });
        match try_connect(p, HANDSHAKE_TIMEOUT).expect("the handshake must end") {
            Err(NbdError::Protocol(m)) => assert!(m.contains("bytes"), "{m}"),
            other => panic!("expected a protocol error, got {:?}", other.map(|c| c.1)),
        }
    }

    #[test]
    fn a_trickling_server_hits_the_handshake_deadline() {
        // One byte of an INFO reply at a time, each well within any per-read timeout.
        let (_d, p) = hostile(|s| {
            let mut m = Vec::new();
            m.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
            m.extend_from_slice(&OPT_GO.to_be_bytes());
            m.extend_from_slice(&REP_INFO.to_be_bytes());
            m.extend_from_slice(&(MAX_OPT_REPLY).to_be_bytes());
            s.write_all(&m)?;
            for _ in 0..MAX_OPT_REPLY {
                s.write_all(&[0])?;
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        });
        match try_connect(p, Duration::from_millis(500)).expect("the handshake must end") {
            Err(NbdError::Io(e)) => assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}"),
            other => panic!("expected a timeout, got {:?}", other.map(|c| c.1)),
        }
    }
}
