#!/bin/bash
# CI: builds the package, installs it, checks what it installed (binaries answer --help, the
# unit and config are in place, accelctl libvirt install/uninstall work with the installed
# binaries), then removes it. Run as root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
deb=$("$here/build.sh")
dpkg-deb --info "$deb" | sed -n '1,12p'
dpkg -i "$deb"
trap 'dpkg -r accel >/dev/null' EXIT
/usr/bin/acceld --help >/dev/null
/usr/bin/accelctl --help >/dev/null
/usr/bin/accelctl libvirt --help >/dev/null
test -x /usr/bin/accel-qemu
test -f /lib/systemd/system/acceld.service
test -f /etc/accel/acceld.toml
if command -v systemd-analyze >/dev/null; then
  systemd-analyze verify /lib/systemd/system/acceld.service
fi
# A capability-probe-like run passes straight through to QEMU.
/usr/bin/accel-qemu -version | grep -q 'QEMU emulator version 10'
t=$(mktemp -d)
/usr/bin/accelctl --run-dir "$t/run" libvirt install --hooks-dir "$t/hooks" --conf "$t/accel-qemu.conf" 2>/dev/null
grep -q 'exec /usr/bin/accelctl libvirt hook' "$t/hooks/qemu.d/accel"
grep -q "run-dir = \"$t/run\"" "$t/accel-qemu.conf"
/usr/bin/accelctl libvirt uninstall --hooks-dir "$t/hooks" --conf "$t/accel-qemu.conf" 2>/dev/null
test ! -e "$t/hooks/qemu.d/accel"
rm -rf "$t"
echo "package: $(basename "$deb") builds, installs and works"
