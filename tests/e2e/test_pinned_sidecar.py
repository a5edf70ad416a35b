"""`SidecarProcess.pin` (refengine/procs.py), which benchmarks use to give each sidecar cores of its own
(bench/ring_latency.py --pin): every thread of the process is moved, not only its main thread (what one
`sched_setaffinity` call does), and threads it starts afterwards inherit the cores."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux, 2 cores"
)


def _threads(pid: int) -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


def test_every_thread_of_a_pinned_sidecar_runs_on_its_cores_and_later_ones_too() -> None:
    cores = {sorted(os.sched_getaffinity(0))[-1]}
    sc = SidecarProcess("pinned")
    try:
        before = _threads(sc.proc.pid)
        assert len(before) > 1 and any(cpus != cores for cpus in before.values())
        sc.pin(cores)
        assert all(cpus == cores for cpus in _threads(sc.proc.pid).values())
        # Calls side by side make the sidecar start threads (gRPC's pool grows with calls in flight).
        with ThreadPoolExecutor(8) as pool:
            clients = [SidecarClient(sc.socket, lane=False) for _ in range(8)]
            try:
                list(pool.map(lambda c: c.status(), clients))
            finally:
                for c in clients:
                    c.close()
        after = _threads(sc.proc.pid)
        assert set(after) - set(before), "no thread started after the pin: nothing inherited was checked"
        assert all(cpus == cores for cpus in after.values())
    finally:
        sc.stop()
