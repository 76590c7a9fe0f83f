#!/bin/bash
# Builds the tiny test guest: Debian's kernel (taken from its package, not installed) and an
# initramfs of busybox-static with the virtio modules. Output: OUT/vmlinuz, OUT/initramfs.cpio.gz.
# The guest runs the shell script passed base64-encoded as `testcmd=` on the kernel command
# line, prints its output on ttyS0, and powers off.
set -euo pipefail
OUT=${1:-$(cd "$(dirname "$0")/.." && pwd)/out}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
if [ -s "$OUT/vmlinuz" ] && [ -s "$OUT/initramfs.cpio.gz" ] && [ "$OUT/initramfs.cpio.gz" -nt "$0" ] \
   && [ "$OUT/initramfs.cpio.gz" -nt "$here/accel-writer.sh" ]; then
  exit 0
fi
for t in busybox apt-get dpkg-deb cpio xz; do
  command -v "$t" >/dev/null || { echo "build.sh: $t is missing (apt-get install busybox-static cpio xz-utils)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$pkg" ] || { echo "build.sh: cannot resolve linux-image-amd64 (run apt-get update)" >&2; exit 1; }
(cd "$work" && apt-get download -q "$pkg" >/dev/null)
dpkg-deb -x "$work"/"$pkg"_*.deb "$work/k"
kver=$(ls "$work/k/lib/modules")
cp "$work/k/boot/vmlinuz-$kver" "$OUT/vmlinuz"

root="$work/root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,mnt,lib/modules}
cp "$(command -v busybox)" "$root/bin/busybox"
install -m 755 "$here/accel-writer.sh" "$root/bin/accel-writer"
for m in virtio_pci_modern_dev virtio_pci_legacy_dev virtio_ring virtio virtio_pci virtio_blk; do
  f=$(find "$work/k/lib/modules/$kver" -name "$m.ko*" | head -1)
  [ -n "$f" ] || { echo "build.sh: module $m not found" >&2; exit 1; }
  case "$f" in
    *.xz) xz -dc "$f" > "$root/lib/modules/$m.ko" ;;
    *) cp "$f" "$root/lib/modules/$m.ko" ;;
  esac
done
cat > "$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in virtio_pci_modern_dev virtio_pci_legacy_dev virtio_ring virtio virtio_pci virtio_blk; do
  insmod /lib/modules/$m.ko 2>/dev/null
done
cmd=$(sed -n 's/.*testcmd=\([^ ]*\).*/\1/p' /proc/cmdline)
echo "$cmd" | base64 -d > /tmp/test.sh
echo "ACCEL-GUEST: booted"
sh /tmp/test.sh
echo "ACCEL-GUEST: exit $?"
sync
poweroff -f
INIT
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$OUT/initramfs.cpio.gz.tmp")
mv "$OUT/initramfs.cpio.gz.tmp" "$OUT/initramfs.cpio.gz"
echo "guest: kernel $kver, initramfs $(du -h "$OUT/initramfs.cpio.gz" | cut -f1) in $OUT"
