#!/usr/bin/env python3
"""acceld's QMP proxy next to QEMU itself, with QEMU's own Python client (qemu.qmp).

Usage: proxy_check.py PROXY_SOCKET REFERENCE_SOCKET DRIVE

PROXY_SOCKET: acceld's monitor.sock of a VM whose drive DRIVE is accelerated.
REFERENCE_SOCKET: the QMP socket of a reference VM whose same-size image is a virtio-blk-pci
drive (-blockdev ... node-name=DRIVE -device virtio-blk-pci,id=DRIVE,drive=DRIVE).

Runs the same sequences on both and compares replies field by field (dropping paths, sizes on
disk and counters); then many clients at once with colliding and odd ids, pipelined, one
killed mid-command. Prints one line per check and exits non-zero on the first mismatch.
"""

import asyncio
import json
import socket
import sys

import time

from qemu.qmp import EventListener, ExecuteError, QMPClient

PROXY, REF, DRIVE = sys.argv[1], sys.argv[2], sys.argv[3]
QOM = f"/machine/peripheral/{DRIVE}/virtio-backend"
failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{(': ' + detail) if detail and not ok else ''}")
    if not ok:
        failures.append(name)


async def run(qmp, cmd, args=None):
    """A reply as (kind, value): ('return', v) or ('error', (class, desc))."""
    try:
        return ("return", await qmp.execute(cmd, args))
    except ExecuteError as e:
        return ("error", (e.error_class, str(e)))


def drop(v, keys):
    if isinstance(v, dict):
        return {k: drop(x, keys) for k, x in v.items() if k not in keys}
    if isinstance(v, list):
        return [drop(x, keys) for x in v]
    return v


def entry(reply, key, value):
    kind, v = reply
    if kind != "return":
        return None
    return next((e for e in v if e.get(key) == value), None)


PATHS = {"filename", "file", "actual-size"}


def throttle(iops):
    return {"id": QOM, "bps": 0, "bps_rd": 0, "bps_wr": 0, "iops": iops, "iops_rd": 0,
            "iops_wr": 0}


async def same(name, a, b, cmd, args=None, post=lambda r: r):
    ra, rb = post(await run(a, cmd, args)), post(await run(b, cmd, args))
    check(name, ra == rb, f"\n  proxy     {json.dumps(ra, sort_keys=True)}\n  reference {json.dumps(rb, sort_keys=True)}")
    return ra


async def compare():
    p, r = QMPClient("proxy"), QMPClient("reference")
    await p.connect(PROXY)
    await r.connect(REF)
    check("greeting: QEMU's version", p.greeting.QMP.version == r.greeting.QMP.version,
          f"{p.greeting} vs {r.greeting}")

    def block(reply):
        e = entry(reply, "qdev", QOM)
        return drop(e, PATHS) if e else reply

    await same("query-block: the drive as a virtio-blk drive", p, r, "query-block", post=block)
    # Events while throttling: QEMU sends none for a virtio-blk drive; acceld's own work (its
    # export, filter, switch) must not show either.
    lp, lr = EventListener(), EventListener()
    p.register_listener(lp)
    r.register_listener(lr)
    took = []
    for iops in (100, 250):
        t0 = time.monotonic()
        await same(f"block_set_io_throttle iops={iops} by QOM path", p, r,
                   "block_set_io_throttle", throttle(iops))
        took.append(time.monotonic() - t0)
        await same(f"query-block after the throttle (iops={iops}, group)", p, r,
                   "query-block", post=block)
    t0 = time.monotonic()
    await same("block_set_io_throttle all zero: no throttle", p, r, "block_set_io_throttle",
               throttle(0))
    took.append(time.monotonic() - t0)
    await same("query-block after clearing (no group)", p, r, "query-block", post=block)
    await asyncio.sleep(0.5)
    ep = [e["event"] for e in lp.history]
    er = [e["event"] for e in lr.history]
    check("events during the throttle sequence as QEMU's", ep == er, f"proxy {ep} reference {er}")
    p.remove_listener(lp)
    r.remove_listener(lr)
    print(f"throttle through the proxy, switch included: set {took[0]*1e3:.0f} ms, "
          f"retune {took[1]*1e3:.0f} ms, clear {took[2]*1e3:.0f} ms (Proxmox allows 5 s)")
    check("throttle answers well inside Proxmox's 5 s", max(took) < 5.0, str(took))

    missing = throttle(5)
    del missing["iops_rd"]
    await same("block_set_io_throttle without iops_rd", p, r, "block_set_io_throttle", missing)
    wrong = throttle(5)
    wrong["bps"] = "x"
    await same("block_set_io_throttle bps of the wrong type", p, r, "block_set_io_throttle",
               wrong)
    for args in ({**throttle(5), "id": "nope"}, {**throttle(5), "id": DRIVE},
                 {k: v for k, v in {**throttle(5), "device": DRIVE}.items() if k != "id"}):
        await same(f"block_set_io_throttle id/device={args.get('id', args.get('device'))}",
                   p, r, "block_set_io_throttle", args)

    def stats_keys(reply):
        e = entry(reply, "qdev", QOM)
        if not e:
            return reply
        return {k: sorted(v) if isinstance(v, dict) else v
                for k, v in drop(e, {"parent"}).items()} | {"stats": sorted(e["stats"])}

    await same("query-blockstats: the drive's entry, same fields", p, r, "query-blockstats",
               post=stats_keys)
    kind, st = await run(p, "query-blockstats")
    e = entry((kind, st), "qdev", QOM) or {}
    check("query-blockstats: acceld's counters (the guest has read and written)",
          e.get("stats", {}).get("wr_operations", 0) > 0
          and e.get("stats", {}).get("rd_bytes", 0) > 0, json.dumps(e.get("stats")))
    # A VM snapshot never silently leaves the accelerated drive out: it is in QEMU's block
    # layer first, so QEMU answers as for the virtio-blk drive (raw: no internal snapshots).
    for hmp in ("savevm s1", "loadvm s1", "delvm s1"):
        await same(f"HMP {hmp}", p, r, "human-monitor-command", {"command-line": hmp})

    async def job(qmp, cmd, args):
        lis = EventListener(("JOB_STATUS_CHANGE",))
        qmp.register_listener(lis)
        reply = await run(qmp, cmd, args)
        for _ in range(200):
            jobs = await qmp.execute("query-jobs")
            j = next((x for x in jobs if x["id"] == args["job-id"]), None)
            if j is None or j["status"] == "concluded":
                break
            await asyncio.sleep(0.05)
        await run(qmp, "job-dismiss", {"id": args["job-id"]})
        await asyncio.sleep(0.2)
        qmp.remove_listener(lis)
        states = [e["data"]["status"] for e in lis.history]
        return reply, drop(j, {"current-progress", "total-progress"}), states

    # QEMU leaves a VM stopped (restore-vm) after a failed loadvm, as with virtio-blk: run it
    # again.
    st = await p.execute("query-status")
    if st["status"] in ("paused", "restore-vm"):
        await p.execute("cont")
    sargs = {"job-id": "snap1", "tag": "s1", "vmstate": DRIVE, "devices": [DRIVE]}
    jp, jr = await job(p, "snapshot-save", sargs), await job(r, "snapshot-save", sargs)
    check("snapshot-save: reply, job result and its states as QEMU's", jp == jr,
          f"\n  proxy     {jp}\n  reference {jr}")
    await same("an unknown command", p, r, "no-such-command")
    await same("qmp_capabilities again", p, r, "qmp_capabilities")
    kind, ex = await run(p, "query-block-exports")
    check("acceld's own exports are hidden", kind == "return"
          and not any(x["id"].startswith("accel-") for x in ex), json.dumps(ex))
    await same("query-iothreads: acceld's iothread hidden", p, r, "query-iothreads")
    kind, objs = await run(p, "qom-list", {"path": "/objects"})
    check("qom-list /objects: acceld's objects hidden", kind == "return"
          and not any(o["name"].startswith("accel-") for o in objs), json.dumps(objs))
    await p.disconnect()
    await r.disconnect()


def raw_session(path, lines):
    """Raw socket: the greeting, then each line's reply (events skipped)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    f = s.makefile("rb")
    json.loads(f.readline())
    out = []
    for line in lines:
        s.sendall(line.encode() + b"\n")
        while True:
            m = json.loads(f.readline())
            if "event" not in m:
                out.append(m)
                break
    s.close()
    return out


def raw_checks():
    seq = [
        '{"execute":"query-status","id":1}',
        '[1,2]',
        '{"execute":"qmp_capabilities","id":{"x":[1,2]}}',
        '{"execute":"query-name","id":null}',
        '{"execute":"query-name","id":"a","extra":1}',
        '{"arguments":{}}',
        'bad',
        '{"execute":"query-name"}',
    ]
    a, b = raw_session(PROXY, seq), raw_session(REF, seq)
    for line, x, y in zip(seq, a, b):
        check(f"raw {line}", x == y, f"\n  proxy     {x}\n  reference {y}")


async def many_clients():
    """8 clients at once, all using qemu.qmp's ids (__qmp#00001, ...), each pipelining 40
    commands: every reply reaches its sender, in order (qemu.qmp checks the ids)."""
    async def one(n):
        c = QMPClient(f"c{n}")
        await c.connect(PROXY)
        names = ["query-status", "query-block", "query-name", "query-blockstats"]
        replies = await asyncio.gather(*(c.execute(names[i % 4]) for i in range(40)))
        await c.disconnect()
        return all(
            (isinstance(v, dict) and "status" in v) if i % 4 == 0 else
            (isinstance(v, list)) if i % 4 in (1, 3) else isinstance(v, dict)
            for i, v in enumerate(replies))
    ok = await asyncio.gather(*(one(n) for n in range(8)))
    check("8 clients x 40 pipelined commands, colliding ids", all(ok), str(ok))


def killed_client():
    """A client that sends a throttle and goes away before the answer: the command still runs,
    and the next client is served."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(PROXY)
    f = s.makefile("rb")
    f.readline()
    s.sendall(b'{"execute":"qmp_capabilities"}\n')
    f.readline()
    s.sendall((json.dumps({"execute": "block_set_io_throttle", "arguments": throttle(77)})
               + "\n").encode())
    s.close()


async def after_kill():
    c = QMPClient("after")
    await c.connect(PROXY)
    for _ in range(100):
        blk = await c.execute("query-block")
        e = next((x for x in blk if x.get("qdev") == QOM), {})
        if e.get("inserted", {}).get("iops") == 77:
            break
        await asyncio.sleep(0.05)
    check("a killed client's throttle still applies; others are served",
          e.get("inserted", {}).get("iops") == 77, json.dumps(e))
    await c.execute("block_set_io_throttle", throttle(0))
    await c.disconnect()


async def main():
    await compare()
    raw_checks()
    await many_clients()
    killed_client()
    await after_kill()
    c = QMPClient("final")
    await c.connect(PROXY)
    st = await c.execute("query-status")
    check("the accelerated VM runs at the end", st["status"] == "running", json.dumps(st))
    await c.disconnect()
    print(f"RESULT: {'PASS' if not failures else 'FAIL ' + ', '.join(failures)}")
    sys.exit(1 if failures else 0)


asyncio.run(main())
