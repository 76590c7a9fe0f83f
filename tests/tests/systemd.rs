//! acceld as systemd's `Type=notify` service runs it (packaging/deb/acceld.service): the
//! whole `acceld run` in a child process, `NOTIFY_SOCKET` naming a datagram socket the test
//! reads in the service manager's place.

use std::time::Duration;

use accel_tests::acceld_run::AcceldRun;

/// `READY=1` comes once the control socket serves (libvirtd, ordered after acceld, may then
/// register domains at once), and `STOPPING=1` when SIGTERM starts the shutdown.
#[test]
fn ready_once_the_control_socket_serves_and_stopping_at_sigterm() {
    let mut a = AcceldRun::start("child", "");
    a.wait_ready();
    // At the moment of READY=1: no retry, no wait for the socket to appear.
    let r = a.status(Duration::from_secs(5));
    assert!(r.ok, "status refused: {r:?}");
    assert_eq!(r.result.unwrap()["vms"], serde_json::json!([]));
    a.terminate();
    assert_eq!(a.notification(Duration::from_secs(30)), "STOPPING=1");
    let st = a.wait();
    assert!(st.success(), "acceld run: {st}; log:\n{}", a.log());
    assert!(
        !a.control_socket().exists(),
        "the control socket outlived acceld"
    );
}

#[test]
#[ignore = "the child of the other tests (AcceldRun::start)"]
fn child() {
    accel_tests::acceld_run::child_main();
}
