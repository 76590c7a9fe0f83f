//! Prometheus metrics over plain HTTP (`GET /metrics`).

use std::sync::Arc;

use serde_json::json;
use tokio::io::AsyncWriteExt;

use crate::supervisor::Supervisor;

pub(super) async fn serve_metrics(l: tokio::net::TcpListener, sup: Arc<Supervisor>) {
    loop {
        let Ok((mut s, _)) = l.accept().await else {
            continue;
        };
        let sup = sup.clone();
        tokio::spawn(async move {
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
        });
    }
}
