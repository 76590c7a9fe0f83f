//! The test domains' libvirt XML.

use std::path::Path;

/// The test domains' XML: a TCG guest running `script`, one raw file disk `img` (with
/// `driver_extra` on its `<driver>`), its console on `serial`; `vcpus` vCPUs; QEMU as root
/// through the domain's DAC label when `qemu_as_root`, else as qemu.conf's user.
pub struct DomainSpec<'a> {
    pub name: &'a str,
    pub uuid: String,
    pub vcpus: u32,
    pub script: &'a str,
    pub img: &'a Path,
    pub driver_extra: &'a str,
    pub serial: &'a Path,
    /// QEMU as root through the domain's own DAC label; else qemu.conf's user.
    pub qemu_as_root: bool,
}

pub fn domain_xml_of(s: &DomainSpec, kernel: &Path, initrd: &Path) -> String {
    let cmd = base64(s.script.as_bytes());
    // Root asks for itself; libvirt-qemu is qemu.conf's user (a dynamic label).
    let seclabel = if s.qemu_as_root {
        "  <seclabel type='static' model='dac' relabel='yes'><label>+0:+0</label></seclabel>\n"
    } else {
        ""
    };
    format!(
        r#"<domain type='qemu'>
  <name>{}</name>
  <uuid>{}</uuid>
  <memory unit='MiB'>256</memory>
  <vcpu>{}</vcpu>
  <features><acpi/></features>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{}</kernel>
    <initrd>{}</initrd>
    <cmdline>console=ttyS0 panic=-1 testcmd={cmd}</cmdline>
  </os>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='none' io='native'{}/>
      <source file='{}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <controller type='usb' model='none'/>
    <serial type='unix'><source mode='bind' path='{}'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
{seclabel}</domain>
"#,
        s.name,
        s.uuid,
        s.vcpus,
        kernel.display(),
        initrd.display(),
        s.driver_extra,
        s.img.display(),
        s.serial.display()
    )
}

/// Standard base64 (the guest's `testcmd=` kernel argument).
pub fn base64(b: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                s.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}
