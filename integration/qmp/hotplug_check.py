#!/usr/bin/env python3
"""A disk hot-plugged and unplugged through acceld's QMP proxy next to QEMU itself, with
QEMU's own Python client (qemu.qmp), in the sequence libvirt and Proxmox send.

Usage: hotplug_check.py PROXY_SOCKET REFERENCE_SOCKET SCRATCH_DIR

Both VMs have a free PCIe root port `hp1` and a guest that waits for /dev/vdb, writes 1 MiB
to it and reads it back, then waits for it to go. On each: blockdev-add of a file node and a
raw node, device_add of a virtio-blk-pci device on the raw node (with a serial), the same
device_add again, query-block, the guest's I/O counted, device_del and the DEVICE_DELETED
events, blockdev-del of both nodes, query-named-block-nodes. Replies and events are compared
field by field (paths and counters dropped). ACCELCTL (environment): the proxy's acceld's
accelctl command line, to check the engine serving the disk and that the drive ends.
"""

import asyncio
import json
import os
import shlex
import subprocess
import sys
import time

from qemu.qmp import EventListener, QMPClient
from qmpcheck import PATHS, both, check, drop, run, verdict

PROXY, REF, SCRATCH = sys.argv[1], sys.argv[2], sys.argv[3]
ACCELCTL = shlex.split(os.environ.get("ACCELCTL", ""))
QOM = "/machine/peripheral/hp0/virtio-backend"


def drives():
    st = json.loads(subprocess.run(ACCELCTL + ["status", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
    return {d["drive"]: d for vm in st["vms"] for d in vm["drives"]}


async def wait_drive(want, timeout=30.0):
    """acceld's hp0 on engine `want` (None: no such drive); what it was at the end."""
    t0 = time.monotonic()
    while True:
        d = drives().get("hp0")
        now = d["engine"] if d else None
        if now == want or time.monotonic() - t0 > timeout:
            return now
        await asyncio.sleep(0.05)


def image(q):
    path = os.path.join(SCRATCH, ("p-" if q.name == "proxy" else "r-") + "hp.raw")
    with open(path, "wb") as f:
        f.truncate(32 << 20)
    return path


async def io_seen(q, timeout=90.0):
    """The guest's writes and reads of the plugged disk, as query-blockstats counts them."""
    t0 = time.monotonic()
    while True:
        st = await q.execute("query-blockstats")
        e = next((x for x in st if x.get("qdev") == QOM), None)
        s = e["stats"] if e else {}
        if s.get("wr_bytes", 0) >= 1 << 20 and s.get("rd_bytes", 0) >= 1 << 20:
            return True
        if time.monotonic() - t0 > timeout:
            return s
        await asyncio.sleep(0.1)


async def main():
    p, r = QMPClient("proxy"), QMPClient("reference")
    await p.connect(PROXY)
    await r.connect(REF)
    await both("blockdev-add of the file node", p, r, lambda q: run(q, "blockdev-add", {
        "driver": "file", "filename": image(q), "node-name": "hp0-file",
        "cache": {"direct": True, "no-flush": False}, "discard": "unmap"}))
    await both("blockdev-add of the raw node", p, r, lambda q: run(q, "blockdev-add", {
        "driver": "raw", "file": "hp0-file", "node-name": "hp0-fmt", "discard": "unmap",
        "cache": {"direct": True, "no-flush": False}}))
    dev = {"driver": "virtio-blk-pci", "id": "hp0", "drive": "hp0-fmt", "bus": "hp1",
           "serial": "HP-QMP-1"}
    await both("device_add of a virtio-blk-pci disk", p, r, lambda q: run(q, "device_add", dev))
    if ACCELCTL:
        e = await wait_drive("direct")
        check("acceld serves the plugged disk on the direct engine", e == "direct", str(e))
    await both("device_add with the same id again", p, r,
               lambda q: run(q, "device_add", dev))

    async def block(q):
        kind, v = await run(q, "query-block")
        if kind != "return":
            return kind, v
        e = next((x for x in v if x.get("qdev") == QOM), None)
        return drop(e, PATHS | {"node-name"}) if e else None
    await both("query-block of the plugged disk", p, r, block)
    await both("the guest wrote and read 1 MiB (query-blockstats)", p, r, io_seen)

    async def unplug(q):
        lis = EventListener(("DEVICE_DELETED",))
        q.register_listener(lis)
        reply = await run(q, "device_del", {"id": "hp0"})
        events = []
        try:
            while True:
                ev = await asyncio.wait_for(lis.get(), 60)
                events.append({"event": ev["event"], "data": ev.get("data")})
                if ev.get("data", {}).get("device") == "hp0":
                    break
        except asyncio.TimeoutError:
            events.append("timeout")
        q.remove_listener(lis)
        # Management deletes the nodes as soon as it sees the event (libvirt does).
        dels = [await run(q, "blockdev-del", {"node-name": n}) for n in ("hp0-fmt", "hp0-file")]
        nodes = [n["node-name"] for n in await q.execute("query-named-block-nodes")
                 if n["node-name"].startswith("hp0")]
        return reply, events, dels, nodes
    await both("device_del, DEVICE_DELETED, blockdev-del of both nodes", p, r, unplug)
    if ACCELCTL:
        e = await wait_drive(None, 5.0)
        check("acceld's drive ended with the device", e is None, str(e))
    ch = await p.execute("query-chardev")
    check("no chardev of the drive is left", not any(c["label"] == "hp0-sock" for c in ch),
          json.dumps(ch))
    await both("device_del of a device no longer there", p, r,
               lambda q: run(q, "device_del", {"id": "hp0"}))
    await p.disconnect()
    await r.disconnect()
    verdict()


asyncio.run(main())
