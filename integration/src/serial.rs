//! A guest's serial console on a unix socket QEMU listens on (libvirt's
//! `<serial type='unix'><source mode='bind' …/>`; a new socket per QEMU process).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

pub struct Serial {
    stream: UnixStream,
    lines: mpsc::Receiver<String>,
    /// Every line read so far.
    pub seen: Vec<String>,
}

impl Serial {
    /// Connects, retrying for up to 60 s while QEMU has not made the socket yet.
    pub fn connect(path: &Path) -> Result<Self> {
        let t0 = Instant::now();
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(60) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => return Err(e).context(format!("serial console {}", path.display())),
            }
        };
        let (tx, lines) = mpsc::channel();
        let r = stream.try_clone()?;
        std::thread::spawn(move || {
            for l in BufReader::new(r).lines().map_while(|l| l.ok()) {
                let _ = tx.send(l);
            }
        });
        Ok(Serial {
            stream,
            lines,
            seen: Vec::new(),
        })
    }

    /// The next line containing `needle`, within `timeout`.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        crate::wait_line(&self.lines, &mut self.seen, needle, timeout)
    }

    /// The value of the next `key=value` line.
    pub fn value(&mut self, key: &str) -> Result<String> {
        let l = self.wait_for(&format!("{key}="), Duration::from_secs(120))?;
        Ok(l.split_once(&format!("{key}="))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default())
    }

    /// The next `accel-writer` progress figure.
    pub fn progress(&mut self) -> Result<u64> {
        let l = self.wait_for("progress=", Duration::from_secs(120))?;
        crate::progress_figure(&l)
    }

    /// Types a line on the console.
    pub fn send_line(&mut self, line: &str) -> Result<()> {
        self.stream.write_all(format!("{line}\n").as_bytes())?;
        Ok(())
    }
}
