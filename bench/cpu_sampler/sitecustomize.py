"""Where a process's threads spend their CPU, for bench runs: put this folder first on PYTHONPATH and
set KVS_CPU_PROFILE=PREFIX.

py-spy here counts a thread asleep in `time.sleep` or on a lock as busy, so its profiles show wall
time, not CPU. This runs every `threading.Thread` under its own cProfile with the thread's CPU clock
as the timer, and writes the merged stats (marshal, as `pstats.Stats(FILE)` reads them) to
PREFIX.PID.ROLE every 5 s and at exit. cProfile's own cost inflates call-heavy code; compare
shares within one run, not with unprofiled runs.
"""

from __future__ import annotations

import atexit
import cProfile
import marshal
import os
import sys
import threading
import time


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

    def dump() -> None:
        merged: dict = {}
        with lock:
            current = list(profiles)
        for prof in current:
            prof.snapshot_stats()  # reads the entries without disabling the thread's profile
            for func, (cc, nc, tt, ct, callers) in prof.stats.items():  # type: ignore[attr-defined]
                if func in merged:
                    a = merged[func]
                    joined = dict(a[4])
                    for k, v in callers.items():
                        old = joined.get(k)
                        joined[k] = v if old is None else tuple(x + y for x, y in zip(old, v, strict=True))
                    merged[func] = (a[0] + cc, a[1] + nc, a[2] + tt, a[3] + ct, joined)
                else:
                    merged[func] = (cc, nc, tt, ct, dict(callers))
        role = "sidecar" if "serve" in sys.argv else "other"  # argv is set only after site runs
        path = f"{prefix}.{os.getpid()}.{role}"
        with open(f"{path}.tmp", "wb") as out:
            marshal.dump(merged, out)
        os.replace(f"{path}.tmp", path)

    def dumper() -> None:
        while True:
            time.sleep(5.0)  # a dump costs the process ~50 ms of CPU
            dump()

    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    threading.Thread(target=dumper, name="cpu-profile-dump", daemon=True).start()
    atexit.register(dump)


if os.environ.get("KVS_CPU_PROFILE"):
    if sys.version_info >= (3, 12):
        # 3.12's cProfile sits on sys.monitoring, one profiler per process: the second thread's
        # enable() raises and that thread dies, which hangs the process being measured.
        raise SystemExit("KVS_CPU_PROFILE needs Python 3.11 (a cProfile per thread)")
    _start(os.environ["KVS_CPU_PROFILE"])
