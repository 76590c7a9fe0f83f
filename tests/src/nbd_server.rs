//! The server side of the NBD handshake, for the test servers (the fake QEMU's export and the
//! hostile server): fixed newstyle, optional structured replies, OPT_GO.

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
