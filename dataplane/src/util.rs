//! Domain-free helpers shared by every layer.

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, recovering the data if a thread panicked while holding it: every value
/// under these locks stays consistent between statements.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub use accel_api::error_chain;

/// A log-line budget: the first `burst` lines of each `period` pass, the rest are counted and
/// reported with the next line that passes. Anything a guest, a disk, an NBD server or a QMP
/// client can trigger goes through one, so no outside action grows the log without bound.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    period: std::time::Duration,
    st: Mutex<LimitState>,
}

#[derive(Debug)]
struct LimitState {
    window: Option<std::time::Instant>,
    passed: u32,
    suppressed: u64,
}

impl LogLimit {
    pub const fn new(burst: u32, period: std::time::Duration) -> Self {
        LogLimit {
            burst,
            period,
            st: Mutex::new(LimitState {
                window: None,
                passed: 0,
                suppressed: 0,
            }),
        }
    }

    /// Whether to log this line now; `Some(n)`: yes, and `n` lines were suppressed since the
    /// last one that passed.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(std::time::Instant::now())
    }

    fn admit_at(&self, now: std::time::Instant) -> Option<u64> {
        let mut st = lock(&self.st);
        let fresh = st
            .window
            .is_none_or(|w| now.saturating_duration_since(w) >= self.period);
        if fresh {
            st.window = Some(now);
            st.passed = 0;
        }
        if st.passed < self.burst {
            st.passed += 1;
            Some(std::mem::take(&mut st.suppressed))
        } else {
            st.suppressed += 1;
            None
        }
    }
}

impl Default for LogLimit {
    /// 5 lines per 10 s.
    fn default() -> Self {
        LogLimit::new(5, std::time::Duration::from_secs(10))
    }
}

/// ", N similar lines suppressed" when N > 0 (for a line that passed a [`LogLimit`]).
pub fn suppressed(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} similar lines suppressed)")
    }
}

/// The address of the unix socket at `path`.
fn unix_addr(path: &std::path::Path) -> std::io::Result<libc::sockaddr_un> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid empty address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "socket path too long for a unix socket",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(addr)
}

/// A new, unconnected unix stream socket (`SOCK_CLOEXEC`, with `extra` flags such as
/// `SOCK_NONBLOCK`).
fn unix_socket(extra: libc::c_int) -> std::io::Result<std::os::unix::net::UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: socket() has no memory preconditions; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | extra,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned here alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) }.into())
}

/// Connects `s` to `addr`, again when a signal interrupts the wait.
fn unix_connect(
    s: &std::os::unix::net::UnixStream,
    addr: &libc::sockaddr_un,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: addr is a valid sockaddr_un that outlives the call; the length is its size.
        let r = unsafe {
            libc::connect(
                s.as_raw_fd(),
                std::ptr::from_ref(addr).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether something listens on the unix socket at `path`, asked without blocking: a
/// listener whose backlog is full (one that never accepts, planted by whoever owns the
/// directory) counts as listening instead of holding the caller in `connect`. A path that
/// is no socket, or a socket nobody serves, is not in use.
pub fn socket_listening(path: &std::path::Path) -> bool {
    let (Ok(addr), Ok(s)) = (unix_addr(path), unix_socket(libc::SOCK_NONBLOCK)) else {
        return false;
    };
    match unix_connect(&s, &addr) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() == Some(libc::EAGAIN),
    }
}

/// Connects to the unix socket at `path`, waiting at most `timeout` for room in its backlog
/// (a unix `connect` waits up to the socket's send timeout: a listener that never accepts
/// cannot hold the caller longer). That wait's end is an error of kind `TimedOut`.
pub fn connect_unix(
    path: &std::path::Path,
    timeout: std::time::Duration,
) -> std::io::Result<std::os::unix::net::UnixStream> {
    let addr = unix_addr(path)?;
    let s = unix_socket(0)?;
    s.set_write_timeout(Some(timeout.max(std::time::Duration::from_millis(1))))?;
    unix_connect(&s, &addr).map_err(|e| {
        // The kernel ends the wait with EAGAIN.
        if e.kind() == std::io::ErrorKind::WouldBlock {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the listener's backlog stayed full for {timeout:?}"),
            )
        } else {
            e
        }
    })?;
    s.set_write_timeout(None)?;
    Ok(s)
}

/// Sets or clears `O_NONBLOCK` on `fd` (shared by every descriptor of the open file).
pub fn set_nonblocking(fd: std::os::fd::RawFd, on: bool) -> std::io::Result<()> {
    // SAFETY: fcntl F_GETFL on a descriptor has no memory effects.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let want = if on {
        fl | libc::O_NONBLOCK
    } else {
        fl & !libc::O_NONBLOCK
    };
    // SAFETY: fcntl F_SETFL on a descriptor has no memory effects.
    if want != fl && unsafe { libc::fcntl(fd, libc::F_SETFL, want) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The uid of the process at the other end of a unix socket (`SO_PEERCRED`).
/// A new memfd `name` of `len` bytes (close-on-exec). With `seals` (`F_SEAL_*` bits) it is
/// created sealable and those seals are added once it has its size: `F_SEAL_SHRINK` makes it
/// memory no holder can truncate under a mapping (SIGBUS); `None` leaves it unsealed.
pub fn memfd(
    name: &std::ffi::CStr,
    len: u64,
    seals: Option<libc::c_int>,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let flags = libc::MFD_CLOEXEC
        | if seals.is_some() {
            libc::MFD_ALLOW_SEALING
        } else {
            0
        };
    // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len)?;
    if let Some(seals) = seals {
        // SAFETY: fcntl F_ADD_SEALS on our own memfd has no memory effects.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(file)
}

pub fn peer_uid(fd: std::os::fd::RawFd) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a ucred and its size for the call.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_burst_then_a_count_then_a_new_window() {
        let l = LogLimit::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(l.admit_at(t0), Some(0));
        assert_eq!(l.admit_at(t0), Some(0));
        for _ in 0..1000 {
            assert_eq!(l.admit_at(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(l.admit_at(t0 + Duration::from_secs(10)), Some(1000));
        assert_eq!(l.admit_at(t0 + Duration::from_secs(11)), Some(0));
        assert_eq!(l.admit_at(t0 + Duration::from_secs(12)), None);
        assert_eq!(suppressed(0), "");
        assert_eq!(suppressed(3), " (3 similar lines suppressed)");
    }
}
