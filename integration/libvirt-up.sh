#!/bin/bash
# Makes libvirt (bookworm-backports 11.3) ready for accel's libvirt test on a machine without
# systemd, as root: QEMU runs as root (acceld's run directory is root's; and with /dev/kvm
# present but not openable by libvirt-qemu, libvirt would re-probe QEMU on every call), then
# virtlogd and libvirtd are started unless they run. Idempotent.
set -euo pipefail
conf=/etc/libvirt/qemu.conf
if ! grep -q '^# accel: QEMU as root' "$conf"; then
  printf '\n# accel: QEMU as root (integration/libvirt-up.sh)\nuser = "root"\ngroup = "root"\n' >> "$conf"
  # A running libvirtd reads qemu.conf at start only.
  if [ -s /run/libvirtd.pid ] && kill -0 "$(cat /run/libvirtd.pid)" 2>/dev/null; then
    kill "$(cat /run/libvirtd.pid)"
    for _ in $(seq 100); do kill -0 "$(cat /run/libvirtd.pid 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
  fi
fi
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
running /run/virtlogd.pid || virtlogd -d
running /run/libvirtd.pid || libvirtd -d
for _ in $(seq 300); do
  virsh -c qemu:///system version >/dev/null 2>&1 && break
  sleep 0.2
done
virsh -c qemu:///system version | sed -n 3p
