//! The policy on live QEMU 10 outputs: a lab VM with an accelerable raw drive, a qcow2 drive,
//! a throttled and exported drive, and a drive with a dirty bitmap.

use accel_integration::capture::Lab;
use policy::qemu::{drive_view, parse_graph, parse_nodes, throttled_nodes, vm_state, DriveContext};
use policy::{decide, Decision};

#[tokio::test]
async fn policy_on_live_qemu_graph() {
    let dir = tempfile::tempdir().unwrap();
    let lab = Lab::start(dir.path()).await.unwrap();
    let q = lab.queries().await.unwrap();
    let get = |f: &str| q.iter().find(|(n, _)| *n == f).unwrap().1.clone();
    let nodes = parse_nodes(&get("query-named-block-nodes-flat.json")).unwrap();
    let graph = parse_graph(&get("x-debug-query-block-graph.json")).unwrap();
    let ctx = DriveContext {
        vm: vm_state(&get("query-status.json"), Some(&get("query-migrate.json"))),
        memory_shared: true,
        throttled: throttled_nodes(&get("query-block.json")),
        ..Default::default()
    };
    let d = |name: &str| decide(&drive_view(name, &nodes, Some(&graph), &ctx));
    match d("d0") {
        Decision::Accelerate(s) => {
            assert_eq!(s.image, dir.path().join("d0.raw"));
            assert!(s.direct, "cache.direct=on carried");
        }
        other => panic!("d0: {other:?}"),
    }
    assert_eq!(d("q0").reason_codes(), ["format:qcow2"]);
    assert_eq!(d("d1").reason_codes(), ["filter:throttle"]);
    assert_eq!(
        d("d1-thr").reason_codes(),
        ["node-in-use", "filter:throttle"]
    );
    assert_eq!(d("d2").reason_codes(), ["dirty-bitmap"]);
    assert_eq!(d("nope").reason_codes(), ["node-missing"]);
}
