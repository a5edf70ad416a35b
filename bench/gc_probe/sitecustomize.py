"""How long a process's garbage collections take, for bench runs: put this folder first on PYTHONPATH
and set KVS_GC_PROBE=PREFIX.

Every collection is timed (gc.callbacks) by generation; PREFIX.PID.ROLE gets, every 2 s and at exit,
per generation the count, the total and the longest pause in ms, when each full collection ran
(seconds after start) and its pause, and how many objects the collector tracks and has frozen. A collection holds the GIL: a pause of a full one stops every thread.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time


def _start(prefix: str) -> None:
    stats = {g: [0, 0.0, 0.0] for g in range(3)}  # count, total s, longest s
    started: list[float] = [0.0]
    born = time.perf_counter()
    full: list[tuple[float, float]] = []  # each full collection: seconds after start, its pause in ms
    events: list[tuple[float, int, float]] = []  # every collection: seconds after start, generation, ms

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        s = stats[info["generation"]]
        s[0] += 1
        s[1] += took
        s[2] = max(s[2], took)
        if info["generation"] == 2:
            full.append((round(started[0] - born, 2), round(took * 1e3, 1)))
        if len(events) < 200_000:
            events.append((round(started[0] - born, 3), info["generation"], round(took * 1e3, 3)))

    gc.callbacks.append(timed)

    def dump() -> None:
        role = "sidecar" if "serve" in sys.argv else "other"  # argv is set only after site runs
        out = {
            f"gen{g}": {"count": c, "total_ms": round(t * 1e3, 3), "longest_ms": round(m * 1e3, 3)}
            for g, (c, t, m) in stats.items()
        }
        out["full"] = full
        out["events"] = events
        out["tracked"] = len(gc.get_objects())
        out["frozen"] = gc.get_freeze_count()
        path = f"{prefix}.{os.getpid()}.{role}"
        with open(f"{path}.tmp", "w") as f:
            json.dump(out, f)
        os.replace(f"{path}.tmp", path)

    def dumper() -> None:
        while True:
            time.sleep(2.0)
            dump()

    threading.Thread(target=dumper, name="gc-probe", daemon=True).start()
    atexit.register(dump)
    # Experiments: KVS_GC_FREEZE_AFTER_S=S freezes what exists S seconds after start (gc.freeze);
    # KVS_GC_THRESHOLD=A,B,C sets the collector's thresholds.
    if thresholds := os.environ.get("KVS_GC_THRESHOLD"):
        gc.set_threshold(*(int(x) for x in thresholds.split(",")))
    if after := os.environ.get("KVS_GC_FREEZE_AFTER_S"):

        def freeze() -> None:
            time.sleep(float(after))
            gc.collect()
            gc.freeze()

        threading.Thread(target=freeze, name="gc-freeze", daemon=True).start()


if _prefix := os.environ.get("KVS_GC_PROBE"):
    _start(_prefix)
