#!/bin/bash
# Builds the accel Debian package (amd64) with dpkg-deb: acceld, accelctl, the emulator wrapper
# accel-qemu, acceld's systemd unit (restart on failure) and default config, the docs.
# Usage: packaging/deb/build.sh [OUT_DIR]   (default: target/debian). Prints the .deb's path.
# Then: dpkg -i accel_*.deb && accelctl libvirt install   (docs/libvirt.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/target/debian}
version=$(awk -F'"' '/^version =/{print $2; exit}' "$root/Cargo.toml")
cd "$root"
cargo build --release -q -p acceld -p accelctl
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
pkg="$stage/accel"
install -D -m 755 target/release/acceld "$pkg/usr/bin/acceld"
install -D -m 755 target/release/accelctl "$pkg/usr/bin/accelctl"
install -D -m 755 target/release/accel-qemu "$pkg/usr/bin/accel-qemu"
# The release profile keeps line tables for backtraces; the package ships stripped binaries.
strip --strip-debug "$pkg/usr/bin/acceld" "$pkg/usr/bin/accelctl" "$pkg/usr/bin/accel-qemu"
install -D -m 644 packaging/deb/acceld.service "$pkg/lib/systemd/system/acceld.service"
install -D -m 644 packaging/deb/acceld.toml "$pkg/etc/accel/acceld.toml"
for f in README.md docs/libvirt.md docs/operator-guide.md docs/qmp-proxy.md docs/migration.md; do
  install -D -m 644 "$f" "$pkg/usr/share/doc/accel/$(basename "$f")"
done
printf 'accel\n\nLicense: Apache-2.0 OR BSD-3-Clause\n' > "$pkg/usr/share/doc/accel/copyright"
mkdir -p "$pkg/DEBIAN"
size=$(du -sk "$pkg" | cut -f1)
cat > "$pkg/DEBIAN/control" <<CONTROL
Package: accel
Version: $version
Architecture: amd64
Maintainer: accel developers <accel@localhost>
Installed-Size: $size
Depends: libc6, qemu-system-x86 (>= 1:10.0)
Recommends: libvirt-daemon-driver-qemu, qemu-utils
Section: admin
Priority: optional
Description: transparent virtio-blk accelerator for QEMU
 acceld serves every guest disk as a vhost-user-blk device, straight from the raw
 file (io_uring, zero-copy) or through the VM's own QEMU block layer when a disk
 needs it (throttling, qcow2, snapshots, block jobs, migration), switching live.
 accel-qemu is the emulator wrapper for libvirt domains; accelctl is the operator
 CLI (accelctl libvirt install sets up the libvirt hook).
CONTROL
echo /etc/accel/acceld.toml > "$pkg/DEBIAN/conffiles"
cat > "$pkg/DEBIAN/postinst" <<'POSTINST'
#!/bin/sh
set -e
if [ "$1" = configure ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
  systemctl enable acceld.service || true
  systemctl restart acceld.service || true
fi
POSTINST
cat > "$pkg/DEBIAN/prerm" <<'PRERM'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  if [ "$1" = remove ]; then
    systemctl disable acceld.service || true
  fi
  systemctl stop acceld.service || true
fi
PRERM
cat > "$pkg/DEBIAN/postrm" <<'POSTRM'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
POSTRM
chmod 755 "$pkg/DEBIAN/postinst" "$pkg/DEBIAN/prerm" "$pkg/DEBIAN/postrm"
mkdir -p "$out"
deb="$out/accel_${version}_amd64.deb"
dpkg-deb --root-owner-group --build "$pkg" "$deb" >/dev/null
echo "$deb"
