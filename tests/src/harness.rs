//! An acceld server in this process, on a temporary image and socket, for tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use acceld::drive::{DiscardMode, Drive, DriveConfig};
use acceld::engine::{FileEngine, FileEngineConfig};
use acceld::vhost::{Server, ShutdownHandle};

pub struct ServerOptions {
    pub size: u64,
    pub queues: u16,
    pub read_only: bool,
    pub direct: bool,
    pub serial: String,
    pub logical_block_size: u32,
    pub discard: DiscardMode,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            size: 64 << 20,
            queues: 1,
            read_only: false,
            direct: true,
            serial: "accel-test-serial".into(),
            logical_block_size: 512,
            discard: DiscardMode::Unmap,
        }
    }
}

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub image: PathBuf,
    pub drive: Arc<Drive>,
    stop: ShutdownHandle,
    thread: Option<JoinHandle<()>>,
}

pub fn file_engine(image: &Path, o: &ServerOptions) -> Arc<FileEngine> {
    Arc::new(
        FileEngine::open(FileEngineConfig {
            path: image.to_path_buf(),
            read_only: o.read_only,
            direct: o.direct,
            logical_block_size: o.logical_block_size,
        })
        .expect("open image"),
    )
}

impl TestServer {
    /// Creates a sparse image of `o.size` bytes in a new temp dir (on disk, not tmpfs, so
    /// O_DIRECT behaves as on a host) and serves it.
    pub fn start(o: ServerOptions) -> Self {
        init_logs();
        let dir = tempfile::Builder::new()
            .prefix("accel-test")
            .tempdir_in(std::env::var_os("ACCEL_TEST_DIR").unwrap_or_else(|| "/var/tmp".into()))
            .expect("temp dir");
        let image = dir.path().join("disk.raw");
        let f = std::fs::File::create(&image).expect("create image");
        f.set_len(o.size).expect("size image");
        drop(f);
        Self::serve(dir, image, o)
    }

    pub fn serve(dir: tempfile::TempDir, image: PathBuf, o: ServerOptions) -> Self {
        let socket = dir.path().join("vhost.sock");
        let engine = file_engine(&image, &o);
        let cfg = DriveConfig {
            name: "test".into(),
            serial: o.serial.clone(),
            capacity_bytes: engine.size(),
            logical_block_size: o.logical_block_size,
            read_only: o.read_only,
            num_queues: o.queues,
            queue_size: 1024,
            discard: o.discard,
            poll_us: 0,
        };
        let drive = Drive::new(cfg, engine);
        let mut server = Server::bind(&socket, drive.clone()).expect("bind");
        let stop = server.shutdown_handle();
        let thread = std::thread::spawn(move || server.run().expect("server run"));
        TestServer {
            dir,
            socket,
            image,
            drive,
            stop,
            thread: Some(thread),
        }
    }

    /// Drains and stops the server; returns once its thread ended.
    pub fn stop(&mut self) {
        self.stop.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().expect("server thread");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Logs of the server in tests, filtered by ACCELD_LOG (e.g. `ACCELD_LOG=debug`).
pub fn init_logs() {
    if let Ok(f) = std::env::var("ACCELD_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(f))
            .with_test_writer()
            .try_init();
    }
}
