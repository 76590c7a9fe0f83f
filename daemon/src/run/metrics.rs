//! Prometheus metrics over plain HTTP (`GET /metrics`).
//!
//! Any local user can connect: connections are capped ([`MAX_CONNECTIONS`]; more wait in the
//! kernel's backlog), each has [`CONNECTION_TIMEOUT`] to send its request and take the answer,
//! and an accept error (descriptors exhausted) waits a little instead of spinning.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::AsyncWriteExt;
use tracing::warn;

use crate::supervisor::Supervisor;

/// Most metrics connections served at once.
const MAX_CONNECTIONS: usize = 16;
/// Longest a metrics connection may take, request and answer together.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) async fn serve_metrics(l: tokio::net::TcpListener, sup: Arc<Supervisor>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut errors = 0u64;
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut s = match l.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                errors += 1;
                if errors.is_power_of_two() {
                    warn!("metrics: accept failed ({errors} so far): {e}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let sup = sup.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let serve = async {
                let mut buf = [0u8; 1024];
                let n = tokio::io::AsyncReadExt::read(&mut s, &mut buf)
                    .await
                    .unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]);
                let (status, body) = if req.starts_with("GET /metrics") {
                    ("200 OK", sup.metrics())
                } else {
                    (
                        "404 Not Found",
                        json!({"error": "try /metrics"}).to_string(),
                    )
                };
                let resp = format!(
                    "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            };
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, serve).await;
        });
    }
}
