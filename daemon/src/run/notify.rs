//! systemd's readiness protocol (`sd_notify`, the unit's `Type=notify`): `READY=1` once the
//! control socket serves, `STOPPING=1` when shutdown begins. The service manager's socket is a
//! unix datagram socket named by `$NOTIFY_SOCKET`: a path, or an abstract name written with a
//! leading `@`. The variable is taken out of the environment at start, so no child of acceld
//! (qemu-img, qemu-storage-daemon) inherits it and speaks for acceld.

use std::ffi::OsStr;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use thiserror::Error;
use tracing::warn;

/// The environment variable systemd sets for a `Type=notify` service.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

#[derive(Debug, Error)]
pub enum NotifyError {
    #[error("NOTIFY_SOCKET {0:?} is neither an absolute path nor an abstract name (@…)")]
    BadAddress(std::ffi::OsString),
    #[error("NOTIFY_SOCKET {addr:?}: cannot make its address")]
    Address {
        addr: std::ffi::OsString,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot make a datagram socket for the service manager")]
    Socket(#[source] std::io::Error),
    #[error("cannot send {state:?} to the service manager")]
    Send {
        state: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// A connection to the service manager's notification socket.
#[derive(Debug)]
pub struct Notifier {
    addr: SocketAddr,
    sock: UnixDatagram,
}

impl Notifier {
    /// The notifier for `$NOTIFY_SOCKET`, which is removed from the environment; `None` when
    /// acceld does not run under a service manager that listens (the variable is unset or
    /// empty), and `None` with a warning when the variable names no usable socket. Call it
    /// before any thread starts (it changes the process's environment).
    pub fn take_from_env() -> Option<Notifier> {
        let v = std::env::var_os(NOTIFY_SOCKET)?;
        std::env::remove_var(NOTIFY_SOCKET);
        if v.is_empty() {
            return None;
        }
        match Notifier::new(&v) {
            Ok(n) => Some(n),
            Err(e) => {
                warn!(
                    "not telling the service manager: {}",
                    crate::error_chain(&e)
                );
                None
            }
        }
    }

    /// A notifier for the socket `addr` names (`/path` or `@abstract`).
    pub fn new(addr: &OsStr) -> Result<Notifier, NotifyError> {
        use std::os::unix::ffi::OsStrExt;
        let bytes = addr.as_bytes();
        let err = |source| NotifyError::Address {
            addr: addr.to_os_string(),
            source,
        };
        let addr = match bytes.split_first() {
            Some((b'@', name)) if !name.is_empty() => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name).map_err(err)?
            }
            Some((b'/', _)) => SocketAddr::from_pathname(addr).map_err(err)?,
            _ => return Err(NotifyError::BadAddress(addr.to_os_string())),
        };
        let sock = UnixDatagram::unbound().map_err(NotifyError::Socket)?;
        // A service manager that stopped reading never holds acceld: the send fails instead.
        sock.set_nonblocking(true).map_err(NotifyError::Socket)?;
        Ok(Notifier { addr, sock })
    }

    fn send(&self, state: &'static str) -> Result<(), NotifyError> {
        self.sock
            .send_to_addr(state.as_bytes(), &self.addr)
            .map(|_| ())
            .map_err(|source| NotifyError::Send { state, source })
    }

    /// `READY=1`: the control socket serves (libvirtd, ordered after acceld, may start).
    pub fn ready(&self) -> Result<(), NotifyError> {
        self.send("READY=1")
    }

    /// `STOPPING=1`: acceld has begun to drain its drives and will exit.
    pub fn stopping(&self) -> Result<(), NotifyError> {
        self.send("STOPPING=1")
    }
}

/// Tells the service manager `state` if acceld runs under one; a failure is logged (once per
/// state: each is sent once per run) and changes nothing else.
pub(super) fn tell(n: Option<&Notifier>, state: fn(&Notifier) -> Result<(), NotifyError>) {
    if let Some(n) = n {
        if let Err(e) = state(n) {
            warn!("{}", crate::error_chain(&e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn recv(s: &UnixDatagram) -> String {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 256];
        let n = s.recv(&mut b).unwrap();
        String::from_utf8_lossy(&b[..n]).into_owned()
    }

    #[test]
    fn ready_and_stopping_reach_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("notify.sock");
        let l = UnixDatagram::bind(&p).unwrap();
        let n = Notifier::new(p.as_os_str()).unwrap();
        n.ready().unwrap();
        assert_eq!(recv(&l), "READY=1");
        n.stopping().unwrap();
        assert_eq!(recv(&l), "STOPPING=1");
    }

    #[test]
    fn an_abstract_name_starts_with_an_at_sign() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("accel-notify-test-{}", std::process::id());
        let l = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let n = Notifier::new(OsStr::new(&format!("@{name}"))).unwrap();
        n.ready().unwrap();
        assert_eq!(recv(&l), "READY=1");
    }

    #[test]
    fn addresses_that_name_no_socket_are_refused() {
        for bad in ["", "@", "relative/notify", "x"] {
            assert!(
                matches!(
                    Notifier::new(OsStr::new(bad)),
                    Err(NotifyError::BadAddress(_))
                ),
                "{bad:?} accepted"
            );
        }
        let long = format!("/{}", "a".repeat(200));
        assert!(matches!(
            Notifier::new(OsStr::new(&long)),
            Err(NotifyError::Address { .. })
        ));
    }

    #[test]
    fn a_socket_nobody_listens_on_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let n = Notifier::new(dir.path().join("gone.sock").as_os_str()).unwrap();
        assert!(matches!(n.ready(), Err(NotifyError::Send { .. })));
    }
}
