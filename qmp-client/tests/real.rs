//! The client against real qemu-storage-daemon and qemu-system-x86_64 (QEMU 10).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use qmp_client::commands::*;
use qmp_client::{connect_with_retry, Qmp};
use serde_json::json;
use tokio::process::{Child, Command};

async fn attach(sock: &Path) -> Qmp {
    connect_with_retry(sock, 200, Duration::from_millis(25))
        .await
        .expect("QMP socket of the QEMU under test")
}

fn kill_on_drop(mut c: Command) -> Child {
    c.kill_on_drop(true)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("QEMU must be installed (integration/setup.sh)")
}

#[tokio::test]
async fn qemu_storage_daemon_session() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let qmp = dir.path().join("qmp.sock");
    let mut c = Command::new("qemu-storage-daemon");
    c.arg("--chardev")
        .arg(format!(
            "socket,id=m0,path={},server=on,wait=off",
            qmp.display()
        ))
        .args(["--monitor", "chardev=m0"])
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=file0,filename={}",
            img.display()
        ))
        .args(["--blockdev", "driver=raw,node-name=disk0,file=file0"]);
    let _child = kill_on_drop(c);
    let q = attach(&qmp).await;
    assert_eq!(q.greeting().version.qemu.major, 10);
    let v = q.execute(&QueryVersion).await.unwrap();
    assert_eq!(v.qemu.major, 10);
    let nodes = q.execute(&QueryNamedBlockNodes::default()).await.unwrap();
    let names: Vec<&str> = nodes
        .iter()
        .filter_map(|n| n["node-name"].as_str())
        .collect();
    assert!(
        names.contains(&"disk0") && names.contains(&"file0"),
        "{names:?}"
    );
    // The NBD export sequence the qemu engine uses.
    q.execute(&ObjectAdd(json!({"qom-type": "iothread", "id": "io0"})))
        .await
        .unwrap();
    let nbd = dir.path().join("nbd.sock");
    q.execute(&NbdServerStart::unix(nbd.to_str().unwrap()))
        .await
        .unwrap();
    q.execute(&BlockExportAdd::nbd("exp0", "disk0", true, Some("io0")))
        .await
        .unwrap();
    let ex = q.execute(&QueryBlockExports).await.unwrap();
    assert_eq!(ex.len(), 1);
    assert_eq!(
        (
            ex[0].id.as_str(),
            ex[0].kind.as_str(),
            ex[0].node_name.as_str()
        ),
        ("exp0", "nbd", "disk0")
    );
    let mut events = q.events();
    q.execute(&BlockExportDel {
        id: "exp0".into(),
        mode: None,
    })
    .await
    .unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev.name, "BLOCK_EXPORT_DELETED");
    assert_eq!(ev.data["id"], "exp0");
    q.execute(&NbdServerStop).await.unwrap();
    // Errors keep QEMU's class and description.
    let e = q
        .execute(&BlockdevDel {
            node_name: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.class(), Some("GenericError"));
    assert!(e.to_string().contains("nope"), "{e}");
    // blockdev-add / blockdev-del and blockdev-set-active.
    q.execute(&BlockdevAdd(
        json!({"driver": "null-co", "node-name": "n0"}),
    ))
    .await
    .unwrap();
    q.execute(&BlockdevSetActive {
        node_name: Some("n0".into()),
        active: false,
    })
    .await
    .unwrap();
    q.execute(&BlockdevDel {
        node_name: "n0".into(),
    })
    .await
    .unwrap();
    q.execute(&ObjectDel { id: "io0".into() }).await.unwrap();
}

#[tokio::test]
async fn qemu_system_session() {
    let dir = tempfile::tempdir().unwrap();
    let qmp = dir.path().join("qmp.sock");
    let mut c = Command::new("qemu-system-x86_64");
    c.args([
        "-machine",
        "q35",
        "-accel",
        "tcg",
        "-S",
        "-nodefaults",
        "-display",
        "none",
    ])
    .arg("-qmp")
    .arg(format!("unix:{},server=on,wait=off", qmp.display()));
    let _child = kill_on_drop(c);
    let q = attach(&qmp).await;
    let st = q.execute(&QueryStatus).await.unwrap();
    assert_eq!(st.status, "prelaunch");
    let mut events = q.events();
    q.execute(&Cont).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev.name, "RESUME");
    assert!(q.execute(&QueryStatus).await.unwrap().running);
    q.execute(&Stop).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev.name, "STOP");
    let chardevs = q.execute(&QueryChardev).await.unwrap();
    assert!(
        chardevs
            .iter()
            .any(|c| c.label == "compat_monitor0" || c.filename.contains("qmp.sock")),
        "{chardevs:?}"
    );
    let props = q
        .execute(&QomList {
            path: "/machine".into(),
        })
        .await
        .unwrap();
    assert!(props.iter().any(|p| p.name == "peripheral"));
    let kvm = q
        .execute(&QomGet {
            path: "/machine".into(),
            property: "type".into(),
        })
        .await
        .unwrap();
    assert!(kvm.as_str().unwrap_or_default().contains("q35"), "{kvm}");
    q.execute(&ObjectAdd(
        json!({"qom-type": "iothread", "id": "accel-io"}),
    ))
    .await
    .unwrap();
    let its = q.execute(&QueryIothreads).await.unwrap();
    assert!(its.iter().any(|t| t.id == "accel-io"), "{its:?}");
    let blk = q.execute(&QueryBlock).await.unwrap();
    assert!(blk.is_empty());
    let m = q.execute(&QueryMigrate).await.unwrap();
    assert!(m.is_object());
    // Closing QEMU fails later commands cleanly.
    let _ = q.execute_raw("quit", None).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = q.execute(&QueryStatus).await.unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
}
