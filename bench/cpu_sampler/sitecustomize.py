"""Probes of bench processes: put this folder first on PYTHONPATH and set either or both of

KVS_CPU_PROFILE=PREFIX: where a process's threads spend their CPU. py-spy here counts a thread asleep
in `time.sleep` or on a lock as busy, so its profiles show wall time, not CPU. This runs every
`threading.Thread` under its own cProfile with the thread's CPU clock as the timer, and writes the
merged stats (marshal, as `pstats.Stats(FILE)` reads them) to PREFIX.PID.ROLE every 5 s and at exit.
cProfile's own cost inflates call-heavy code; compare shares within one run, not with unprofiled runs.

KVS_GC_PROBE=PREFIX: how long the process's garbage collections take (a collection holds the GIL: a
full one stops every thread). Every collection is timed (gc.callbacks); PREFIX.PID.ROLE (JSON) gets,
every 2 s and at exit, per generation the count, total and longest pause in ms, every collection
(seconds after start, generation, ms), and how many objects the collector tracks and has frozen.
"""

from __future__ import annotations

import atexit
import cProfile
import gc
import json
import marshal
import os
import sys
import threading
import time
from collections.abc import Callable


def _dump_every(prefix: str, period_s: float, write: Callable[[str], None], name: str) -> None:
    """`write(path)` to PREFIX.PID.ROLE (through a temporary file) every `period_s` and at exit."""

    def dump() -> None:
        role = "sidecar" if "serve" in sys.argv else "other"  # argv is set only after site runs
        path = f"{prefix}.{os.getpid()}.{role}"
        write(f"{path}.tmp")
        os.replace(f"{path}.tmp", path)

    def dumper() -> None:
        while True:
            time.sleep(period_s)
            dump()

    threading.Thread(target=dumper, name=name, daemon=True).start()
    atexit.register(dump)


def _start(prefix: str) -> None:
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(prof)
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    def stats() -> dict:
        merged: dict = {}
        with lock:
            current = list(profiles)
        for prof in current:
            prof.snapshot_stats()  # reads the entries without disabling the thread's profile
            for func, (cc, nc, tt, ct, callers) in prof.stats.items():
                if func in merged:
                    a = merged[func]
                    joined = dict(a[4])
                    for k, v in callers.items():
                        old = joined.get(k)
                        joined[k] = v if old is None else tuple(x + y for x, y in zip(old, v, strict=True))
                    merged[func] = (a[0] + cc, a[1] + nc, a[2] + tt, a[3] + ct, joined)
                else:
                    merged[func] = (cc, nc, tt, ct, dict(callers))
        return merged

    def write(path: str) -> None:
        with open(path, "wb") as out:
            marshal.dump(stats(), out)

    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    _dump_every(prefix, 5.0, write, "cpu-profile-dump")  # a dump costs the process ~50 ms of CPU


def _gc_probe(prefix: str) -> None:
    by_gen = {g: [0, 0.0, 0.0] for g in range(3)}  # count, total s, longest s
    events: list[tuple[float, int, float]] = []  # every collection: seconds after start, generation, ms
    born, started = time.perf_counter(), [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        s = by_gen[info["generation"]]
        s[0] += 1
        s[1] += took
        s[2] = max(s[2], took)
        if len(events) < 200_000:
            events.append((round(started[0] - born, 3), info["generation"], round(took * 1e3, 3)))

    def write(path: str) -> None:
        out: dict[str, object] = {
            f"gen{g}": {"count": c, "total_ms": round(t * 1e3, 3), "longest_ms": round(m * 1e3, 3)}
            for g, (c, t, m) in by_gen.items()
        }
        out["full"] = [(t, ms) for t, g, ms in events if g == 2]
        out["events"] = events
        out["tracked"] = len(gc.get_objects())
        out["frozen"] = gc.get_freeze_count()
        with open(path, "w") as f:
            json.dump(out, f)

    gc.callbacks.append(timed)
    _dump_every(prefix, 2.0, write, "gc-probe")


if os.environ.get("KVS_CPU_PROFILE"):
    if sys.version_info >= (3, 12):
        # 3.12's cProfile sits on sys.monitoring, one profiler per process: the second thread's
        # enable() raises and that thread dies, which hangs the process being measured.
        raise SystemExit("KVS_CPU_PROFILE needs Python 3.11 (a cProfile per thread)")
    _start(os.environ["KVS_CPU_PROFILE"])
if os.environ.get("KVS_GC_PROBE"):
    _gc_probe(os.environ["KVS_GC_PROBE"])
