#!/bin/bash
# Makes libvirt (bookworm-backports 11.3) ready for accel's libvirt test on a machine without
# systemd, as root, then starts virtlogd and libvirtd unless they run. Idempotent.
# QEMU runs as Debian's default user, libvirt-qemu (a domain can ask for root with its own
# DAC label; the test runs both). /dev/kvm gets the mode udev gives it on a normal host
# (0660 root:kvm, libvirt-qemu is in kvm): when it exists but libvirt-qemu cannot open it,
# libvirt re-probes QEMU on every call (seconds each).
set -euo pipefail
conf=/etc/libvirt/qemu.conf
restart=0
# An earlier version of this script made QEMU root for every domain: undo it.
if grep -q '^# accel: QEMU as root' "$conf"; then
  sed -i '/^# accel: QEMU as root/,/^group = "root"$/d' "$conf"
  restart=1
fi
if [ -c /dev/kvm ] && [ "$(stat -c %G:%a /dev/kvm)" != kvm:660 ]; then
  chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
  restart=1
fi
# A running libvirtd reads qemu.conf (and its capability cache's validity) at start only.
if [ $restart = 1 ] && [ -s /run/libvirtd.pid ] && kill -0 "$(cat /run/libvirtd.pid)" 2>/dev/null; then
  kill "$(cat /run/libvirtd.pid)"
  for _ in $(seq 100); do kill -0 "$(cat /run/libvirtd.pid 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
fi
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
running /run/virtlogd.pid || virtlogd -d
running /run/libvirtd.pid || libvirtd -d
for _ in $(seq 300); do
  virsh -c qemu:///system version >/dev/null 2>&1 && break
  sleep 0.2
done
virsh -c qemu:///system version | sed -n 3p
