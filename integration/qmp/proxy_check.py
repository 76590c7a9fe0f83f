#!/usr/bin/env python3
"""acceld's QMP proxy next to QEMU itself, with QEMU's own Python client (qemu.qmp).

Usage: proxy_check.py PROXY_SOCKET REFERENCE_SOCKET DRIVE SCRATCH_DIR

PROXY_SOCKET: acceld's monitor.sock of a VM whose drive DRIVE is accelerated.
REFERENCE_SOCKET: the QMP socket of a reference VM whose same-size image is a virtio-blk-pci
drive (-blockdev ... node-name=DRIVE -device virtio-blk-pci,id=DRIVE,drive=DRIVE).

SCRATCH_DIR: where each side's overlays, backups and mirror targets go (p-* and r-*).
ACCELCTL (environment): the accelctl command line of the proxy's acceld (with --run-dir), to
read which engine serves the drive.

Runs the same sequences on both and compares replies, job states and events field by field
(dropping paths, sizes on disk and counters); then many clients at once with colliding and
odd ids, pipelined, while the drive switches, one killed mid-command. Prints one line per
check and exits non-zero if any differs.
"""

import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time

from qemu.qmp import EventListener, QMPClient
from qmpcheck import PATHS, both, check, drop, run, verdict

PROXY, REF, DRIVE, SCRATCH = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ACCELCTL = shlex.split(os.environ.get("ACCELCTL", ""))
PROXY_OOB = False
# Graph changes (external snapshots, commits, backups, mirrors) through the proxy; on by
# default. ACCEL_QMP_GRAPH_TESTS=0 leaves them out (to bisect a failure elsewhere).
GRAPH = os.environ.get("ACCEL_QMP_GRAPH_TESTS", "1") != "0"
QOM = f"/machine/peripheral/{DRIVE}/virtio-backend"
# The drive's size after block_resize (from 64 MiB); the Rust side checks that the guest sees it.
RESIZED = 96 << 20
def entry(reply, key, value):
    kind, v = reply
    if kind != "return":
        return None
    return next((e for e in v if e.get(key) == value), None)


def engine():
    """The engine serving the proxy's drive, from acceld's status."""
    if not ACCELCTL:
        return None
    st = json.loads(subprocess.run(ACCELCTL + ["status", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
    for vm in st["vms"]:
        for d in vm["drives"]:
            if d["drive"] == DRIVE:
                return d["engine"], d.get("data_node")
    return None


async def wait_engine(want, timeout=20.0):
    t0 = time.monotonic()
    while True:
        e = engine()
        if e is None or e[0] == want or time.monotonic() - t0 > timeout:
            return e
        await asyncio.sleep(0.1)


def side(qmp, name):
    """A per-side path in the scratch dir."""
    return os.path.join(SCRATCH, ("p-" if qmp.name == "proxy" else "r-") + name)


JOB_EVENTS = ("JOB_STATUS_CHANGE", "BLOCK_JOB_READY", "BLOCK_JOB_COMPLETED",
              "BLOCK_JOB_CANCELLED", "BLOCK_JOB_ERROR", "BLOCK_JOB_PENDING")


def drop_drain_pauses(states):
    """A drain of a job's nodes pauses a running job for a moment (running, paused, running):
    whether one happens depends on timing (QEMU's own graph work, where the export runs), not
    on the command, so such a pause is left out of the comparison."""
    out, i = [], 0
    while i < len(states):
        if states[i] == "paused" and states[i + 1:i + 2] == ["running"] and out[-1:] == ["running"]:
            i += 2
            continue
        out.append(states[i])
        i += 1
    return out


async def job_run(qmp, cmd, args, jid, at_ready=None):
    """Starts a job, answers READY with at_ready (a (cmd, args) pair), waits until it is gone
    (or concluded: then dismisses it). Returns the reply, the job's states, the block-job
    events and the reply to at_ready."""
    lis = EventListener(JOB_EVENTS)
    qmp.register_listener(lis)
    reply = await run(qmp, cmd, args)
    ready_reply = None
    t0 = time.monotonic()
    while reply[0] == "return" and time.monotonic() - t0 < 120:
        jobs = await qmp.execute("query-jobs")
        j = next((x for x in jobs if x["id"] == jid), None)
        if j is None:
            break
        if j["status"] == "concluded":
            await run(qmp, "job-dismiss", {"id": jid})
            break
        if j["status"] == "ready" and at_ready and ready_reply is None:
            ready_reply = await run(qmp, *at_ready)
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    qmp.remove_listener(lis)
    states = [e["data"]["status"] for e in lis.history if e["event"] == "JOB_STATUS_CHANGE"]
    states = drop_drain_pauses(states)
    others = [e["event"] for e in lis.history if e["event"] != "JOB_STATUS_CHANGE"]
    return reply, states, others, ready_reply


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
    # Capabilities: the proxy offers oob only when acceld's own connection has it (off for
    # now, see supervisor/vm.rs OOB_UPSTREAM), so only the version is compared.
    check("greeting: QEMU's version", p.greeting.QMP.version == r.greeting.QMP.version,
          f"{p.greeting} vs {r.greeting}")
    global PROXY_OOB
    PROXY_OOB = "oob" in p.greeting.QMP.capabilities

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

    # Management's own throttle group: object-add, join it, qom-set its limits (Proxmox's
    # way of retuning), all-zero limits (the drive stays a member, acceld goes direct), leave.
    await same("object-add throttle-group tg0", p, r, "object-add",
               {"qom-type": "throttle-group", "id": "tg0", "limits": {"iops-total": 500}})
    await same("block_set_io_throttle into group tg0", p, r, "block_set_io_throttle",
               {**throttle(300), "group": "tg0"})
    await same("query-block in group tg0", p, r, "query-block", post=block)
    for limits, label in (({"iops-total": 700}, "700"), ({}, "nothing (absent fields stay)"),
                          ({"iops-total": 0}, "all zero"),
                          ({"iops-total": 400, "bps-write": 1 << 30}, "400 and bps")):
        await same(f"qom-set tg0 limits {label}", p, r, "qom-set",
                   {"path": "tg0", "property": "limits", "value": limits})
        await same(f"query-block after qom-set {label}", p, r, "query-block", post=block)
        await same(f"qom-get tg0 limits after {label}", p, r, "qom-get",
                   {"path": "tg0", "property": "limits"})
        zero = label == "all zero"
        e = await wait_engine("direct" if zero else "qemu")
        check(f"acceld's engine after qom-set {label}",
              e is None or e[0] == ("direct" if zero else "qemu"), str(e))
    await same("block_set_io_throttle all zero leaves tg0", p, r, "block_set_io_throttle",
               throttle(0))
    await same("query-block after leaving tg0", p, r, "query-block", post=block)
    await same("object-del tg0 right after", p, r, "object-del", {"id": "tg0"})
    await same("qom-set of a group no one has", p, r, "qom-set",
               {"path": "tg0", "property": "limits", "value": {"iops-total": 1}})
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
    if GRAPH:
        await block_jobs(p, r)
    else:
        print("skip snapshot/commit/backup/mirror checks: ACCEL_QMP_GRAPH_TESTS=0")
    await nbd_server(p, r)
    await fd_passing(p, r)
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


def block_entry(reply):
    e = entry(reply, "qdev", QOM)
    return drop(e, PATHS) if e else reply


async def block_jobs(p, r):
    """External snapshot and active commit, a backup job, mirrors cancelled and completed,
    stats across the switches, unknown names: the same on the accelerated drive as on the
    virtio-blk one."""
    async def stats(q):
        return entry(await run(q, "query-blockstats"), "qdev", QOM)["stats"]

    before = await stats(p)
    # External snapshot (what Proxmox and libvirt do with blockdev-add + blockdev-snapshot,
    # and older tools with blockdev-snapshot-sync).
    await both("blockdev-snapshot-sync node-name=D: reply", p, r, lambda q: run(
        q, "blockdev-snapshot-sync", {"node-name": DRIVE, "snapshot-file": side(q, "ov1.qcow2"),
                                      "snapshot-node-name": "ov1", "format": "qcow2"}))
    await same("query-block on the overlay (qcow2, backing chain)", p, r, "query-block",
               post=block_entry)
    e = engine()
    check("the drive is on QEMU's block layer with its data on the overlay",
          e is None or e == ("qemu", "ov1"), str(e))
    await both("block-commit of the active overlay, pivot: reply, states, events", p, r,
               lambda q: job_run(q, "block-commit", {"job-id": "c1", "device": "ov1"}, "c1",
                                 ("job-complete", {"id": "c1"})))
    await same("query-block after the commit (the raw image again)", p, r, "query-block",
               post=block_entry)
    e = await wait_engine("direct")
    check("after the commit the drive goes back to direct", e is None or e == ("direct", None),
          str(e))
    # transaction with blockdev-snapshot on a blockdev-add'ed overlay (libvirt's way).
    async def overlay_tx(q):
        f = side(q, "ov2.qcow2")
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", f, "64M"], check=True)
        a = await run(q, "blockdev-add", {"driver": "qcow2", "node-name": "ov2", "backing": None,
                                          "file": {"driver": "file", "filename": f}})
        b = await run(q, "transaction", {"actions": [
            {"type": "blockdev-snapshot", "data": {"node": DRIVE, "overlay": "ov2"}}]})
        c = block_entry(await run(q, "query-block"))
        return a, b, c
    await both("blockdev-add overlay + transaction blockdev-snapshot", p, r, overlay_tx)
    await both("block-commit ov2 into D with job-complete", p, r, lambda q: job_run(
        q, "block-commit", {"job-id": "c2", "device": "ov2"}, "c2", ("job-complete", {"id": "c2"})))
    await both("blockdev-del of the committed overlay", p, r,
               lambda q: run(q, "blockdev-del", {"node-name": "ov2"}))
    await wait_engine("direct")
    # A backup job to a file.
    await both("drive-backup to a file: reply, states, events", p, r, lambda q: job_run(
        q, "drive-backup", {"job-id": "b1", "device": DRIVE, "sync": "full",
                            "target": side(q, "backup.raw"), "format": "raw"}, "b1"))
    check("the backup file has the drive's size",
          os.path.getsize(side(p, "backup.raw")) == os.path.getsize(side(r, "backup.raw")),
          f"{os.path.getsize(side(p, 'backup.raw'))} vs {os.path.getsize(side(r, 'backup.raw'))}")
    e = await wait_engine("direct")
    check("after the backup the drive goes back to direct", e is None or e[0] == "direct", str(e))

    # A slow backup, and the VM stopped and continued while it runs: QEMU's stop waits for
    # acceld's rings, whose requests QEMU's NBD server answers from acceld's iothread (a
    # main-loop export would deadlock here).
    during = {}

    async def slow_backup(q):
        a = await run(q, "drive-backup", {"job-id": "b2", "device": DRIVE, "sync": "full",
                                          "target": side(q, "backup2.raw"), "format": "raw",
                                          "speed": 1 << 20})
        if q is p:
            # The reference VM stays in prelaunch (its guest never runs): stop only here.
            lis = EventListener(("STOP", "RESUME"))
            q.register_listener(lis)
            during["stop"] = await asyncio.wait_for(run(q, "stop"), 20)
            during["status"] = (await q.execute("query-status"))["status"]
            during["cont"] = await run(q, "cont")
            await asyncio.sleep(0.2)
            q.remove_listener(lis)
            during["events"] = [e["event"] for e in lis.history]
        j = await job_run(q, "block-job-set-speed", {"device": "b2", "speed": 0}, "b2")
        return a, j[0]
    await both("drive-backup at 1 MiB/s: replies", p, r, slow_backup)
    check("stop and cont during the backup: replies, paused, STOP and RESUME",
          (during.get("stop"), during.get("status"), during.get("cont"), during.get("events"))
          == (("return", {}), "paused", ("return", {}), ["STOP", "RESUME"]), str(during))
    e = await wait_engine("direct")
    check("after the slow backup the drive goes back to direct", e is None or e[0] == "direct",
          str(e))

    async def mirror(q, tag, at_ready):
        f = side(q, tag + ".raw")
        with open(f, "wb") as fh:
            fh.truncate(64 << 20)
        a = await run(q, "blockdev-add", {"driver": "raw", "node-name": tag,
                                          "file": {"driver": "file", "filename": f}})
        j = await job_run(q, "blockdev-mirror", {"job-id": "j" + tag, "device": DRIVE,
                                                 "target": tag, "sync": "full"},
                          "j" + tag, at_ready)
        return a, j, block_entry(await run(q, "query-block"))
    await both("blockdev-mirror cancelled at READY", p, r, lambda q: mirror(
        q, "m1", ("block-job-cancel", {"device": "jm1"})))
    await both("blockdev-del of the cancelled mirror's target", p, r,
               lambda q: run(q, "blockdev-del", {"node-name": "m1"}))
    e = await wait_engine("direct")
    check("after the cancelled mirror the drive goes back to direct",
          e is None or e == ("direct", None), str(e))
    after = await stats(p)
    check("query-blockstats: acceld's counters only grow across the switches",
          all(after[k] >= before[k] for k in ("rd_operations", "wr_operations", "rd_bytes",
                                              "wr_bytes", "flush_operations")),
          f"{before} -> {after}")
    # query-nodes: the node entries, as QEMU lists them.
    await same("query-blockstats query-nodes=true: the nodes listed", p, r, "query-blockstats",
               {"query-nodes": True},
               post=lambda rep: sorted(e.get("node-name", "") for e in rep[1])
               if rep[0] == "return" else rep)
    # HMP info block / info blockstats: the drive's text as QEMU prints it.
    async def info_block(q):
        text = await q.execute("human-monitor-command", {"command-line": "info block"})
        para = next((x for x in text.split("\r\n\r\n") if x.startswith(DRIVE + ":")), "")
        lines = para.split("\r\n")
        if lines:
            lines[0] = lines[0].split(" ")[0] + " " + lines[0].split(" ")[-1]
        return lines
    await both("HMP info block: the drive's paragraph", p, r, info_block)

    async def info_stats(q):
        text = await q.execute("human-monitor-command", {"command-line": "info blockstats"})
        return sorted({tuple(w.split("=")[0] for w in line.split()) for line in
                       text.split("\r\n") if line.startswith(": ")})
    await both("HMP info blockstats: the drive's line", p, r, info_stats)
    # Unknown names: QEMU's own texts.
    for cmd, args in (
            ("blockdev-snapshot-sync", {"node-name": "nope", "snapshot-file": "/nonexistent/x",
                                        "format": "qcow2"}),
            ("drive-backup", {"device": "nope", "target": "/nonexistent/x", "sync": "full",
                              "job-id": "x"}),
            ("blockdev-mirror", {"device": "nope", "target": "nope2", "sync": "full",
                                 "job-id": "x"}),
            ("block-commit", {"device": "nope", "job-id": "x"}),
            ("block-dirty-bitmap-add", {"node": "nope", "name": "b"}),
            ("block-job-cancel", {"device": "nope"}),
            ("job-complete", {"id": "nope"}),
            ("block_set_io_throttle", {**throttle(5), "id": "/machine/peripheral/nope/virtio-backend"})):
        await same(f"{cmd} on an unknown name", p, r, cmd, args)
    # Dirty bitmaps on the drive (they keep it on QEMU's block layer while they exist).
    await same("block-dirty-bitmap-add on D", p, r, "block-dirty-bitmap-add",
               {"node": DRIVE, "name": "bm0"})
    await same("block-dirty-bitmap-remove on D", p, r, "block-dirty-bitmap-remove",
               {"node": DRIVE, "name": "bm0"})


async def mirror_complete(p, r):
    """A mirror completed (the pivot): the device's data is on the target, and the guest keeps
    writing to it."""
    async def mirror(q):
        f = side(q, "m2.raw")
        with open(f, "wb") as fh:
            fh.truncate(RESIZED)
        a = await run(q, "blockdev-add", {"driver": "raw", "node-name": "m2",
                                          "file": {"driver": "file", "filename": f}})
        j = await job_run(q, "blockdev-mirror", {"job-id": "jm2", "device": DRIVE,
                                                 "target": "m2", "sync": "full"},
                          "jm2", ("job-complete", {"id": "jm2"}))
        return a, j, block_entry(await run(q, "query-block"))
    await both("blockdev-mirror completed (pivot to the target)", p, r, mirror)
    e = engine()
    check("after the pivot the drive serves the target through QEMU's block layer",
          e is None or e == ("qemu", "m2"), str(e))


async def resize(p, r):
    """block_resize of the drive the guest keeps writing to: QEMU's replies and query-block,
    errors included; the drive goes back to direct at its new size."""
    args = {"node-name": DRIVE, "size": RESIZED}
    t0 = time.monotonic()
    rp = await run(p, "block_resize", args)
    t1 = time.monotonic()
    rr = await run(r, "block_resize", args)
    t2 = time.monotonic()
    check("block_resize node-name=D to 96 MiB: reply", rp == rr, f"{rp} vs {rr}")
    print(f"info block_resize: {(t1 - t0) * 1000:.0f} ms through the proxy (hold, export off "
          f"and back, guest told), {(t2 - t1) * 1000:.0f} ms on the reference")
    await same("query-block after the resize (virtual-size)", p, r, "query-block",
               post=block_entry)
    await same("block_resize to the same size again", p, r, "block_resize",
               {"node-name": DRIVE, "size": RESIZED})
    await same("block_resize with a negative size", p, r, "block_resize",
               {"node-name": DRIVE, "size": -1})
    await same("block_resize device=D (a qdev id, not a BlockBackend)", p, r, "block_resize",
               {"device": DRIVE, "size": RESIZED})
    await same("block_resize of an unknown node", p, r, "block_resize",
               {"node-name": "nope", "size": RESIZED})
    e = await wait_engine("direct")
    check("after the resize the drive goes back to direct", e is None or e == ("direct", None),
          str(e))
    kind, blk = await run(p, "query-block")
    e = entry((kind, blk), "qdev", QOM) or {}
    check("query-block shows the new size on the direct engine",
          e.get("inserted", {}).get("image", {}).get("virtual-size") == RESIZED, json.dumps(e))


async def stream_into_overlay(p, r):
    """An external snapshot of the data node (the mirror's target by now), then block-stream
    into the overlay: QEMU puts a copy-on-read filter over it while the job runs (into
    acceld's iothread, where its export is fixed); afterwards the overlay holds all the data
    and the drive is served from it."""
    async def seq(q):
        top = entry(await run(q, "query-block"), "qdev", QOM)["inserted"]["node-name"]
        a = await run(q, "blockdev-snapshot-sync", {
            "node-name": top, "snapshot-file": side(q, "ov3.qcow2"),
            "snapshot-node-name": "ov3", "format": "qcow2"})
        j = await job_run(q, "block-stream", {"job-id": "s1", "device": "ov3"}, "s1")
        return a, j, block_entry(await run(q, "query-block"))
    await both("blockdev-snapshot-sync + block-stream into the overlay: replies, states, events",
               p, r, seq)
    e = engine()
    check("after the stream the drive is served from the overlay through QEMU's block layer",
          e is None or e == ("qemu", "ov3"), str(e))


def drive_status():
    st = json.loads(subprocess.run(ACCELCTL + ["status", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
    return next((vm["vm"], d) for vm in st["vms"] for d in vm["drives"] if d["drive"] == DRIVE)


async def persistent_pin(p):
    """An operator's persistent pin to direct (`accelctl accelerate --pin`) survives a hold:
    a dirty bitmap added and removed through the proxy moves the drive to QEMU's block layer
    and back, and the pin is still there, still persistent."""
    if not ACCELCTL:
        return
    vm, _ = drive_status()
    subprocess.run(ACCELCTL + ["accelerate", vm, DRIVE, "--pin"], check=True,
                   capture_output=True)
    a = await run(p, "block-dirty-bitmap-add", {"node": DRIVE, "name": "bm1"})
    b = await run(p, "block-dirty-bitmap-remove", {"node": DRIVE, "name": "bm1"})
    _, d = drive_status()
    check("a persistent pin to direct is still persistent after a hold",
          (a[0], b[0], d["pin"], d["pin_persistent"]) == ("return", "return", "direct", True),
          f"{a} {b} pin={d['pin']} persistent={d['pin_persistent']}")
    subprocess.run(ACCELCTL + ["accelerate", vm, DRIVE], check=True, capture_output=True)
    e = await wait_engine("direct")
    check("after the pinned hold the drive is direct", e is None or e[0] == "direct", str(e))


async def nbd_server(p, r):
    """Management's own NBD server and export next to acceld's, on a throttled drive."""
    await same("block_set_io_throttle before the NBD server", p, r, "block_set_io_throttle",
               throttle(400))
    await same("nbd-server-stop with none running", p, r, "nbd-server-stop")
    await same("block-export-add without a server", p, r, "block-export-add",
               {"type": "nbd", "id": "e1", "node-name": DRIVE})
    lp, lr = EventListener(("BLOCK_EXPORT_DELETED",)), EventListener(("BLOCK_EXPORT_DELETED",))
    p.register_listener(lp)
    r.register_listener(lr)
    await both("nbd-server-start on management's socket", p, r, lambda q: run(
        q, "nbd-server-start", {"addr": {"type": "unix", "data": {"path": side(q, "nbd.sock")}}}))
    await both("nbd-server-start again", p, r, lambda q: run(
        q, "nbd-server-start", {"addr": {"type": "unix", "data": {"path": side(q, "nbd2.sock")}}}))
    await same("nbd-server-start without addr", p, r, "nbd-server-start", {})
    await same("block-export-add type=nbd on D", p, r, "block-export-add",
               {"type": "nbd", "id": "e1", "node-name": DRIVE})
    await same("a second export named like D", p, r, "block-export-add",
               {"type": "nbd", "id": "e2", "node-name": DRIVE})
    await same("query-block-exports: management's export only", p, r, "query-block-exports")
    await same("block-export-del of acceld's export", p, r, "block-export-del",
               {"id": "accel-" + DRIVE})

    async def nbd_info(q):
        out = subprocess.run(["qemu-img", "info", "--output=json",
                              f"nbd+unix:///{DRIVE}?socket={side(q, 'nbd.sock')}"],
                             capture_output=True, text=True, timeout=30)
        return out.returncode, json.loads(out.stdout).get("virtual-size") if out.stdout else out.stderr
    await both("qemu-img info through management's NBD server", p, r, nbd_info)
    await same("nbd-server-stop", p, r, "nbd-server-stop")
    await asyncio.sleep(0.5)
    ep = [e["data"]["id"] for e in lp.history]
    er = [e["data"]["id"] for e in lr.history]
    check("BLOCK_EXPORT_DELETED for management's export only", ep == er, f"{ep} vs {er}")
    p.remove_listener(lp)
    r.remove_listener(lr)
    await same("query-block-exports after the stop", p, r, "query-block-exports")
    check("management's socket is gone after the stop", not os.path.exists(side(p, "nbd.sock")))
    await same("clear the throttle", p, r, "block_set_io_throttle", throttle(0))
    e = await wait_engine("direct")
    check("after the NBD server and the throttle the drive goes back to direct",
          e is None or e[0] == "direct", str(e))


async def fd_passing(p, r):
    """Descriptors by SCM_RIGHTS for getfd and add-fd, QEMU's answers without one, and two
    proxy clients using the same fd name without clashing."""
    async def getfd(q, name):
        with open(side(q, "fd-" + name), "wb") as f:
            q.send_fd_scm(f.fileno())
            return await run(q, "getfd", {"fdname": name})
    await both("getfd with a descriptor", p, r, lambda q: getfd(q, "f1"))
    await same("getfd without a descriptor", p, r, "getfd", {"fdname": "f2"})
    await same("closefd of the name", p, r, "closefd", {"fdname": "f1"})
    await same("closefd of a name no longer there", p, r, "closefd", {"fdname": "f1"})

    async def addfd(q):
        with open(side(q, "fd-set"), "wb") as f:
            q.send_fd_scm(f.fileno())
            kind, v = await run(q, "add-fd", {"opaque": "mine"})
        if kind != "return":
            return kind, v
        sets = await q.execute("query-fdsets")
        mine = next((s for s in sets if s["fdset-id"] == v["fdset-id"]), None)
        gone = await run(q, "remove-fd", {"fdset-id": v["fdset-id"]})
        return sorted(v), [sorted(x) for x in mine["fds"]] if mine else None, \
            [x.get("opaque") for x in mine["fds"]] if mine else None, gone
    await both("add-fd with a descriptor, query-fdsets, remove-fd", p, r, addfd)
    await same("add-fd without a descriptor", p, r, "add-fd", {})
    c1, c2 = QMPClient("c1"), QMPClient("c2")
    await c1.connect(PROXY)
    await c2.connect(PROXY)
    a = await getfd_as(c1, "same")
    b = await getfd_as(c2, "same")
    x = await run(c1, "closefd", {"fdname": "same"})
    y = await run(c2, "closefd", {"fdname": "same"})
    check("two clients' fd names do not clash", (a, b, x, y) == (("return", {}),) * 4,
          str((a, b, x, y)))
    await c1.disconnect()
    await c2.disconnect()


async def getfd_as(q, name):
    with open(os.path.join(SCRATCH, "fd-" + q.name), "wb") as f:
        q.send_fd_scm(f.fileno())
        return await run(q, "getfd", {"fdname": name})


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
    # Out of band, as QEMU offers it (when the proxy offers it too).
    if not PROXY_OOB:
        print("skip exec-oob checks: the proxy offers no oob (acceld's connection has it off)")
        return
    oob = [
        '{"execute":"qmp_capabilities","arguments":{"enable":["oob"]},"id":0}',
        '{"exec-oob":"query-status","id":"o1"}',
        '{"exec-oob":"query-yank","id":"o2"}',
        '{"exec-oob":"migrate-pause","id":"o3"}',
        '{"exec-oob":5,"id":"o4"}',
        '{"execute":"query-name","id":"o5"}',
    ]
    a, b = raw_session(PROXY, oob), raw_session(REF, oob)
    # The accelerated VM has the tests' side monitor too (compat_monitor1), not acceld's.
    a[2]["return"] = [y for y in a[2].get("return", []) if y["id"] != "compat_monitor1"]
    for line, x, y in zip(oob, a, b):
        check(f"raw oob {line}", x == y, f"\n  proxy     {x}\n  reference {y}")


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
    async def switcher():
        c = QMPClient("switcher")
        await c.connect(PROXY)
        for iops in (300, 0, 600, 0):
            await c.execute("block_set_io_throttle", throttle(iops))
        await c.disconnect()
        return True
    ok = await asyncio.gather(*(one(n) for n in range(8)), switcher())
    check("8 clients x 40 pipelined commands, colliding ids, while the drive switches",
          all(ok), str(ok))


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
    p, r = QMPClient("proxy"), QMPClient("reference")
    await p.connect(PROXY)
    await r.connect(REF)
    await resize(p, r)
    await persistent_pin(p)
    if GRAPH:
        await mirror_complete(p, r)
        await stream_into_overlay(p, r)
    await p.disconnect()
    await r.disconnect()
    c = QMPClient("final")
    await c.connect(PROXY)
    st = await c.execute("query-status")
    check("the accelerated VM runs at the end", st["status"] == "running", json.dumps(st))
    await c.disconnect()
    verdict()


asyncio.run(main())
