//! A scripted stand-in for QEMU, for hermetic supervisor tests: a QMP server that keeps a small
//! model of one VM's block graph (nodes, exports, objects) and a simple NBD server that serves
//! the image file for each export. Any command can be made to fail once (`fail_next`), and the
//! NBD server can be stopped, to drive every rollback path of a switch.
//!
//! It answers what the supervisor asks, in QEMU 10's shapes; anything else gets
//! `CommandNotFound`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

#[derive(Clone, Debug)]
struct Node {
    driver: String,
    file: String,
    /// Child node (the `file` edge), if any.
    child: Option<String>,
}

#[derive(Default)]
struct Model {
    nodes: BTreeMap<String, Node>,
    /// export id -> (node, export name)
    exports: BTreeMap<String, (String, String)>,
    objects: BTreeSet<String>,
    fail: HashMap<String, String>,
    /// Runs (once) before the reply to the command (a compromised QEMU acting meanwhile).
    before_reply: HashMap<String, Box<dyn FnOnce() + Send>>,
    log: Vec<String>,
    nbd_path: Option<PathBuf>,
    /// Offer `oob` in the greeting.
    oob: bool,
    /// Answer no `exec-oob` until released (ids kept, per connection).
    hold_oob: bool,
    held: Vec<(Value, Arc<Mutex<UnixStream>>)>,
    oob_seen: usize,
    /// Every QMP connection's writer (events go to all).
    conns: Vec<Arc<Mutex<UnixStream>>>,
}

pub struct FakeQemu {
    pub qmp_path: PathBuf,
    model: Arc<Mutex<Model>>,
    nbd_up: Arc<AtomicBool>,
    /// The NBD server reads writes and neither performs nor answers them (a hung export).
    nbd_hold_writes: Arc<AtomicBool>,
    /// QMP commands are read and never answered (a wedged or compromised QEMU).
    qmp_silent: AtomicBool,
    image: PathBuf,
    chardev_socket: PathBuf,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FakeQemu {
    /// A VM with one drive `drive` (raw over file on `image`) whose vhost-user-blk device
    /// uses `vhost_socket`.
    pub fn start(dir: &Path, drive: &str, image: &Path, vhost_socket: &Path) -> Arc<Self> {
        let qmp_path = dir.join("fake-qmp.sock");
        let _ = std::fs::remove_file(&qmp_path);
        let listener = UnixListener::bind(&qmp_path).expect("bind fake QMP");
        let mut m = Model::default();
        let fname = image.display().to_string();
        m.nodes.insert(
            format!("{drive}-file"),
            Node {
                driver: "file".into(),
                file: fname.clone(),
                child: None,
            },
        );
        m.nodes.insert(
            drive.to_string(),
            Node {
                driver: "raw".into(),
                file: fname,
                child: Some(format!("{drive}-file")),
            },
        );
        m.objects.insert("accel-io".into());
        let me = Arc::new(FakeQemu {
            qmp_path,
            model: Arc::new(Mutex::new(m)),
            nbd_up: Arc::new(AtomicBool::new(true)),
            nbd_hold_writes: Arc::new(AtomicBool::new(false)),
            qmp_silent: AtomicBool::new(false),
            image: image.to_path_buf(),
            chardev_socket: vhost_socket.to_path_buf(),
        });
        let me2 = me.clone();
        std::thread::spawn(move || {
            for s in listener.incoming().map_while(Result::ok) {
                let me3 = me2.clone();
                std::thread::spawn(move || me3.serve_qmp(s));
            }
        });
        me
    }

    /// A supervisor over `run` (quiet period 100 ms; no periodic poll, so only explicit
    /// requests act and an injected failure meets the step it targets) with VM `vm`
    /// registered on this QEMU with `spec`. From a multi-threaded tokio runtime.
    pub fn supervise(
        &self,
        run: &Path,
        spec: acceld::control::DriveSpec,
    ) -> Arc<acceld::supervisor::Supervisor> {
        self.supervise_polling(run, spec, 3_600_000)
    }

    /// [`FakeQemu::supervise`] with a periodic reconcile every `poll_interval_ms`.
    pub fn supervise_polling(
        &self,
        run: &Path,
        spec: acceld::control::DriveSpec,
        poll_interval_ms: u64,
    ) -> Arc<acceld::supervisor::Supervisor> {
        use acceld::supervisor::{Config, Supervisor};
        let sup = Supervisor::new(Config {
            run_dir: run.to_path_buf(),
            quiet_period_ms: 100,
            poll_interval_ms,
            attach_timeout_ms: 5000,
            ..Config::default()
        });
        let s = sup.clone();
        let qmp = self.qmp_path.clone();
        tokio::task::block_in_place(|| {
            s.register("vm".into(), qmp, vec![spec], false, false, None)
        })
        .expect("register the VM");
        sup
    }

    /// The next `cmd` fails with `desc` (GenericError).
    pub fn fail_next(&self, cmd: &str, desc: &str) {
        lock(&self.model).fail.insert(cmd.into(), desc.into());
    }

    /// Runs `f` once, before the next `cmd` is answered: what a compromised QEMU can do while
    /// acceld waits for that answer.
    pub fn before_reply(&self, cmd: &str, f: impl FnOnce() + Send + 'static) {
        lock(&self.model)
            .before_reply
            .insert(cmd.into(), Box::new(f));
    }

    /// Whether QEMU's model has a node of that name.
    pub fn has_node(&self, name: &str) -> bool {
        lock(&self.model).nodes.contains_key(name)
    }

    pub fn exports(&self) -> Vec<String> {
        lock(&self.model).exports.keys().cloned().collect()
    }

    pub fn objects(&self) -> Vec<String> {
        lock(&self.model).objects.iter().cloned().collect()
    }

    /// Every command received, in order.
    pub fn log(&self) -> Vec<String> {
        lock(&self.model).log.clone()
    }

    /// Stop accepting NBD connections (the export "disappears" for new connections).
    pub fn set_nbd_up(&self, up: bool) {
        self.nbd_up.store(up, Ordering::Relaxed);
    }

    /// From now on, writes to any export are read and then neither performed nor answered.
    pub fn hold_nbd_writes(&self, on: bool) {
        self.nbd_hold_writes.store(on, Ordering::Relaxed);
    }

    /// From now on, no QMP command gets an answer (the connection stays open).
    pub fn silence_qmp(&self, on: bool) {
        self.qmp_silent.store(on, Ordering::Relaxed);
    }

    /// Offer `oob` to connections made from now on.
    pub fn set_oob(&self, on: bool) {
        lock(&self.model).oob = on;
    }

    /// Hold every `exec-oob` reply until [`FakeQemu::release_oob`].
    pub fn hold_oob(&self, on: bool) {
        lock(&self.model).hold_oob = on;
    }

    /// Answers the held `exec-oob` commands (`{}` each), and stops holding.
    pub fn release_oob(&self) {
        let held = {
            let mut m = lock(&self.model);
            m.hold_oob = false;
            std::mem::take(&mut m.held)
        };
        for (id, w) in held {
            let _ = writeln!(lock(&w), "{}", json!({"return": {}, "id": id}));
        }
    }

    /// How many `exec-oob` commands arrived.
    pub fn oob_seen(&self) -> usize {
        lock(&self.model).oob_seen
    }

    /// Sends an event (`{"event": name, "data": data}` with a timestamp) on every connection.
    pub fn emit(&self, name: &str, data: &Value) {
        let ev =
            json!({"event": name, "data": data, "timestamp": {"seconds": 1, "microseconds": 2}});
        let conns = lock(&self.model).conns.clone();
        for w in conns {
            let _ = writeln!(lock(&w), "{ev}");
        }
    }

    fn serve_qmp(&self, s: UnixStream) {
        let w = Arc::new(Mutex::new(s.try_clone().expect("clone")));
        let caps = if lock(&self.model).oob {
            json!(["oob"])
        } else {
            json!([])
        };
        let greeting = json!({"QMP": {"version": {"qemu": {"major": 10, "minor": 0, "micro": 2}, "package": "fake"}, "capabilities": caps}});
        if writeln!(lock(&w), "{greeting}").is_err() {
            return;
        }
        lock(&self.model).conns.push(w.clone());
        for line in BufReader::new(s).lines().map_while(Result::ok) {
            let Ok(req) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            let id = req["id"].clone();
            if let Some(cmd) = req["exec-oob"].as_str() {
                let mut m = lock(&self.model);
                m.oob_seen += 1;
                m.log.push(format!("oob:{cmd}"));
                if m.hold_oob {
                    m.held.push((id, w.clone()));
                    continue;
                }
                drop(m);
                if writeln!(lock(&w), "{}", json!({"return": {}, "id": id})).is_err() {
                    return;
                }
                continue;
            }
            if self.qmp_silent.load(Ordering::Relaxed) {
                continue;
            }
            let cmd = req["execute"].as_str().unwrap_or_default().to_string();
            let args = req["arguments"].clone();
            let result = self.exec(&cmd, &args);
            let hook = lock(&self.model).before_reply.remove(&cmd);
            if let Some(f) = hook {
                f();
            }
            let reply = match result {
                Ok(v) => json!({"return": v, "id": id}),
                Err((class, desc)) => json!({"error": {"class": class, "desc": desc}, "id": id}),
            };
            if writeln!(lock(&w), "{reply}").is_err() {
                return;
            }
        }
    }

    fn exec(&self, cmd: &str, a: &Value) -> Result<Value, (&'static str, String)> {
        let mut m = lock(&self.model);
        m.log.push(cmd.to_string());
        if let Some(desc) = m.fail.remove(cmd) {
            return Err(("GenericError", desc));
        }
        let generic = |d: String| ("GenericError", d);
        let s = |k: &str| a[k].as_str().unwrap_or_default().to_string();
        match cmd {
            "qmp_capabilities" | "cont" | "qom-set" | "getfd" | "closefd" => Ok(json!({})),
            "query-status" => Ok(json!({"status": "running", "running": true})),
            "query-migrate" => Ok(json!({})),
            "query-block" => Ok(json!([])),
            "query-chardev" => Ok(json!([
                {"label": "d-sock", "filename": format!("unix:{}", self.chardev_socket.display()), "frontend-open": true}
            ])),
            "qom-list" => match a["path"].as_str() {
                Some("/machine/peripheral") => {
                    Ok(json!([{"name": "vdisk", "type": "child<vhost-user-blk-pci>"}]))
                }
                Some("/objects") => Ok(Value::Array(
                    m.objects
                        .iter()
                        .map(|o| json!({"name": o, "type": "child<x>"}))
                        .collect(),
                )),
                p => Err(generic(format!("no path {p:?}"))),
            },
            "qom-get" => Ok(json!("d-sock")),
            "query-named-block-nodes" => Ok(Value::Array(
                m.nodes
                    .iter()
                    .map(|(n, node)| {
                        json!({"node-name": n, "drv": node.driver, "ro": false, "file": node.file,
                           "image": {"virtual-size": 0}, "detect_zeroes": "off", "encrypted": false,
                           "backing_file_depth": 0, "active": true,
                           "cache": {"direct": true, "no-flush": false, "writeback": true}})
                    })
                    .collect(),
            )),
            "x-debug-query-block-graph" => {
                let names: Vec<&String> = m.nodes.keys().collect();
                let id = |n: &str| names.iter().position(|x| *x == n).unwrap_or(0) as u64 + 1;
                let mut nodes: Vec<Value> = names
                    .iter()
                    .map(|n| json!({"id": id(n), "type": "block-driver", "name": n}))
                    .collect();
                let mut edges = Vec::new();
                for (n, node) in &m.nodes {
                    if let Some(c) = &node.child {
                        edges.push(json!({"parent": id(n), "child": id(c), "name": "file"}));
                    }
                }
                for (i, (_, (node, _))) in m.exports.iter().enumerate() {
                    let eid = 1000 + i as u64;
                    nodes.push(json!({"id": eid, "type": "block-backend", "name": ""}));
                    edges.push(json!({"parent": eid, "child": id(node), "name": "root"}));
                }
                Ok(json!({"nodes": nodes, "edges": edges}))
            }
            "query-block-exports" => Ok(Value::Array(
                m.exports
                    .iter()
                    .map(|(id, (node, _))| json!({"id": id, "node-name": node, "type": "nbd", "shutting-down": false}))
                    .collect(),
            )),
            "blockdev-del" => {
                let n = s("node-name");
                if !m.nodes.contains_key(&n) {
                    return Err(generic(format!("Failed to find node with node-name='{n}'")));
                }
                let used = m.nodes.values().any(|x| x.child.as_deref() == Some(&n))
                    || m.exports.values().any(|(x, _)| x == &n);
                if used {
                    return Err(generic(format!("Node '{n}' is busy")));
                }
                m.nodes.remove(&n);
                Ok(json!({}))
            }
            "blockdev-add" => {
                let n = s("node-name");
                if m.nodes.contains_key(&n) {
                    return Err(generic(format!("Duplicate nodes with node-name='{n}'")));
                }
                let child = a["file"].as_str().map(String::from);
                if let Some(c) = &child {
                    if !m.nodes.contains_key(c) {
                        return Err(generic(format!("Cannot find node '{c}'")));
                    }
                }
                let file = match &child {
                    Some(c) => m.nodes[c].file.clone(),
                    None => s("filename"),
                };
                m.nodes.insert(
                    n,
                    Node {
                        driver: s("driver"),
                        file,
                        child,
                    },
                );
                Ok(json!({}))
            }
            "object-add" => {
                m.objects.insert(s("id"));
                Ok(json!({}))
            }
            "object-del" => {
                m.objects.remove(&s("id"));
                Ok(json!({}))
            }
            "nbd-server-start" => {
                if m.nbd_path.is_some() {
                    return Err(generic("NBD server already running".into()));
                }
                let p = PathBuf::from(a["addr"]["data"]["path"].as_str().unwrap_or_default());
                let _ = std::fs::remove_file(&p);
                let l = UnixListener::bind(&p).map_err(|e| generic(e.to_string()))?;
                m.nbd_path = Some(p);
                let model = self.model.clone();
                let up = self.nbd_up.clone();
                let hold = self.nbd_hold_writes.clone();
                let image = self.image.clone();
                std::thread::spawn(move || {
                    for c in l.incoming().map_while(Result::ok) {
                        if !up.load(Ordering::Relaxed) {
                            continue; // dropped: the client sees EOF in the handshake
                        }
                        let model = model.clone();
                        let image = image.clone();
                        let hold = hold.clone();
                        std::thread::spawn(move || {
                            let _ = serve_nbd(c, &model, &image, &hold);
                        });
                    }
                });
                Ok(json!({}))
            }
            "block-export-add" => {
                let id = s("id");
                let node = s("node-name");
                if a["type"] != "nbd" {
                    // No vhost-user-blk export here: a relay falls back to NBD.
                    return Err(generic(format!(
                        "the fake QEMU has no {} export",
                        a["type"].as_str().unwrap_or("?")
                    )));
                }
                if !m.nodes.contains_key(&node) {
                    return Err(generic(format!("Cannot find node '{node}'")));
                }
                if m.exports.contains_key(&id) {
                    return Err(generic(format!("Block export id '{id}' is already in use")));
                }
                let name = a["name"].as_str().map(String::from).unwrap_or(node.clone());
                m.exports.insert(id, (node, name));
                Ok(json!({}))
            }
            "block-export-del" => {
                let id = s("id");
                if m.exports.remove(&id).is_none() {
                    return Err(generic(format!("Export '{id}' is not found")));
                }
                Ok(json!({}))
            }
            _ => Err(("CommandNotFound", format!("The command {cmd} has not been found"))),
        }
    }
}

/// A minimal NBD server: fixed newstyle, NBD_OPT_GO (structured replies refused, so the
/// client's simple-reply path runs), READ/WRITE/FLUSH/TRIM/WRITE_ZEROES on the image file.
fn serve_nbd(
    mut s: UnixStream,
    model: &Mutex<Model>,
    image: &Path,
    hold_writes: &AtomicBool,
) -> std::io::Result<()> {
    let f = File::options().read(true).write(true).open(image)?;
    let size = f.metadata()?.len();
    crate::nbd_server::handshake(&mut s, size, 1 | 4 | 8 | 32 | 64, false, &|name| {
        lock(model).exports.values().any(|(_, n)| n == name)
    })?;
    crate::nbd_server::serve_file(&mut s, &f, |_| hold_writes.load(Ordering::Relaxed))
}
