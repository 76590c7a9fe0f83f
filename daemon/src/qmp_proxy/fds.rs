//! File descriptors from management: received with a client's bytes (SCM_RIGHTS), passed on
//! to QEMU with the `getfd` or `add-fd` that claims them, and fd names kept apart per client.
//! QEMU's `getfd` names belong to one monitor, and all clients share acceld's monitor, so a
//! client's name `N` is `acceld.fd.K.N` in QEMU; the proxy rewrites the name where commands
//! refer to it (`fdname`, `fd`, `str`, `fd:N`, `/dev/fdname/N`) and restores it in QEMU's
//! errors. The namespace is unforgeable: a command with [`MARKER`] anywhere in its arguments
//! (another client's name spelled out, in any field or HMP text) is refused ([`forged`]).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};

use serde_json::{Map, Value};
use tokio::net::unix::OwnedReadHalf;

/// Received descriptors not yet claimed; more are closed (QEMU keeps only the last read's).
pub const MAX_PENDING: usize = 16;

/// Reads bytes and any descriptors sent with them.
pub async fn read(
    rd: &OwnedReadHalf,
    buf: &mut [u8],
    pending: &mut VecDeque<OwnedFd>,
) -> std::io::Result<usize> {
    let s: &tokio::net::UnixStream = rd.as_ref();
    loop {
        s.readable().await?;
        match s.try_io(tokio::io::Interest::READABLE, || recv(s.as_raw_fd(), buf)) {
            Ok((n, fds)) => {
                for fd in fds {
                    if pending.len() == MAX_PENDING {
                        pending.pop_front();
                    }
                    pending.push_back(fd);
                }
                return Ok(n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

fn recv(sock: i32, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    accel_api::fdpass::recv(sock, buf)
}

/// What every client's names in QEMU start with; no client may send it.
pub const MARKER: &str = "acceld.fd.";

/// The first string in `args` (values at any depth, and keys) that contains [`MARKER`]: a
/// client naming an fd in the proxy's own namespace, which only another client's could be.
pub fn forged(args: &Option<Map<String, Value>>) -> Option<String> {
    fn walk(v: &Value) -> Option<String> {
        match v {
            Value::String(s) => s.contains(MARKER).then(|| s.clone()),
            Value::Array(l) => l.iter().find_map(walk),
            Value::Object(m) => m.iter().find_map(|(k, x)| {
                if k.contains(MARKER) {
                    Some(k.clone())
                } else {
                    walk(x)
                }
            }),
            _ => None,
        }
    }
    let a = args.as_ref()?;
    a.iter().find_map(|(k, x)| {
        if k.contains(MARKER) {
            Some(k.clone())
        } else {
            walk(x)
        }
    })
}

/// A client's fd names and their names in QEMU.
#[derive(Debug, Default)]
pub struct Names {
    prefix: String,
    /// Names the client has in QEMU now.
    pub held: Vec<String>,
}

impl Names {
    pub fn new(client: u64) -> Self {
        Names {
            prefix: format!("{MARKER}{client}."),
            held: Vec::new(),
        }
    }

    pub fn upstream(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The command's arguments with the client's fd names as QEMU knows them: `getfd` and
    /// `closefd` always (QEMU's answer for an unknown name then names the client's), others
    /// where they refer to a name the client holds.
    pub fn rewrite(&self, cmd: &str, args: &mut Option<Map<String, Value>>) {
        let Some(a) = args.as_mut() else { return };
        if matches!(cmd, "getfd" | "closefd") {
            if let Some(Value::String(n)) = a.get_mut("fdname") {
                *n = self.upstream(n);
            }
            return;
        }
        if self.held.is_empty() {
            return;
        }
        for (k, v) in a.iter_mut() {
            self.walk(k, v);
        }
    }

    fn walk(&self, key: &str, v: &mut Value) {
        match v {
            Value::String(s) => {
                let held = |n: &str| self.held.iter().any(|h| h == n);
                if matches!(key, "fdname" | "fd" | "str") && held(s) {
                    *s = self.upstream(s);
                } else if let Some(n) = s.strip_prefix("fd:").filter(|n| held(n)) {
                    *s = format!("fd:{}", self.upstream(n));
                } else if let Some(n) = s.strip_prefix("/dev/fdname/").filter(|n| held(n)) {
                    *s = format!("/dev/fdname/{}", self.upstream(n));
                }
            }
            Value::Array(l) => l.iter_mut().for_each(|x| self.walk(key, x)),
            Value::Object(m) => m.iter_mut().for_each(|(k, x)| self.walk(k, x)),
            _ => {}
        }
    }

    /// QEMU's error text with the client's own names.
    pub fn restore(&self, desc: &str) -> String {
        desc.replace(&format!("'{}", self.prefix), "'")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value) -> Option<Map<String, Value>> {
        match v {
            Value::Object(m) => Some(m),
            _ => None,
        }
    }

    #[test]
    fn names_are_the_clients_own() {
        let mut n = Names::new(3);
        let mut a = args(json!({"fdname": "mig"}));
        n.rewrite("getfd", &mut a);
        assert_eq!(a.unwrap()["fdname"], "acceld.fd.3.mig");
        n.held.push("mig".into());
        let mut a = args(
            json!({"uri": "fd:mig", "channels": [{"addr": {"type": "fd", "str": "mig"}}],
                                "other": "mig", "x": "fd:nope"}),
        );
        n.rewrite("migrate", &mut a);
        let a = a.unwrap();
        assert_eq!(a["uri"], "fd:acceld.fd.3.mig");
        assert_eq!(a["channels"][0]["addr"]["str"], "acceld.fd.3.mig");
        assert_eq!(a["other"], "mig", "only where a name is expected");
        assert_eq!(a["x"], "fd:nope", "names the client does not hold stay");
        assert_eq!(
            n.restore("File descriptor named 'acceld.fd.3.mig' not found"),
            "File descriptor named 'mig' not found"
        );
    }

    #[test]
    fn another_clients_names_cannot_be_spelled_out() {
        // Client 4 names client 3's fd the way QEMU knows it, in every place a name goes.
        let mine = Names::new(4);
        let other = Names::new(3).upstream("mig");
        for a in [
            json!({"uri": format!("fd:{other}")}),
            json!({"channels": [{"addr": {"type": "fd", "str": other}}]}),
            json!({"filename": format!("/dev/fdname/{other}")}),
            json!({"fdname": other}),
            json!({"command-line": format!("migrate -d fd:{other}")}),
        ] {
            let mut a = args(a);
            mine.rewrite("migrate", &mut a);
            assert!(forged(&a).is_some(), "{a:?} passes");
        }
        assert_eq!(forged(&args(json!({"uri": "fd:mig", "n": 1}))), None);
        assert_eq!(forged(&None), None);
    }
}
