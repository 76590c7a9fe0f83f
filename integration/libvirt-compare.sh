#!/bin/bash
# Runs the same virsh commands on a plain domain and on the same domain converted for accel
# (accelctl libvirt convert), one after the other, and diffs their outputs (names
# normalized): W/diff.txt. Besides virsh's answers it compares what the guest sees of its
# disk at boot (size, serial, queues, virtio features, block limits, by-id links; the same
# view as integration/tests/libvirt.rs's twin test) and the taint flags libvirt logged for
# each domain. Needs libvirtd running (libvirt-up.sh) and a debug build
# (cargo build -p acceld -p accelctl). Only timing and counter values should differ, and the
# guest's features line at bit 40 (VIRTIO_F_RING_RESET; see docs/libvirt.md, "What the guest
# can tell").
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${W:-/var/tmp/accel-libvirt-compare}; rm -rf $W; mkdir -p $W/bin $W/run
A=$ROOT/target/debug/accelctl
ln -s $ROOT/target/debug/accel-qemu $W/bin/accel-qemu
(ACCELD_LOG=info setsid $ROOT/target/debug/acceld run --run-dir $W/run > $W/acceld.log 2>&1 &)
sleep 1
$A --run-dir $W/run libvirt install --conf $W/bin/accel-qemu.conf 2>/dev/null
kill $(cat /run/libvirtd.pid); sleep 1; libvirtd -d; sleep 2
V='d=/sys/block/vda; q=$d/queue; for k in size ro; do echo "view $k=$(cat $d/$k)"; done; echo "view serial=$(cat $d/serial 2>/dev/null)"; echo "view queues=$(ls $d/mq | wc -l)"; echo "view features=$(cat $d/device/features 2>/dev/null)"; for k in logical_block_size physical_block_size minimum_io_size optimal_io_size discard_granularity discard_max_hw_bytes write_zeroes_max_bytes max_hw_sectors_kb max_segments max_segment_size rotational write_cache nr_requests; do echo "view $k=$(cat $q/$k 2>/dev/null)"; done; echo "view by-id=$(ls /dev/disk/by-id 2>/dev/null | tr "\n" " ")"; '
T=$(printf '%si=0; while [ $i -lt 3000 ]; do dd if=/dev/urandom of=/dev/vda bs=4k count=1 seek=$((RANDOM%%1000)) oflag=direct 2>/dev/null; i=$((i+1)); sleep 0.1; done\n' "$V" | base64 -w0)
mk() { # name uuidsuffix
cat > $W/$1.xml <<X
<domain type='qemu'>
  <name>$1</name>
  <uuid>6a4e4c1e-3333-4a5b-9c8d-0000000000$2</uuid>
  <memory unit='MiB'>256</memory>
  <vcpu>2</vcpu>
  <features><acpi/></features>
  <os><type arch='x86_64' machine='q35'>hvm</type>
    <kernel>$ROOT/integration/out/vmlinuz</kernel><initrd>$ROOT/integration/out/initramfs.cpio.gz</initrd>
    <cmdline>console=ttyS0 panic=-1 testcmd=$T</cmdline></os>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='none' io='native' discard='unmap'/>
      <source file='$W/$1.raw'/>
      <target dev='vda' bus='virtio'/>
      <serial>SER-$1</serial>
    </disk>
    <controller type='usb' model='none'/>
    <serial type='file'><source path='$W/$1.serial' append='on'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>
X
truncate -s 64M $W/$1.raw
}
mk lvcmp-plain 01; mk lvcmp-accel 02
$A libvirt convert $W/lvcmp-accel.xml --emulator $W/bin/accel-qemu > $W/accel-conv.xml 2>/dev/null
virsh define $W/lvcmp-plain.xml >/dev/null; virsh define $W/accel-conv.xml >/dev/null
run() { # dom
  d=$1; o=$W/$d.out; : > $o
  l=/var/log/libvirt/qemu/$d.log; from=$(stat -c %s $l 2>/dev/null || echo 0)
  virsh start $d >/dev/null; sleep 12
  for c in "domblklist $d --details" "domblkinfo $d vda" "domblkinfo $d --all" "domstats $d --block" "blkdeviotune $d vda" "domblkerror $d" "domjobinfo $d" "blockjob $d vda --info" "domstate $d --reason" "suspend $d" "domstate $d --reason" "resume $d" "domstate $d --reason" "blkdeviotune $d vda --total-bytes-sec 10000000 --live" "blkdeviotune $d vda" "blkdeviotune $d vda --total-bytes-sec 0 --live" "domblkthreshold $d vda 50M" "domstats $d --block" "blockcopy $d vda $W/$d-copy.raw --wait --pivot --transient-job --format raw" "domblklist $d" "domblkinfo $d vda" "managedsave $d" "domstate $d --reason" "start $d" "domstate $d --reason" "domblkstat $d vda" "reset $d" "domstate $d --reason" "destroy $d"; do
    echo "### virsh $c" >> $o
    timeout 60 virsh $c >> $o 2>&1; echo "rc=$?" >> $o
    sleep 1
  done
  echo "### the guest's view of its disk at its first boot" >> $o
  grep -a '^view ' $W/$d.serial | sed -n '1,/view by-id/p' | tr -d '\r' >> $o
  echo "### taint flags libvirt logged" >> $o
  tail -c +$((from + 1)) $l | grep -o 'is tainted: .*' | sort | uniq -c >> $o
}
run lvcmp-plain; run lvcmp-accel
virsh undefine lvcmp-plain --managed-save >/dev/null; virsh undefine lvcmp-accel --managed-save >/dev/null
$A libvirt uninstall --conf $W/bin/accel-qemu.conf 2>/dev/null
pkill -TERM -f "acceld run --run-dir $W/run"
sed -e 's/lvcmp-plain/DOM/g' $W/lvcmp-plain.out > $W/p.norm; sed -e 's/lvcmp-accel/DOM/g' $W/lvcmp-accel.out > $W/a.norm
diff $W/p.norm $W/a.norm > $W/diff.txt; echo "diff lines: $(wc -l < $W/diff.txt)"
