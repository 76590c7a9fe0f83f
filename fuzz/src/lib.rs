//! Fuzz targets for every parser of untrusted input in accel. Each is a function of bytes that
//! must never panic, hang or allocate without bound, whatever the bytes; each also checks the
//! invariants its parser promises (an accepted request lies inside the disk, an accepted NBD
//! chunk inside its length, …).
//!
//! Two ways to run them (see `fuzz/README.md`):
//! - `accel-fuzz` (`src/bin/accel-fuzz.rs`): a plain runner on any toolchain: random and
//!   mutated inputs from built-in seeds, N executions per target, a count of crashes;
//! - `fuzz/libfuzzer.sh TARGET N`: the same functions under libFuzzer, coverage-guided, on the
//!   stable toolchain (SanitizerCoverage flags, no nightly needed).

use std::fs::File;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use accel_dataplane::engine::nbd::reply::{self, Chunk, ReplyHeader};
use accel_dataplane::virtio_blk::{self, Desc, DiskGeometry, DwzSegment, Header, Layout, Op};

/// A fuzz target: any bytes in, no panic out.
pub type Target = fn(&[u8]);

/// The targets by name, for the runner.
pub const TARGETS: [(&str, Target); 5] = [
    ("virtio_blk", virtio_blk),
    ("nbd_reply", nbd_reply),
    ("qmp_wire", qmp_wire),
    ("control", control),
    ("vhost_user", vhost_user),
];

/// Reads fuzz bytes as little numbers; past the end everything is 0.
struct Input<'a> {
    b: &'a [u8],
}

impl<'a> Input<'a> {
    fn u8(&mut self) -> u8 {
        match self.b.split_first() {
            Some((x, rest)) => {
                self.b = rest;
                *x
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.b.len());
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        a
    }
    fn done(&self) -> bool {
        self.b.is_empty()
    }
}

/// virtio-blk: a chain of guest descriptors split into header/data/status, then the request
/// validated against a disk. An accepted request must lie inside the disk and be aligned.
pub fn virtio_blk(data: &[u8]) {
    let mut i = Input { b: data };
    let g = DiskGeometry {
        sectors: i.u64() >> (i.u8() % 64),
        block_size: if i.u8() & 1 == 0 { 512 } else { 4096 },
        read_only: i.u8() & 1 == 1,
        model: if i.u8() & 1 == 0 {
            accel_dataplane::virtio_blk::DeviceModel::Export
        } else {
            accel_dataplane::virtio_blk::DeviceModel::VirtioBlk
        },
    };
    // A disk's first sector is the guest's (and QEMU's user's) to write: the geometry guess
    // from it stays in CHS's range whatever it holds.
    {
        let mut sector = [0u8; 512];
        let src = i.bytes(512);
        sector[..src.len()].copy_from_slice(src);
        let c = accel_dataplane::virtio_blk::guess_chs(g.sectors, Some(&sector));
        assert!((1..=16383).contains(&c.cylinders));
        assert!((1..=16).contains(&c.heads) && (1..=63).contains(&c.sectors));
    }
    let mut hb = [0u8; 16];
    hb.copy_from_slice(&{
        let mut h = [0u8; 16];
        let src = i.bytes(16);
        h[..src.len()].copy_from_slice(src);
        h
    });
    let h = Header::from_bytes(&hb);
    let mut sb = [0u8; 16];
    let src = i.bytes(16);
    sb[..src.len()].copy_from_slice(src);
    let n = usize::from(i.u8()) * 8;
    let mut descs = Vec::with_capacity(n.min(4096));
    while descs.len() < n && !i.done() {
        descs.push(Desc {
            addr: i.u64(),
            len: i.u32() >> (i.u8() % 32),
            writable: i.u8() & 1 == 1,
        });
    }
    let max_segs = 1 + usize::from(i.u8()) * 8;
    let mut layout = Layout::with_capacity(max_segs);
    if virtio_blk::split_chain(descs.iter().copied(), max_segs, &mut layout).is_err() {
        return;
    }
    assert!(layout.readable_data.len() <= max_segs && layout.writable_data.len() <= max_segs);
    let dwz = (layout.readable_data_len == u64::from(virtio_blk::DWZ_SEGMENT_LEN))
        .then(|| DwzSegment::from_bytes(&sb));
    let Ok(op) = virtio_blk::validate(&g, h, &layout, dwz) else {
        return;
    };
    let disk = g.sectors.saturating_mul(512);
    let inside = |offset: u64, len: u64| {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= disk),
            "{op:?} outside a disk of {disk} bytes"
        );
        assert_eq!(offset % u64::from(g.block_size), 0, "{op:?} misaligned");
    };
    match op {
        Op::Read { offset, len } => inside(offset, len),
        Op::Write { offset, len } => {
            assert!(!g.read_only, "a write to a read-only disk was accepted");
            inside(offset, len)
        }
        Op::Discard { offset, len } | Op::WriteZeroes { offset, len, .. } => {
            assert!(!g.read_only);
            inside(offset, len)
        }
        Op::Flush | Op::GetId => {}
    }
}

/// NBD replies from a hostile server: headers, chunk prefixes, ranges. Whatever is accepted
/// stays inside what it announced.
pub fn nbd_reply(data: &[u8]) {
    let mut i = Input { b: data };
    while !i.done() {
        let head = i.bytes(4);
        if head.len() < 4 {
            return;
        }
        let magic = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let Ok(n) = reply::header_len(magic) else {
            return;
        };
        let mut h = head.to_vec();
        h.extend_from_slice(i.bytes(n - 4));
        let Ok(hdr) = reply::parse_header(&h) else {
            return;
        };
        if let ReplyHeader::Structured { typ, len, .. } = hdr {
            let Ok(p) = reply::chunk_prefix_len(typ, len) else {
                continue;
            };
            assert!(p <= 12);
            let prefix = i.bytes(p);
            match reply::parse_chunk(typ, len, prefix) {
                Ok(Chunk::Data { len: l, .. }) => assert_eq!(u64::from(l) + 8, u64::from(len)),
                Ok(Chunk::Hole { .. }) => assert_eq!(len, 12),
                Ok(Chunk::Error { msg_len, skip, .. }) => {
                    assert_eq!(u64::from(msg_len) + 6 + u64::from(skip), u64::from(len))
                }
                Ok(Chunk::Skip { skip }) => assert_eq!(skip, len),
                Err(_) => {}
            }
        }
        let (ro, rl, o, l) = (i.u64(), i.u64(), i.u64(), i.u64());
        if let Ok(f) = reply::data_range(ro, rl, o, l) {
            assert!(f.checked_add(l).is_some_and(|e| e <= rl));
        }
        let (off, len) = reply::simple_read_part(ro, rl, i.u64(), u64::from(i.u32()));
        assert!(len <= rl);
        let _ = off;
    }
}

/// QMP lines from a peer: decode, classify.
pub fn qmp_wire(data: &[u8]) {
    if let Ok(Some(v)) = qmp_client::wire::decode_line(data) {
        let _ = qmp_client::wire::classify(v);
    }
    let mut line = data.to_vec();
    line.push(b'\n');
    if let Ok(Some(v)) = qmp_client::wire::decode_line(&line) {
        let _ = qmp_client::wire::classify(v);
    }
}

/// Control-socket requests: the JSON request, every drive spec in it, and the `id=…,image=…`
/// drive syntax of accelctl.
pub fn control(data: &[u8]) {
    if let Ok(accel_api::control::Request::Register { vm, drives, .. }) =
        acceld::run::parse_request(data)
    {
        let _ = accel_api::control::check_id("VM name", &vm);
        for d in &drives {
            let _ = d.validate();
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(d) = accel_api::control::DriveSpec::parse(s) {
            assert!(
                d.validate().is_ok(),
                "parse accepted what validate refuses: {d:?}"
            );
        }
    }
}

const MEM: usize = 1 << 20;
const DISK: u64 = 4 << 20;

struct VhostWorld {
    engine: Arc<dyn accel_dataplane::engine::Engine>,
    memfd: File,
    map: usize,
}

// SAFETY: `map` is the address of a shared mapping that lives as long as the process; the
// target writes into it only through `write_guest`, which bounds every access.
unsafe impl Sync for VhostWorld {}
// SAFETY: as above.
unsafe impl Send for VhostWorld {}

/// A new memfd of `len` bytes, sealed against shrinking and growing (as QEMU's
/// `memory-backend-memfd` is) or not.
fn memfd(name: &std::ffi::CStr, len: u64, sealed: bool) -> Option<File> {
    let seals = sealed.then_some(libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
    accel_dataplane::util::memfd(name, len, seals).ok()
}

fn vhost_world() -> &'static VhostWorld {
    static W: OnceLock<VhostWorld> = OnceLock::new();
    W.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("accel-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let image = dir.join("disk.raw");
        File::create(&image)
            .and_then(|f| f.set_len(DISK))
            .expect("image");
        let mut cfg = accel_dataplane::engine::FileEngineConfig::new(image, false, false, 512);
        cfg.io = accel_dataplane::engine::IoMode::Inline;
        cfg.lock = false;
        let engine = Arc::new(accel_dataplane::engine::FileEngine::open(cfg).expect("engine"));
        // Sealed: a front-end that is not root may pass it too.
        let memfd = memfd(c"accel-fuzz", MEM as u64, true).expect("memfd");
        use std::os::fd::AsRawFd;
        // SAFETY: a new shared mapping of the whole memfd; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MEM,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        VhostWorld {
            engine,
            memfd,
            map: p as usize,
        }
    })
}

fn write_guest(w: &VhostWorld, off: usize, bytes: &[u8]) {
    let off = off % MEM;
    let n = bytes.len().min(MEM - off);
    // Pointer arithmetic only: off < MEM.
    let dst = (w.map as *mut u8).wrapping_add(off);
    // SAFETY: [off, off+n) is inside the MEM-byte mapping; the backend may read it at the same
    // time, which is what a guest does too (the device treats it as hostile).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, n) };
}

/// The descriptors this process holds (`/proc/self/fd`), each with what it names.
fn open_fds() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| {
                let e = e.ok()?;
                let what = std::fs::read_link(e.path()).ok()?;
                Some((
                    e.file_name().to_string_lossy().into_owned(),
                    what.to_string_lossy().into_owned(),
                ))
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Most descriptors the target attaches to one message (the kernel takes up to 253; the
/// vhost crate reads up to 32, the spec allows 8).
const MAX_MSG_FDS: usize = 28;

/// One descriptor of a kind the input chooses: an eventfd, a sealed or an unsealed memfd of
/// any size, either end of a pipe, /dev/null, a socket. The other end of a pipe or socket is
/// kept in `keep` until the input ends (so that a write to it neither fails nor raises
/// SIGPIPE, and a read does not see EOF).
fn fuzz_fd(i: &mut Input, keep: &mut Vec<std::os::fd::OwnedFd>) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let kind = i.u8();
    match kind % 7 {
        0 => {
            // SAFETY: eventfd takes plain integers and returns a new descriptor or -1.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            // SAFETY: fd is new and owned here alone.
            (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
        }
        k @ (1 | 2) => {
            let len = match i.u8() % 4 {
                0 => 0,
                1 => MEM as u64,
                2 => u64::from(i.u8()) << 16,
                _ => u64::from(i.u16()),
            };
            memfd(c"fuzz-fd", len, k == 1).map(OwnedFd::from)
        }
        k @ (3 | 4) => {
            let mut p = [0; 2];
            // SAFETY: p has room for the two descriptors pipe2 writes.
            if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return None;
            }
            // SAFETY: p[0] is new and owned here alone.
            let r = unsafe { OwnedFd::from_raw_fd(p[0]) };
            // SAFETY: p[1] is new and owned here alone.
            let w = unsafe { OwnedFd::from_raw_fd(p[1]) };
            if k == 3 {
                keep.push(w);
                Some(r)
            } else {
                keep.push(r);
                Some(w)
            }
        }
        5 => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .ok()
            .map(OwnedFd::from),
        _ => {
            let (a, b) = std::os::unix::net::UnixStream::pair().ok()?;
            keep.push(b.into());
            Some(a.into())
        }
    }
}

/// The descriptors a message goes with: its own (`natural`: the memfd of a memory table, the
/// eventfd of a kick…), the input's on top of them or in their place, at most
/// [`MAX_MSG_FDS`].
fn message_fds(
    i: &mut Input,
    natural: Vec<std::os::fd::OwnedFd>,
    keep: &mut Vec<std::os::fd::OwnedFd>,
) -> Vec<std::os::fd::OwnedFd> {
    let spec = i.u8();
    let mut fds = if spec >> 6 == 3 { Vec::new() } else { natural };
    if spec >> 6 >= 2 {
        let n = usize::from(i.u8()) % (MAX_MSG_FDS + 1);
        for _ in 0..n {
            if let Some(fd) = fuzz_fd(i, keep) {
                fds.push(fd);
            }
        }
    }
    fds.truncate(MAX_MSG_FDS);
    fds
}

/// Sends `bytes` in one `sendmsg`, `fds` attached (`SCM_RIGHTS`), as QEMU sends a message.
fn send_with_fds(
    sock: &std::os::unix::net::UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::OwnedFd],
) {
    use std::os::fd::AsRawFd;
    let raw: Vec<libc::c_int> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE only computes a length.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(raw.as_slice()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain old data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at cbuf, big enough for one header and the fds.
        let c = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
        // SAFETY: CMSG_LEN only computes a length.
        let clen = unsafe { libc::CMSG_LEN(std::mem::size_of_val(raw.as_slice()) as u32) };
        // SAFETY: c points at the first cmsghdr inside cbuf (zeroed, large enough).
        let h = unsafe { &mut *c };
        h.cmsg_level = libc::SOL_SOCKET;
        h.cmsg_type = libc::SCM_RIGHTS;
        h.cmsg_len = clen as usize;
        // SAFETY: c is a valid cmsghdr; CMSG_DATA points at its payload inside cbuf.
        let data = unsafe { libc::CMSG_DATA(c) }.cast::<libc::c_int>();
        for (k, fd) in raw.iter().enumerate() {
            // Pointer arithmetic only: k < raw.len() keeps it inside the payload.
            let p = data.wrapping_add(k);
            // SAFETY: the payload has room for raw.len() descriptors (CMSG_SPACE above);
            // unaligned, as the payload has no alignment guarantee.
            unsafe { p.write_unaligned(*fd) };
        }
    }
    // SAFETY: msg points at live buffers of the lengths given. A failure (the session
    // closed its end) is what the next step sees.
    let _ = unsafe { libc::sendmsg(sock.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
}

/// Everything the back-end sent so far (replies), without waiting; descriptors that came
/// with them (`GET_INFLIGHT_FD`'s memfd) are closed by the kernel, as no control buffer
/// takes them.
fn drain(sock: &std::os::unix::net::UnixStream) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: buf is writable for its length.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n <= 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
}

/// Whether bytes wait to be read on `sock`.
fn readable(sock: &std::os::unix::net::UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: b is writable for its length; MSG_PEEK leaves the data queued.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n > 0
}

/// The bytes of a vhost-user message body.
fn body<T: vm_memory::ByteValued>(v: &T) -> Vec<u8> {
    v.as_slice().to_vec()
}

/// One front-end connection: the front-end's end of a socket pair, the back-end's end
/// served by acceld's own per-message loop (`vhost::Session`, as `Server::run` serves).
struct Peer {
    fe: std::os::unix::net::UnixStream,
    /// The back-end's end, to see whether a message waits (never read here).
    be: std::os::unix::net::UnixStream,
    session: accel_dataplane::vhost::Session,
}

impl Peer {
    fn new(drive: &Arc<accel_dataplane::drive::Drive>, untrusted: bool) -> Option<Peer> {
        let (fe, be) = std::os::unix::net::UnixStream::pair().ok()?;
        let peek = be.try_clone().ok()?;
        // Short waits for the rest of a message: the input can send half of one.
        let mut session = accel_dataplane::vhost::Session::from_stream(
            be,
            drive.clone(),
            std::time::Duration::from_millis(2),
        );
        session.set_untrusted(untrusted);
        Some(Peer {
            fe,
            be: peek,
            session,
        })
    }
}

/// A front-end's message sequence over a socket, into acceld's vhost-user message loop
/// (`vhost::Session`, the vhost crate's parsing included): features, memory tables (a real
/// memfd), rings anywhere in it, eventfds, enables, config, inflight and log regions, the
/// backend channel, and raw messages of any code, flags and size; every message goes with
/// the descriptors the input chooses (0 to 28: eventfds, sealed and unsealed memfds, pipe
/// ends, /dev/null, sockets) on top of its own or in their place. Guest memory is written
/// between messages, so queue workers start on random rings and pop random descriptors; a
/// connection that ends is followed by a new one (QEMU reconnects). After each input the
/// process holds exactly the descriptors it held before: every one acceld received was
/// consumed or closed.
pub fn vhost_user(data: &[u8]) {
    use std::os::fd::OwnedFd;
    use vhost::vhost_user::message::{
        VhostUserConfig, VhostUserConfigFlags, VhostUserInflight, VhostUserLog, VhostUserMemory,
        VhostUserMemoryRegion, VhostUserSingleMemoryRegion, VhostUserU64, VhostUserVringAddr,
        VhostUserVringAddrFlags, VhostUserVringState,
    };
    use vmm_sys_util::eventfd::EventFd;

    let w = vhost_world();
    // A clean guest for each input, so a crash reproduces from its input alone.
    // SAFETY: the whole mapping, MEM bytes.
    unsafe { std::ptr::write_bytes(w.map as *mut u8, 0, MEM) };
    let fds_before = open_fds();
    {
        let cfg = accel_dataplane::drive::DriveConfig {
            name: "fuzz".into(),
            serial: "fuzz".into(),
            capacity_bytes: DISK,
            logical_block_size: 512,
            read_only: false,
            num_queues: 2,
            queue_size: 256,
            discard: accel_dataplane::drive::DiscardMode::Unmap,
            poll_us: 0,
            werror: accel_dataplane::drive::ErrorPolicy::Enospc,
            rerror: accel_dataplane::drive::ErrorPolicy::Report,
            model: accel_dataplane::drive::DeviceModel::Export,
            chs: None,
        };
        let drive = accel_dataplane::drive::Drive::new(cfg, w.engine.clone());
        let mut i = Input { b: data };
        // A front-end that is not root must pass sealed memory.
        let untrusted = i.u8() & 1 == 1;
        let mut peer = Peer::new(&drive, untrusted);
        let Ok(never) = EventFd::new(0) else {
            return;
        };
        let user_base: u64 = 0x7f00_0000_0000;
        let mut kicks: Vec<EventFd> = Vec::new();
        let mut keep: Vec<OwnedFd> = Vec::new();
        let world_fd = || w.memfd.try_clone().ok().map(OwnedFd::from);
        let evfd = || {
            EventFd::new(0)
                .ok()
                .and_then(|e| e.try_clone().ok().map(|f| (e, f)))
        };
        let ev_owned = |e: EventFd| {
            use std::os::fd::{FromRawFd, IntoRawFd};
            // SAFETY: into_raw_fd gives up ownership, which the OwnedFd takes once.
            unsafe { OwnedFd::from_raw_fd(e.into_raw_fd()) }
        };
        let features = accel_dataplane::vhost::virtio_features(drive.config());
        let (mut steps, mut connections) = (0, 1);
        // Whether every message so far was sent whole and as framed (a raw message may leave
        // bytes that the next read takes as a header).
        let mut framed = true;
        while let Some(p) = peer.as_mut().filter(|_| !i.done() && steps < 64) {
            steps += 1;
            let q = u32::from(i.u8() % 3);
            let step = i.u8() % 30;
            // (request, body, the message's own descriptors), or a step without a message.
            let (code, bytes, natural): (u32, Vec<u8>, Vec<OwnedFd>) = match step {
                0 => (3, Vec::new(), Vec::new()),
                1 => (4, Vec::new(), Vec::new()),
                2 => (34, Vec::new(), Vec::new()),
                3 => (1, Vec::new(), Vec::new()),
                4 => {
                    let mask = i.u64();
                    let f = if mask & 1 == 0 { features & mask } else { mask };
                    (2, body(&VhostUserU64::new(f)), Vec::new())
                }
                5 => (15, Vec::new(), Vec::new()),
                6 => (16, body(&VhostUserU64::new(i.u64())), Vec::new()),
                7 => {
                    let gpa = u64::from(i.u16()) << 12;
                    let size = match i.u8() % 4 {
                        0 => MEM as u64,
                        1 => u64::from(i.u32()),
                        2 => (MEM / 2) as u64,
                        _ => u64::MAX - u64::from(i.u8()),
                    };
                    let off = u64::from(i.u8()) << 12;
                    let mut b = body(&VhostUserMemory::new(1));
                    b.extend(body(&VhostUserMemoryRegion::new(gpa, size, user_base, off)));
                    (5, b, world_fd().into_iter().collect())
                }
                8 => (
                    8,
                    body(&VhostUserVringState::new(q, u32::from(i.u16()))),
                    Vec::new(),
                ),
                9 => {
                    let flags = VhostUserVringAddrFlags::from_bits_truncate(u32::from(i.u8()));
                    let a = |x: u16| user_base + u64::from(x) * 16;
                    let (d, u, av) = (a(i.u16()), a(i.u16()), a(i.u16()));
                    let addr = VhostUserVringAddr::new(q, flags, d, u, av, i.u64());
                    (9, body(&addr), Vec::new())
                }
                10 => (
                    10,
                    body(&VhostUserVringState::new(q, u32::from(i.u16()))),
                    Vec::new(),
                ),
                11 => (11, body(&VhostUserVringState::new(q, 0)), Vec::new()),
                12..=14 => {
                    // VHOST_USER_VRING_NOFD_MASK when the input says so.
                    let nofd = i.u8() & 1 == 1;
                    let v = u64::from(q) | if nofd { 0x100 } else { 0 };
                    let mut own = Vec::new();
                    if let Some((e, f)) = evfd() {
                        if step == 12 {
                            kicks.push(e);
                        }
                        own.push(ev_owned(f));
                    }
                    (u32::from(step), body(&VhostUserU64::new(v)), own)
                }
                15 => (
                    18,
                    body(&VhostUserVringState::new(q, u32::from(i.u8() & 1))),
                    Vec::new(),
                ),
                16 => {
                    let (off, size) = (u32::from(i.u8()), u32::from(i.u8()));
                    let mut b = body(&VhostUserConfig::new(
                        off,
                        size,
                        VhostUserConfigFlags::empty(),
                    ));
                    b.resize(b.len() + size as usize, 0);
                    (24, b, Vec::new())
                }
                17 => {
                    let off = u32::from(i.u8());
                    let n = usize::from(i.u8() % 16);
                    let payload = i.bytes(n).to_vec();
                    let mut b = body(&VhostUserConfig::new(
                        off,
                        payload.len() as u32,
                        VhostUserConfigFlags::WRITABLE,
                    ));
                    b.extend(payload);
                    (25, b, Vec::new())
                }
                18 => (17, Vec::new(), Vec::new()),
                19..=21 => {
                    let off = i.u32() as usize;
                    let n = usize::from(i.u8());
                    let b = i.bytes(n);
                    write_guest(w, off, b);
                    continue;
                }
                22 => {
                    for k in &kicks {
                        let _ = k.write(1);
                    }
                    continue;
                }
                23 => {
                    let want = VhostUserInflight {
                        mmap_size: 0,
                        mmap_offset: 0,
                        num_queues: u16::from(i.u8() % 4),
                        queue_size: i.u16() % 1025,
                    };
                    (31, body(&want), Vec::new())
                }
                24 => {
                    // A region the frontend claims: any shape over a file of any size.
                    let info = VhostUserInflight {
                        mmap_size: u64::from(i.u32()),
                        mmap_offset: u64::from(i.u16()) << 12,
                        num_queues: u16::from(i.u8() % 4),
                        queue_size: i.u16() % 1025,
                    };
                    let len = u64::from(i.u16()) * 64;
                    let own = memfd(c"fuzz-inflight", len, i.u8() & 1 == 1).map(OwnedFd::from);
                    (32, body(&info), own.into_iter().collect())
                }
                25 => {
                    // A dirty log of any claimed shape over a file of any size (marks go to it
                    // once LOG_ALL is acked, from every completion and used ring).
                    let log = VhostUserLog {
                        mmap_size: u64::from(i.u32()),
                        mmap_offset: u64::from(i.u16()),
                    };
                    let len = u64::from(i.u16()) * 8;
                    let own = memfd(c"fuzz-log", len, i.u8() & 1 == 1).map(OwnedFd::from);
                    (6, body(&log), own.into_iter().collect())
                }
                26 => {
                    let gpa = u64::from(i.u16()) << 20;
                    let r = VhostUserSingleMemoryRegion::new(gpa, MEM as u64, user_base, 0);
                    if i.u8() & 1 == 0 {
                        (37, body(&r), world_fd().into_iter().collect())
                    } else {
                        (38, body(&r), Vec::new())
                    }
                }
                27 => {
                    // The backend channel: a socket whose other end stays open.
                    let mut own = Vec::new();
                    if let Ok((a, b)) = std::os::unix::net::UnixStream::pair() {
                        keep.push(b.into());
                        own.push(a.into());
                    }
                    (21, Vec::new(), own)
                }
                28 => (36, Vec::new(), Vec::new()),
                _ => {
                    // Any request, flags and size: the header as the input writes it.
                    let code = u32::from(i.u8());
                    let flags = i.u32();
                    let n = usize::from(i.u16() % 512);
                    let b = i.bytes(n).to_vec();
                    let size = if i.u8() & 1 == 0 {
                        b.len() as u32
                    } else {
                        u32::from(i.u16())
                    };
                    let mut m = Vec::with_capacity(12 + b.len());
                    m.extend_from_slice(&code.to_le_bytes());
                    m.extend_from_slice(&flags.to_le_bytes());
                    m.extend_from_slice(&size.to_le_bytes());
                    m.extend(b);
                    (u32::MAX, m, Vec::new())
                }
            };
            // Version 1, and a reply asked for (REPLY_ACK) when the input says so.
            let need_reply = i.u8() & 1 == 1;
            let fds = message_fds(&mut i, natural, &mut keep);
            let msg = if code == u32::MAX {
                framed = false;
                bytes.clone()
            } else {
                let mut m = Vec::with_capacity(12 + bytes.len());
                m.extend_from_slice(&code.to_le_bytes());
                m.extend_from_slice(&(1u32 | if need_reply { 8 } else { 0 }).to_le_bytes());
                m.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
                m.extend(&bytes);
                m
            };
            send_with_fds(&p.fe, &msg, &fds);
            drop(fds);
            // One message in, one served (a message that broke the framing leaves bytes
            // for the next; never a wait on an empty socket).
            let served = if readable(&p.be) {
                p.session
                    .serve_next(std::os::fd::AsRawFd::as_raw_fd(&never))
            } else {
                accel_dataplane::vhost::Served::Closed
            };
            let replies = drain(&p.fe);
            if framed
                && code == 24
                && served == accel_dataplane::vhost::Served::Next
                && replies.len() >= 24
            {
                // GET_CONFIG answers the size asked (offset + size within the 256 bytes of
                // config space always is) or, refusing, nothing.
                let asked = u32::from_le_bytes(bytes[4..8].try_into().expect("4"));
                let off = u32::from_le_bytes(bytes[0..4].try_into().expect("4"));
                let got = u32::from_le_bytes(replies[16..20].try_into().expect("4"));
                assert_eq!(replies.len(), 24 + got as usize, "GET_CONFIG reply framing");
                if off + asked <= 256 {
                    assert_eq!(got, asked, "GET_CONFIG answers the size asked");
                }
            }
            if served == accel_dataplane::vhost::Served::Closed {
                // Dropping the session drains and stops every queue, as a disconnect does;
                // then QEMU reconnects.
                peer = None;
                connections += 1;
                if connections <= 4 {
                    peer = Peer::new(&drive, untrusted);
                    framed = true;
                }
            }
        }
        // The last connection ends, drained, as a disconnect does.
        drop(peer);
        drop(kicks);
        drop(keep);
    }
    let fds_after = open_fds();
    assert!(
        fds_after == fds_before,
        "descriptors left open by the input: before {fds_before:?}, after {fds_after:?}"
    );
}

/// Seeds for the plain runner: well-formed inputs its mutations start from.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "virtio_blk" => {
            let mut v = Vec::new();
            for t in [0u32, 1, 4, 8, 11, 13] {
                let mut s = Vec::new();
                s.extend_from_slice(&(1u64 << 20).to_le_bytes());
                s.extend_from_slice(&[0, 0, 0]);
                let mut h = [0u8; 16];
                h[..4].copy_from_slice(&t.to_le_bytes());
                h[8..16].copy_from_slice(&8u64.to_le_bytes());
                s.extend_from_slice(&h);
                let mut dwz = [0u8; 16];
                dwz[..8].copy_from_slice(&16u64.to_le_bytes());
                dwz[8..12].copy_from_slice(&8u32.to_le_bytes());
                s.extend_from_slice(&dwz);
                s.push(1);
                for (addr, len, wr) in [(0x1000u64, 16u32, 0u8), (0x2000, 4096, 1), (0x3000, 1, 1)]
                {
                    s.extend_from_slice(&addr.to_le_bytes());
                    s.extend_from_slice(&len.to_le_bytes());
                    s.push(0);
                    s.push(wr);
                }
                s.push(16);
                v.push(s);
            }
            v
        }
        "nbd_reply" => {
            let mut s = 0x668e_33efu32.to_be_bytes().to_vec();
            s.extend_from_slice(&1u16.to_be_bytes());
            s.extend_from_slice(&1u16.to_be_bytes());
            s.extend_from_slice(&(7u64 << 32).to_be_bytes());
            s.extend_from_slice(&4104u32.to_be_bytes());
            s.extend_from_slice(&4096u64.to_be_bytes());
            let mut simple = 0x6744_6698u32.to_be_bytes().to_vec();
            simple.extend_from_slice(&0u32.to_be_bytes());
            simple.extend_from_slice(&(3u64 << 32).to_be_bytes());
            vec![s, simple]
        }
        "qmp_wire" => vec![
            br#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}}, "capabilities": ["oob"]}}"#.to_vec(),
            br#"{"return": {}, "id": 1}"#.to_vec(),
            br#"{"id": 2, "error": {"class": "GenericError", "desc": "no"}}"#.to_vec(),
            br#"{"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 2}, "data": {}}"#.to_vec(),
        ],
        "control" => vec![
            br#"{"op":"status"}"#.to_vec(),
            br#"{"op":"register","vm":"vm1","qmp":"/run/q.sock","drives":[{"id":"d0","image":"/i.raw","queues":2,"discard":"ignore"}],"cont":true}"#.to_vec(),
            br#"{"op":"throttle","vm":"vm1","drive":"d0","limits":{"iops-total":5}}"#.to_vec(),
            b"id=d0,image=/var/lib/i.raw,format=qcow2,read-only=on,serial=abc,queues=4,discard=unmap,direct=off,logical-block-size=4096".to_vec(),
        ],
        "vhost_user" => {
            // Each message step: queue, step, its arguments, the reply bit, the descriptor
            // byte (0: the message's own; 0x80, N, kinds…: N more on top).
            let msg = |q: u8, step: u8, args: &[u8], fds: &[u8]| {
                let mut m = vec![q, step];
                m.extend_from_slice(args);
                m.push(0);
                if fds.is_empty() {
                    m.push(0);
                } else {
                    m.push(0x80);
                    m.push(fds.len() as u8);
                    m.extend_from_slice(fds);
                }
                m
            };
            // Trusted front-end; owner, features, protocol features (MQ, LOG_SHMFD,
            // REPLY_ACK, BACKEND_REQ, CONFIG, INFLIGHT_SHMFD, CONFIGURE_MEM_SLOTS), memory
            // table, a queue set up and enabled, an avail ring entry, a kick, config, stop.
            let mut s = vec![0];
            s.extend(msg(0, 0, &[], &[]));
            s.extend(msg(0, 4, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], &[]));
            s.extend(msg(0, 6, &[0x2b, 0x92, 0, 0, 0, 0, 0, 0], &[]));
            s.extend(msg(0, 7, &[0, 0, 0, 0], &[]));
            s.extend(msg(0, 8, &[64, 0], &[]));
            s.extend(msg(0, 9, &[0, 0, 0, 0, 1, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
            s.extend(msg(0, 12, &[0], &[]));
            s.extend(msg(0, 13, &[0], &[]));
            s.extend(msg(0, 15, &[1], &[]));
            s.extend_from_slice(&[0, 19, 0, 0x02, 0, 0, 6, 0, 0, 1, 0, 0, 0]);
            s.extend_from_slice(&[0, 22]);
            s.extend(msg(0, 16, &[0, 60], &[]));
            s.extend(msg(0, 11, &[], &[]));
            // The same front-end not root, and descriptors of every kind on top of messages:
            // 28 on the backend channel (the peek once kept 20 of them), on a memory table,
            // a kick, a header-only request and an inflight region.
            let every: Vec<u8> = (0..28u8).map(|k| k % 7).flat_map(|k| {
                if k == 1 || k == 2 { vec![k, 2, 4] } else { vec![k] }
            }).collect();
            let mut t = vec![1];
            t.extend(msg(0, 0, &[], &[]));
            t.extend(msg(0, 6, &[0x2b, 0x92, 0, 0, 0, 0, 0, 0], &[]));
            t.extend(msg(0, 27, &[], &every));
            t.extend(msg(0, 7, &[0, 0, 0, 0], &every));
            t.extend(msg(0, 12, &[0], &[1, 2, 3, 4]));
            t.extend(msg(0, 3, &[], &every));
            t.extend(msg(0, 24, &[0, 0x10, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0], &every));
            t.extend(msg(0, 23, &[1, 0, 1], &[]));
            vec![s, t]
        }
        _ => Vec::new(),
    }
}

/// Panics anywhere in the process (queue workers included), counted by the hook.
pub static PANICS: AtomicU64 = AtomicU64::new(0);

pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// One input: fresh random bytes, or a seed or the previous input mutated (flips, interesting
/// values, inserted and deleted runs, splices).
pub fn input(rng: &mut Rng, seeds: &[Vec<u8>], last: &[u8], max: usize) -> Vec<u8> {
    let mut v = match rng.below(8) {
        0 => (0..rng.below(max)).map(|_| rng.next_u64() as u8).collect(),
        1..=4 if !seeds.is_empty() => seeds[rng.below(seeds.len())].clone(),
        _ => last.to_vec(),
    };
    for _ in 0..1 + rng.below(8) {
        let n = v.len();
        match rng.below(7) {
            0 if n > 0 => {
                let i = rng.below(n);
                v[i] ^= 1 << rng.below(8);
            }
            1 if n > 0 => {
                let i = rng.below(n);
                v[i] = [0, 1, 0x7f, 0x80, 0xff, 16, 64][rng.below(7)];
            }
            2 if n >= 4 => {
                let i = rng.below(n - 3);
                let x: u32 = [0, 1, u32::MAX, 0x8000_0000, 4096, 65535, 65536][rng.below(7)];
                v[i..i + 4].copy_from_slice(&x.to_le_bytes());
            }
            3 if v.len() < max => {
                let i = rng.below(n + 1);
                let k = rng.below(32);
                let ins: Vec<u8> = (0..k).map(|_| rng.next_u64() as u8).collect();
                v.splice(i..i, ins);
            }
            4 if n > 0 => {
                let i = rng.below(n);
                let k = rng.below(n - i + 1);
                v.drain(i..i + k);
            }
            5 if !seeds.is_empty() => {
                let s = &seeds[rng.below(seeds.len())];
                let i = rng.below(v.len() + 1);
                let j = rng.below(s.len() + 1);
                v.truncate(i);
                v.extend_from_slice(&s[j..]);
            }
            _ => v.push(rng.next_u64() as u8),
        }
    }
    v.truncate(max);
    v
}

/// Counts every panic of the process (queue worker threads included) in [`PANICS`], then
/// runs the previous hook. Install once, before running targets.
pub fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::Relaxed);
            prev(info);
        }));
    });
}

/// What one target's run found.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    pub executions: u64,
    pub crashes: u64,
    pub secs: f64,
}

/// Runs `f` on `runs` inputs: its seeds first, then random and mutated ones. A crashing input
/// is written to `crash_dir` (when given). Call [`count_panics`] first.
pub fn run_target(
    name: &str,
    f: Target,
    runs: u64,
    seed: u64,
    max_len: usize,
    crash_dir: Option<&Path>,
) -> Report {
    let seeds = seeds(name);
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut last = seeds.first().cloned().unwrap_or_default();
    let t0 = Instant::now();
    let mut crashes = 0u64;
    for n in 0..runs {
        let data = if n < seeds.len() as u64 {
            seeds[n as usize].clone()
        } else {
            input(&mut rng, &seeds, &last, max_len)
        };
        let before = PANICS.load(Ordering::Relaxed);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| f(&data)));
        if r.is_err() || PANICS.load(Ordering::Relaxed) != before {
            crashes += 1;
            if let Some(dir) = crash_dir {
                let _ = std::fs::create_dir_all(dir);
                let p = dir.join(format!("{name}-{n}"));
                let _ = std::fs::write(&p, &data);
                eprintln!(
                    "{name}: crash at execution {n}, input saved to {}",
                    p.display()
                );
            }
        }
        last = data;
    }
    Report {
        executions: runs,
        crashes,
        secs: t0.elapsed().as_secs_f64(),
    }
}
