//! The server side of the NBD handshake, for the test servers (the fake QEMU's export and the
//! hostile server): fixed newstyle, optional structured replies, OPT_GO; then simple replies
//! to requests on a file.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

/// Negotiates up to OPT_GO. `structured`: accept NBD_OPT_STRUCTURED_REPLY; `known`: whether an
/// export name exists. The export has `size` bytes and transmission flags `flags`.
pub fn handshake(
    s: &mut UnixStream,
    size: u64,
    flags: u16,
    structured: bool,
    known: &dyn Fn(&str) -> bool,
) -> std::io::Result<()> {
    s.write_all(b"NBDMAGICIHAVEOPT")?;
    s.write_all(&3u16.to_be_bytes())?;
    let mut b4 = [0u8; 4];
    s.read_exact(&mut b4)?;
    loop {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut data = vec![0u8; len.min(4096) as usize];
        s.read_exact(&mut data)?;
        let reply = |s: &mut UnixStream, typ: u32, payload: &[u8]| -> std::io::Result<()> {
            let mut r = Vec::new();
            r.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
            r.extend_from_slice(&opt.to_be_bytes());
            r.extend_from_slice(&typ.to_be_bytes());
            r.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            r.extend_from_slice(payload);
            s.write_all(&r)
        };
        match opt {
            OPT_STRUCTURED_REPLY if structured => reply(s, REP_ACK, &[])?,
            OPT_GO => {
                let nlen = data
                    .get(0..4)
                    .map_or(0, |b| u32::from_be_bytes(b.try_into().unwrap()) as usize);
                let name = data.get(4..4 + nlen).unwrap_or_default();
                if !known(&String::from_utf8_lossy(name)) {
                    reply(s, REP_ERR_UNKNOWN, b"unknown export")?;
                    continue;
                }
                let mut info = Vec::new();
                info.extend_from_slice(&0u16.to_be_bytes());
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&flags.to_be_bytes());
                reply(s, REP_INFO, &info)?;
                return reply(s, REP_ACK, &[]);
            }
            _ => reply(s, REP_ERR_UNSUP, b"unsupported")?,
        }
    }
}

/// Serves requests on `f` with simple replies until the client disconnects. A write at an
/// offset for which `hold_write` is true is read and then neither performed nor answered (a
/// request that never completes).
pub fn serve_file(
    s: &mut UnixStream,
    f: &std::fs::File,
    hold_write: impl Fn(u64) -> bool,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    loop {
        let mut h = [0u8; 28];
        s.read_exact(&mut h)?;
        let typ = u16::from_be_bytes(h[6..8].try_into().unwrap());
        let cookie = &h[8..16];
        let off = u64::from_be_bytes(h[16..24].try_into().unwrap());
        let len = u32::from_be_bytes(h[24..28].try_into().unwrap()) as usize;
        let mut out = Vec::with_capacity(16);
        out.extend_from_slice(&0x6744_6698u32.to_be_bytes());
        let mut payload = Vec::new();
        let err: u32 = match typ {
            0 => {
                payload = vec![0u8; len];
                f.read_exact_at(&mut payload, off).map_or(5, |_| 0)
            }
            1 => {
                let mut d = vec![0u8; len];
                s.read_exact(&mut d)?;
                if hold_write(off) {
                    continue;
                }
                f.write_all_at(&d, off).map_or(5, |_| 0)
            }
            2 => return Ok(()),
            3 => f.sync_data().map_or(5, |_| 0),
            4 => 0,
            6 => f.write_all_at(&vec![0u8; len], off).map_or(5, |_| 0),
            _ => 22,
        };
        out.extend_from_slice(&err.to_be_bytes());
        out.extend_from_slice(cookie);
        if typ == 0 && err == 0 {
            out.extend_from_slice(&payload);
        }
        s.write_all(&out)?;
    }
}
