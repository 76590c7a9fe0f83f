//! A hostile NBD server: a correct fixed-newstyle handshake (with structured replies), then
//! answers to READ requests that break the protocol in one chosen way. For tests of the qemu
//! engine's reply parser against a server that lies.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// How the server answers each request after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// Reads requests and never answers (a hung export).
    Silent,
    /// A simple reply with a cookie no request has.
    WrongCookie,
    /// A data chunk larger than the request.
    Oversized,
    /// A data chunk that announces the request's length, then half of it, then EOF.
    ShortData,
    /// Random bytes instead of a reply.
    Garbage,
    /// An error chunk whose message is longer than the chunk.
    ErrorTooLong,
    /// A hole chunk whose length is not 12.
    BadHole,
    /// A well-formed error chunk, EIO, for every request (a failing disk behind the export).
    Eio,
    /// A simple reply followed by data, to a read, although structured replies were agreed.
    SimpleDataRead,
    /// An OFFSET_DATA chunk answering a write (a device must never write into the buffers
    /// of a write).
    DataForWrite,
}

impl Behaviour {
    pub const ALL: [Behaviour; 9] = [
        Behaviour::Silent,
        Behaviour::WrongCookie,
        Behaviour::Oversized,
        Behaviour::ShortData,
        Behaviour::Garbage,
        Behaviour::ErrorTooLong,
        Behaviour::BadHole,
        Behaviour::SimpleDataRead,
        Behaviour::DataForWrite,
    ];
}

pub struct HostileNbd {
    pub socket: PathBuf,
    pub export: String,
}

const STRUCTURED: u32 = 0x668e_33ef;
const SIMPLE: u32 = 0x6744_6698;

impl HostileNbd {
    /// Listens on `socket`; every connection is served on its own thread.
    pub fn start(socket: &Path, size: u64, how: Behaviour) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(socket);
        let l = UnixListener::bind(socket)?;
        std::thread::spawn(move || {
            for c in l.incoming().map_while(Result::ok) {
                std::thread::spawn(move || {
                    let _ = serve(c, size, how);
                });
            }
        });
        Ok(HostileNbd {
            socket: socket.to_path_buf(),
            export: "hostile".into(),
        })
    }
}

/// One request's header: (type, cookie, offset, length).
fn read_request(s: &mut UnixStream) -> std::io::Result<(u16, u64, u64, u32)> {
    let mut h = [0u8; 28];
    s.read_exact(&mut h)?;
    Ok((
        u16::from_be_bytes(h[6..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        u64::from_be_bytes(h[16..24].try_into().unwrap()),
        u32::from_be_bytes(h[24..28].try_into().unwrap()),
    ))
}

/// A structured reply chunk's header.
fn chunk_header(cookie: u64, flags: u16, ctype: u16, clen: u32) -> Vec<u8> {
    let mut r = STRUCTURED.to_be_bytes().to_vec();
    r.extend_from_slice(&flags.to_be_bytes());
    r.extend_from_slice(&ctype.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&clen.to_be_bytes());
    r
}

/// A simple reply (error 0) to `cookie`.
fn simple_ok(cookie: u64) -> Vec<u8> {
    let mut r = SIMPLE.to_be_bytes().to_vec();
    r.extend_from_slice(&0u32.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r
}

fn serve(mut s: UnixStream, size: u64, how: Behaviour) -> std::io::Result<()> {
    crate::nbd_server::handshake(&mut s, size, 1 | 4 | 8 | 32 | 64, true, &|_| true)?;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    loop {
        let (typ, cookie, off, len) = read_request(&mut s)?;
        if typ == 1 {
            let mut d = vec![0u8; len as usize];
            s.read_exact(&mut d)?;
        }
        if typ == 2 {
            return Ok(());
        }
        let chunk = |flags: u16, ctype: u16, clen: u32| chunk_header(cookie, flags, ctype, clen);
        let out: Vec<u8> = match how {
            Behaviour::Silent => continue,
            Behaviour::SimpleDataRead => {
                let mut r = simple_ok(cookie);
                r.extend(std::iter::repeat_n(0x5a, len as usize));
                r
            }
            Behaviour::DataForWrite => {
                let mut r = chunk(1, 1, len + 8);
                r.extend_from_slice(&off.to_be_bytes());
                r.extend(std::iter::repeat_n(0x77, len as usize));
                r
            }
            Behaviour::WrongCookie => {
                let mut r = SIMPLE.to_be_bytes().to_vec();
                r.extend_from_slice(&0u32.to_be_bytes());
                r.extend_from_slice(&(cookie ^ 0xdead_0000_0000).to_be_bytes());
                r
            }
            Behaviour::Oversized => {
                let extra = len + 4096;
                let mut r = chunk(1, 1, extra + 8);
                r.extend_from_slice(&off.to_be_bytes());
                r.extend(std::iter::repeat_n(0xab, extra as usize));
                r
            }
            Behaviour::ShortData => {
                let mut r = chunk(1, 1, len + 8);
                r.extend_from_slice(&off.to_be_bytes());
                r.extend(std::iter::repeat_n(0xcd, (len / 2) as usize));
                s.write_all(&r)?;
                return Ok(());
            }
            Behaviour::Garbage => (0..64)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect(),
            Behaviour::ErrorTooLong => {
                let mut r = chunk(1, (1 << 15) | 1, 6);
                r.extend_from_slice(&5u32.to_be_bytes());
                r.extend_from_slice(&60_000u16.to_be_bytes());
                r
            }
            Behaviour::Eio => {
                let mut r = chunk(1, (1 << 15) | 1, 6);
                r.extend_from_slice(&5u32.to_be_bytes());
                r.extend_from_slice(&0u16.to_be_bytes());
                r
            }
            Behaviour::BadHole => {
                let mut r = chunk(1, 2, 16);
                r.extend_from_slice(&off.to_be_bytes());
                r.extend_from_slice(&len.to_be_bytes());
                r.extend_from_slice(&[0; 4]);
                r
            }
        };
        s.write_all(&out)?;
    }
}

/// An NBD server over a real file that answers everything except writes to odd 4 KiB
/// blocks: those it reads and then neither performs nor answers, as a disk that completes
/// requests out of order and never finishes some. For inflight-tracking tests: the requests
/// it holds are exactly the ones a new backend must resubmit.
pub fn start_holding_odd_writes(socket: &Path, image: &Path) -> std::io::Result<HostileNbd> {
    let _ = std::fs::remove_file(socket);
    let l = UnixListener::bind(socket)?;
    let image = image.to_path_buf();
    std::thread::spawn(move || {
        for c in l.incoming().map_while(Result::ok) {
            let image = image.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = c;
                let f = std::fs::File::options()
                    .read(true)
                    .write(true)
                    .open(&image)?;
                let size = f.metadata()?.len();
                crate::nbd_server::handshake(&mut s, size, 1 | 4 | 8 | 32 | 64, false, &|_| true)?;
                // Writes to odd 4 KiB blocks are taken and never performed nor answered.
                crate::nbd_server::serve_file(&mut s, &f, |off| (off / 4096) % 2 == 1)
            });
        }
    });
    Ok(HostileNbd {
        socket: socket.to_path_buf(),
        export: "holding".into(),
    })
}

/// The byte an [`start_awkward`] export holds at disk offset `o` (where it sends data).
pub fn awkward_byte(o: u64) -> u8 {
    ((o / 7) ^ (o >> 12) ^ 0x3c) as u8
}

/// A correct NBD server (structured replies, DF offered) that frames its replies as awkwardly
/// as the protocol allows, cycling per request (`i` counts requests in arrival order):
/// - `i % 3 == 0`: a read's one OFFSET_DATA chunk, written one byte at a time;
/// - `i % 3 == 1`: a read in three chunks, data for its first half, a hole for the next
///   quarter (it reads as zeroes), data for the rest, DONE only on the last;
/// - `i % 3 == 2`: one chunk written in two pieces split inside the header.
///
/// Reads return [`awkward_byte`]; writes are taken and answered with a simple reply (what
/// QEMU sends for a successful write even with structured replies); other commands with a
/// NONE chunk. For tests of the reply reader's framing.
pub fn start_awkward(socket: &Path, size: u64) -> std::io::Result<HostileNbd> {
    let _ = std::fs::remove_file(socket);
    let l = UnixListener::bind(socket)?;
    std::thread::spawn(move || {
        for c in l.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let _ = serve_awkward(c, size);
            });
        }
    });
    Ok(HostileNbd {
        socket: socket.to_path_buf(),
        export: "awkward".into(),
    })
}

fn serve_awkward(mut s: UnixStream, size: u64) -> std::io::Result<()> {
    // HAS_FLAGS, SEND_FLUSH, SEND_FUA, SEND_TRIM, SEND_WRITE_ZEROES, SEND_DF.
    crate::nbd_server::handshake(&mut s, size, 1 | 4 | 8 | 32 | 64 | 128, true, &|_| true)?;
    let mut i = 0u64;
    loop {
        let (typ, cookie, off, len) = read_request(&mut s)?;
        let chunk = |flags: u16, ctype: u16, clen: u32| chunk_header(cookie, flags, ctype, clen);
        let data = |from: u64, n: u64| (from..from + n).map(awkward_byte).collect::<Vec<u8>>();
        match typ {
            0 => {
                let n = u64::from(len);
                match i % 3 {
                    0 => {
                        let mut r = chunk(1, 1, len + 8);
                        r.extend_from_slice(&off.to_be_bytes());
                        r.extend(data(off, n));
                        for b in r {
                            s.write_all(&[b])?;
                        }
                    }
                    1 => {
                        let (a, b) = (n / 2, n / 4);
                        let mut r = chunk(0, 1, a as u32 + 8);
                        r.extend_from_slice(&off.to_be_bytes());
                        r.extend(data(off, a));
                        r.extend(chunk(0, 2, 12));
                        r.extend_from_slice(&(off + a).to_be_bytes());
                        r.extend_from_slice(&(b as u32).to_be_bytes());
                        let rest = n - a - b;
                        r.extend(chunk(1, 1, rest as u32 + 8));
                        r.extend_from_slice(&(off + a + b).to_be_bytes());
                        r.extend(data(off + a + b, rest));
                        s.write_all(&r)?;
                    }
                    _ => {
                        let mut r = chunk(1, 1, len + 8);
                        r.extend_from_slice(&off.to_be_bytes());
                        r.extend(data(off, n));
                        s.write_all(&r[..11])?;
                        s.flush()?;
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        s.write_all(&r[11..])?;
                    }
                }
            }
            1 => {
                let mut d = vec![0u8; len as usize];
                s.read_exact(&mut d)?;
                s.write_all(&simple_ok(cookie))?;
            }
            2 => return Ok(()),
            _ => s.write_all(&chunk(1, 0, 0))?,
        }
        i += 1;
    }
}
