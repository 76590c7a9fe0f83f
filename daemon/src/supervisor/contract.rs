//! The VM contract as QEMU arguments (`accelctl qemu-args`).

use super::{SupError, Supervisor};

impl Supervisor {
    /// The VM contract as QEMU arguments, one per element.
    pub fn qemu_args(&self, vm: &str, memory: &str) -> Result<Vec<String>, SupError> {
        let vmr = self.vm(vm)?;
        if memory.is_empty()
            || !memory
                .trim_end_matches(['K', 'M', 'G', 'T'])
                .chars()
                .all(|c| c.is_ascii_digit())
        {
            return Err(SupError::Invalid(format!(
                "memory size '{memory}' is not a number with an optional K/M/G/T suffix"
            )));
        }
        let mut a: Vec<String> = vec![
            "-object".into(),
            format!("memory-backend-memfd,id=accel-mem,size={memory},share=on"),
            "-machine".into(),
            "memory-backend=accel-mem".into(),
            "-m".into(),
            memory.into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", vmr.qmp_path.display()),
            "-object".into(),
            format!("iothread,id={}", self.cfg.iothread),
        ];
        for d in &vmr.drives() {
            let s = &d.spec;
            let ro = if s.read_only { ",read-only=on" } else { "" };
            let direct = if s.direct { "on" } else { "off" };
            a.push("-blockdev".into());
            a.push(format!(
                "driver=file,filename={},node-name={}-file,cache.direct={direct},discard={}{ro}",
                s.image.display(),
                s.node_name(),
                s.discard
            ));
            a.push("-blockdev".into());
            a.push(format!(
                "driver={},file={}-file,node-name={},cache.direct={direct},discard={}{ro}",
                s.format,
                s.node_name(),
                s.node_name(),
                s.discard
            ));
            a.push("-chardev".into());
            a.push(format!(
                "socket,id={}-sock,path={},reconnect-ms=1000",
                s.id,
                d.socket.display()
            ));
            a.push("-device".into());
            a.push(format!(
                // virtio-blk-pci's 256-entry rings (vhost-user-blk-pci's default is 128),
                // which the device config's seg_max (ring - 2) assumes.
                "vhost-user-blk-pci,id={},chardev={}-sock,num-queues={},queue-size=256",
                s.id, s.id, s.queues
            ));
        }
        a.push("-S".into());
        Ok(a)
    }
}
