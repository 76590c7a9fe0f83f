//! The direct engine's settings: how an image is opened ([`FileEngineConfig`]), the file it
//! must be ([`ImageId`]) and how I/O reaches it ([`IoMode`]). Plain data, named by the
//! [`Engine`](crate::engine::Engine) trait (`file_config`) as well as by the engine.

use std::io;
use std::path::{Path, PathBuf};

/// How the file engine opens an image.
#[derive(Clone, Debug)]
pub struct FileEngineConfig {
    pub path: PathBuf,
    pub read_only: bool,
    /// O_DIRECT: bypass the host page cache.
    pub direct: bool,
    /// The guest's logical block size; direct I/O must be possible at that granularity.
    pub logical_block_size: u32,
    /// Take QEMU-compatible image locks (see [`qemu_lock`](super::qemu_lock)) while the
    /// engine exists.
    pub lock: bool,
    /// How requests reach the file (see [`IoMode`]).
    pub io: IoMode,
    /// The file `path` must be (its device and inode, recorded when the drive was
    /// registered): the path is then opened without following any symbolic link
    /// (`openat2` `RESOLVE_NO_SYMLINKS`) and the file opened checked against it, so that
    /// whoever can change a directory on the way (QEMU's user) cannot make acceld open
    /// another file.
    pub identity: Option<ImageId>,
}

/// A file's identity: device and inode number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageId {
    pub dev: u64,
    pub ino: u64,
}

impl ImageId {
    /// The identity of the file `m` describes.
    pub fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        ImageId {
            dev: m.dev(),
            ino: m.ino(),
        }
    }

    /// The identity of the file `path` names now (links followed).
    pub fn of_path(path: &Path) -> io::Result<Self> {
        Ok(Self::of(&std::fs::metadata(path)?))
    }
}

impl FileEngineConfig {
    /// An image opened with QEMU-compatible locks and the I/O mode chosen by its file system.
    pub fn new(path: PathBuf, read_only: bool, direct: bool, logical_block_size: u32) -> Self {
        FileEngineConfig {
            path,
            read_only,
            direct,
            logical_block_size,
            lock: true,
            io: IoMode::Auto,
            identity: None,
        }
    }
}

/// How the file engine issues I/O.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoMode {
    /// `Inline` for images in memory (tmpfs, ramfs, hugetlbfs), `Uring` for everything else.
    #[default]
    Auto,
    /// io_uring, one ring per queue: many requests in flight, one system call per batch.
    Uring,
    /// preadv2/pwritev2 on the queue's own thread. For memory file systems, where the kernel
    /// cannot do I/O without blocking (no RWF_NOWAIT) and io_uring would hand every request
    /// to a kernel worker thread: a copy on the queue's thread is cheaper than that hop.
    /// Never for slow storage: one request at a time per queue.
    Inline,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Auto => "auto",
            IoMode::Uring => "io_uring",
            IoMode::Inline => "inline",
        }
    }
}
