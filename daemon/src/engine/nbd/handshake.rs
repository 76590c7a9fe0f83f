//! The NBD handshake: fixed newstyle, structured replies, OPT_GO with block sizes.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::*;

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

/// Whether an NBD server greets on `path` (a fixed-newstyle greeting within `timeout`). The
/// connection is dropped before any option is sent.
pub fn greets(path: &Path, timeout: Duration) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else {
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
    let mut s = UnixStream::connect(path).map_err(|source| NbdError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    s.set_read_timeout(Some(SEND_TIMEOUT))?;
    s.set_write_timeout(Some(SEND_TIMEOUT))?;
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
    s.write_all(&cflags.to_be_bytes())?;

    send_option(&mut s, OPT_STRUCTURED_REPLY, &[])?;
    let (typ, _) = read_option_reply(&mut s, OPT_STRUCTURED_REPLY)?;
    let structured = typ == REP_ACK;

    let mut go = Vec::new();
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(&mut s, OPT_GO, &go)?;
    let mut size = None;
    let mut flags = 0;
    let mut max_payload = DEFAULT_MAX_PAYLOAD;
    loop {
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
    s.set_read_timeout(None)?;
    Ok((
        s,
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
