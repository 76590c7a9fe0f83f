//! The emulator wrapper's decision on libvirt 11.3's real command lines (captured with a
//! logging `<emulator>` script: a capability probe, a start, a restore), and the domain
//! converter.

use std::path::PathBuf;

use accel_api::control::{DiscardMode, ErrorPolicy};
use accelctl::libvirt::argv::{plan, split_opts, vm_name, Monitor, Outcome, WrapConfig};
use accelctl::libvirt::xml::{convert, facts, uses_wrapper};
use serde_json::Value;

fn fixture(name: &str) -> Vec<String> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn cfg() -> WrapConfig {
    WrapConfig {
        run_dir: "/run/accel".into(),
        iothread: "accel-io".into(),
        lend: false,
    }
}

fn wrap(args: &[String]) -> accelctl::libvirt::argv::Plan {
    match plan(args, &cfg()) {
        Outcome::Wrap(p) => *p,
        Outcome::Unchanged(why) => panic!("not wrapped: {why}"),
    }
}

fn value_after<'a>(args: &'a [String], opt: &str, pred: impl Fn(&str) -> bool) -> Vec<&'a str> {
    args.windows(2)
        .filter(|w| w[0] == opt && pred(&w[1]))
        .map(|w| w[1].as_str())
        .collect()
}

#[test]
fn capability_probes_run_unchanged() {
    assert!(matches!(
        plan(&fixture("libvirt-11.3-probe.args"), &cfg()),
        Outcome::Unchanged(_)
    ));
    assert!(matches!(
        plan(&["-version".into()], &cfg()),
        Outcome::Unchanged(_)
    ));
}

#[test]
fn libvirts_start_command_line_is_accelerated() {
    let args = fixture("libvirt-11.3-start.args");
    let p = wrap(&args);
    assert_eq!(p.vm, "lvref");
    assert_eq!(p.monitor, Monitor::Fd(20));
    assert!(!p.incoming);
    assert_eq!(p.qmp, PathBuf::from("/run/accel/lvref/qemu-qmp.sock"));
    let [d] = p.drives.as_slice() else {
        panic!("{:?}", p.drives)
    };
    assert_eq!(d.id, "virtio-disk0");
    assert_eq!(d.node.as_deref(), Some("libvirt-1-storage"));
    assert_eq!(d.image, PathBuf::from("/tmp/lvref/disk.raw"));
    assert_eq!(d.format, "raw");
    assert!(d.direct, "cache.direct from the file node");
    assert!(!d.read_only);
    assert_eq!(d.writeback, Some(true), "write-cache on");
    assert_eq!(d.queues, 1);
    // The device: vhost-user-blk-pci on acceld's socket, keeping id, bus, addr, bootindex.
    let dev: Vec<Value> = value_after(&p.args, "-device", |v| v.contains("vhost-user-blk"))
        .iter()
        .map(|v| serde_json::from_str(v).unwrap())
        .collect();
    let [dev] = dev.as_slice() else {
        panic!("{:?}", p.args)
    };
    assert_eq!(dev["id"], "virtio-disk0");
    assert_eq!(dev["bus"], "pci.1");
    assert_eq!(dev["addr"], "0x0");
    assert_eq!(dev["bootindex"], 1);
    assert_eq!(dev["chardev"], "virtio-disk0-sock");
    assert!(dev.get("drive").is_none() && dev.get("write-cache").is_none());
    assert!(value_after(&p.args, "-device", |v| v.contains("virtio-blk-pci")).is_empty());
    assert_eq!(
        value_after(&p.args, "-chardev", |v| v
            .starts_with("socket,id=virtio-disk0-sock")),
        ["socket,id=virtio-disk0-sock,path=/run/accel/lvref/virtio-disk0.sock,reconnect-ms=1000"]
    );
    // libvirt's -blockdev stays (the qemu engine's node); the monitor is acceld's socket.
    assert_eq!(value_after(&p.args, "-blockdev", |_| true).len(), 1);
    assert_eq!(
        value_after(&p.args, "-chardev", |v| v.contains("charmonitor")),
        ["socket,id=charmonitor,path=/run/accel/lvref/qemu-qmp.sock,server=on,wait=off"]
    );
    assert!(!p.args.iter().any(|a| a.contains("fd=20")));
    // Shared memory and the iothread.
    let mem = value_after(&p.args, "-object", |v| v.contains("\"pc.ram\""));
    let mem: Value = serde_json::from_str(mem[0]).unwrap();
    assert_eq!(mem["qom-type"], "memory-backend-memfd");
    assert_eq!(mem["share"], true);
    assert_eq!(mem["size"], 268435456);
    assert_eq!(
        value_after(&p.args, "-object", |v| v.contains("iothread")),
        [r#"{"id":"accel-io","qom-type":"iothread"}"#]
    );
    // Everything else is as libvirt gave it, in order.
    let rest = |a: &[String]| -> Vec<String> {
        a.iter()
            .filter(|x| {
                !x.contains("pc.ram\"")
                    && !x.contains("charmonitor,")
                    && !x.contains("virtio-blk")
                    && !x.contains("vhost-user")
                    && !x.contains("iothread")
                    && !x.contains("-sock,")
            })
            .cloned()
            .collect()
    };
    let (mut a, mut b) = (rest(&args), rest(&p.args));
    a.retain(|x| x != "-object" && x != "-device" && x != "-chardev");
    b.retain(|x| x != "-object" && x != "-device" && x != "-chardev");
    assert_eq!(a, b);
    assert!(
        p.notes.iter().any(|n| n.contains("virtio-disk0")),
        "{:?}",
        p.notes
    );
}

#[test]
fn restore_is_an_incoming_vm() {
    let p = wrap(&fixture("libvirt-11.3-restore.args"));
    assert!(p.incoming);
    assert_eq!(p.monitor, Monitor::Fd(21));
    assert_eq!(value_after(&p.args, "-incoming", |_| true), ["defer"]);
}

/// libvirt's start line with the disk device and its node replaced.
fn with_disk(node: &str, device: &str) -> Vec<String> {
    let mut a = fixture("libvirt-11.3-start.args");
    for x in a.iter_mut() {
        if x.contains("\"libvirt-1-storage\"") && x.contains("\"driver\":\"file\"") {
            *x = node.to_string();
        } else if x.contains("virtio-blk-pci") {
            *x = device.to_string();
        }
    }
    a
}

#[test]
fn disk_options_become_the_drive_spec() {
    let node = r#"{"driver":"host_device","filename":"/dev/vg/lv","node-name":"libvirt-1-storage","read-only":true,"discard":"unmap","cache":{"direct":false}}"#;
    let dev = r#"{"driver":"virtio-blk-pci","bus":"pci.1","addr":"0x0","drive":"libvirt-1-storage","id":"ua-data","num-queues":2,"serial":"SN-1","werror":"stop","rerror":"report","logical_block_size":4096,"physical_block_size":4096,"write-cache":"off"}"#;
    let p = wrap(&with_disk(node, dev));
    let d = &p.drives[0];
    assert_eq!(d.id, "ua-data");
    assert_eq!(d.image, PathBuf::from("/dev/vg/lv"));
    assert!(d.read_only && !d.direct);
    assert_eq!(d.queues, 2);
    assert_eq!(d.serial.as_deref(), Some("SN-1"));
    assert_eq!(d.werror, ErrorPolicy::Stop);
    assert_eq!(d.rerror, ErrorPolicy::Report);
    assert_eq!(d.logical_block_size, 4096);
    assert_eq!(d.writeback, Some(false));
    // discard needs unmap on every layer; here there is one.
    assert_eq!(d.discard, DiscardMode::Unmap);
    let dev: Value =
        serde_json::from_str(value_after(&p.args, "-device", |v| v.contains("vhost-user"))[0])
            .unwrap();
    assert_eq!(dev["num-queues"], 2);
}

#[test]
fn a_qcow2_disk_is_served_through_the_qemu_engine() {
    let mut a = with_disk(
        r#"{"driver":"file","filename":"/img/d.qcow2","node-name":"libvirt-1-storage"}"#,
        r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-format","id":"virtio-disk0"}"#,
    );
    a.push("-blockdev".into());
    a.push(r#"{"node-name":"libvirt-1-format","driver":"qcow2","file":"libvirt-1-storage","backing":null}"#.into());
    let p = wrap(&a);
    assert_eq!(p.drives[0].format, "qcow2");
    assert_eq!(p.drives[0].node.as_deref(), Some("libvirt-1-format"));
    assert_eq!(p.drives[0].image, PathBuf::from("/img/d.qcow2"));
    assert!(
        !p.drives[0].lend,
        "lend is off unless the wrapper's config says so"
    );
    // `lend = true` in the wrapper's config: every converted disk lends its rings.
    let lend = WrapConfig {
        lend: true,
        ..cfg()
    };
    let Outcome::Wrap(p) = plan(&a, &lend) else {
        panic!("not wrapped")
    };
    assert!(p.drives[0].lend);
    assert!(
        p.notes.iter().any(|n| n.contains("lend=on")),
        "{:?}",
        p.notes
    );
}

#[test]
fn the_wrapper_config_round_trips_lend() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("accel-qemu.conf");
    for lend in [false, true] {
        let c = accelctl::libvirt::WrapperConf {
            lend,
            ..Default::default()
        };
        std::fs::write(&path, c.render()).unwrap();
        assert_eq!(accelctl::libvirt::WrapperConf::load(&path).unwrap(), c);
    }
}

#[test]
fn disks_acceld_cannot_serve_stay_as_they_are() {
    let file = r#"{"driver":"file","filename":"/img/d.raw","node-name":"libvirt-1-storage"}"#;
    for (node, dev, why) in [
        (
            file,
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-storage","id":"virtio-disk0","share-rw":true}"#,
            "property 'share-rw'",
        ),
        (
            file,
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-storage","id":"virtio-disk0","frobnicate":1}"#,
            "property 'frobnicate'",
        ),
        (
            r#"{"driver":"file","filename":"/dev/fdset/3","node-name":"libvirt-1-storage"}"#,
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-storage","id":"virtio-disk0"}"#,
            "descriptor",
        ),
        (
            r#"{"driver":"nbd","server":{"type":"unix","path":"/x"},"node-name":"libvirt-1-storage"}"#,
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-storage","id":"virtio-disk0"}"#,
            "driver is nbd",
        ),
        (
            file,
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-1-storage","id":"0bad"}"#,
            "not a valid name",
        ),
        (
            file,
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-9-storage","id":"virtio-disk0"}"#,
            "not a -blockdev",
        ),
    ] {
        match plan(&with_disk(node, dev), &cfg()) {
            Outcome::Unchanged(_) => {}
            Outcome::Wrap(p) => panic!("{why}: wrapped {:?}", p.drives),
        }
        // The reason is in the notes when another disk is accelerated.
        let mut a = with_disk(node, dev);
        a.push("-blockdev".into());
        a.push(
            r#"{"driver":"file","filename":"/img/e.raw","node-name":"libvirt-2-storage"}"#.into(),
        );
        a.push("-device".into());
        a.push(
            r#"{"driver":"virtio-blk-pci","drive":"libvirt-2-storage","id":"virtio-disk1"}"#.into(),
        );
        let p = wrap(&a);
        assert_eq!(p.drives.len(), 1);
        assert!(
            p.notes.iter().any(|n| n.contains(why)),
            "{why}: {:?}",
            p.notes
        );
        assert!(p.args.iter().any(|x| x == dev), "{why}: the device changed");
    }
}

#[test]
fn file_memory_without_share_keeps_every_disk() {
    let mut a = fixture("libvirt-11.3-start.args");
    for x in a.iter_mut() {
        if x.contains("memory-backend-ram") {
            *x = r#"{"qom-type":"memory-backend-file","id":"pc.ram","mem-path":"/dev/hugepages","size":268435456}"#.into();
        }
    }
    assert!(matches!(plan(&a, &cfg()), Outcome::Unchanged(_)));
}

#[test]
fn names_and_options() {
    assert_eq!(
        split_opts("socket,path=/a,,b,server=on"),
        ["socket", "path=/a,b", "server=on"]
    );
    assert_eq!(vm_name("web-1", None).as_deref(), Some("web-1"));
    assert_eq!(
        vm_name(
            "my vm.example",
            Some("0b6f2f9e-5a1c-4e7e-9d1e-acce1d000001")
        )
        .as_deref(),
        Some("vm-0b6f2f9e5a1c4e7e9d1eacce")
    );
    assert_eq!(vm_name("my vm", None), None);
}

const DOMAIN: &str = r#"<domain type='kvm'>
  <name>web</name>
  <uuid>0b6f2f9e-5a1c-4e7e-9d1e-acce1d000001</uuid>
  <memory unit='KiB'>1048576</memory>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/var/lib/libvirt/images/web.raw'/>
      <target dev='vda' bus='virtio'/>
    </disk>
  </devices>
</domain>
"#;

#[test]
fn convert_sets_the_emulator_and_shared_memory_only() {
    let (out, changes) = convert(DOMAIN, "/usr/bin/accel-qemu").unwrap();
    assert_eq!(changes.len(), 3, "{changes:?}");
    let f = facts(&out).unwrap();
    assert_eq!(f.name, "web");
    assert_eq!(f.emulator.as_deref(), Some("/usr/bin/accel-qemu"));
    assert!(uses_wrapper(&f));
    assert!(
        out.contains(
            r#"<memoryBacking><source type="memfd"/><access mode="shared"/></memoryBacking>"#
        ),
        "{out}"
    );
    // The disk and everything else is untouched.
    assert!(
        out.contains("<source file='/var/lib/libvirt/images/web.raw'/>"),
        "{out}"
    );
    // Converting again changes nothing.
    let (again, changes) = convert(&out, "/usr/bin/accel-qemu").unwrap();
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(again, out);
}

#[test]
fn convert_keeps_hugepages_and_other_memory_options() {
    let d = DOMAIN.replace(
        "<os>",
        "<memoryBacking><hugepages/><nosharepages/><access mode='private'/></memoryBacking>\n  <os>",
    );
    let (out, changes) = convert(&d, "/usr/bin/accel-qemu").unwrap();
    assert!(
        out.contains("<hugepages/><nosharepages/><access mode=\"shared\"/>"),
        "{out}"
    );
    assert!(!out.contains("memfd"));
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert_eq!(out.matches("<memoryBacking>").count(), 1);
}

#[test]
fn convert_refuses_what_is_not_a_domain() {
    assert!(convert("<network><name>x</name></network>", "/x").is_err());
    assert!(convert("<domain><name>x</name>", "/x").is_err());
    assert!(convert("not xml at all <", "/x").is_err());
    assert!(
        convert("<domain><name>x</name></domain>", "/x").is_err(),
        "no devices"
    );
}

#[test]
fn queues_follow_the_vcpus_when_libvirt_gives_none() {
    // QEMU gives virtio-blk-pci one queue per vCPU by default; the vhost-user-blk device
    // gets as many, explicitly.
    let mut a = fixture("libvirt-11.3-start.args");
    for x in a.iter_mut() {
        if x == "1,sockets=1,cores=1,threads=1" {
            *x = "4,sockets=1,cores=4,threads=1".into();
        }
    }
    let p = wrap(&a);
    assert_eq!(p.drives[0].queues, 4);
    let dev: Value =
        serde_json::from_str(value_after(&p.args, "-device", |v| v.contains("vhost-user"))[0])
            .unwrap();
    assert_eq!(dev["num-queues"], 4);
}

#[test]
fn command_lines_the_wrapper_cannot_read_run_unchanged() {
    // An unknown flag in front of an option: the structure is unclear.
    let mut a = fixture("libvirt-11.3-start.args");
    let i = a.iter().position(|x| x == "-smp").unwrap();
    a.insert(i, "-some-new-flag".into());
    assert!(matches!(plan(&a, &cfg()), Outcome::Unchanged(_)));
    // Guest memory from -mem-path, or no memory backend: not shared.
    let mut a = fixture("libvirt-11.3-start.args");
    a.extend(["-mem-path".into(), "/dev/hugepages".into()]);
    assert!(matches!(plan(&a, &cfg()), Outcome::Unchanged(_)));
    let a: Vec<String> = fixture("libvirt-11.3-start.args")
        .into_iter()
        .map(|x| x.replace(",memory-backend=pc.ram", ""))
        .collect();
    assert!(matches!(plan(&a, &cfg()), Outcome::Unchanged(_)));
}

#[test]
fn convert_fills_an_empty_emulator_and_refuses_a_cut_domain() {
    let d = DOMAIN.replace(
        "<emulator>/usr/bin/qemu-system-x86_64</emulator>",
        "<emulator/>",
    );
    let (out, _) = convert(&d, "/usr/bin/accel-qemu").unwrap();
    assert_eq!(out.matches("<emulator>").count(), 1, "{out}");
    assert!(out.contains("<emulator>/usr/bin/accel-qemu</emulator>"));
    let cut = &DOMAIN[..DOMAIN.find("</devices>").unwrap()];
    assert!(convert(cut, "/x").is_err());
    assert!(facts(cut).is_err());
}

#[test]
fn the_hook_reads_qemus_user_and_the_domains_images() {
    // As libvirt 11.3's `start` hook gets it: a dynamic DAC label, a disk with a backing
    // chain, a cdrom, a network disk (no image), and a disk's own seclabel (not QEMU's user).
    let xml = r#"<domain type='qemu' id='3'>
  <name>web</name>
  <devices>
    <emulator>/usr/bin/accel-qemu</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/var/lib/img/top.qcow2' index='2'>
        <seclabel model='dac' relabel='no'/>
      </source>
      <backingStore type='file' index='1'><format type='raw'/><source file='/var/lib/img/base.raw'/></backingStore>
      <target dev='vda' bus='virtio'/>
    </disk>
    <disk type='block' device='cdrom'><driver name='qemu' type='raw'/><source dev='/dev/sr0'/><target dev='sda'/><readonly/></disk>
    <disk type='network' device='disk'><source protocol='nbd' name='x'><host name='h'/></source></disk>
    <interface type='user'><source network='default'/></interface>
  </devices>
  <seclabel type='dynamic' model='dac' relabel='yes'><label>+64055:+107</label><imagelabel>+64055:+107</imagelabel></seclabel>
</domain>"#;
    let f = facts(xml).unwrap();
    assert_eq!(f.dac_label.as_deref(), Some("+64055:+107"));
    let img = |path: &str, read_only, format: &str| accelctl::libvirt::xml::ImageFact {
        path: path.into(),
        read_only,
        format: Some(format.into()),
    };
    // The disk's own image is writable; its backing file and the cdrom only read.
    assert_eq!(
        f.images,
        [
            img("/var/lib/img/top.qcow2", false, "qcow2"),
            img("/var/lib/img/base.raw", true, "raw"),
            img("/dev/sr0", true, "raw"),
        ]
    );
    use accelctl::libvirt::hook::parse_dac_label;
    assert_eq!(parse_dac_label("+64055:+107"), Ok((64055, 107)));
    assert_eq!(parse_dac_label("root:root"), Ok((0, 0)));
    assert_eq!(parse_dac_label("+5:root"), Ok((5, 0)));
    assert!(parse_dac_label("nosuchuser-accel:+1").is_err());
    assert!(parse_dac_label("+64055").is_err());
    assert!(parse_dac_label("+x:+1").is_err());
    // Another model's label is not QEMU's user.
    let selinux = xml.replace("model='dac' relabel='yes'", "model='selinux' relabel='yes'");
    assert_eq!(facts(&selinux).unwrap().dac_label, None);
}
