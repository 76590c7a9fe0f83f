//! A vhost-user front-end of QEMU's `vhost-user-blk` export: enough to lend it a guest's
//! rings: the session set-up QEMU's own front-end sends, SET_VRING_KICK without a descriptor
//! (the export stops popping), and GET_VRING_BASE. Every message that changes state asks for
//! an acknowledgement (REPLY_ACK), so an error is seen at the message that caused it.
//!
//! The export's replies are input like any other: a reply to another request, a short one or
//! an unknown flag fails the session with an error, never a panic or a wait without end (every
//! read and write on the socket is bounded by [`IO_TIMEOUT`]).

use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use thiserror::Error;

/// The longest the export may take to answer one message.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const GET_QUEUE_NUM: u32 = 17;
const SET_VRING_ENABLE: u32 = 18;
const SET_BACKEND_REQ_FD: u32 = 21;
const GET_CONFIG: u32 = 24;
const SET_CONFIG: u32 = 25;
const GET_MAX_MEM_SLOTS: u32 = 36;
const ADD_MEM_REG: u32 = 37;
const REM_MEM_REG: u32 = 38;

const VERSION: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;
const NOFD: u64 = 0x100;

/// VHOST_USER_F_PROTOCOL_FEATURES, a virtio feature bit of vhost-user.
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
const PROTOCOL_MQ: u64 = 1 << 0;
const PROTOCOL_REPLY_ACK: u64 = 1 << 3;
const PROTOCOL_BACKEND_REQ: u64 = 1 << 5;
const PROTOCOL_CONFIG: u64 = 1 << 9;
const PROTOCOL_CONFIGURE_MEM_SLOTS: u64 = 1 << 15;

/// Virtio feature bits a relay negotiates (virtio 1.2 §6 and §5.2.3).
pub const F_VERSION_1: u64 = 1 << 32;
pub const F_INDIRECT_DESC: u64 = 1 << 28;
pub const F_EVENT_IDX: u64 = 1 << 29;
pub const F_BLK_RO: u64 = 1 << 5;
pub const F_BLK_SIZE: u64 = 1 << 6;
pub const F_BLK_FLUSH: u64 = 1 << 9;
pub const F_BLK_CONFIG_WCE: u64 = 1 << 11;
pub const F_BLK_MQ: u64 = 1 << 12;
pub const F_BLK_DISCARD: u64 = 1 << 13;
pub const F_BLK_WRITE_ZEROES: u64 = 1 << 14;

/// What a relay learns from the export at set-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportConfig {
    /// The virtio features agreed.
    pub features: u64,
    /// The node's size in bytes (the config space's capacity, in 512-byte sectors).
    pub capacity: u64,
    /// The export's logical block size.
    pub blk_size: u32,
    /// How many queues the export has.
    pub num_queues: u16,
    /// Whether the export refuses writes (VIRTIO_BLK_F_RO).
    pub read_only: bool,
    /// Most memory slots the export takes (GET_MAX_MEM_SLOTS).
    pub max_mem_slots: u64,
    /// Whether the export has a back-end channel (it sends config changes on it).
    pub backend_channel: bool,
}

/// Bytes of the virtio-blk config space a relay reads (up to `write_zeroes_may_unmap`).
const BLK_CONFIG_LEN: u32 = 60;

/// Most regions one SET_MEM_TABLE carries (without CONFIGURE_MEM_SLOTS).
pub const MAX_REGIONS: usize = 8;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot connect to the export's socket {path}")]
    Connect {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the server on {path} runs as uid {got:?}, not as the VM's QEMU (uid {want})")]
    Peer {
        path: std::path::PathBuf,
        want: u32,
        got: Option<u32>,
    },
    #[error("vhost-user request {} to the export", req_name(*req))]
    Io {
        req: u32,
        #[source]
        source: io::Error,
    },
    #[error("the export refused {} (status {status})", req_name(*req))]
    Refused { req: u32, status: u64 },
    #[error("the export's reply to {} is malformed: {what}", req_name(*req))]
    BadReply { req: u32, what: String },
    #[error("the export lacks what acceld needs: {0}")]
    Unsupported(String),
}

/// One guest memory region as the export gets it: the guest-physical range and where it
/// lies in `fd`. The table's "user address" of a region is its guest-physical address, so
/// ring addresses are sent as guest-physical addresses too.
#[derive(Clone, Copy, Debug)]
pub struct Region<'a> {
    pub gpa: u64,
    pub size: u64,
    pub fd: BorrowedFd<'a>,
    pub offset: u64,
}

/// The addresses and position of one split ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingAddr {
    pub index: u32,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// The next avail entry the export pops.
    pub base: u16,
}

/// A session with the export.
pub struct Client {
    sock: UnixStream,
    reply_ack: bool,
}

impl Client {
    /// Connects and negotiates: the guest's `features` (which must all be offered by the
    /// export, PROTOCOL_FEATURES aside), REPLY_ACK and MQ, SET_OWNER. `queues` rings are
    /// needed.
    /// `peer_uid`: the server must run as this user (the VM's QEMU).
    pub fn connect(
        path: &Path,
        peer_uid: Option<u32>,
        features: u64,
        queues: u32,
    ) -> Result<Client, ClientError> {
        let mut c = Self::open(path, peer_uid)?;
        c.negotiate(features, queues)?;
        Ok(c)
    }

    fn open(path: &Path, peer_uid: Option<u32>) -> Result<Client, ClientError> {
        // The export's socket is in the VM's directory: a listener that never accepts
        // holds the connect 5 s at most.
        let sock = crate::util::connect_unix(path, std::time::Duration::from_secs(5)).map_err(
            |source| ClientError::Connect {
                path: path.to_path_buf(),
                source,
            },
        )?;
        if let Some(want) = peer_uid {
            let got = crate::util::peer_uid(sock.as_raw_fd());
            if got != Some(want) {
                return Err(ClientError::Peer {
                    path: path.to_path_buf(),
                    want,
                    got,
                });
            }
        }
        let io = |source| ClientError::Io { req: 0, source };
        sock.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
        sock.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
        Ok(Client {
            sock,
            reply_ack: false,
        })
    }

    fn negotiate(&mut self, features: u64, queues: u32) -> Result<(), ClientError> {
        let c = self;
        let offered = c.get_u64(GET_FEATURES)?;
        let wanted = features & !F_PROTOCOL_FEATURES;
        if wanted & !offered != 0 {
            return Err(ClientError::Unsupported(format!(
                "virtio features {:#x}",
                wanted & !offered
            )));
        }
        if offered & F_PROTOCOL_FEATURES == 0 {
            return Err(ClientError::Unsupported("protocol features".into()));
        }
        let proto = c.get_u64(GET_PROTOCOL_FEATURES)?;
        let need = PROTOCOL_REPLY_ACK | if queues > 1 { PROTOCOL_MQ } else { 0 };
        if proto & need != need {
            return Err(ClientError::Unsupported(format!(
                "protocol features {:#x}",
                need & !proto
            )));
        }
        c.set(SET_PROTOCOL_FEATURES, &(proto & need).to_le_bytes(), &[])?;
        c.reply_ack = true;
        if queues > 1 {
            let n = c.get_u64(GET_QUEUE_NUM)?;
            if n < u64::from(queues) {
                return Err(ClientError::Unsupported(format!(
                    "{queues} queues (the export has {n})"
                )));
            }
        }
        c.set(SET_OWNER, &[], &[])?;
        c.set(
            SET_FEATURES,
            &(wanted | F_PROTOCOL_FEATURES).to_le_bytes(),
            &[],
        )
    }

    /// Connects as a relay: acceld's own rings, so acceld picks the virtio features
    /// (VERSION_1, INDIRECT_DESC and EVENT_IDX are required; FLUSH, DISCARD, WRITE_ZEROES,
    /// CONFIG_WCE, BLK_SIZE, MQ and RO are taken when offered), never LOG_ALL (QEMU's log must
    /// not reach the export: its log code asserts on any address outside the log). Protocol
    /// features: REPLY_ACK, CONFIGURE_MEM_SLOTS and CONFIG are required, MQ for more than one
    /// queue, BACKEND_REQ when offered (`backend` is then sent as the back-end channel: the
    /// export writes a config change there on a resize and stops serving if it cannot).
    pub fn connect_relay(
        path: &Path,
        peer_uid: Option<u32>,
        queues: u32,
        backend: Option<BorrowedFd<'_>>,
    ) -> Result<(Client, ExportConfig), ClientError> {
        let mut c = Self::open(path, peer_uid)?;
        let offered = c.get_u64(GET_FEATURES)?;
        let need = F_VERSION_1 | F_INDIRECT_DESC | F_EVENT_IDX | F_PROTOCOL_FEATURES;
        if offered & need != need {
            return Err(ClientError::Unsupported(format!(
                "virtio features {:#x}",
                need & !offered
            )));
        }
        let optional = F_BLK_FLUSH
            | F_BLK_DISCARD
            | F_BLK_WRITE_ZEROES
            | F_BLK_CONFIG_WCE
            | F_BLK_SIZE
            | F_BLK_RO
            | if queues > 1 { F_BLK_MQ } else { 0 };
        let features = need | (offered & optional);
        let proto = c.get_u64(GET_PROTOCOL_FEATURES)?;
        let need_p = PROTOCOL_REPLY_ACK
            | PROTOCOL_CONFIGURE_MEM_SLOTS
            | PROTOCOL_CONFIG
            | if queues > 1 { PROTOCOL_MQ } else { 0 };
        if proto & need_p != need_p {
            return Err(ClientError::Unsupported(format!(
                "protocol features {:#x}",
                need_p & !proto
            )));
        }
        let with_backend = backend.is_some() && proto & PROTOCOL_BACKEND_REQ != 0;
        let agreed = need_p
            | if with_backend {
                PROTOCOL_BACKEND_REQ
            } else {
                0
            };
        c.set(SET_PROTOCOL_FEATURES, &agreed.to_le_bytes(), &[])?;
        c.reply_ack = true;
        let n = c.get_u64(GET_QUEUE_NUM)?;
        if n < u64::from(queues) {
            return Err(ClientError::Unsupported(format!(
                "{queues} queues (the export has {n})"
            )));
        }
        c.set(SET_OWNER, &[], &[])?;
        c.set(SET_FEATURES, &features.to_le_bytes(), &[])?;
        let max_mem_slots = c.get_u64(GET_MAX_MEM_SLOTS)?;
        if let (true, Some(fd)) = (with_backend, backend) {
            c.set(SET_BACKEND_REQ_FD, &[], &[fd])?;
        }
        let cfg = c.get_config(BLK_CONFIG_LEN)?;
        let u32_at = |o: usize| u32::from_le_bytes(cfg[o..o + 4].try_into().expect("4 bytes"));
        let capacity = u64::from_le_bytes(cfg[0..8].try_into().expect("8 bytes"));
        let blk_size = if features & F_BLK_SIZE != 0 {
            u32_at(20)
        } else {
            512
        };
        let num_queues = if features & F_BLK_MQ != 0 {
            u16::from_le_bytes(cfg[34..36].try_into().expect("2 bytes"))
        } else {
            1
        };
        let bad = |what: String| ClientError::BadReply {
            req: GET_CONFIG,
            what,
        };
        if !(512..=65536).contains(&blk_size) || !blk_size.is_power_of_two() {
            return Err(bad(format!("block size {blk_size}")));
        }
        let capacity = capacity
            .checked_mul(512)
            .ok_or_else(|| bad(format!("capacity {capacity} sectors")))?;
        if u32::from(num_queues) < queues {
            return Err(ClientError::Unsupported(format!(
                "{queues} queues (the export's config space has {num_queues})"
            )));
        }
        Ok((
            c,
            ExportConfig {
                features,
                capacity,
                blk_size,
                num_queues,
                read_only: features & F_BLK_RO != 0,
                max_mem_slots,
                backend_channel: with_backend,
            },
        ))
    }

    /// The first `len` bytes of the export's config space.
    pub fn get_config(&mut self, len: u32) -> Result<Vec<u8>, ClientError> {
        let mut p = Vec::with_capacity(12 + len as usize);
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&len.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.resize(12 + len as usize, 0);
        self.send(GET_CONFIG, 0, &p, &[])?;
        let b = self.reply(GET_CONFIG, 12 + len as usize)?;
        let got = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        if got != len {
            return Err(ClientError::BadReply {
                req: GET_CONFIG,
                what: format!("{got} config bytes, {len} asked"),
            });
        }
        Ok(b[12..].to_vec())
    }

    /// Turns the export's write cache on or off (the config space's `writeback` byte: off is
    /// write-through, every write durable when it completes). The export takes no other
    /// config write.
    pub fn set_write_cache(&mut self, on: bool) -> Result<(), ClientError> {
        let mut p = Vec::with_capacity(13);
        p.extend_from_slice(&32u32.to_le_bytes());
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.push(u8::from(on));
        self.set(SET_CONFIG, &p, &[])
    }

    /// Adds one region to the export's memory table (CONFIGURE_MEM_SLOTS).
    pub fn add_mem_region(&mut self, r: &Region<'_>) -> Result<(), ClientError> {
        self.set(ADD_MEM_REG, &mem_reg(r.gpa, r.size, r.offset), &[r.fd])
    }

    /// Removes the region at `gpa` of `size` bytes (the export unmaps it at once: nothing in
    /// flight may point into it).
    pub fn remove_mem_region(&mut self, gpa: u64, size: u64) -> Result<(), ClientError> {
        self.set(REM_MEM_REG, &mem_reg(gpa, size, 0), &[])
    }

    /// One round trip that changes nothing: QEMU's export acknowledges a message it failed
    /// on (a "panic" of libvhost-user sets the session broken yet replies 0) and then closes
    /// the session, so a reply here proves the messages before it were taken.
    pub fn ping(&mut self) -> Result<(), ClientError> {
        self.get_u64(GET_QUEUE_NUM).map(|_| ())
    }

    /// The session's socket (for watching it for the export's end).
    pub fn socket(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.sock)
    }

    /// The guest's memory (at most [`MAX_REGIONS`] regions).
    pub fn set_mem_table(&mut self, regions: &[Region<'_>]) -> Result<(), ClientError> {
        if regions.is_empty() || regions.len() > MAX_REGIONS {
            return Err(ClientError::Unsupported(format!(
                "{} memory regions (1 to {MAX_REGIONS})",
                regions.len()
            )));
        }
        let mut p = Vec::with_capacity(8 + 32 * regions.len());
        p.extend_from_slice(&(regions.len() as u32).to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        for r in regions {
            for v in [r.gpa, r.size, r.gpa, r.offset] {
                p.extend_from_slice(&v.to_le_bytes());
            }
        }
        let fds: Vec<BorrowedFd<'_>> = regions.iter().map(|r| r.fd).collect();
        self.set(SET_MEM_TABLE, &p, &fds)
    }

    /// Hands rings over, each: size, base, addresses, the call eventfd, then the kick
    /// eventfd (the export may complete a request as soon as it has the kick; the call must
    /// be there first), then enable. Every message is sent before the first acknowledgement
    /// is read: one round trip for all (QEMU's export handles them in order).
    pub fn start_rings(
        &mut self,
        rings: &[(RingAddr, Option<BorrowedFd<'_>>, BorrowedFd<'_>)],
    ) -> Result<(), ClientError> {
        let mut sent = Vec::with_capacity(6 * rings.len());
        for (r, call, kick) in rings {
            let mut a = Vec::with_capacity(40);
            a.extend_from_slice(&r.index.to_le_bytes());
            a.extend_from_slice(&0u32.to_le_bytes());
            for v in [r.desc, r.used, r.avail, 0] {
                a.extend_from_slice(&v.to_le_bytes());
            }
            let i = u64::from(r.index);
            let msgs: [(u32, Vec<u8>, Option<BorrowedFd<'_>>); 6] = [
                (
                    SET_VRING_NUM,
                    state(r.index, u32::from(r.size)).to_vec(),
                    None,
                ),
                (
                    SET_VRING_BASE,
                    state(r.index, u32::from(r.base)).to_vec(),
                    None,
                ),
                (SET_VRING_ADDR, a, None),
                match call {
                    Some(fd) => (SET_VRING_CALL, i.to_le_bytes().to_vec(), Some(*fd)),
                    None => (SET_VRING_CALL, (i | NOFD).to_le_bytes().to_vec(), None),
                },
                (SET_VRING_KICK, i.to_le_bytes().to_vec(), Some(*kick)),
                (SET_VRING_ENABLE, state(r.index, 1).to_vec(), None),
            ];
            for (req, payload, fd) in msgs {
                let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
                self.send(req, NEED_REPLY, &payload, &fds)?;
                sent.push(req);
            }
        }
        for req in sent {
            self.ack(req)?;
        }
        Ok(())
    }

    /// Takes the kick eventfds away from rings `indices` (all sent, then every
    /// acknowledgement read): once acknowledged, the export pops nothing more from them (it
    /// pops only in its kick handler, on the same thread that answers).
    pub fn detach_kicks(&mut self, indices: &[u32]) -> Result<(), ClientError> {
        for &i in indices {
            let p = (u64::from(i) | NOFD).to_le_bytes();
            self.send(SET_VRING_KICK, NEED_REPLY, &p, &[])?;
        }
        for _ in indices {
            self.ack(SET_VRING_KICK)?;
        }
        Ok(())
    }

    /// Stops rings `indices` and returns the export's next avail index of each (all asked
    /// before the first answer is read). QEMU's export answers at once, whatever it still has
    /// in flight: call it only once the rings are idle.
    pub fn get_vring_bases(&mut self, indices: &[u32]) -> Result<Vec<u16>, ClientError> {
        for &i in indices {
            self.send(GET_VRING_BASE, 0, &state(i, 0), &[])?;
        }
        let mut out = Vec::with_capacity(indices.len());
        for &index in indices {
            let b = self.reply(GET_VRING_BASE, 8)?;
            let got = u32::from_le_bytes(b[0..4].try_into().expect("8 bytes"));
            if got != index {
                return Err(ClientError::BadReply {
                    req: GET_VRING_BASE,
                    what: format!("ring {got}, asked for {index}"),
                });
            }
            let num = u32::from_le_bytes(b[4..8].try_into().expect("8 bytes"));
            out.push(u16::try_from(num).map_err(|_| ClientError::BadReply {
                req: GET_VRING_BASE,
                what: format!("base {num}"),
            })?);
        }
        Ok(out)
    }

    fn get_u64(&mut self, req: u32) -> Result<u64, ClientError> {
        self.send(req, 0, &[], &[])?;
        let b = self.reply(req, 8)?;
        Ok(u64::from_le_bytes(b[..8].try_into().expect("8 bytes")))
    }

    /// A request without a reply of its own: acknowledged once REPLY_ACK is agreed.
    fn set(&mut self, req: u32, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ClientError> {
        let ack = self.reply_ack;
        self.send(req, if ack { NEED_REPLY } else { 0 }, payload, fds)?;
        if ack {
            self.ack(req)?;
        }
        Ok(())
    }

    /// Reads the acknowledgement of `req` (REPLY_ACK): zero is success.
    fn ack(&mut self, req: u32) -> Result<(), ClientError> {
        let b = self.reply(req, 8)?;
        let status = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        if status != 0 {
            return Err(ClientError::Refused { req, status });
        }
        Ok(())
    }

    fn send(
        &mut self,
        req: u32,
        flags: u32,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ClientError> {
        let mut m = Vec::with_capacity(12 + payload.len());
        m.extend_from_slice(&req.to_le_bytes());
        m.extend_from_slice(&(VERSION | flags).to_le_bytes());
        m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        m.extend_from_slice(payload);
        let io = |source| ClientError::Io { req, source };
        let mut sent = accel_api::fdpass::send(self.sock.as_raw_fd(), &m, fds).map_err(io)?;
        while sent < m.len() {
            sent += accel_api::fdpass::send(self.sock.as_raw_fd(), &m[sent..], &[]).map_err(io)?;
        }
        Ok(())
    }

    /// Reads the reply to `req`, whose payload must be exactly `len` bytes.
    fn reply(&mut self, req: u32, len: usize) -> Result<Vec<u8>, ClientError> {
        let io = |source| ClientError::Io { req, source };
        let mut h = [0u8; 12];
        self.sock.read_exact(&mut h).map_err(io)?;
        let got = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
        let flags = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
        let size = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
        let bad = |what: String| ClientError::BadReply { req, what };
        if got != req {
            return Err(bad(format!("a reply to {}", req_name(got))));
        }
        if flags & 0x3 != VERSION || flags & REPLY == 0 {
            return Err(bad(format!("flags {flags:#x}")));
        }
        if size != len {
            return Err(bad(format!("{size} bytes, {len} expected")));
        }
        let mut b = vec![0u8; len];
        self.sock.read_exact(&mut b).map_err(io)?;
        Ok(b)
    }
}

/// A new connection that asked GET_FEATURES: QEMU's export answers it only once it took
/// the connection, which it does only after its previous session ended and drained.
pub struct Probe(Client);

impl Probe {
    /// Connects and asks. The export's listen backlog is empty here (acceld is its only
    /// client and just closed its session), so the connect does not wait.
    pub fn start(path: &Path, peer_uid: Option<u32>) -> Result<Probe, ClientError> {
        let mut c = Client::open(path, peer_uid)?;
        c.send(GET_FEATURES, 0, &[], &[])?;
        Ok(Probe(c))
    }

    /// Whether the answer came within `wait` (then it is read and checked).
    pub fn answered(&mut self, wait: Duration) -> Result<bool, ClientError> {
        let mut pfd = libc::pollfd {
            fd: self.0.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = wait.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: pfd is one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if r <= 0 {
            return Ok(false);
        }
        self.0.reply(GET_FEATURES, 8).map(|_| true)
    }
}

/// The vhost-user spec's name of request `req` (for errors).
fn req_name(req: u32) -> String {
    let n = match req {
        GET_FEATURES => "GET_FEATURES",
        SET_FEATURES => "SET_FEATURES",
        SET_OWNER => "SET_OWNER",
        SET_MEM_TABLE => "SET_MEM_TABLE",
        SET_VRING_NUM => "SET_VRING_NUM",
        SET_VRING_ADDR => "SET_VRING_ADDR",
        SET_VRING_BASE => "SET_VRING_BASE",
        GET_VRING_BASE => "GET_VRING_BASE",
        SET_VRING_KICK => "SET_VRING_KICK",
        SET_VRING_CALL => "SET_VRING_CALL",
        GET_PROTOCOL_FEATURES => "GET_PROTOCOL_FEATURES",
        SET_PROTOCOL_FEATURES => "SET_PROTOCOL_FEATURES",
        GET_QUEUE_NUM => "GET_QUEUE_NUM",
        SET_VRING_ENABLE => "SET_VRING_ENABLE",
        SET_BACKEND_REQ_FD => "SET_BACKEND_REQ_FD",
        GET_CONFIG => "GET_CONFIG",
        SET_CONFIG => "SET_CONFIG",
        GET_MAX_MEM_SLOTS => "GET_MAX_MEM_SLOTS",
        ADD_MEM_REG => "ADD_MEM_REG",
        REM_MEM_REG => "REM_MEM_REG",
        _ => return format!("request {req}"),
    };
    n.to_string()
}

/// A `VhostUserMemRegMsg`: padding, then the region (user address = guest-physical address).
fn mem_reg(gpa: u64, size: u64, offset: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    for v in [0, gpa, size, gpa, offset] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p
}

fn state(index: u32, num: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&index.to_le_bytes());
    b[4..8].copy_from_slice(&num.to_le_bytes());
    b
}
