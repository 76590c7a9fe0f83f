//! The NBD reply parser: pure functions over the bytes a server sends (no socket, no guest
//! memory), so a hostile server's every answer can be checked in isolation and fuzzed.
//!
//! A reply starts with a 4-byte magic that fixes the header's length: a simple reply (NBD
//! spec "Simple reply message", 16 bytes) or a structured reply chunk ("Structured reply
//! chunk message", 20 bytes, then `length` bytes of payload). A chunk's payload starts with a
//! fixed prefix whose size depends on its type (offset for data, offset + size for a hole,
//! error + message length for an error), checked here against the chunk's length.

use thiserror::Error;

use super::proto::{
    REPLY_TYPE_ERROR_BIT, REPLY_TYPE_NONE, REPLY_TYPE_OFFSET_DATA, REPLY_TYPE_OFFSET_HOLE,
    SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};

/// A reply the server should not have sent.
#[derive(Debug, Error)]
pub enum ReplyError {
    #[error("reply magic {0:#x}")]
    Magic(u32),
    #[error("{what} chunk of {len} bytes")]
    ChunkLength { what: &'static str, len: u32 },
    #[error("error message longer than its chunk")]
    ErrorMessage,
    #[error("reply for unknown request slot {0}")]
    UnknownSlot(u32),
    #[error("reply data at {offset}+{len} outside the request")]
    OutsideRequest { offset: u64, len: u64 },
    #[error("data reply to a request without data")]
    NoData,
    #[error("simple reply with data to a read, after structured replies were negotiated")]
    SimpleRead,
    #[error("server closed the connection")]
    Closed,
    #[error("reading replies")]
    Io(#[source] std::io::Error),
}

/// The header of one reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply; a successful READ's data follows it.
    Simple { error: u32, cookie: u64 },
    /// One chunk of a structured reply; `len` bytes of payload follow it.
    Structured {
        flags: u16,
        typ: u16,
        cookie: u64,
        len: u32,
    },
}

impl ReplyHeader {
    pub fn cookie(&self) -> u64 {
        match *self {
            ReplyHeader::Simple { cookie, .. } | ReplyHeader::Structured { cookie, .. } => cookie,
        }
    }
}

/// Length of the whole header whose first 4 bytes are `magic`.
pub fn header_len(magic: u32) -> Result<usize, ReplyError> {
    match magic {
        SIMPLE_REPLY_MAGIC => Ok(16),
        STRUCTURED_REPLY_MAGIC => Ok(20),
        m => Err(ReplyError::Magic(m)),
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Parses a whole header (`b` holds exactly [`header_len`] bytes, magic included).
pub fn parse_header(b: &[u8]) -> Result<ReplyHeader, ReplyError> {
    if b.len() < 4 {
        return Err(ReplyError::Closed);
    }
    let magic = be32(b);
    let want = header_len(magic)?;
    if b.len() != want {
        return Err(ReplyError::Closed);
    }
    Ok(match magic {
        SIMPLE_REPLY_MAGIC => ReplyHeader::Simple {
            error: be32(&b[4..]),
            cookie: be64(&b[8..]),
        },
        _ => ReplyHeader::Structured {
            flags: be16(&b[4..]),
            typ: be16(&b[6..]),
            cookie: be64(&b[8..]),
            len: be32(&b[16..]),
        },
    })
}

/// What a structured chunk carries, from its type, length and fixed prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunk {
    /// NONE, or a type this client does not know: `skip` payload bytes to discard.
    Skip { skip: u32 },
    /// OFFSET_DATA: `len` bytes of data for disk offset `offset` follow.
    Data { offset: u64, len: u32 },
    /// OFFSET_HOLE: `len` bytes at `offset` read as zeroes; nothing follows.
    Hole { offset: u64, len: u32 },
    /// An error chunk: a message of `msg_len` bytes follows, then `skip` bytes to discard.
    Error { errno: i32, msg_len: u16, skip: u32 },
}

/// How many bytes of a chunk's payload to read before [`parse_chunk`] can tell what it is.
pub fn chunk_prefix_len(typ: u16, len: u32) -> Result<usize, ReplyError> {
    let need = match typ {
        REPLY_TYPE_NONE => 0,
        REPLY_TYPE_OFFSET_DATA => 8,
        REPLY_TYPE_OFFSET_HOLE => {
            if len != 12 {
                return Err(ReplyError::ChunkLength {
                    what: "OFFSET_HOLE",
                    len,
                });
            }
            12
        }
        t if t & REPLY_TYPE_ERROR_BIT != 0 => 6,
        _ => 0,
    };
    if len < need {
        let what = match typ {
            REPLY_TYPE_OFFSET_DATA => "OFFSET_DATA",
            _ => "error",
        };
        return Err(ReplyError::ChunkLength { what, len });
    }
    Ok(need as usize)
}

/// Parses a chunk from its header fields and the prefix [`chunk_prefix_len`] named.
pub fn parse_chunk(typ: u16, len: u32, prefix: &[u8]) -> Result<Chunk, ReplyError> {
    let need = chunk_prefix_len(typ, len)?;
    if prefix.len() != need {
        return Err(ReplyError::Closed);
    }
    Ok(match typ {
        REPLY_TYPE_OFFSET_DATA => Chunk::Data {
            offset: be64(prefix),
            len: len - 8,
        },
        REPLY_TYPE_OFFSET_HOLE => Chunk::Hole {
            offset: be64(prefix),
            len: be32(&prefix[8..]),
        },
        t if t & REPLY_TYPE_ERROR_BIT != 0 => {
            let msg_len = be16(&prefix[4..]);
            if u32::from(msg_len) + 6 > len {
                return Err(ReplyError::ErrorMessage);
            }
            let e = nbd_errno(be32(prefix));
            Chunk::Error {
                errno: if e == 0 { -libc::EIO } else { e },
                msg_len,
                skip: len - 6 - u32::from(msg_len),
            }
        }
        _ => Chunk::Skip { skip: len },
    })
}

/// Where reply data for disk bytes [offset, offset+len) falls in a request covering
/// [req_offset, req_offset+req_len): the offset into the request.
pub fn data_range(req_offset: u64, req_len: u64, offset: u64, len: u64) -> Result<u64, ReplyError> {
    offset
        .checked_sub(req_offset)
        .filter(|f| f.checked_add(len).is_some_and(|e| e <= req_len))
        .ok_or(ReplyError::OutsideRequest { offset, len })
}

/// The bytes a simple reply's READ carries for part `part` of a request (parts are
/// `max_payload` long): (disk offset, length).
pub fn simple_read_part(req_offset: u64, req_len: u64, part: u64, max_payload: u64) -> (u64, u64) {
    let poff = part.saturating_mul(max_payload);
    (
        req_offset.saturating_add(poff),
        (req_len - poff.min(req_len)).min(max_payload),
    )
}

/// NBD errors are errno values of the protocol's own numbering; these match Linux's. 0 stays
/// 0 (success); anything unknown is EIO.
pub fn nbd_errno(e: u32) -> i32 {
    match e {
        0 => 0,
        1 | 5 | 12 | 22 | 28 | 75 | 95 | 108 => -(e as i32),
        _ => -libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn structured(flags: u16, typ: u16, cookie: u64, len: u32) -> Vec<u8> {
        let mut b = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    #[test]
    fn headers() {
        let mut s = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        s.extend_from_slice(&5u32.to_be_bytes());
        s.extend_from_slice(&7u64.to_be_bytes());
        assert_eq!(header_len(SIMPLE_REPLY_MAGIC).unwrap(), 16);
        assert_eq!(
            parse_header(&s).unwrap(),
            ReplyHeader::Simple {
                error: 5,
                cookie: 7
            }
        );
        let h = structured(1, REPLY_TYPE_OFFSET_DATA, 9 << 32, 4104);
        assert_eq!(
            parse_header(&h).unwrap(),
            ReplyHeader::Structured {
                flags: 1,
                typ: 1,
                cookie: 9 << 32,
                len: 4104
            }
        );
        assert!(matches!(
            header_len(0xdead_beef),
            Err(ReplyError::Magic(0xdead_beef))
        ));
        assert!(parse_header(&h[..19]).is_err(), "short header");
    }

    #[test]
    fn chunks() {
        let mut p = 4096u64.to_be_bytes().to_vec();
        assert_eq!(chunk_prefix_len(REPLY_TYPE_OFFSET_DATA, 4104).unwrap(), 8);
        assert_eq!(
            parse_chunk(REPLY_TYPE_OFFSET_DATA, 4104, &p).unwrap(),
            Chunk::Data {
                offset: 4096,
                len: 4096
            }
        );
        assert!(chunk_prefix_len(REPLY_TYPE_OFFSET_DATA, 7).is_err());
        assert!(chunk_prefix_len(REPLY_TYPE_OFFSET_HOLE, 13).is_err());
        p.extend_from_slice(&512u32.to_be_bytes());
        assert_eq!(
            parse_chunk(REPLY_TYPE_OFFSET_HOLE, 12, &p).unwrap(),
            Chunk::Hole {
                offset: 4096,
                len: 512
            }
        );
        let mut e = 28u32.to_be_bytes().to_vec();
        e.extend_from_slice(&3u16.to_be_bytes());
        assert_eq!(
            parse_chunk(REPLY_TYPE_ERROR_BIT | 1, 10, &e).unwrap(),
            Chunk::Error {
                errno: -28,
                msg_len: 3,
                skip: 1
            }
        );
        assert!(matches!(
            parse_chunk(REPLY_TYPE_ERROR_BIT | 1, 8, &e),
            Err(ReplyError::ErrorMessage)
        ));
        let mut zero = 0u32.to_be_bytes().to_vec();
        zero.extend_from_slice(&0u16.to_be_bytes());
        assert!(
            matches!(
                parse_chunk(REPLY_TYPE_ERROR_BIT | 1, 6, &zero).unwrap(),
                Chunk::Error { errno, .. } if errno == -libc::EIO
            ),
            "an error chunk with error 0 is still an error"
        );
        assert_eq!(parse_chunk(77, 5, &[]).unwrap(), Chunk::Skip { skip: 5 });
    }

    #[test]
    fn ranges() {
        assert_eq!(data_range(4096, 8192, 8192, 4096).unwrap(), 4096);
        assert!(
            data_range(4096, 8192, 0, 512).is_err(),
            "before the request"
        );
        assert!(data_range(4096, 8192, 8192, 8192).is_err(), "past its end");
        assert!(data_range(0, u64::MAX, u64::MAX, 2).is_err(), "overflow");
        assert_eq!(simple_read_part(100, 10, 0, 4), (100, 4));
        assert_eq!(simple_read_part(100, 10, 2, 4), (108, 2));
        assert_eq!(simple_read_part(100, 10, 9, 4), (136, 0));
        assert_eq!(simple_read_part(0, 10, u64::MAX, 4).1, 0);
    }

    /// Random bytes never panic the parser and every accepted chunk stays inside its length.
    #[test]
    fn random_input_is_answered_never_panics() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200_000 {
            let r = next();
            let magic = if r & 3 == 0 {
                r as u32
            } else if r & 1 == 0 {
                SIMPLE_REPLY_MAGIC
            } else {
                STRUCTURED_REPLY_MAGIC
            };
            let mut b = magic.to_be_bytes().to_vec();
            for _ in 0..3 {
                b.extend_from_slice(&next().to_be_bytes());
            }
            let Ok(n) = header_len(magic) else { continue };
            let Ok(h) = parse_header(&b[..n]) else {
                continue;
            };
            if let ReplyHeader::Structured { typ, len, .. } = h {
                let typ = if r & 8 == 0 { typ & 0x8003 } else { typ };
                let len = if r & 16 == 0 { len % 32 } else { len };
                if let Ok(p) = chunk_prefix_len(typ, len) {
                    let prefix: Vec<u8> = (0..p).map(|_| next() as u8).collect();
                    match parse_chunk(typ, len, &prefix) {
                        Ok(Chunk::Data { len: l, .. }) => assert_eq!(l + 8, len),
                        Ok(Chunk::Error { msg_len, skip, .. }) => {
                            assert_eq!(u32::from(msg_len) + 6 + skip, len)
                        }
                        Ok(Chunk::Skip { skip }) => assert_eq!(skip, len),
                        Ok(Chunk::Hole { .. }) => assert_eq!(len, 12),
                        Err(_) => {}
                    }
                }
            }
            let (a, l, o, m) = (next(), next(), next(), next());
            if let Ok(f) = data_range(a, l, o, m) {
                assert!(f.checked_add(m).is_some_and(|e| e <= l));
            }
        }
    }
}
