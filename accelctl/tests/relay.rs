//! libvirt's monitor relay against a scripted proxy: lines and descriptors cross, an acceld
//! restart fails the command in flight and renegotiates without a second greeting, and
//! QEMU's end closes libvirt's connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command};
use std::time::Duration;

use accelctl::libvirt::relay::{Process, Relay};
use serde_json::Value;

const GREETING: &str = "{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n";

fn line(r: &mut BufReader<UnixStream>) -> Value {
    let mut l = String::new();
    r.read_line(&mut l).unwrap();
    serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
}

fn send(s: &UnixStream, v: &str) {
    (&*s).write_all(format!("{v}\r\n").as_bytes()).unwrap();
}

struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_relay_survives_a_proxy_restart_and_ends_with_qemu() {
    let dir = tempfile::tempdir().unwrap();
    let proxy_path = dir.path().join("monitor.sock");
    let libvirt_path = dir.path().join("libvirt.sock");
    let listener = UnixListener::bind(&libvirt_path).unwrap();
    let mut qemu = Qemu(Command::new("sleep").arg("600").spawn().unwrap());
    let relay = Relay {
        listener,
        proxy: proxy_path.clone(),
        qemu: Process::open(qemu.0.id() as i32).unwrap(),
    };
    let t = std::thread::spawn(move || relay.run());

    // libvirt connects first; the proxy comes later (acceld attaches after QEMU starts).
    let client = UnixStream::connect(&libvirt_path).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut from_relay = BufReader::new(client.try_clone().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let proxy = UnixListener::bind(&proxy_path).unwrap();
    let (up, _) = proxy.accept().unwrap();
    (&up).write_all(GREETING.as_bytes()).unwrap();
    let mut from_client = BufReader::new(up.try_clone().unwrap());
    assert!(line(&mut from_relay)["QMP"].is_object());

    // Negotiation, then a command with a descriptor (libvirt's getfd), sent in two parts.
    send(
        &client,
        r#"{"execute": "qmp_capabilities", "id": "libvirt-1"}"#,
    );
    assert_eq!(line(&mut from_client)["id"], "libvirt-1");
    send(&up, r#"{"return": {}, "id": "libvirt-1"}"#);
    assert_eq!(line(&mut from_relay)["id"], "libvirt-1");
    let file = tempfile::tempfile().unwrap();
    let cmd = br#"{"execute": "getfd", "arguments": {"fdname": "migrate"}, "id": "libvirt-2"}"#;
    accel_api::fdpass::send(
        std::os::fd::AsRawFd::as_raw_fd(&client),
        &cmd[..10],
        &[file.as_fd()],
    )
    .unwrap();
    (&client).write_all(&cmd[10..]).unwrap();
    (&client).write_all(b"\r\n").unwrap();
    let mut buf = [0u8; 4096];
    let (n, fds) = accel_api::fdpass::recv(std::os::fd::AsRawFd::as_raw_fd(&up), &mut buf).unwrap();
    assert_eq!(fds.len(), 1, "the descriptor crosses with the command");
    let got: Value = serde_json::from_slice(&buf[..n]).unwrap();
    assert_eq!(got["id"], "libvirt-2");
    send(&up, r#"{"return": {}, "id": "libvirt-2"}"#);
    assert_eq!(line(&mut from_relay)["id"], "libvirt-2");

    // acceld restarts with a command in flight and half a reply sent.
    send(&client, r#"{"execute": "query-block", "id": "libvirt-3"}"#);
    assert_eq!(line(&mut from_client)["id"], "libvirt-3");
    (&up).write_all(br#"{"return": [{"device": "#).unwrap();
    drop(from_client);
    drop(up);
    drop(proxy);
    std::fs::remove_file(&proxy_path).unwrap();
    let err = line(&mut from_relay);
    assert_eq!(err["id"], "libvirt-3");
    assert!(err["error"]["desc"]
        .as_str()
        .unwrap()
        .contains("acceld restarted"));
    // The new proxy greets; the relay negotiates for libvirt and passes nothing of it on.
    let proxy = UnixListener::bind(&proxy_path).unwrap();
    let (up, _) = proxy.accept().unwrap();
    (&up).write_all(GREETING.as_bytes()).unwrap();
    let mut from_client = BufReader::new(up.try_clone().unwrap());
    let neg = line(&mut from_client);
    assert_eq!(neg["execute"], "qmp_capabilities");
    let reply = format!(
        "{{\"return\": {{}}, \"id\": {}}}\r\n{{\"event\": \"RESUME\", \"data\": {{}}}}\r\n",
        neg["id"]
    );
    (&up).write_all(reply.as_bytes()).unwrap();
    let ev = line(&mut from_relay);
    assert_eq!(
        ev["event"], "RESUME",
        "the event after the reply reaches libvirt: {ev}"
    );
    send(&client, r#"{"execute": "query-status", "id": "libvirt-4"}"#);
    assert_eq!(line(&mut from_client)["id"], "libvirt-4");
    send(
        &up,
        r#"{"return": {"status": "running"}, "id": "libvirt-4"}"#,
    );
    assert_eq!(line(&mut from_relay)["return"]["status"], "running");

    // QEMU ends: libvirt's connection closes and the relay exits.
    let _ = qemu.0.kill();
    let _ = qemu.0.wait();
    drop(up);
    let mut rest = Vec::new();
    from_relay.read_to_end(&mut rest).unwrap();
    t.join().unwrap();
}
