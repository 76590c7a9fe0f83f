//! The policy's rules, one case per reason, combinations, accept cases, and QEMU 10's real
//! outputs (shared fixtures).

use std::path::PathBuf;

use policy::qemu::{drive_view, parse_graph, parse_nodes, throttled_nodes, vm_state, DriveContext};
use policy::{decide, Decision, DriveView, NodeView, Parent, Pin, RecordedOptions, VmState};
use serde_json::Value;

fn raw(name: &str, size: u64) -> NodeView {
    NodeView {
        name: name.into(),
        driver: "raw".into(),
        filename: "/img/d.raw".into(),
        virtual_size: size,
        detect_zeroes: "off".into(),
        active: true,
        cache_writeback: true,
        ..Default::default()
    }
}

fn file(size: u64) -> NodeView {
    NodeView {
        name: "d0-file".into(),
        driver: "file".into(),
        cache_direct: true,
        ..raw("", size)
    }
}

fn good() -> DriveView {
    DriveView {
        drive: "d0".into(),
        node: Some(raw("d0", 1 << 30)),
        protocol: Some(file(1 << 30)),
        vm: VmState {
            run_state: "running".into(),
            migration: None,
        },
        memory_shared: true,
        options: RecordedOptions {
            queues: 2,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn codes(v: &DriveView) -> Vec<String> {
    decide(v).reason_codes()
}

#[test]
fn raw_over_file_is_accelerated() {
    match decide(&good()) {
        Decision::Accelerate(s) => {
            assert_eq!(s.image, PathBuf::from("/img/d.raw"));
            assert!(s.direct, "cache.direct carried");
            assert!(!s.read_only);
            assert_eq!(s.discard, "ignore", "QEMU's default discard");
            assert_eq!(s.queues, 2);
            assert!(!s.block_device);
        }
        d => panic!("{d:?}"),
    }
}

#[test]
fn raw_over_host_device_read_only_unmap_is_accelerated() {
    let mut v = good();
    v.protocol.as_mut().unwrap().driver = "host_device".into();
    v.node.as_mut().unwrap().read_only = true;
    v.options.discard = "unmap".into();
    v.options.logical_block_size = 4096;
    match decide(&v) {
        Decision::Accelerate(s) => {
            assert!(s.block_device && s.read_only);
            assert_eq!(s.discard, "unmap");
            assert_eq!(s.logical_block_size, 4096);
        }
        d => panic!("{d:?}"),
    }
}

#[test]
fn a_bare_file_or_block_device_node_is_accelerated() {
    // libvirt's raw disks: `-blockdev {"driver":"file","node-name":"libvirt-1-storage",…}`
    // and the device on it, no format layer.
    for (driver, block_device) in [("file", false), ("host_device", true)] {
        let mut v = good();
        v.node = Some(NodeView {
            name: "libvirt-1-storage".into(),
            driver: driver.into(),
            cache_direct: true,
            ..raw("", 1 << 30)
        });
        v.protocol = None;
        match decide(&v) {
            Decision::Accelerate(s) => {
                assert_eq!(s.image, PathBuf::from("/img/d.raw"));
                assert!(s.direct);
                assert_eq!(s.block_device, block_device, "{driver}");
            }
            d => panic!("{driver}: {d:?}"),
        }
        // The node's own rules still apply.
        v.node.as_mut().unwrap().cache_no_flush = true;
        assert_eq!(codes(&v), vec!["cache-no-flush".to_string()]);
    }
    // A protocol QEMU serves itself stays there.
    let mut v = good();
    v.node.as_mut().unwrap().driver = "nbd".into();
    v.protocol = None;
    assert_eq!(codes(&v), vec!["protocol:nbd".to_string()]);
}

#[test]
fn one_case_per_reason() {
    type Edit = fn(&mut DriveView);
    let cases: Vec<(&str, Edit)> = vec![
        ("format:qcow2", |v| {
            v.node.as_mut().unwrap().driver = "qcow2".into()
        }),
        ("protocol:nbd", |v| {
            v.protocol.as_mut().unwrap().driver = "nbd".into()
        }),
        ("backing-chain", |v| {
            v.node.as_mut().unwrap().backing_depth = 1
        }),
        ("filter:throttle", |v| {
            v.parents.push(Parent::Filter("throttle".into()))
        }),
        ("filter:copy-on-read", |v| {
            v.parents.push(Parent::Filter("copy-on-read".into()))
        }),
        ("block-job:mirror", |v| {
            v.parents.push(Parent::Job("mirror".into()))
        }),
        ("dirty-bitmap", |v| {
            v.node.as_mut().unwrap().dirty_bitmaps = 1
        }),
        ("write-threshold", |v| {
            v.node.as_mut().unwrap().write_threshold = 50 << 20
        }),
        ("encryption", |v| v.node.as_mut().unwrap().encrypted = true),
        ("detect-zeroes", |v| {
            v.node.as_mut().unwrap().detect_zeroes = "unmap".into()
        }),
        ("throttle", |v| v.node.as_mut().unwrap().throttled = true),
        ("raw-subrange", |v| {
            v.node.as_mut().unwrap().virtual_size = 1 << 20
        }),
        ("cache-no-flush", |v| {
            v.protocol.as_mut().unwrap().cache_no_flush = true
        }),
        ("node-in-use", |v| {
            v.parents.push(Parent::Backend("vblk0".into()))
        }),
        ("inactive-node", |v| v.node.as_mut().unwrap().active = false),
        ("migration-in-progress", |v| {
            v.vm.migration = Some("active".into())
        }),
        ("migration-in-progress", |v| {
            v.vm.run_state = "inmigrate".into()
        }),
        ("operator-pin", |v| v.pin = Some(Pin::Qemu)),
        ("memory-not-shared", |v| v.memory_shared = false),
        ("node-missing", |v| v.node = None),
        ("unknown-node-driver:frobnicate", |v| {
            v.node.as_mut().unwrap().driver = "frobnicate".into()
        }),
        ("unknown-node-driver:blkfoo", |v| {
            v.parents.push(Parent::Filter("blkfoo".into()))
        }),
        ("unknown-node-driver:raw without file", |v| {
            v.protocol = None
        }),
        ("unknown-vm-state:weird", |v| {
            v.vm.run_state = "weird".into()
        }),
        ("backing-chain", |v| v.other_children.push("backing".into())),
    ];
    for (want, edit) in cases {
        let mut v = good();
        edit(&mut v);
        assert_eq!(codes(&v), vec![want.to_string()], "case {want}");
    }
}

#[test]
fn pin_direct_and_finished_migration_do_not_block() {
    let mut v = good();
    v.pin = Some(Pin::Direct);
    v.vm.migration = Some("completed".into());
    assert!(decide(&v).is_accelerated());
}

#[test]
fn combinations_list_every_reason_once() {
    let mut v = good();
    v.node.as_mut().unwrap().driver = "qcow2".into();
    v.node.as_mut().unwrap().backing_depth = 2;
    v.parents.push(Parent::Filter("throttle".into()));
    v.parents.push(Parent::Job("commit".into()));
    v.other_children.push("backing".into());
    v.pin = Some(Pin::Qemu);
    assert_eq!(
        codes(&v),
        [
            "operator-pin",
            "filter:throttle",
            "block-job:commit",
            "backing-chain",
            "format:qcow2"
        ]
    );
    let d = decide(&v);
    if let Decision::Qemu(r) = d {
        assert!(r[0].sentence().contains("pinned"));
        assert!(r.iter().all(|x| !x.sentence().is_empty()));
    }
}

fn fixture(name: &str) -> Value {
    // Copies of shared/fixtures/qmp-qemu-10.0.2 (real QEMU 10.0.2 outputs, see README.txt).
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap()
}

fn ctx() -> DriveContext {
    DriveContext {
        vm: vm_state(&fixture("query-status.json"), None),
        memory_shared: true,
        ..Default::default()
    }
}

#[test]
fn real_qemu_outputs() {
    let nodes = parse_nodes(&fixture("query-named-block-nodes-flat.json")).unwrap();
    assert_eq!(nodes.len(), 4);
    let mut c = ctx();
    c.throttled = throttled_nodes(&fixture("query-block.json"));
    // disk-a: raw over file → accelerated (in this VM a virtio-blk device also uses it, which
    // the graph would show; without the graph the policy sees only the nodes).
    let a = drive_view("disk-a", &nodes, None, &c);
    assert_eq!(a.protocol.as_ref().unwrap().name, "file-a");
    match decide(&a) {
        Decision::Accelerate(s) => assert_eq!(s.image, PathBuf::from("/tmp/inv-a.raw")),
        d => panic!("{d:?}"),
    }
    // The qcow2 node with -drive throttling (visible through query-block only).
    let b = drive_view("#block144", &nodes, None, &c);
    let codes = decide(&b).reason_codes();
    assert!(codes.contains(&"format:qcow2".to_string()), "{codes:?}");
    // The vhost-user disk has no node: node-missing.
    assert_eq!(
        decide(&drive_view("vdisk0", &nodes, None, &c)).reason_codes(),
        ["node-missing"]
    );
}

#[test]
fn legacy_throttle_seen_through_query_block() {
    let t = throttled_nodes(&fixture("query-block.json"));
    // drive-b has throttling.iops-total=100; its top node is the qcow2 node.
    assert_eq!(t.len(), 1, "{t:?}");
}

#[test]
fn qsd_outputs() {
    let nodes = parse_nodes(&fixture("qsd_query-named-block-nodes-flat.json")).unwrap();
    let v = drive_view("disk0", &nodes, None, &ctx());
    assert!(decide(&v).is_accelerated(), "{:?}", decide(&v));
}

#[test]
fn block_graph_gives_parents_and_children() {
    // Captured from QEMU 10: a throttle filter over raw disk0 over file f0, exported over NBD.
    let g: Value = serde_json::from_str(
        r#"{"return": {"edges": [
        {"name": "file", "parent": 2, "child": 4, "perm": [], "shared-perm": []},
        {"name": "file", "parent": 4, "child": 3, "perm": [], "shared-perm": []},
        {"name": "root", "parent": 1, "child": 2, "perm": [], "shared-perm": []}],
      "nodes": [{"name": "thr0", "type": "block-driver", "id": 2},
                {"name": "disk0", "type": "block-driver", "id": 4},
                {"name": "f0", "type": "block-driver", "id": 3},
                {"name": "", "type": "block-backend", "id": 1}]}}"#,
    )
    .unwrap();
    let g = parse_graph(&g).unwrap();
    let mk = |name: &str, drv: &str| NodeView {
        name: name.into(),
        driver: drv.into(),
        filename: "/tmp/g/d.raw".into(),
        virtual_size: 16 << 20,
        detect_zeroes: "off".into(),
        active: true,
        ..Default::default()
    };
    let nodes = vec![mk("thr0", "throttle"), mk("disk0", "raw"), mk("f0", "file")];
    let v = drive_view("disk0", &nodes, Some(&g), &ctx());
    assert_eq!(v.protocol.as_ref().unwrap().name, "f0");
    assert_eq!(v.parents, vec![Parent::Filter("throttle".into())]);
    assert_eq!(decide(&v).reason_codes(), ["filter:throttle"]);
    // The filter's own view: the export's anonymous backend uses it.
    let t = drive_view("thr0", &nodes, Some(&g), &ctx());
    assert_eq!(decide(&t).reason_codes()[0], "node-in-use");
}

#[test]
fn malformed_outputs_are_clear_errors() {
    let e = parse_nodes(&serde_json::json!({"return": {"not": "an array"}})).unwrap_err();
    assert!(e.to_string().contains("expected an array"), "{e}");
    let e = parse_nodes(&serde_json::json!([{"drv": "raw"}])).unwrap_err();
    assert!(e.to_string().contains("node-name"), "{e}");
    let e = parse_graph(&serde_json::json!({"nodes": []})).unwrap_err();
    assert!(e.to_string().contains("nodes and edges"), "{e}");
}

#[test]
fn a_running_mirror_is_a_filter_and_a_job() {
    use policy::{decide, Decision, DriveView, NodeView, Parent};
    let raw = NodeView {
        name: "d0".into(),
        driver: "raw".into(),
        filename: "/x.raw".into(),
        active: true,
        cache_direct: true,
        cache_writeback: true,
        detect_zeroes: "off".into(),
        ..Default::default()
    };
    let file = NodeView {
        name: "d0-file".into(),
        driver: "file".into(),
        ..raw.clone()
    };
    let v = DriveView {
        drive: "d0".into(),
        node: Some(raw),
        protocol: Some(file),
        parents: vec![
            Parent::Filter("mirror_top".into()),
            Parent::Job("m1".into()),
        ],
        vm: policy::VmState {
            run_state: "running".into(),
            migration: None,
        },
        memory_shared: true,
        ..Default::default()
    };
    match decide(&v) {
        Decision::Qemu(r) => {
            let codes: Vec<String> = r.iter().map(|x| x.code()).collect();
            assert_eq!(codes, vec!["filter:mirror_top", "block-job:m1"]);
        }
        d => panic!("{d:?}"),
    }
}

#[test]
fn libvirts_leftover_commit_bitmap_is_not_a_reason() {
    // After `virsh blockcommit --active --pivot` (libvirt 11.3, QEMU 10.0.2) the base keeps
    // libvirt's temporary bitmap; a management bitmap still counts.
    let node = |bitmaps: Value| {
        serde_json::json!({"return": [{"node-name": "libvirt-1-storage", "drv": "file",
            "file": "/img/d.raw", "ro": false, "encrypted": false, "detect_zeroes": "off",
            "backing_file_depth": 0, "active": true,
            "cache": {"direct": true, "no-flush": false, "writeback": true},
            "image": {"virtual-size": 1048576, "filename": "/img/d.raw", "format": "file"},
            "dirty-bitmaps": bitmaps}]})
    };
    let tmp = serde_json::json!([{"name": "libvirt-tmp-activewrite", "recording": true,
        "persistent": false, "busy": false, "granularity": 65536, "count": 0}]);
    let n = parse_nodes(&node(tmp)).unwrap();
    assert_eq!(n[0].dirty_bitmaps, 0);
    let mine = serde_json::json!([{"name": "backup-1", "recording": true, "persistent": false,
        "busy": false, "granularity": 65536, "count": 0}]);
    assert_eq!(parse_nodes(&node(mine)).unwrap()[0].dirty_bitmaps, 1);
}
