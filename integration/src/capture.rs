//! Captures QEMU 10's QMP outputs for a VM laid out as accel's VM contract says (and with the
//! cases the policy must recognise), for policy tests and fixtures:
//! `accel-integration capture --out DIR` writes one JSON file per query.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use qmp_client::{connect_with_retry, Qmp};
use serde_json::{json, Value};

/// A QEMU (`-machine none`, no guest) whose block graph has: `d0` raw over file (accelerable),
/// `q0` qcow2 over file, `d1` raw with a throttle filter `d1-thr` exported over NBD, `d2` raw
/// with a dirty bitmap.
pub struct Lab {
    pub qmp: Qmp,
    pub dir: PathBuf,
    _child: tokio::process::Child,
}

impl Lab {
    pub async fn start(dir: &Path) -> Result<Self> {
        for (n, size) in [
            ("d0.raw", 16u64 << 20),
            ("d1.raw", 16 << 20),
            ("d2.raw", 16 << 20),
        ] {
            std::fs::File::create(dir.join(n))?.set_len(size)?;
        }
        let q0 = dir.join("q0.qcow2");
        let st = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&q0)
            .arg("16M")
            .status()
            .context("qemu-img")?;
        anyhow::ensure!(st.success(), "qemu-img create failed");
        let sock = dir.join("qmp.sock");
        let mut c = tokio::process::Command::new("qemu-system-x86_64");
        c.args(["-machine", "none", "-nodefaults", "-display", "none"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .args(["-object", "iothread,id=accel-io"]);
        for d in ["d0", "d1", "d2"] {
            c.arg("-blockdev").arg(format!(
                "driver=file,node-name={d}-file,filename={},cache.direct=on",
                dir.join(format!("{d}.raw")).display()
            ));
            c.arg("-blockdev")
                .arg(format!("driver=raw,node-name={d},file={d}-file"));
        }
        c.arg("-blockdev").arg(format!(
            "driver=file,node-name=q0-file,filename={}",
            q0.display()
        ));
        c.args(["-blockdev", "driver=qcow2,node-name=q0,file=q0-file"]);
        let child = c
            .kill_on_drop(true)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("qemu-system-x86_64")?;
        let qmp = connect_with_retry(&sock, 200, Duration::from_millis(25)).await?;
        qmp.execute_raw(
            "object-add",
            Some(json!({"qom-type": "throttle-group", "id": "tg0", "limits": {"iops-total": 100}})),
        )
        .await?;
        qmp.execute_raw(
            "blockdev-add",
            Some(json!({"driver": "throttle", "node-name": "d1-thr", "throttle-group": "tg0", "file": "d1"})),
        )
        .await?;
        let nbd = dir.join("nbd.sock");
        qmp.execute_raw(
            "nbd-server-start",
            Some(json!({"addr": {"type": "unix", "data": {"path": nbd}}})),
        )
        .await?;
        qmp.execute_raw(
            "block-export-add",
            Some(json!({"type": "nbd", "id": "d1-exp", "node-name": "d1-thr", "writable": true, "iothread": "accel-io"})),
        )
        .await?;
        qmp.execute_raw(
            "block-dirty-bitmap-add",
            Some(json!({"node": "d2", "name": "bm0"})),
        )
        .await?;
        Ok(Lab {
            qmp,
            dir: dir.to_path_buf(),
            _child: child,
        })
    }

    /// The queries the policy reads, by file name.
    pub async fn queries(&self) -> Result<Vec<(&'static str, Value)>> {
        let mut out = Vec::new();
        for (file, cmd, args) in [
            (
                "query-named-block-nodes-flat.json",
                "query-named-block-nodes",
                Some(json!({"flat": true})),
            ),
            (
                "x-debug-query-block-graph.json",
                "x-debug-query-block-graph",
                None,
            ),
            ("query-block.json", "query-block", None),
            ("query-status.json", "query-status", None),
            ("query-migrate.json", "query-migrate", None),
            ("query-block-exports.json", "query-block-exports", None),
        ] {
            let r = self.qmp.execute_raw(cmd, args.clone()).await?;
            let mut v = json!({"execute": cmd, "response": {"return": r}});
            if let Some(a) = args {
                v["arguments"] = a;
            }
            out.push((file, v));
        }
        Ok(out)
    }
}

/// `accel-integration capture --out DIR`.
pub fn capture(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let work = tempfile::tempdir()?;
        let lab = Lab::start(work.path()).await?;
        for (file, v) in lab.queries().await? {
            std::fs::write(out.join(file), serde_json::to_string_pretty(&v)?)?;
            println!("wrote {}", out.join(file).display());
        }
        Ok(())
    })
}
