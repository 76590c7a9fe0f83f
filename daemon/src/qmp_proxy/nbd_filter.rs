//! The option phase of an NBD connection from management to QEMU's one NBD server, filtered:
//! QEMU's server also serves acceld's own writable exports (`accel-*`), and management's
//! listener is open to whoever can reach it, so those exports must not exist for it.
//! `NBD_OPT_LIST` replies leave them out; `NBD_OPT_INFO`/`GO`/`LIST_META_CONTEXT`/
//! `SET_META_CONTEXT` naming one get `NBD_REP_ERR_UNKNOWN` (as for a name QEMU does not have),
//! `NBD_OPT_EXPORT_NAME` naming one closes the connection (what a server does for an unknown
//! name there); `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_POLICY` (the proxy has no TLS). After a
//! successful `GO` or `EXPORT_NAME` the connection is a plain pipe.
//!
//! Every length read is bounded: option data to [`MAX_OPTION`], reply data to [`MAX_REPLY`].
//! Fixed newstyle only (what QEMU speaks).

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use accel_dataplane::engine::nbd::proto::{
    IHAVEOPT, NBDMAGIC, OPT_ABORT, OPT_EXPORT_NAME, OPT_GO, OPT_INFO, OPT_LIST,
    OPT_LIST_META_CONTEXT, OPT_REPLY_MAGIC, OPT_SET_META_CONTEXT, OPT_STARTTLS, REP_ACK,
    REP_ERR_INVALID, REP_ERR_POLICY, REP_ERR_TOO_BIG, REP_ERR_UNKNOWN, REP_INFO, REP_META_CONTEXT,
    REP_SERVER,
};

/// Longest option data a client may send (names are at most 4096 bytes; a GO or a
/// meta-context query list fits easily).
pub const MAX_OPTION: u32 = 16 << 10;
/// Longest option reply data passed on from QEMU.
pub const MAX_REPLY: u32 = 64 << 10;

#[derive(Debug, Error)]
pub enum FilterError {
    #[error("NBD I/O")]
    Io(#[from] std::io::Error),
    #[error("NBD client broke the protocol: {0}")]
    Client(String),
    #[error("NBD server broke the protocol: {0}")]
    Server(String),
    #[error("NBD client asked for a hidden export")]
    Hidden,
}

/// Names acceld gives its own exports.
pub fn hidden(name: &[u8]) -> bool {
    name.starts_with(b"accel-")
}

async fn reply(
    c: &mut (impl AsyncWrite + Unpin),
    opt: u32,
    typ: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(20 + data.len());
    m.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&typ.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    c.write_all(&m).await
}

/// The export name at the start of INFO/GO/META_CONTEXT data (`u32 len, name`).
fn lead_name(data: &[u8]) -> Option<&[u8]> {
    let n = u32::from_be_bytes(data.get(..4)?.try_into().ok()?) as usize;
    data.get(4..4usize.checked_add(n)?)
}

/// Runs the option phase between management's `client` and QEMU's `server`; Ok: the rest
/// of the connection is a plain pipe (transmission, or the server's end after ABORT).
pub async fn negotiate<C, S>(client: &mut C, server: &mut S) -> Result<(), FilterError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut g = [0u8; 18];
    server.read_exact(&mut g).await?;
    let magic = u64::from_be_bytes(g[..8].try_into().expect("8"));
    let opt_magic = u64::from_be_bytes(g[8..16].try_into().expect("8"));
    if magic != NBDMAGIC || opt_magic != IHAVEOPT {
        return Err(FilterError::Server("not a fixed-newstyle greeting".into()));
    }
    client.write_all(&g).await?;
    let mut cflags = [0u8; 4];
    client.read_exact(&mut cflags).await?;
    server.write_all(&cflags).await?;
    loop {
        let mut h = [0u8; 16];
        client.read_exact(&mut h).await?;
        if u64::from_be_bytes(h[..8].try_into().expect("8")) != IHAVEOPT {
            return Err(FilterError::Client("option without IHAVEOPT".into()));
        }
        let opt = u32::from_be_bytes(h[8..12].try_into().expect("4"));
        let len = u32::from_be_bytes(h[12..16].try_into().expect("4"));
        if len > MAX_OPTION {
            // The data is not read: the connection cannot go on.
            reply(client, opt, REP_ERR_TOO_BIG, b"option data too long").await?;
            return Err(FilterError::Client(format!("option {opt} of {len} bytes")));
        }
        let mut data = vec![0u8; len as usize];
        client.read_exact(&mut data).await?;
        match opt {
            OPT_STARTTLS => {
                reply(client, opt, REP_ERR_POLICY, b"TLS is not offered here").await?;
                continue;
            }
            OPT_EXPORT_NAME if hidden(&data) => return Err(FilterError::Hidden),
            OPT_INFO | OPT_GO | OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                match lead_name(&data) {
                    None => {
                        reply(client, opt, REP_ERR_INVALID, b"malformed option").await?;
                        continue;
                    }
                    Some(n) if hidden(n) => {
                        let text = format!("export '{}' not present", String::from_utf8_lossy(n));
                        reply(client, opt, REP_ERR_UNKNOWN, text.as_bytes()).await?;
                        continue;
                    }
                    Some(_) => {}
                }
            }
            _ => {}
        }
        server.write_all(&h).await?;
        server.write_all(&data).await?;
        if matches!(opt, OPT_EXPORT_NAME | OPT_ABORT) {
            // EXPORT_NAME: the server answers with the export's size and flags, then
            // transmission; ABORT: the server acks and closes.
            return Ok(());
        }
        // The server's replies to this option, up to its final one.
        loop {
            let mut r = [0u8; 20];
            server.read_exact(&mut r).await?;
            if u64::from_be_bytes(r[..8].try_into().expect("8")) != OPT_REPLY_MAGIC {
                return Err(FilterError::Server("bad option reply magic".into()));
            }
            let ropt = u32::from_be_bytes(r[8..12].try_into().expect("4"));
            let typ = u32::from_be_bytes(r[12..16].try_into().expect("4"));
            let rlen = u32::from_be_bytes(r[16..20].try_into().expect("4"));
            if ropt != opt {
                return Err(FilterError::Server(format!(
                    "reply to option {ropt} for option {opt}"
                )));
            }
            if rlen > MAX_REPLY {
                return Err(FilterError::Server(format!("option reply of {rlen} bytes")));
            }
            let mut rdata = vec![0u8; rlen as usize];
            server.read_exact(&mut rdata).await?;
            let pass =
                !(opt == OPT_LIST && typ == REP_SERVER && lead_name(&rdata).is_some_and(hidden));
            if pass {
                client.write_all(&r).await?;
                client.write_all(&rdata).await?;
            }
            if !matches!(typ, REP_SERVER | REP_INFO | REP_META_CONTEXT) {
                if opt == OPT_GO && typ == REP_ACK {
                    return Ok(());
                }
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command};
    use tokio::net::{UnixListener, UnixStream};

    struct Qsd(Child);
    impl Drop for Qsd {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// qemu-storage-daemon with acceld's kind of export (`accel-d0`, writable) and
    /// management's (`mgmt`) on one NBD server, as QEMU's server has them; and the proxy's
    /// filter in front of it. (None when qemu-storage-daemon is not installed.)
    async fn setup(dir: &Path) -> Option<(Qsd, PathBuf)> {
        let qsd = Path::new("/usr/bin/qemu-storage-daemon");
        if !qsd.exists() {
            eprintln!("skip: no qemu-storage-daemon");
            return None;
        }
        for n in ["a", "b"] {
            std::fs::File::create(dir.join(format!("{n}.raw")))
                .unwrap()
                .set_len(1 << 20)
                .unwrap();
        }
        let up = dir.join("qemu-nbd.sock");
        let d = dir.display();
        let child = Command::new(qsd)
            .args([
                "--blockdev",
                &format!("driver=file,filename={d}/a.raw,node-name=fa"),
                "--blockdev",
                &format!("driver=file,filename={d}/b.raw,node-name=fb"),
                "--nbd-server",
                &format!("addr.type=unix,addr.path={}", up.display()),
                "--export",
                "type=nbd,id=e1,node-name=fa,name=accel-d0,writable=on",
                "--export",
                "type=nbd,id=e2,node-name=fb,name=mgmt",
            ])
            .spawn()
            .unwrap();
        let qsd = Qsd(child);
        let t0 = std::time::Instant::now();
        while UnixStream::connect(&up).await.is_err() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(20), "no qsd");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let front = dir.join("mgmt-nbd.sock");
        let l = UnixListener::bind(&front).unwrap();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let up = up.clone();
                tokio::spawn(async move {
                    let mut s = UnixStream::connect(&up).await.unwrap();
                    if negotiate(&mut c, &mut s).await.is_ok() {
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
                    }
                });
            }
        });
        Some((qsd, front))
    }

    async fn opt(s: &mut UnixStream, opt: u32, data: &[u8]) {
        let mut m = Vec::new();
        m.extend_from_slice(&IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m).await.unwrap();
    }

    async fn rep(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u64::from_be_bytes(h[..8].try_into().unwrap()),
            OPT_REPLY_MAGIC
        );
        let o = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let t = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let n = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0; n as usize];
        s.read_exact(&mut d).await.unwrap();
        (o, t, d)
    }

    async fn raw(front: &Path) -> UnixStream {
        let mut s = UnixStream::connect(front).await.unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).await.unwrap();
        s.write_all(&3u32.to_be_bytes()).await.unwrap();
        s
    }

    fn named(name: &str) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        d
    }

    fn qemu_img_info(front: &Path, export: &str) -> std::process::Output {
        Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(format!("nbd+unix:///{export}?socket={}", front.display()))
            .output()
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acceld_exports_do_not_exist_for_management() {
        let dir = tempfile::tempdir().unwrap();
        let Some((_qsd, front)) = setup(dir.path()).await else {
            return;
        };
        // LIST: management's export only.
        let mut s = raw(&front).await;
        opt(&mut s, OPT_LIST, &[]).await;
        let mut names = Vec::new();
        loop {
            let (o, t, d) = rep(&mut s).await;
            assert_eq!(o, OPT_LIST);
            if t != REP_SERVER {
                assert_eq!(t, REP_ACK);
                break;
            }
            names.push(String::from_utf8_lossy(lead_name(&d).unwrap()).into_owned());
        }
        assert_eq!(names, ["mgmt"]);
        // INFO, GO, LIST_META_CONTEXT naming acceld's export: unknown; the connection goes on.
        for o in [OPT_INFO, OPT_GO] {
            opt(&mut s, o, &named("accel-d0")).await;
            assert_eq!(rep(&mut s).await.1, REP_ERR_UNKNOWN);
        }
        let mut meta = (8u32).to_be_bytes().to_vec();
        meta.extend_from_slice(b"accel-d0");
        meta.extend_from_slice(&0u32.to_be_bytes());
        opt(&mut s, OPT_LIST_META_CONTEXT, &meta).await;
        assert_eq!(rep(&mut s).await.1, REP_ERR_UNKNOWN);
        // STARTTLS: refused by policy.
        opt(&mut s, OPT_STARTTLS, &[]).await;
        assert_eq!(rep(&mut s).await.1, REP_ERR_POLICY);
        // INFO for management's export: QEMU's answer passes.
        opt(&mut s, OPT_INFO, &named("mgmt")).await;
        loop {
            let (_, t, _) = rep(&mut s).await;
            if t != REP_INFO {
                assert_eq!(t, REP_ACK);
                break;
            }
        }
        // Oversized option data: an error and the end.
        opt(&mut s, OPT_INFO, &vec![0u8; MAX_OPTION as usize + 1]).await;
        assert_eq!(rep(&mut s).await.1, REP_ERR_TOO_BIG);
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).await.unwrap_or(0), 0);
        // EXPORT_NAME of acceld's export: closed.
        let mut s = raw(&front).await;
        opt(&mut s, OPT_EXPORT_NAME, b"accel-d0").await;
        assert_eq!(s.read(&mut b).await.unwrap_or(0), 0);

        // A real client: management's export works, acceld's does not exist.
        let f = front.clone();
        let (ok, hidden) = tokio::task::spawn_blocking(move || {
            (qemu_img_info(&f, "mgmt"), qemu_img_info(&f, "accel-d0"))
        })
        .await
        .unwrap();
        assert!(
            ok.status.success(),
            "{}",
            String::from_utf8_lossy(&ok.stderr)
        );
        assert!(String::from_utf8_lossy(&ok.stdout).contains("\"virtual-size\": 1048576"));
        assert!(!hidden.status.success(), "acceld's export reachable");
        assert!(String::from_utf8_lossy(&hidden.stderr).contains("accel-d0"));
    }
}
