//! The client against a scripted fake QEMU: greeting, negotiation, out-of-order replies,
//! interleaved and unknown events, errors with class and desc, disconnect mid-request,
//! garbage and truncated JSON, timeouts.

use std::time::Duration;

use qmp_client::commands::{QueryStatus, QueryVersion};
use qmp_client::{connect, QmpError};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixListener;

const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian 1:10.0.2"}, "capabilities": ["oob"]}}"#;

struct Peer {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
}

impl Peer {
    async fn recv(&mut self) -> Value {
        let mut l = String::new();
        self.r.read_line(&mut l).await.unwrap();
        serde_json::from_str(&l).unwrap()
    }
    async fn send(&mut self, s: &str) {
        self.w.write_all(s.as_bytes()).await.unwrap();
        self.w.write_all(b"\n").await.unwrap();
    }
    async fn negotiate(&mut self) {
        self.send(GREETING).await;
        let m = self.recv().await;
        assert_eq!(m["execute"], "qmp_capabilities");
        self.send(&json!({"return": {}, "id": m["id"]}).to_string())
            .await;
    }
}

/// A fake server on a temp socket; `script` plays QEMU for one connection.
async fn fake<F, Fut>(script: F) -> (tempfile::TempDir, std::path::PathBuf)
where
    F: FnOnce(Peer) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let (r, w) = s.into_split();
        script(Peer {
            r: BufReader::new(r),
            w,
        })
        .await;
    });
    (dir, path)
}

#[tokio::test]
async fn greeting_negotiation_and_typed_command() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let m = peer.recv().await;
        assert_eq!(m["execute"], "query-status");
        assert!(m.get("arguments").is_none(), "no arguments for query-status");
        peer.send(&json!({"return": {"running": false, "status": "prelaunch", "singlestep": false}, "id": m["id"]}).to_string()).await;
    })
    .await;
    let h = connect(&p).await.unwrap();
    assert_eq!(h.greeting().version.qemu.major, 10);
    assert_eq!(h.greeting().capabilities, vec!["oob"]);
    let q = h.negotiate().await.unwrap();
    let st = q.execute(&QueryStatus).await.unwrap();
    assert_eq!(st.status, "prelaunch");
    assert!(!st.running);
}

#[tokio::test]
async fn out_of_order_replies_and_events_in_between() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let a = peer.recv().await;
        let b = peer.recv().await;
        let c = peer.recv().await;
        // Replies in reverse order, with a known and an unknown event between them.
        peer.send(r#"{"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 2}}"#).await;
        for m in [&c, &b, &a] {
            peer.send(&json!({"return": {"echo": m["execute"]}, "id": m["id"]}).to_string()).await;
            peer.send(r#"{"event": "SOME_FUTURE_EVENT", "data": {"new-field": [1, 2]}, "timestamp": {"seconds": 3, "microseconds": 4}}"#).await;
        }
        // Keep the connection open until the client is done.
        let mut l = String::new();
        let _ = peer.r.read_line(&mut l).await;
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let mut ev = q.events();
    let (x, y, z) = tokio::join!(
        q.execute_raw("cmd-a", None),
        q.execute_raw("cmd-b", Some(json!({"k": 1}))),
        q.execute_raw("cmd-c", None)
    );
    // join! polls in order, so the fake reads a, b, c in that order.
    assert_eq!(x.unwrap()["echo"], "cmd-a");
    assert_eq!(y.unwrap()["echo"], "cmd-b");
    assert_eq!(z.unwrap()["echo"], "cmd-c");
    let first = ev.recv().await.unwrap();
    assert_eq!(first.name, "STOP");
    assert_eq!(first.timestamp, (1, 2));
    let unknown = ev.recv().await.unwrap();
    assert_eq!(unknown.name, "SOME_FUTURE_EVENT");
    assert_eq!(unknown.data["new-field"][1], 2);
}

#[tokio::test]
async fn qemu_errors_keep_class_and_desc() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let m = peer.recv().await;
        peer.send(&json!({"error": {"class": "DeviceNotFound", "desc": "Device 'x' not found"}, "id": m["id"]}).to_string()).await;
        let mut l = String::new();
        let _ = peer.r.read_line(&mut l).await;
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let e = q
        .execute_raw("block_set_io_throttle", None)
        .await
        .unwrap_err();
    assert_eq!(e.class(), Some("DeviceNotFound"));
    assert!(e.to_string().contains("Device 'x' not found"), "{e}");
    assert!(e.to_string().contains("block_set_io_throttle"), "{e}");
}

#[tokio::test]
async fn disconnect_mid_request_fails_every_pending_command() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let _a = peer.recv().await;
        let _b = peer.recv().await;
        // Drop the connection without answering.
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let (a, b) = tokio::join!(q.execute_raw("a", None), q.execute(&QueryVersion));
    for e in [a.unwrap_err(), b.unwrap_err()] {
        assert!(matches!(e, QmpError::Closed(_)), "{e}");
        assert!(e.to_string().contains("closed"), "{e}");
    }
    assert!(q.is_closed());
    let e = q.execute_raw("after", None).await.unwrap_err();
    assert!(matches!(e, QmpError::Closed(_)), "{e}");
}

#[tokio::test]
async fn garbage_json_is_a_clear_error() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let _m = peer.recv().await;
        peer.send("{\"return\": {}, \"id\": 1 ]]] this is not json")
            .await;
        let mut l = String::new();
        let _ = peer.r.read_line(&mut l).await;
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let e = q.execute_raw("x", None).await.unwrap_err();
    assert!(e.to_string().contains("invalid JSON"), "{e}");
}

#[tokio::test]
async fn truncated_message_is_a_clear_error() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let _m = peer.recv().await;
        peer.w.write_all(b"{\"return\": {\"half\":").await.unwrap();
        // Close: the message never ends.
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let e = q.execute_raw("x", None).await.unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
}

#[tokio::test]
async fn garbage_greeting_is_a_clear_error() {
    let (_d, p) = fake(|mut peer| async move {
        peer.send("{\"hello\": 1}").await;
    })
    .await;
    let e = connect(&p).await.err().unwrap();
    assert!(e.to_string().contains("expected a greeting"), "{e}");
}

#[tokio::test]
async fn command_timeout() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        let _m = peer.recv().await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let e = q
        .execute_raw_timeout("slow", None, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(matches!(e, QmpError::Timeout { .. }), "{e}");
    q.set_timeout(Duration::from_millis(100));
    let e = q.execute_raw("slow", None).await.unwrap_err();
    assert!(e.to_string().contains("no reply within"), "{e}");
}

#[tokio::test]
async fn lagging_subscriber_learns_it_lagged() {
    let (_d, p) = fake(|mut peer| async move {
        peer.negotiate().await;
        for i in 0..5000 {
            peer.send(&format!(
                r#"{{"event": "E{i}", "timestamp": {{"seconds": 0, "microseconds": 0}}}}"#
            ))
            .await;
        }
        let m = peer.recv().await;
        peer.send(&json!({"return": {}, "id": m["id"]}).to_string())
            .await;
        let mut l = String::new();
        let _ = peer.r.read_line(&mut l).await;
    })
    .await;
    let q = connect(&p).await.unwrap().negotiate().await.unwrap();
    let mut ev = q.events();
    // The reply comes after all events, so they were all dispatched by then.
    q.execute_raw("sync", None).await.unwrap();
    match ev.recv().await {
        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => assert!(n > 0),
        other => panic!("expected a lag report, got {other:?}"),
    }
}

#[tokio::test]
async fn connect_error_names_the_socket() {
    let e = connect(std::path::Path::new("/nonexistent/qmp.sock"))
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("/nonexistent/qmp.sock"), "{e}");
}
