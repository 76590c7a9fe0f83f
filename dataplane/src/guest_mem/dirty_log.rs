//! The dirty log of a live migration (vhost-user "Migration", `VHOST_F_LOG_ALL` with
//! `VHOST_USER_PROTOCOL_F_LOG_SHMFD`): one bit per 4 KiB guest page, in a memfd the frontend
//! shares with every vhost-user device of the VM, set by the device for every page it writes.
//!
//! acceld writes guest memory outside vm-memory's `Bytes` API (io_uring and NBD `readv` land
//! data straight in guest pages), so marking is explicit: a worker marks a request's writable
//! buffers and its status byte after they were written and before the request's used element is
//! published, and the used ring after it is. Marks are atomic ORs: several devices (and other
//! backends of the VM) set bits in the same bytes concurrently.
//!
//! A new SET_LOG_BASE (a resize) swaps the map under a write lock: marks in progress finish in
//! the old log before the swap, and none reaches it afterwards, so the frontend can sync and
//! free it as soon as it has the reply.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

/// One bit of the log covers this many bytes of guest-physical memory (`VHOST_LOG_PAGE`).
pub const LOG_PAGE: u64 = 0x1000;

/// Largest log acceld maps: one bit per 4 KiB page of 64 TiB of guest memory.
pub const MAX_LOG_BYTES: u64 = 2 << 30;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log of {size} bytes at offset {offset} is empty, too large or past the end of its {file_len}-byte file")]
    Bounds {
        size: u64,
        offset: u64,
        file_len: u64,
    },
    #[error("cannot map the log")]
    Map(#[source] std::io::Error),
}

/// A mapped log.
pub struct LogMap {
    base: *mut u8,
    /// The whole mapping (from the page-aligned start below the log's offset).
    map_len: usize,
    /// Where the log starts inside the mapping.
    skip: usize,
    /// Log bytes.
    len: u64,
    /// Marks that fell past the end of the log (the frontend sized it too small).
    pub outside: AtomicU64,
}

// SAFETY: the mapping is shared memory accessed only through atomic byte operations; the raw
// pointer is valid for the map's lifetime, which the Arc owning the LogMap bounds.
unsafe impl Send for LogMap {}
// SAFETY: as above: every access is an atomic fetch_or on a byte inside the mapping.
unsafe impl Sync for LogMap {}

impl LogMap {
    /// Maps `size` bytes at `offset` of `file` (SET_LOG_BASE's `mmap_size` and `mmap_offset`).
    /// A log that does not fit in its file is refused: touching a mapped page past the end of
    /// a file is SIGBUS.
    pub fn map(file: &File, size: u64, offset: u64) -> Result<Self, LogError> {
        let file_len = file.metadata().map_err(LogError::Map)?.len();
        let bounds = LogError::Bounds {
            size,
            offset,
            file_len,
        };
        let end = offset.checked_add(size);
        if size == 0 || size > MAX_LOG_BYTES || end.is_none_or(|e| e > file_len) {
            return Err(bounds);
        }
        let page = 4096u64;
        let start = offset / page * page;
        let skip = (offset - start) as usize;
        let map_len = skip + size as usize;
        // SAFETY: a fresh shared mapping of a file range that exists (checked above); the
        // kernel picks the address, nothing else refers to that range yet.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(LogError::Map(std::io::Error::last_os_error()));
        }
        Ok(LogMap {
            base: p.cast(),
            map_len,
            skip,
            len: size,
            outside: AtomicU64::new(0),
        })
    }

    /// Log bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn byte(&self, i: u64) -> Option<&AtomicU8> {
        if i >= self.len {
            return None;
        }
        // SAFETY: skip + i < map_len, so the pointer stays inside the live mapping.
        let p = unsafe { self.base.add(self.skip + i as usize) };
        // SAFETY: p points at a byte of the live mapping; AtomicU8 has the layout of u8, and
        // the mapping is only ever accessed atomically here.
        Some(unsafe { &*p.cast::<AtomicU8>() })
    }

    /// Sets the bit of every page that `[gpa, gpa + len)` touches.
    pub fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        let mut page = first;
        while page <= last {
            let (byte, bit) = (page / 8, page % 8);
            match self.byte(byte) {
                Some(b) => {
                    // Whole bytes at once where the range covers them.
                    if bit == 0 && last - page >= 7 {
                        b.fetch_or(0xff, Ordering::Relaxed);
                        page += 8;
                        continue;
                    }
                    b.fetch_or(1 << bit, Ordering::Relaxed);
                }
                None => {
                    self.outside.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            page += 1;
        }
    }

    /// Whether the bit of `page` is set (tests and diagnostics).
    pub fn is_marked(&self, page: u64) -> bool {
        self.byte(page / 8)
            .is_some_and(|b| b.load(Ordering::Relaxed) & (1 << (page % 8)) != 0)
    }
}

impl Drop for LogMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; no reference into it outlives
        // self (marks borrow the LogMap).
        unsafe {
            libc::munmap(self.base.cast(), self.map_len);
        }
    }
}

/// The dirty-log state of one frontend connection, shared with its queue workers.
#[derive(Default)]
pub struct DirtyLog {
    /// LOG_ALL is acked (SET_FEATURES): the device logs its writes.
    log_all: AtomicBool,
    map: RwLock<Option<Arc<LogMap>>>,
}

impl DirtyLog {
    pub fn new() -> Arc<Self> {
        Arc::new(DirtyLog::default())
    }

    /// LOG_ALL on or off. Off drops the map: the frontend frees its log after a migration
    /// ends, and a new one always comes with a new SET_LOG_BASE.
    pub fn set_log_all(&self, on: bool) {
        self.log_all.store(on, Ordering::SeqCst);
        if !on {
            *self.map.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    pub fn log_all(&self) -> bool {
        self.log_all.load(Ordering::SeqCst)
    }

    /// Replaces the log (SET_LOG_BASE). Returns once no mark can reach the old one.
    pub fn set_map(&self, m: LogMap) {
        *self.map.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(m));
    }

    /// The log to mark now, if the device logs (LOG_ALL and a map). The caller marks while
    /// holding the returned guard: a log swap waits for it.
    pub fn active(&self) -> Option<std::sync::RwLockReadGuard<'_, Option<Arc<LogMap>>>> {
        // SeqCst pairs with set_log_all: a write done before this load is either seen by a
        // migration that starts later in its first pass, or marked here.
        if !self.log_all.load(Ordering::SeqCst) {
            return None;
        }
        let g = self.map.read().unwrap_or_else(|e| e.into_inner());
        g.is_some().then_some(g)
    }

    /// The current map (tests and diagnostics).
    pub fn current(&self) -> Option<Arc<LogMap>> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Bytes of a split used ring of `size` entries (flags, idx, ring, avail_event).
pub fn used_ring_len(size: u16) -> u64 {
    4 + 8 * u64::from(size) + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64) -> File {
        crate::util::memfd(c"log-test", len, None).expect("memfd")
    }

    #[test]
    fn marks_every_touched_page_and_nothing_else() {
        let f = memfd(64);
        let m = LogMap::map(&f, 64, 0).expect("map");
        m.mark(0x1fff, 2); // pages 1 and 2
        m.mark(0x10000, 0x8000); // pages 16..=23: one whole byte
        m.mark(0x30000, 0); // nothing
        let set: Vec<u64> = (0..512).filter(|&p| m.is_marked(p)).collect();
        let mut want = vec![1, 2];
        want.extend(16..24);
        assert_eq!(set, want);
        assert_eq!(m.outside.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_mark_past_the_log_is_counted_not_written() {
        let f = memfd(8192);
        let m = LogMap::map(&f, 1, 4096).expect("map at an offset");
        m.mark(7 * LOG_PAGE, 1);
        m.mark(8 * LOG_PAGE, 1);
        assert!(m.is_marked(7));
        assert_eq!(m.outside.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_log_past_its_file_is_refused() {
        let f = memfd(4096);
        assert!(matches!(
            LogMap::map(&f, 4097, 0),
            Err(LogError::Bounds { .. })
        ));
        assert!(matches!(
            LogMap::map(&f, 1, u64::MAX),
            Err(LogError::Bounds { .. })
        ));
        assert!(matches!(
            LogMap::map(&f, 0, 0),
            Err(LogError::Bounds { .. })
        ));
    }

    #[test]
    fn nothing_is_active_without_log_all_or_a_map() {
        let l = DirtyLog::new();
        assert!(l.active().is_none());
        l.set_log_all(true);
        assert!(l.active().is_none(), "LOG_ALL before SET_LOG_BASE");
        l.set_map(LogMap::map(&memfd(8), 8, 0).expect("map"));
        assert!(l.active().is_some());
        l.set_log_all(false);
        assert!(l.active().is_none());
        assert!(l.current().is_none(), "LOG_ALL off drops the map");
    }
}
