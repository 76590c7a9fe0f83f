#!/bin/bash
# Two libvirt hosts on one machine, for cross-host tests, the demo and people.
#
# Each host is a long-lived process (its "init") in its own mount, UTS, network and pid
# namespaces, with a private /run, its own /etc/libvirt (its own host_uuid, libvirtd
# listening on TCP), /var/lib/libvirt, /var/log/libvirt, /var/cache/libvirt, /etc/accel and
# /etc/hosts, its own hostname (hosta, hostb), and a veth pair between the two network
# namespaces (10.77.0.1 and 10.77.0.2). Both see the same /var/tmp, so DIR/shared is storage
# shared by both at the same path. Each runs its own virtlogd, libvirtd and `acceld run`, with
# `accelctl libvirt install` done inside it before libvirtd starts.
#
#   two-hosts.sh up              start both (stops an earlier pair first)
#   two-hosts.sh down            stop both (their QEMUs and acceld die with them)
#   two-hosts.sh exec A|B CMD... run CMD inside a host (all its namespaces)
#   two-hosts.sh pid A|B         the host init's pid (/proc/PID/root is the host's file view)
#   two-hosts.sh status          whether each host runs and answers virsh
#   two-hosts.sh acceld A|B stop|start   stop or start a host's acceld
#
# DIR is $ACCEL_HOSTS_DIR or /var/tmp/accel-hosts: DIR/A and DIR/B hold each host's
# directories and logs (acceld.log, libvirtd.log), DIR/shared the shared storage. The binaries
# are target/debug's unless ACCEL_BIN_DIR names another directory (acceld, accelctl,
# accel-qemu). Needs root, iproute2, util-linux, libvirt and QEMU (integration/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${ACCEL_HOSTS_DIR:-/var/tmp/accel-hosts}
BIN=${ACCEL_BIN_DIR:-$ROOT/target/debug}
NET=10.77.0

ip_of() { [ "$1" = A ] && echo $NET.1 || echo $NET.2; }
name_of() { [ "$1" = A ] && echo hosta || echo hostb; }
uuid_of() { [ "$1" = A ] && echo 0a5e1a00-0000-4000-8000-00000000000a || echo 0a5e1a00-0000-4000-8000-00000000000b; }
pid_of() { cat "$DIR/$1/init.pid" 2>/dev/null || true; }
alive() { local p; p=$(pid_of "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

# A directory's skeleton (directories to depth 2, same owners and modes), no files.
skeleton() { # from to
  mkdir -p "$2"
  (cd "$1" && find . -maxdepth 2 -type d) | while read -r d; do
    mkdir -p "$2/$d"
    chown --reference="$1/$d" "$2/$d"
    chmod --reference="$1/$d" "$2/$d"
  done
}

prepare() { # A|B
  local h=$1 d=$DIR/$1
  rm -rf "$d"
  mkdir -p "$d"/{etc-accel,run-serial}
  cp -a /etc/libvirt "$d/etc-libvirt"
  rm -rf "$d/etc-libvirt/hooks" "$d/etc-libvirt/qemu/"*.xml "$d/etc-libvirt/qemu/networks/autostart"
  cat >> "$d/etc-libvirt/libvirtd.conf" <<EOF

# two-hosts.sh: host $(name_of "$h")
host_uuid = "$(uuid_of "$h")"
listen_tls = 0
listen_tcp = 1
listen_addr = "$(ip_of "$h")"
auth_tcp = "none"
log_outputs = "1:file:/var/log/libvirt/libvirtd.log"
log_filters = "1:qemu.qemu_migration 1:qemu.qemu_hotplug 3:*"
EOF
  # Two libvirtds in one cgroup tree would name their QEMUs' cgroups alike (qemu-1-NAME).
  # DIR/shared is the hosts' shared storage (both see the same files, as over NFS from
  # one of them): libvirt then lets a domain migrate without copying its disks.
  printf '\n# two-hosts.sh\ncgroup_controllers = [ ]\nshared_filesystems = [ "%s" ]\n' "$DIR/shared" >> "$d/etc-libvirt/qemu.conf"
  skeleton /var/lib/libvirt "$d/var-lib-libvirt"
  skeleton /var/log/libvirt "$d/var-log-libvirt"
  mkdir -p "$d/var-cache-libvirt"
  # QEMU's capabilities, probed once on this machine: the same binary on both hosts.
  cp -a /var/cache/libvirt/. "$d/var-cache-libvirt/" 2>/dev/null || true
  printf '127.0.0.1 localhost\n%s hosta\n%s hostb\n' "$(ip_of A)" "$(ip_of B)" > "$d/hosts"
}

# Inside host $1: starts its acceld (log appended to DIR/H/acceld.log), waits for its socket.
start_acceld() {
  local d=$DIR/$1
  ACCELD_LOG=${ACCELD_LOG:-info} setsid "$BIN/acceld" run --run-dir /run/accel >> "$d/acceld.log" 2>&1 < /dev/null &
  echo $! > "$d/acceld.pid"
  for _ in $(seq 200); do [ -S /run/accel/acceld.sock ] && break; sleep 0.05; done
}

# Runs as the host's init (pid 1 of its pid namespace), in its own mount namespace.
init() { # A|B
  local h=$1 d=$DIR/$1
  hostname "$(name_of "$h")"
  mount --bind "$d/etc-libvirt" /etc/libvirt
  mkdir -p /etc/accel 2>/dev/null || true
  mount --bind "$d/etc-accel" /etc/accel
  mount --bind "$d/var-lib-libvirt" /var/lib/libvirt
  mount --bind "$d/var-log-libvirt" /var/log/libvirt
  mount --bind "$d/var-cache-libvirt" /var/cache/libvirt
  mount --bind "$d/hosts" /etc/hosts
  mount -t tmpfs -o mode=0755 tmpfs /run
  mkdir -p /run/lock /run/accel-serial
  ip link set lo up
  # The parent moves our end of the veth pair in and addresses it; wait for it.
  for _ in $(seq 200); do [ -e "$d/net-ready" ] && break; sleep 0.05; done
  start_acceld "$h"
  "$BIN/accelctl" libvirt install --apparmor-dir "$d/no-apparmor" > "$d/install.log" 2>&1
  virtlogd -d
  libvirtd -d --listen
  for _ in $(seq 300); do virsh -c qemu:///system version > /dev/null 2>&1 && break; sleep 0.1; done
  touch "$d/up"
  trap 'exit 0' TERM INT
  while :; do sleep 3600 & wait $!; done
}

up() {
  down
  mkdir -p "$DIR/shared"
  chmod 0777 "$DIR/shared"
  for h in A B; do
    prepare $h
    unshare --mount --uts --net --pid --fork --mount-proc --propagation private \
      "$(readlink -f "$0")" __init $h > "$DIR/$h/init.log" 2>&1 < /dev/null &
    echo $! > "$DIR/$h/unshare.pid"
  done
  # The init's pid as seen from here: unshare's child.
  for h in A B; do
    local u p=""
    u=$(cat "$DIR/$h/unshare.pid")
    for _ in $(seq 200); do
      p=$(pgrep -P "$u" | head -1 || true)
      [ -n "$p" ] && break
      sleep 0.05
    done
    [ -n "$p" ] || { echo "host $h did not start: $(cat "$DIR/$h/init.log")" >&2; exit 1; }
    echo "$p" > "$DIR/$h/init.pid"
  done
  ip link del accel-veth-a 2>/dev/null || true
  ip link add accel-veth-a netns "$(pid_of A)" type veth peer name accel-veth-b netns "$(pid_of B)"
  for h in A B; do
    local dev
    dev=accel-veth-$(echo $h | tr AB ab)
    nsenter -t "$(pid_of $h)" -n ip addr add "$(ip_of $h)/24" dev "$dev"
    nsenter -t "$(pid_of $h)" -n ip link set "$dev" up
    touch "$DIR/$h/net-ready"
  done
  for h in A B; do
    for _ in $(seq 600); do [ -e "$DIR/$h/up" ] && break; alive $h || break; sleep 0.1; done
    [ -e "$DIR/$h/up" ] || { echo "host $h is not up: $(cat "$DIR/$h/init.log" "$DIR/$h/install.log" 2>/dev/null)" >&2; exit 1; }
  done
  echo "two hosts up: hosta $(ip_of A) (init $(pid_of A)), hostb $(ip_of B) (init $(pid_of B)); shared storage $DIR/shared"
}

down() {
  for h in A B; do
    if alive $h; then
      local p
      p=$(pid_of $h)
      # Domains first, so libvirt and acceld see their QEMUs end; then the init.
      nsenter -t "$p" -a sh -c 'for d in $(virsh -q list --name 2>/dev/null); do virsh destroy "$d" >/dev/null 2>&1; done' || true
      kill -TERM "$p" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
      kill -KILL "$p" 2>/dev/null || true
    fi
    rm -f "$DIR/$h/init.pid" "$DIR/$h/up" "$DIR/$h/net-ready"
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  __init) init "$2" ;;
  exec)
    h=${2:?A or B}; shift 2
    alive "$h" || { echo "host $h is not up (two-hosts.sh up)" >&2; exit 1; }
    exec nsenter -t "$(pid_of "$h")" -a --wd=/ "$@"
    ;;
  pid) alive "${2:?A or B}" && pid_of "$2" ;;
  acceld)
    # two-hosts.sh acceld A|B stop|start: a host without its acceld (failure tests), then back.
    h=${2:?A or B}
    alive "$h" || { echo "host $h is not up" >&2; exit 1; }
    case "${3:-}" in
      stop)
        p=$(cat "$DIR/$h/acceld.pid")
        nsenter -t "$(pid_of "$h")" -a kill -TERM "$p"
        for _ in $(seq 200); do nsenter -t "$(pid_of "$h")" -a kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
        ;;
      start) nsenter -t "$(pid_of "$h")" -a "$(readlink -f "$0")" __acceld "$h" ;;
      *) echo "acceld A|B stop|start" >&2; exit 2 ;;
    esac
    ;;
  __acceld) start_acceld "$2" ;;
  status)
    for h in A B; do
      if alive $h && nsenter -t "$(pid_of $h)" -a virsh -c qemu:///system version > /dev/null 2>&1; then
        echo "$h: up ($(name_of $h), $(ip_of $h), init $(pid_of $h))"
      else
        echo "$h: down"
      fi
    done
    ;;
  *) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
