#!/bin/bash
# Installs what accel's demo and tests need on a fresh Debian 12 machine (run as root):
# QEMU 10 from bookworm-backports (reusing the mirror the machine already uses), busybox-static,
# cpio and xz for the tiny guest, fio for benchmarks, g++ for libFuzzer (fuzz/), a Python
# venv with QEMU's own QMP client (qemu.qmp, for the QMP proxy tests), and libvirt 11.3 from
# bookworm-backports with virtlogd and libvirtd started (integration/libvirt-up.sh, for the
# libvirt test). Idempotent.
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "setup.sh: run as root (it installs Debian packages)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
need_update=0
if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
  uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  if [ -z "$uri" ]; then
    uri=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
  fi
  echo "deb $uri bookworm-backports main" > /etc/apt/sources.list.d/backports.list
  need_update=1
fi
if [ $need_update = 1 ] || [ ! -d /var/lib/apt/lists ] || [ -z "$(ls /var/lib/apt/lists/ | grep -i backports || true)" ]; then
  apt-get update -q
fi
if ! qemu-system-x86_64 --version 2>/dev/null | grep -q 'version 10'; then
  apt-get install -y -q -t bookworm-backports qemu-system-x86 qemu-utils
fi
# apparmor: apparmor_parser checks the rules `accelctl libvirt install` writes for libvirt's
# confined QEMU (this kernel cannot enforce them; see docs/libvirt.md). gdb: the stacks of a
# test's QEMU that does not exit (accel_integration::backtraces).
apt-get install -y -q busybox-static cpio xz-utils fio g++ python3-venv apparmor gdb >/dev/null
if ! libvirtd --version 2>/dev/null | grep -q ' 11\.'; then
  # Each package pinned to backports (`-t` would pull systemd and more from there too); no
  # init script starts a daemon meanwhile (libvirt-up.sh does, after configuring it).
  created=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    created=1
  fi
  B=bookworm-backports
  apt-get install -y -q --no-install-recommends libvirt-daemon/$B libvirt-daemon-driver-qemu/$B \
    libvirt-clients/$B libvirt-daemon-common/$B >/dev/null
  [ $created = 1 ] && rm -f /usr/sbin/policy-rc.d
fi
"$(dirname "$0")/libvirt-up.sh"
venv="$(dirname "$0")/.venv"
if ! "$venv/bin/python3" -c 'import qemu.qmp' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'qemu.qmp==0.0.6'
fi
qemu-system-x86_64 --version | head -1
qemu-storage-daemon --version | head -1
