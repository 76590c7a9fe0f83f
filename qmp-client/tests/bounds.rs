//! What a compromised QEMU can make acceld's QMP client hold: a greeting that never comes or
//! never ends, and events too large to pass on. A fake QMP server (a UnixListener here) plays
//! the hostile QEMU.

use std::time::Duration;

use qmp_client::{connect_within, QmpError, MAX_EVENT, MAX_GREETING};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": ""}, "capabilities": []}}"#;

fn socket() -> (tempfile::TempDir, std::path::PathBuf, UnixListener) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("qmp.sock");
    let l = UnixListener::bind(&p).unwrap();
    (dir, p, l)
}

#[tokio::test]
async fn a_greeting_that_never_comes_times_out() {
    let (_d, p, l) = socket();
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        // Holds the connection open and says nothing.
        let mut r = BufReader::new(s);
        let mut v = Vec::new();
        let _ = r.read_until(b'\n', &mut v).await;
    });
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        connect_within(&p, Duration::from_millis(300)),
    )
    .await
    .expect("the client must give up on its own");
    assert!(matches!(r, Err(QmpError::Timeout { .. })), "{:?}", r.err());
    server.abort();
}

#[tokio::test]
async fn an_endless_greeting_line_is_refused() {
    let (_d, p, l) = socket();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        // A line without end: far more than a greeting, never a newline.
        let chunk = vec![b' '; 64 << 10];
        for _ in 0..64 {
            if s.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let mut r = BufReader::new(s);
        let mut v = Vec::new();
        let _ = r.read_until(b'\n', &mut v).await;
    });
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        connect_within(&p, Duration::from_secs(15)),
    )
    .await
    .expect("the client must stop reading at its bound");
    match r {
        Err(QmpError::Protocol(m)) => assert!(m.contains(&MAX_GREETING.to_string()), "{m}"),
        other => panic!("expected a protocol error, got {:?}", other.err()),
    }
    server.abort();
}

#[tokio::test]
async fn an_oversized_event_is_dropped_and_later_ones_pass() {
    let (_d, p, l) = socket();
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let mut r = BufReader::new(r);
        w.write_all(format!("{GREETING}\n").as_bytes())
            .await
            .unwrap();
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        let m: Value = serde_json::from_str(&line).unwrap();
        w.write_all(format!("{}\n", json!({"return": {}, "id": m["id"]})).as_bytes())
            .await
            .unwrap();
        // Wait for the test's command: it subscribed by then.
        line.clear();
        r.read_line(&mut line).await.unwrap();
        let m: Value = serde_json::from_str(&line).unwrap();
        let big = "x".repeat(MAX_EVENT + 1);
        let ts = json!({"seconds": 1, "microseconds": 0});
        for ev in [
            json!({"event": "BIG", "data": {"x": big}, "timestamp": ts}),
            json!({"event": "SMALL", "timestamp": ts}),
        ] {
            w.write_all(format!("{ev}\n").as_bytes()).await.unwrap();
        }
        w.write_all(format!("{}\n", json!({"return": {}, "id": m["id"]})).as_bytes())
            .await
            .unwrap();
        let _ = r.read_line(&mut line).await;
    });
    let qmp = connect_within(&p, Duration::from_secs(5))
        .await
        .unwrap()
        .negotiate()
        .await
        .unwrap();
    let mut rx = qmp.events();
    qmp.execute_raw("query-status", None).await.unwrap();
    let ev = rx.recv().await.unwrap();
    assert_eq!(ev.name, "SMALL", "the oversized event is not passed on");
    server.abort();
}
