//! The file engine's two I/O modes on real files: `auto` picks inline I/O for a file in
//! memory (tmpfs) and io_uring for one on a disk file system, and both modes give the same
//! results for every operation.

use std::os::unix::fs::FileExt;
use std::path::Path;

use accel_dataplane::engine::{Engine, FileEngine, FileEngineConfig, IoMode, IoOp, QueueIo};

fn open(path: &Path, io: IoMode) -> FileEngine {
    FileEngine::open(FileEngineConfig {
        path: path.to_path_buf(),
        read_only: false,
        direct: false,
        logical_block_size: 512,
        lock: false,
        io,
        identity: None,
    })
    .unwrap()
}

fn image(dir: &str) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new()
        .prefix("accel-engine")
        .tempfile_in(dir)
        .unwrap();
    f.as_file().set_len(1 << 20).unwrap();
    f
}

/// Runs one operation to completion (waiting on the completion fd when needed).
fn run(q: &mut dyn QueueIo, op: IoOp) -> i32 {
    // SAFETY: the caller's iovecs and buffers outlive this call, which reaps the completion.
    assert!(unsafe { q.push(&op, 7) });
    q.submit().unwrap();
    let mut out = Vec::new();
    while out.is_empty() {
        if !q.has_completions() {
            let mut pfd = libc::pollfd {
                fd: q.completion_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
        }
        q.reap(&mut out);
    }
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, 7, "token");
    out[0].1
}

fn iov(buf: &mut [u8]) -> libc::iovec {
    libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }
}

fn exercise(path: &Path, io: IoMode) {
    let e = open(path, io);
    let mut q = e.open_queue(0, 8, &Default::default()).unwrap();
    let mut data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    let w = [iov(&mut data)];
    let r = run(
        &mut *q,
        IoOp::Writev {
            offset: 4096,
            iov: w.as_ptr(),
            iovcnt: 1,
            dsync: true,
        },
    );
    assert_eq!(r, 8192, "{io:?} write");
    let mut back = vec![0u8; 8192];
    let rv = [iov(&mut back)];
    let r = run(
        &mut *q,
        IoOp::Readv {
            offset: 4096,
            iov: rv.as_ptr(),
            iovcnt: 1,
        },
    );
    assert_eq!(r, 8192, "{io:?} read");
    assert_eq!(back, data);
    assert_eq!(run(&mut *q, IoOp::Flush), 0, "{io:?} flush");
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    let r = run(
        &mut *q,
        IoOp::Fallocate {
            offset: 4096,
            len: 4096,
            mode: punch,
            zeroes: true,
        },
    );
    assert_eq!(r, 0, "{io:?} punch hole");
    let mut file_bytes = vec![1u8; 8192];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut file_bytes, 4096)
        .unwrap();
    assert!(file_bytes[..4096].iter().all(|&b| b == 0), "{io:?} hole");
    assert_eq!(file_bytes[4096..], data[4096..], "{io:?} data after hole");
    // At the end of the file a read is short (0 bytes), not an error.
    let r = run(
        &mut *q,
        IoOp::Readv {
            offset: 1 << 20,
            iov: rv.as_ptr(),
            iovcnt: 1,
        },
    );
    assert_eq!(r, 0, "{io:?} read at EOF");
    // An operation the file cannot do comes back as -errno.
    let r = run(
        &mut *q,
        IoOp::Fallocate {
            offset: 0,
            len: 4096,
            mode: 0x7fff_0000,
            zeroes: true,
        },
    );
    assert!(r < 0, "{io:?} bad fallocate mode gave {r}");
}

#[test]
fn auto_picks_inline_in_memory_and_io_uring_on_disk() {
    let shm = image("/dev/shm");
    let disk = image("/var/tmp");
    assert_eq!(open(shm.path(), IoMode::Auto).io_mode(), IoMode::Inline);
    assert_eq!(open(disk.path(), IoMode::Auto).io_mode(), IoMode::Uring);
    assert_eq!(open(shm.path(), IoMode::Uring).io_path(), "io_uring");
    assert_eq!(open(disk.path(), IoMode::Inline).io_path(), "inline");
}

#[test]
fn both_modes_do_every_operation() {
    for dir in ["/dev/shm", "/var/tmp"] {
        for io in [IoMode::Uring, IoMode::Inline] {
            let f = image(dir);
            exercise(f.path(), io);
        }
    }
}
