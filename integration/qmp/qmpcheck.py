"""What the QMP checks (proxy_check.py, hotplug_check.py) share: one line per check, QEMU's
replies as comparable values, a sequence run on both sides and compared, the final verdict."""

import json
import sys

from qemu.qmp import ExecuteError

failures = []

# Fields that name each side's own files and sizes on disk.
PATHS = {"filename", "file", "actual-size", "backing_file", "backing-filename",
         "full-backing-filename"}


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


async def both(name, p, r, fn):
    """fn(qmp) on each side; the results compared."""
    a, b = await fn(p), await fn(r)
    check(name, a == b, f"\n  proxy     {json.dumps(a, sort_keys=True)}\n  reference {json.dumps(b, sort_keys=True)}")
    return a


def verdict():
    """RESULT line, and the exit status."""
    print(f"RESULT: {'PASS' if not failures else 'FAIL ' + ', '.join(failures)}")
    sys.exit(1 if failures else 0)
