//! `accel-integration compare`: fio bare metal, qemu-storage-daemon's vhost-user-blk export and
//! `acceld serve` on the same file, server (or fio) pinned to one core and the client to the
//! other; every cell repeated; one table with the ratios.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use accel_tests::harness::{wait_socket, Qsd, QsdOptions};

use crate::acceld_bin;

/// `accel-integration compare` options.
#[derive(Clone, Debug, clap::Args)]
pub struct CompareOpts {
    /// The file (default: 1 GiB on tmpfs).
    #[arg(long, default_value = "/dev/shm/accel-bench.raw")]
    pub image: PathBuf,
    #[arg(long, default_value_t = 1024)]
    pub size_mib: u64,
    /// Repeats of each cell (the table shows the median).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Queue depths (default 1,32,128; with --qemu-engine 1,32).
    #[arg(long, value_delimiter = ',')]
    pub depths: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub queues: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "randread,randwrite")]
    pub workloads: Vec<String>,
    /// CPU for the server (and for fio).
    #[arg(long, default_value_t = 1)]
    pub server_cpu: usize,
    /// CPU for the client (accel-bench).
    #[arg(long, default_value_t = 0)]
    pub client_cpu: usize,
    /// The accel-bench binary (default: next to this program).
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// Extra arguments for `acceld serve`, e.g. `--acceld-arg=--io=io_uring`.
    #[arg(long = "acceld-arg", allow_hyphen_values = true)]
    pub acceld_args: Vec<String>,
    /// Compare the qemu engine instead: QEMU's own vhost-user-blk export of a node against
    /// acceld's qemu engine on an NBD export of the same node of the same
    /// qemu-storage-daemon (the serving side, acceld and QEMU together, on the server CPU),
    /// with acceld's direct engine on the file in the same run. Default depths: 1,32.
    #[arg(long)]
    pub qemu_engine: bool,
}

/// One measurement.
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    iops: f64,
    p99_us: f64,
    /// Requests per CPU-second of the server (for fio: of fio itself, with its kernel
    /// worker threads).
    per_cpu: f64,
}

/// CPU seconds (user + system) of this process's waited-for children so far.
fn children_cpu() -> f64 {
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: ru is a valid rusage buffer that outlives the call.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn prepare_image(o: &CompareOpts) -> Result<()> {
    let want = o.size_mib << 20;
    if std::fs::metadata(&o.image).map(|m| m.len()).ok() == Some(want) {
        return Ok(());
    }
    // Real data, not holes: reads of a sparse file would measure nothing.
    let st = Command::new("fio")
        .args([
            "--name=fill",
            "--rw=write",
            "--bs=1M",
            "--ioengine=psync",
            "--direct=0",
        ])
        .arg(format!("--filename={}", o.image.display()))
        .arg(format!("--size={want}"))
        .arg("--output=/dev/null")
        .status()
        .context("fio (apt-get install fio)")?;
    if !st.success() {
        bail!("filling {} failed", o.image.display());
    }
    Ok(())
}

/// fio on the server's core: `engine` io_uring (the ceiling) or pvsync2 (one
/// synchronous request at a time per job, whatever the depth).
fn fio(o: &CompareOpts, engine: &str, rw: &str, depth: usize, jobs: usize) -> Result<Sample> {
    let depth = if engine == "io_uring" { depth } else { 1 };
    let cpu0 = children_cpu();
    let out = Command::new("taskset")
        .arg("-c")
        .arg(o.server_cpu.to_string())
        .args(["fio", "--name=bare", "--direct=1", "--bs=4k", "--thread"])
        .arg(format!("--ioengine={engine}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--iodepth={depth}"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--filename={}", o.image.display()))
        .arg(format!("--runtime={}", o.seconds))
        .args(["--time_based", "--group_reporting", "--output-format=json"])
        .output()
        .context("running fio")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("fio json")?;
    let job = &v["jobs"][0];
    let dir = if rw.contains("read") { "read" } else { "write" };
    let iops = job[dir]["iops"].as_f64().unwrap_or(0.0);
    let p99 = job[dir]["clat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .unwrap_or(0.0)
        / 1000.0;
    let runtime = job[dir]["runtime"].as_f64().unwrap_or(1000.0) / 1000.0;
    // fio's own usr_cpu/sys_cpu leave out the io_uring worker threads that do the copies on
    // tmpfs; the kernel's accounting of the whole child (threads included) does not.
    let cpu = children_cpu() - cpu0;
    Ok(Sample {
        iops,
        p99_us: p99,
        per_cpu: if cpu > 0.0 { iops * runtime / cpu } else { 0.0 },
    })
}

fn client(
    o: &CompareOpts,
    sock: &Path,
    pids: &[u32],
    rw: &str,
    depth: usize,
    queues: usize,
) -> Result<Sample> {
    let out = Command::new("taskset")
        .arg("-c")
        .arg(o.client_cpu.to_string())
        .arg(bench_bin(o)?)
        .arg("--socket")
        .arg(sock)
        .args(["--workload", rw, "--bs", "4k", "--json", "--poll"])
        .arg(format!("--depth={depth}"))
        .arg(format!("--queues={queues}"))
        .arg(format!("--duration={}", o.seconds))
        .arg(format!(
            "--server-pid={}",
            pids.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ))
        .output()
        .context("running accel-bench")?;
    if !out.status.success() {
        bail!(
            "accel-bench failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("accel-bench json")?;
    Ok(Sample {
        iops: v["iops"].as_f64().unwrap_or(0.0),
        p99_us: v["p99_us"].as_f64().unwrap_or(0.0),
        per_cpu: v["iops_per_cpu_s"].as_f64().unwrap_or(0.0),
    })
}

fn bench_bin(o: &CompareOpts) -> Result<PathBuf> {
    match &o.bench {
        Some(b) => Ok(b.clone()),
        None => Ok(std::env::current_exe()?.with_file_name("accel-bench")),
    }
}

fn qsd(o: &CompareOpts, sock: &Path, queues: usize) -> Result<Qsd> {
    Qsd::start(
        &o.image,
        sock,
        &QsdOptions {
            queues: queues as u16,
            aio_io_uring: true,
            cpu: Some(o.server_cpu),
            ..Default::default()
        },
    )
    .context("qemu-storage-daemon")
}

fn acceld(o: &CompareOpts, sock: &Path, queues: usize) -> Result<Kill> {
    acceld_on(
        o,
        sock,
        queues,
        &["--image".into(), o.image.display().to_string()],
    )
}

/// `acceld serve` on the server CPU with `what` (an image, or an NBD export).
fn acceld_on(o: &CompareOpts, sock: &Path, queues: usize, what: &[String]) -> Result<Kill> {
    let _ = std::fs::remove_file(sock);
    let c = Command::new("taskset")
        .arg("-c")
        .arg(o.server_cpu.to_string())
        .arg(acceld_bin()?)
        .arg("serve")
        .args(what)
        .arg("--socket")
        .arg(sock)
        .arg(format!("--queues={queues}"))
        .args(&o.acceld_args)
        .env("ACCELD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("acceld")?;
    let k = Kill(c);
    wait_socket(sock, Duration::from_secs(10))?;
    Ok(k)
}

fn median(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let m = v[v.len() / 2];
    let spread = if m > 0.0 {
        (v[v.len() - 1] - v[0]) / m * 100.0
    } else {
        0.0
    };
    (m, spread)
}

/// The median of each figure over a cell's runs, and half the IOPS spread (in %).
struct Med {
    iops: f64,
    spread: f64,
    p99: f64,
    per_cpu: f64,
}

fn med(v: &[Sample]) -> Med {
    let col = |f: fn(&Sample) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        median(&mut x)
    };
    let (iops, spread) = col(|s| s.iops);
    Med {
        iops,
        spread: spread / 2.0,
        p99: col(|s| s.p99_us).0,
        per_cpu: col(|s| s.per_cpu).0,
    }
}

/// The line above a table: runs, duration, file, CPUs, acceld's options.
fn print_setup(o: &CompareOpts, serving: &str) {
    println!(
        "median of {} runs x {:.0} s, 4 KiB, {} MiB file {}; {serving} on CPU {}, client on CPU {}; acceld {}; (spread = (max-min)/median)\n",
        o.runs,
        o.seconds,
        o.size_mib,
        o.image.display(),
        o.server_cpu,
        o.client_cpu,
        if o.acceld_args.is_empty() {
            "with default options".to_string()
        } else {
            o.acceld_args.join(" ")
        }
    );
}

struct Cell {
    name: String,
    fio: Vec<Sample>,
    fio_sync: Vec<Sample>,
    qsd: Vec<Sample>,
    acc: Vec<Sample>,
}

/// One qemu-storage-daemon on the server CPU serving one node (file, `cache.direct=on`,
/// `aio=io_uring`, raw) in an iothread twice: QEMU's own vhost-user-blk export on `vu`, and
/// an NBD export named `disk0` on `nbd` (what the VM's QEMU gives the qemu engine).
fn qsd_both(o: &CompareOpts, vu: &Path, nbd: &Path, queues: usize) -> Result<Qsd> {
    Qsd::start(
        &o.image,
        vu,
        &QsdOptions {
            queues: queues as u16,
            aio_io_uring: true,
            cpu: Some(o.server_cpu),
            iothread: true,
            nbd: Some(nbd.to_path_buf()),
            ..Default::default()
        },
    )
    .context("qemu-storage-daemon")
}

struct EngineCell {
    name: String,
    export: Vec<Sample>,
    relay: Vec<Sample>,
    lent: Vec<Sample>,
    qemu: Vec<Sample>,
    direct: Vec<Sample>,
}

/// `compare --qemu-engine`.
fn compare_qemu_engine(o: &CompareOpts) -> Result<()> {
    let dir = tempfile::Builder::new().prefix("accel-compare").tempdir()?;
    let (vu, nbd, sock) = (
        dir.path().join("vu.sock"),
        dir.path().join("nbd.sock"),
        dir.path().join("acceld.sock"),
    );
    let depths = if o.depths.is_empty() {
        vec![1, 32]
    } else {
        o.depths.clone()
    };
    let mut cells = Vec::new();
    for rw in &o.workloads {
        for &q in &o.queues {
            for &d in &depths {
                let mut c = EngineCell {
                    name: format!("{rw} QD{d} q{q}"),
                    export: vec![],
                    relay: vec![],
                    lent: vec![],
                    qemu: vec![],
                    direct: vec![],
                };
                for run in 0..o.runs {
                    {
                        let qsd = qsd_both(o, &vu, &nbd, q)?;
                        let qpid = qsd.pid();
                        let what = [
                            "--nbd-socket".to_string(),
                            nbd.display().to_string(),
                            "--nbd-export".into(),
                            "disk0".into(),
                        ];
                        // The qemu engine with the rings lent to the same export.
                        let mut lend = what.to_vec();
                        lend.extend(["--lend-to".to_string(), vu.display().to_string()]);
                        let lent = |c: &mut EngineCell| -> Result<()> {
                            let a = acceld_on(o, &sock, q, &lend)?;
                            c.lent.push(client(o, &sock, &[a.0.id(), qpid], rw, d, q)?);
                            Ok(())
                        };
                        // The relay: acceld's rings, posted on shadow rings in the same export.
                        let relay_what = ["--relay-to".to_string(), vu.display().to_string()];
                        let relay = |c: &mut EngineCell| -> Result<()> {
                            let a = acceld_on(o, &sock, q, &relay_what)?;
                            c.relay.push(client(o, &sock, &[a.0.id(), qpid], rw, d, q)?);
                            Ok(())
                        };
                        // QEMU's export, the relay and the lent rings run in the same process:
                        // every other run turns their order around, so none gains from coming
                        // first or last.
                        if run % 2 == 1 {
                            lent(&mut c)?;
                            relay(&mut c)?;
                        }
                        c.export.push(client(o, &vu, &[qpid], rw, d, q)?);
                        if run % 2 == 0 {
                            relay(&mut c)?;
                            lent(&mut c)?;
                        }
                        let a = acceld_on(o, &sock, q, &what)?;
                        c.qemu.push(client(o, &sock, &[a.0.id(), qpid], rw, d, q)?);
                    }
                    let a = acceld(o, &sock, q)?;
                    c.direct.push(client(o, &sock, &[a.0.id()], rw, d, q)?);
                }
                eprintln!("done: {}", c.name);
                cells.push(c);
            }
        }
    }
    print_setup(o, "serving side (qemu-storage-daemon, acceld, or both)");
    println!("| cell | QEMU export IOPS | relay IOPS | relay / export | relay / export per CPU | rings lent IOPS | lent / export | over NBD IOPS | NBD / export | direct IOPS | p99 µs export / relay / lent / NBD / direct | IOPS per CPU-s export / relay / lent / NBD / direct |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for c in &cells {
        let (e, r, l, q, d) = (
            med(&c.export),
            med(&c.relay),
            med(&c.lent),
            med(&c.qemu),
            med(&c.direct),
        );
        println!(
            "| {} | {:.0} (±{:.0}%) | {:.0} (±{:.0}%) | {:.2} | {:.2} | {:.0} (±{:.0}%) | {:.2} | {:.0} (±{:.0}%) | {:.2} | {:.0} (±{:.0}%) | {:.0} / {:.0} / {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} / {:.0} / {:.0} |",
            c.name,
            e.iops,
            e.spread,
            r.iops,
            r.spread,
            r.iops / e.iops.max(1.0),
            r.per_cpu / e.per_cpu.max(1.0),
            l.iops,
            l.spread,
            l.iops / e.iops.max(1.0),
            q.iops,
            q.spread,
            q.iops / e.iops.max(1.0),
            d.iops,
            d.spread,
            e.p99,
            r.p99,
            l.p99,
            q.p99,
            d.p99,
            e.per_cpu,
            r.per_cpu,
            l.per_cpu,
            q.per_cpu,
            d.per_cpu,
        );
    }
    Ok(())
}

pub fn compare(o: &CompareOpts) -> Result<()> {
    prepare_image(o)?;
    if o.qemu_engine {
        return compare_qemu_engine(o);
    }
    let mut o = o.clone();
    if o.depths.is_empty() {
        o.depths = vec![1, 32, 128];
    }
    let o = &o;
    let dir = tempfile::Builder::new().prefix("accel-compare").tempdir()?;
    let sock = dir.path().join("s.sock");
    let mut cells = Vec::new();
    for rw in &o.workloads {
        for &q in &o.queues {
            for &d in &o.depths {
                let mut c = Cell {
                    name: format!("{rw} QD{d} q{q}"),
                    fio: vec![],
                    fio_sync: vec![],
                    qsd: vec![],
                    acc: vec![],
                };
                for _ in 0..o.runs {
                    c.fio.push(fio(o, "io_uring", rw, d, q)?);
                    c.fio_sync.push(fio(o, "pvsync2", rw, d, q)?);
                    {
                        let s = qsd(o, &sock, q)?;
                        c.qsd.push(client(o, &sock, &[s.pid()], rw, d, q)?);
                    }
                    {
                        let s = acceld(o, &sock, q)?;
                        c.acc.push(client(o, &sock, &[s.0.id()], rw, d, q)?);
                    }
                }
                eprintln!("done: {}", c.name);
                cells.push(c);
            }
        }
    }
    print_setup(o, "server/fio");
    println!("| cell | fio io_uring IOPS | fio sync IOPS | qsd IOPS | acceld IOPS | acceld/fio io_uring | acceld/best fio | acceld/qsd | p99 µs fio / qsd / acceld | IOPS per CPU-s fio / qsd / acceld | acceld/qsd per CPU |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for c in &cells {
        let (f, fs, q, a) = (med(&c.fio), med(&c.fio_sync), med(&c.qsd), med(&c.acc));
        println!(
            "| {} | {:.0} (±{:.0}%) | {:.0} (±{:.0}%) | {:.0} (±{:.0}%) | {:.0} (±{:.0}%) | {:.2} | {:.2} | {:.2} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} | {:.2} |",
            c.name,
            f.iops,
            f.spread,
            fs.iops,
            fs.spread,
            q.iops,
            q.spread,
            a.iops,
            a.spread,
            a.iops / f.iops.max(1.0),
            a.iops / f.iops.max(fs.iops).max(1.0),
            a.iops / q.iops.max(1.0),
            f.p99,
            q.p99,
            a.p99,
            f.per_cpu,
            q.per_cpu,
            a.per_cpu,
            a.per_cpu / q.per_cpu.max(1.0)
        );
    }
    Ok(())
}
