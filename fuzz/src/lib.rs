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
use std::os::fd::FromRawFd;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use acceld::engine::nbd::reply::{self, Chunk, ReplyHeader};
use acceld::virtio_blk::{self, Desc, DiskGeometry, DwzSegment, Header, Layout, Op};

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
    };
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
    engine: Arc<dyn acceld::engine::Engine>,
    memfd: File,
    map: usize,
}

// SAFETY: `map` is the address of a shared mapping that lives as long as the process; the
// target writes into it only through `write_guest`, which bounds every access.
unsafe impl Sync for VhostWorld {}
// SAFETY: as above.
unsafe impl Send for VhostWorld {}

fn vhost_world() -> &'static VhostWorld {
    static W: OnceLock<VhostWorld> = OnceLock::new();
    W.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("accel-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let image = dir.join("disk.raw");
        File::create(&image)
            .and_then(|f| f.set_len(DISK))
            .expect("image");
        let mut cfg = acceld::engine::FileEngineConfig::new(image, false, false, 512);
        cfg.io = acceld::engine::IoMode::Inline;
        cfg.lock = false;
        let engine = Arc::new(acceld::engine::FileEngine::open(cfg).expect("engine"));
        // SAFETY: memfd_create with a valid NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"accel-fuzz".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: fd is a new descriptor that nothing else owns.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(MEM as u64).expect("memfd size");
        // SAFETY: a new shared mapping of the whole memfd; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MEM,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
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

/// A frontend's message sequence, straight into acceld's vhost-user handler: features, memory
/// tables (a real memfd), rings anywhere in it, eventfds, enables, config, and the guest
/// memory itself written between messages, so that queue workers start on random rings and
/// pop random descriptors.
pub fn vhost_user(data: &[u8]) {
    use vhost::vhost_user::message::{
        VhostUserConfigFlags, VhostUserInflight, VhostUserMemoryRegion,
        VhostUserSingleMemoryRegion, VhostUserVringAddrFlags,
    };
    use vhost::vhost_user::VhostUserBackendReqHandlerMut;
    use vmm_sys_util::eventfd::EventFd;

    let w = vhost_world();
    // A clean guest for each input, so a crash reproduces from its input alone.
    // SAFETY: the whole mapping, MEM bytes.
    unsafe { std::ptr::write_bytes(w.map as *mut u8, 0, MEM) };
    let cfg = acceld::drive::DriveConfig {
        name: "fuzz".into(),
        serial: "fuzz".into(),
        capacity_bytes: DISK,
        logical_block_size: 512,
        read_only: false,
        num_queues: 2,
        queue_size: 256,
        discard: acceld::drive::DiscardMode::Unmap,
        poll_us: 0,
        werror: acceld::drive::ErrorPolicy::Enospc,
        rerror: acceld::drive::ErrorPolicy::Report,
    };
    let drive = acceld::drive::Drive::new(cfg, w.engine.clone());
    let mut c = acceld::vhost::Connection::new(drive);
    let mut i = Input { b: data };
    let user_base: u64 = 0x7f00_0000_0000;
    let mut kicks: Vec<EventFd> = Vec::new();
    let file = || w.memfd.try_clone().ok();
    let evfd = || {
        EventFd::new(0)
            .ok()
            .and_then(|e| e.try_clone().ok().map(|f| (e, f)))
    };
    let as_file = |e: EventFd| {
        use std::os::fd::IntoRawFd;
        // SAFETY: into_raw_fd gives up ownership, which the File takes once.
        unsafe { File::from_raw_fd(e.into_raw_fd()) }
    };
    let mut steps = 0;
    while !i.done() && steps < 64 {
        steps += 1;
        let q = u32::from(i.u8() % 3);
        match i.u8() % 27 {
            0 => drop(c.set_owner()),
            1 => drop(c.reset_owner()),
            2 => drop(c.reset_device()),
            3 => drop(c.get_features()),
            4 => {
                let f = c.get_features().unwrap_or(0);
                let mask = i.u64();
                drop(c.set_features(if mask & 1 == 0 { f & mask } else { mask }));
            }
            5 => drop(c.get_protocol_features()),
            6 => drop(c.set_protocol_features(i.u64())),
            7 => {
                let gpa = u64::from(i.u16()) << 12;
                let size = match i.u8() % 4 {
                    0 => MEM as u64,
                    1 => u64::from(i.u32()),
                    2 => (MEM / 2) as u64,
                    _ => u64::MAX - u64::from(i.u8()),
                };
                let off = u64::from(i.u8()) << 12;
                let r = [VhostUserMemoryRegion::new(gpa, size, user_base, off)];
                if let Some(f) = file() {
                    drop(c.set_mem_table(&r, vec![f], None));
                }
            }
            8 => drop(c.set_vring_num(q, u32::from(i.u16()))),
            9 => {
                let flags = VhostUserVringAddrFlags::from_bits_truncate(u32::from(i.u8()));
                let a = |x: u16| user_base + u64::from(x) * 16;
                let (d, u, av) = (a(i.u16()), a(i.u16()), a(i.u16()));
                drop(c.set_vring_addr(q, flags, d, u, av, i.u64()));
            }
            10 => drop(c.set_vring_base(q, u32::from(i.u16()))),
            11 => drop(c.get_vring_base(q)),
            12 => {
                if let Some((e, f)) = evfd() {
                    kicks.push(e);
                    drop(c.set_vring_kick(q as u8, Some(as_file(f))));
                }
            }
            13 => drop(c.set_vring_call(q as u8, evfd().map(|(_, f)| as_file(f)))),
            14 => drop(c.set_vring_err(q as u8, evfd().map(|(_, f)| as_file(f)))),
            15 => drop(c.set_vring_enable(q, i.u8() & 1 == 1)),
            16 => {
                let (off, size) = (u32::from(i.u8()), u32::from(i.u8()));
                if let Ok(v) = c.get_config(off, size, VhostUserConfigFlags::empty()) {
                    assert_eq!(v.len(), size as usize, "GET_CONFIG answers the size asked");
                }
            }
            17 => {
                let off = u32::from(i.u8());
                let n = usize::from(i.u8() % 16);
                let b = i.bytes(n).to_vec();
                drop(c.set_config(off, &b, VhostUserConfigFlags::WRITABLE));
            }
            18 => drop(c.get_queue_num()),
            19..=21 => {
                let off = i.u32() as usize;
                let n = usize::from(i.u8());
                let b = i.bytes(n);
                write_guest(w, off, b);
            }
            22 => {
                for k in &kicks {
                    let _ = k.write(1);
                }
            }
            23 => {
                let want = VhostUserInflight {
                    mmap_size: 0,
                    mmap_offset: 0,
                    num_queues: u16::from(i.u8() % 4),
                    queue_size: i.u16() % 1025,
                };
                drop(c.get_inflight_fd(&want));
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
                // SAFETY: memfd_create with a valid NUL-terminated name.
                let fd = unsafe { libc::memfd_create(c"fuzz-inflight".as_ptr(), 0) };
                if fd >= 0 {
                    // SAFETY: fd is a new descriptor nothing else owns.
                    let f = unsafe { File::from_raw_fd(fd) };
                    if f.set_len(len).is_ok() {
                        drop(c.set_inflight_fd(&info, f));
                    }
                }
            }
            25 => {
                // A dirty log of any claimed shape over a file of any size (marks go to it
                // once LOG_ALL is acked, from every completion and used ring).
                let log = vhost::vhost_user::message::VhostUserLog {
                    mmap_size: u64::from(i.u32()),
                    mmap_offset: u64::from(i.u16()),
                };
                let len = u64::from(i.u16()) * 8;
                // SAFETY: memfd_create with a valid NUL-terminated name.
                let fd = unsafe { libc::memfd_create(c"fuzz-log".as_ptr(), 0) };
                if fd >= 0 {
                    // SAFETY: fd is a new descriptor nothing else owns.
                    let f = unsafe { File::from_raw_fd(fd) };
                    if f.set_len(len).is_ok() {
                        drop(c.set_log_base(&log, f));
                    }
                }
            }
            _ => {
                let gpa = u64::from(i.u16()) << 20;
                let r = VhostUserSingleMemoryRegion::new(gpa, MEM as u64, user_base, 0);
                if i.u8() & 1 == 0 {
                    if let Some(f) = file() {
                        drop(c.add_mem_region(&r, f, None));
                    }
                } else {
                    drop(c.remove_mem_region(&r));
                }
            }
        }
    }
    // Dropping the connection drains and stops every queue, as a disconnect does.
    drop(c);
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
            // owner, features, protocol features, memory table, a queue set up and enabled,
            // an avail ring entry, a kick.
            let mut s = vec![0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe];
            s.extend_from_slice(&[0, 6, 0x0b, 0, 0, 0, 0, 0, 0, 0]);
            s.extend_from_slice(&[0, 7, 0, 0, 0, 0]);
            s.extend_from_slice(&[0, 8, 64, 0]);
            s.extend_from_slice(&[0, 9, 0, 0, 0, 0, 1, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            s.extend_from_slice(&[0, 12, 0, 13, 0, 15, 1]);
            s.extend_from_slice(&[0, 19, 0, 0x10, 0, 0, 6, 0, 0, 1, 0, 0, 0]);
            s.extend_from_slice(&[0, 22, 0, 11]);
            vec![s]
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
