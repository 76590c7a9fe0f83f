//! Real-QEMU scenarios: the tiny guest (built by `guest/build.sh`), acceld as a real process,
//! and QEMU (TCG) booting the guest with its disk on acceld's socket.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

pub mod capture;
pub mod compare;
pub mod domain;
pub mod migration;
pub mod migration_bench;
pub mod serial;
pub mod supervised;
pub mod switch_bench;
pub mod two_hosts;

/// The integration crate's folder.
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Builds the guest kernel and initramfs if they are missing; returns (vmlinuz, initramfs).
pub fn ensure_guest() -> Result<(PathBuf, PathBuf)> {
    // Tests of one binary run in parallel; one builds, the others wait.
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = BUILD.lock().unwrap_or_else(|p| p.into_inner());
    let out = crate_dir().join("out");
    let script = crate_dir().join("guest/build.sh");
    let st = Command::new("bash")
        .arg(&script)
        .arg(&out)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !st.success() {
        bail!("{} failed ({st})", script.display());
    }
    Ok((out.join("vmlinuz"), out.join("initramfs.cpio.gz")))
}

/// The acceld binary of this workspace build (or `ACCELD_BIN`).
pub fn acceld_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ACCELD_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> or target/<profile>/<bin>
    for dir in exe.ancestors().skip(1).take(3) {
        let cand = dir.join("acceld");
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "acceld binary not found next to {}; run `cargo build -p acceld` or set ACCELD_BIN",
        exe.display()
    )
}

/// acceld running as its own process.
pub struct Acceld {
    child: Child,
    pub socket: PathBuf,
    log: PathBuf,
}

impl Acceld {
    /// `acceld serve --socket SOCKET ARGS…`, returning once the socket exists.
    pub fn serve(socket: &Path, args: &[&str], log: &Path) -> Result<Self> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(acceld_bin()?)
            .arg("serve")
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("spawning acceld")?;
        let mut me = Acceld {
            child,
            socket: socket.to_path_buf(),
            log: log.to_path_buf(),
        };
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Some(st) = me.child.try_wait()? {
                bail!("acceld exited ({st}): {}", me.log_text());
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("acceld did not listen within 10 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(me)
    }

    /// SIGKILL: acceld dies with whatever it had in flight.
    pub fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then wait (it drains first); returns its exit status.
    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        sigterm_and_wait(&mut self.child, Duration::from_secs(30))
    }
}

impl Drop for Acceld {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One vhost-user-blk disk of the guest.
/// SIGTERM to a child (acceld), then wait for it to exit; SIGKILL and fail after `timeout`.
pub fn sigterm_and_wait(child: &mut Child, timeout: Duration) -> Result<std::process::ExitStatus> {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(st);
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            bail!("acceld did not exit within {timeout:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub struct GuestDisk {
    pub socket: PathBuf,
    pub queues: u16,
}

pub struct GuestSpec<'a> {
    pub disks: &'a [GuestDisk],
    /// Shell script the guest runs (busybox sh).
    pub script: &'a str,
    pub mem_mb: u32,
    pub timeout: Duration,
}

/// A booted guest; its serial output arrives line by line.
pub struct Guest {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
    lines: mpsc::Receiver<String>,
    pub output: Vec<String>,
    /// The last [`TRACE_KEEP`] lines of QEMU's own trace ([`TRACE_EVENTS`]), kept apart from
    /// the output and shown when QEMU does not exit.
    trace: Arc<Mutex<VecDeque<String>>>,
}

/// QEMU trace events every test guest records (QEMU's `log` trace back-end, on its stderr):
/// the vhost-user messages and device start/stop, the run states, the shutdown request and
/// the NBD server's connections. Few per second outside a switch; enough to tell where a
/// QEMU that does not exit stopped.
pub const TRACE_EVENTS: &[&str] = &[
    "vhost_user_write",
    "vhost_user_read",
    "vhost_user_event",
    "vhost_dev_start",
    "vhost_dev_stop",
    "vm_state_notify",
    "runstate_set",
    "qemu_system_shutdown_request",
    "nbd_negotiate_begin",
    "nbd_negotiate_success",
    "nbd_handshake_timer_cb",
    "blk_root_attach",
    "blk_root_detach",
];

/// How many trace lines a [`Guest`] keeps.
pub const TRACE_KEEP: usize = 400;

/// `-trace` for each of [`TRACE_EVENTS`], and thread names (`debug-threads=on`, merged with
/// any other `-name`) so a stuck thread says what it is.
fn diagnostic_args(cmd: &mut Command) {
    for e in TRACE_EVENTS {
        cmd.arg("-trace").arg(e);
    }
    cmd.args(["-name", "debug-threads=on"]);
}

fn is_trace_line(l: &str) -> bool {
    TRACE_EVENTS
        .iter()
        .any(|e| l.strip_prefix(e).is_some_and(|r| r.starts_with(' ')))
}

fn b64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Boots the tiny guest's kernel and initramfs directly, with `script` for its init to run.
fn direct_kernel(cmd: &mut Command, kernel: &Path, initrd: &Path, script: &str) {
    cmd.arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 quiet testcmd={}",
            b64(script.as_bytes())
        ));
}

impl Guest {
    pub fn boot(spec: &GuestSpec) -> Result<Self> {
        let (kernel, initrd) = ensure_guest()?;
        let mem = format!("{}M", spec.mem_mb);
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(["-machine", "q35,accel=tcg,memory-backend=mem", "-m", &mem])
            .arg("-object")
            .arg(format!("memory-backend-memfd,id=mem,size={mem},share=on"))
            .args([
                "-smp",
                "2",
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
            ])
            .args(["-no-reboot", "-serial", "stdio"]);
        diagnostic_args(&mut cmd);
        direct_kernel(&mut cmd, &kernel, &initrd, spec.script);
        for (i, d) in spec.disks.iter().enumerate() {
            cmd.arg("-chardev").arg(format!(
                "socket,id=vub{i},path={},reconnect-ms=1000",
                d.socket.display()
            ));
            cmd.arg("-device").arg(format!(
                "vhost-user-blk-pci,chardev=vub{i},id=vdisk{i},num-queues={}",
                d.queues
            ));
        }
        Self::spawn(cmd)
    }

    /// Boots the tiny guest with the arguments of accel's VM contract (`accelctl qemu-args`:
    /// memory backend, QMP, block graph, vhost-user devices, -S) plus `extra`.
    pub fn boot_contract(contract: &[String], extra: &[String], script: &str) -> Result<Self> {
        Self::boot_contract_in(&[], contract, extra, script)
    }

    /// [`Guest::boot_contract`], QEMU run through `prefix` (say, `two-hosts.sh exec B`: inside
    /// a host's namespaces).
    pub fn boot_contract_in(
        prefix: &[&str],
        contract: &[String],
        extra: &[String],
        script: &str,
    ) -> Result<Self> {
        if b64(script.as_bytes()).len() > 1800 {
            bail!(
                "guest script too long for the kernel command line (2048 bytes); put it in guest/"
            );
        }
        let (kernel, initrd) = ensure_guest()?;
        let mut cmd = match prefix.split_first() {
            Some((p, rest)) => {
                let mut c = Command::new(p);
                c.args(rest).arg("qemu-system-x86_64");
                c
            }
            None => Command::new("qemu-system-x86_64"),
        };
        cmd.args(["-machine", "q35,accel=tcg"])
            .args(contract)
            .args(extra)
            .args(["-smp", "2", "-nodefaults", "-no-user-config"])
            .args(["-display", "none", "-no-reboot", "-serial", "stdio"]);
        diagnostic_args(&mut cmd);
        direct_kernel(&mut cmd, &kernel, &initrd, script);
        Self::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Result<Self> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning qemu-system-x86_64 (apt-get install qemu-system-x86)")?;
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("piped");
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
                let _ = tx.send(l);
            }
        });
        let err = child.stderr.take().expect("piped");
        let trace = Arc::new(Mutex::new(VecDeque::with_capacity(TRACE_KEEP)));
        let trace2 = trace.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(|l| l.ok()) {
                if is_trace_line(&l) {
                    let mut t = trace2.lock().unwrap_or_else(|p| p.into_inner());
                    if t.len() == TRACE_KEEP {
                        t.pop_front();
                    }
                    t.push_back(l);
                } else {
                    let _ = tx2.send(format!("qemu: {l}"));
                }
            }
        });
        Ok(Guest {
            child,
            stdin,
            lines: rx,
            output: Vec::new(),
            trace,
        })
    }

    /// The next `progress=N` figure of `accel-writer` (writes its kernel completed on the
    /// disk, printed every 2 s).
    pub fn progress(&mut self) -> Result<u64> {
        let line = self.wait_for("progress=", Duration::from_secs(120))?;
        progress_figure(&line)
    }

    /// Waits for a `progress=` figure above `at` (the guest's I/O went on) and returns it;
    /// fails once the guest printed 100 000 lines without one.
    pub fn progress_beyond(&mut self, at: u64) -> Result<u64> {
        loop {
            let p = self.progress()?;
            if p > at {
                return Ok(p);
            }
            if self.output.len() > 100_000 {
                bail!("the guest's I/O did not go on past {at}");
            }
        }
    }

    /// Watches the guest's `progress=` figures for `span` ([`keeps_progressing`]).
    pub fn keeps_writing(&mut self, span: Duration, window: Duration) -> Result<Vec<u64>> {
        keeps_progressing(span, window, || self.progress())
    }

    /// Waits for a serial line containing `needle`, up to `timeout`. A guest that does not
    /// get there shows what its QEMU waits in, as [`Guest::wait_exit`] does.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        let r = wait_line(&self.lines, &mut self.output, needle, timeout);
        r.map_err(|e| {
            let pid = self.child.id();
            e.context(format!(
                "QEMU's threads:\n{}\ntheir stacks:\n{}\nQEMU's trace (last {TRACE_KEEP} lines):\n{}",
                thread_states(pid),
                backtraces(pid),
                self.trace_text()
            ))
        })
    }

    /// Types a line on the guest's serial console (scripts may `read` it from /dev/ttyS0).
    pub fn send_line(&mut self, line: &str) -> Result<()> {
        use std::io::Write;
        let s = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow!("guest stdin closed"))?;
        s.write_all(format!("{line}\n").as_bytes())?;
        s.flush()?;
        Ok(())
    }

    /// Kills QEMU; returns all its output (stderr lines start with `qemu: `).
    pub fn kill(&mut self) -> Result<Vec<String>> {
        let _ = self.child.kill();
        self.wait_exit(Duration::from_secs(10))
    }

    /// The trace lines kept ([`TRACE_EVENTS`]), oldest first.
    pub fn trace_text(&self) -> String {
        let t = self.trace.lock().unwrap_or_else(|p| p.into_inner());
        t.iter().map(String::as_str).collect::<Vec<_>>().join("\n")
    }

    /// Waits for the guest to power off; returns all its output.
    /// QEMU's exit status, once [`Guest::wait_exit`] returned.
    pub fn exit_status(&mut self) -> Result<std::process::ExitStatus> {
        self.child
            .try_wait()?
            .ok_or_else(|| anyhow::anyhow!("QEMU is still running"))
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Vec<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            while let Ok(l) = self.lines.try_recv() {
                self.output.push(l);
            }
            if self.child.try_wait()?.is_some() {
                // Drain what the readers still hold.
                while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.output.push(l);
                }
                return Ok(self.output.clone());
            }
            if Instant::now() >= deadline {
                let pid = self.child.id();
                let threads = thread_states(pid);
                let stacks = backtraces(pid);
                let _ = self.child.kill();
                bail!(
                    "guest did not finish within {timeout:?}; QEMU's threads:\n{threads}\n\
                     their stacks:\n{stacks}\nQEMU's trace (last {TRACE_KEEP} lines):\n{}\n\
                     output:\n{}",
                    self.trace_text(),
                    self.output.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What each thread of process `pid` is doing: its name, state and the system call it waits
/// in (`/proc/PID/task/TID/syscall`: number and arguments), with what the first argument
/// names when it is a descriptor: enough to tell, for a QEMU that does not exit, whether it
/// waits for a vhost-user reply (a `recvmsg` on a back-end's socket) or for its own threads.
pub fn thread_states(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("(process {pid} is gone)");
    };
    for t in tasks.flatten().take(64) {
        let base = t.path();
        let read = |f: &str| std::fs::read_to_string(base.join(f)).unwrap_or_default();
        let comm = read("comm");
        let stat = read("stat");
        // The state follows the parenthesised name.
        let state = stat
            .rsplit(") ")
            .next()
            .and_then(|r| r.split(' ').next())
            .unwrap_or("?");
        let syscall = read("syscall");
        let args: Vec<u64> = syscall
            .split_whitespace()
            .map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).unwrap_or(u64::MAX))
            .collect();
        let link = |fd: u64| {
            std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
                .map(|l| l.display().to_string())
                .unwrap_or_else(|_| "?".into())
        };
        let fd = match args.as_slice() {
            // poll(2) and ppoll(2): the descriptors of the pollfd array.
            [7 | 271, fds, n, ..] => format!(" polls=[{}]", poll_fds(pid, *fds, *n, &link)),
            [_, fd, ..] if *fd < 4096 => format!(" fd1={}", link(*fd)),
            _ => String::new(),
        };
        out.push_str(&format!(
            "  {} {} {state} syscall={}{fd} wchan={}\n",
            t.file_name().to_string_lossy(),
            comm.trim(),
            syscall.trim(),
            read("wchan").trim()
        ));
    }
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        let mut links: Vec<String> = fds
            .flatten()
            .take(256)
            .filter_map(|f| {
                let l = std::fs::read_link(f.path()).ok()?;
                Some(format!(
                    "{}={}",
                    f.file_name().to_string_lossy(),
                    l.display()
                ))
            })
            .collect();
        links.sort();
        out.push_str(&format!("  fds: {}\n", links.join(" ")));
    }
    out
}

/// The `n` (at most 64) `struct pollfd` at `addr` in process `pid`, as `fd:link`.
fn poll_fds(pid: u32, addr: u64, n: u64, link: &dyn Fn(u64) -> String) -> String {
    use std::os::unix::fs::FileExt;
    let n = n.min(64) as usize;
    let mut buf = vec![0u8; n * 8];
    let Ok(mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return "?".into();
    };
    if mem.read_exact_at(&mut buf, addr).is_err() {
        return "?".into();
    }
    buf.chunks(8)
        .map(|p| {
            let fd = i32::from_ne_bytes([p[0], p[1], p[2], p[3]]);
            let ev = i16::from_ne_bytes([p[4], p[5]]);
            format!(
                "{fd}:{}/{ev:#x}",
                link(u64::try_from(fd).unwrap_or(u64::MAX))
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every thread's stack of process `pid` (`gdb -batch`, at most 30 s; QEMU's own frames are
/// addresses without its debug symbols, the libraries' are named).
pub fn backtraces(pid: u32) -> String {
    let out = Command::new("timeout")
        .args(["30", "gdb", "-nx", "-batch", "-p"])
        .arg(pid.to_string())
        .args(["-ex", "thread apply all bt 16"])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread "))
            .take(400)
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(gdb: {e})"),
    }
}

/// The next line from `lines` containing `needle`, within `timeout`; every line read is kept
/// in `seen` (and shown if none comes).
pub fn wait_line(
    lines: &mpsc::Receiver<String>,
    seen: &mut Vec<String>,
    needle: &str,
    timeout: Duration,
) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) => {
                seen.push(l.clone());
                if l.contains(needle) {
                    return Ok(l);
                }
            }
            Err(_) => bail!(
                "guest did not print '{needle}' within {timeout:?}; output:\n{}",
                seen.join("\n")
            ),
        }
    }
}

/// The figure of an `accel-writer` `progress=N` line.
pub fn progress_figure(line: &str) -> Result<u64> {
    line.rsplit("progress=")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no figure in {line:?}"))
}

/// Watches `accel-writer`'s `progress=` figures (`next` gives the next one) for `span`: the
/// guest's writes must go on completing, no `window` without one. Returns the figures seen.
/// (The figure is printed every 2 s by a shell loop that needs no disk, so a stalled disk
/// still prints: the same figure.)
pub fn keeps_progressing(
    span: Duration,
    window: Duration,
    mut next: impl FnMut() -> Result<u64>,
) -> Result<Vec<u64>> {
    let t0 = Instant::now();
    let mut seen = vec![next()?];
    let mut rose = Instant::now();
    while t0.elapsed() < span {
        let p = next()?;
        if p > *seen.last().unwrap() {
            rose = Instant::now();
        }
        seen.push(p);
        if rose.elapsed() > window {
            bail!(
                "the guest's writes stopped completing {:?} after the watch began: no progress for {:?} (figures {seen:?})",
                rose - t0,
                rose.elapsed()
            );
        }
    }
    Ok(seen)
}

/// `key=value` lines the guest printed.
pub fn guest_value(output: &[String], key: &str) -> Result<String> {
    let p = format!("{key}=");
    output
        .iter()
        .find_map(|l| l.trim().strip_prefix(&p).map(str::to_string))
        .ok_or_else(|| anyhow!("guest printed no '{key}='; output:\n{}", output.join("\n")))
}

/// The guest script that reports the disk's geometry and writes, reads back and compares a
/// pattern; prints `md5=` of what it wrote.
pub fn report_and_verify_script(mib: u32) -> String {
    format!(
        r#"d=/sys/block/vda
echo size=$(cat $d/size)
echo serial=$(cat $d/serial)
echo queues=$(ls $d/mq | wc -l)
echo discard_max=$(cat $d/queue/discard_max_bytes)
echo logical_block=$(cat $d/queue/logical_block_size)
echo ro=$(cat $d/ro)
dd if=/dev/urandom of=/tmp/p bs=1M count={mib} 2>/dev/null
dd if=/tmp/p of=/dev/vda bs=1M oflag=direct 2>/dev/null || echo WRITE-FAILED
dd if=/dev/vda of=/tmp/r bs=1M count={mib} iflag=direct 2>/dev/null || echo READ-FAILED
cmp /tmp/p /tmp/r && echo verify=ok || echo verify=mismatch
echo md5=$(md5sum /tmp/p | cut -d' ' -f1)
"#
    )
}

/// `qemu-img create -f qcow2 PATH SIZE` (size as qemu-img takes it: `64M`).
pub fn create_qcow2(path: &Path, size: &str) -> Result<()> {
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(path)
        .arg(size)
        .status()?;
    if !st.success() {
        bail!("qemu-img create {} failed: {st}", path.display());
    }
    Ok(())
}

/// md5 of the first `len` bytes of the guest's view of a qcow2 image (converted to raw next
/// to it, `-U`: the VM may still hold it).
pub fn qcow2_md5(img: &Path, len: u64) -> Result<String> {
    let raw = img.with_extension("md5.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(img)
        .arg(&raw)
        .status()?;
    if !st.success() {
        bail!("qemu-img convert {} failed: {st}", img.display());
    }
    let md5 = host_md5(&raw, len);
    let _ = std::fs::remove_file(&raw);
    md5
}

/// md5 of the first `len` bytes of a file, with the host's md5sum.
pub fn host_md5(path: &Path, len: u64) -> Result<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("head -c {len} '{}' | md5sum", path.display()))
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}
