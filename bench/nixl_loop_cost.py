"""What the NIXL driver thread's polling costs the threads beside it, in one process.

While a transfer is in flight, or a staged transfer's poller is registered (or parked), the driver
thread (transport/nixl_driver.py) polls every `busy_wait_s` (20 us by default): a timed wait, then
its transfers, its notifications and its pollers, in Python. Every poll takes the GIL. A sidecar's
lane thread (a pull's steps, a batch's members) releases the GIL at each CUDA call, lock or socket
call, and may then wait for a poll to end before it goes on.

This script runs a real NixlDriver (a UCX agent, no peer) and a "lane" thread beside it that does
units of Python work, each followed by a call that releases the GIL (as a CUDA launch does), and
reports per row: the lane's time per unit (its slowdown against the driver idle), the driver's
polls per second and the process's CPU. Rows: the driver idle (no poller: it waits 2 ms between
polls), then busy with one poller at several poll periods.

    PYTHONPATH=sidecar:client python bench/nixl_loop_cost.py [--seconds 3] [--unit-us 50] [--periods 0,5,20,100]

Needs nixl (no GPU). Medians of --repeats runs per row.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time

from kv_sidecar.transport.nixl_driver import NixlDriver


def _unit(n: int) -> int:
    """Pure Python work (holds the GIL throughout)."""
    x = 0
    for i in range(n):
        x += i * i % 7
    return x


def _calibrate(unit_us: float) -> int:
    n = 1000
    while True:
        t0 = time.perf_counter()
        _unit(n)
        took = time.perf_counter() - t0
        if took > 0.01:
            return max(1, int(n * unit_us * 1e-6 / took))
        n *= 2


def _row(busy_wait_s: float | None, seconds: float, n: int) -> tuple[float, float, float]:
    """(lane us per unit, driver polls per second, process CPU % of a core) with the driver idle
    (busy_wait_s None) or polling every busy_wait_s."""
    driver = NixlDriver(
        f"loopcost-{time.monotonic_ns()}",
        on_notif=lambda agent, msg: None,
        busy_wait_s=busy_wait_s if busy_wait_s is not None else 20e-6,
    )
    driver.start()
    polls = [0]

    def poller(agent: object) -> bool:
        polls[0] += 1
        return agent is None  # the driver stopping: done

    if busy_wait_s is not None:
        driver.add_poller(poller)
    time.sleep(0.3)
    units = [0]
    stop = threading.Event()

    def lane() -> None:
        while not stop.is_set():
            _unit(n)
            time.sleep(0)  # gives the GIL up, as a CUDA call does
            units[0] += 1

    t = threading.Thread(target=lane)
    c0, p0, t0 = resource.getrusage(resource.RUSAGE_SELF), polls[0], time.perf_counter()
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    c1, p1, t1 = resource.getrusage(resource.RUSAGE_SELF), polls[0], time.perf_counter()
    driver.stop()
    wall = t1 - t0
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    return wall / max(1, units[0]) * 1e6, (p1 - p0) / wall, cpu / wall * 100


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--unit-us", type=float, default=50.0, help="Python work between two GIL releases")
    ap.add_argument("--periods", default="0,5,20,100", help="busy poll periods, us, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = _calibrate(args.unit_us)
    rows: list[tuple[str, list[tuple[float, float, float]]]] = []
    settings: list[tuple[str, float | None]] = [("idle (no poller)", None)]
    settings += [(f"busy, polling every {p} us", float(p) * 1e-6) for p in args.periods.split(",")]
    for _ in range(args.repeats):  # rows interleaved: drift falls on all of them alike
        for k, (name, period) in enumerate(settings):
            if len(rows) <= k:
                rows.append((name, []))
            rows[k][1].append(_row(period, args.seconds, n))
    base = statistics.median(r[0] for r in rows[0][1])
    print(
        f"lane unit {args.unit_us:g} us of Python then a GIL release; {args.seconds:g} s a row, medians of "
        f"{args.repeats}"
    )
    print("| driver | lane us per unit | against idle | driver polls/s | process CPU % |")
    print("|---|---|---|---|---|")
    for name, samples in rows:
        us = statistics.median(s[0] for s in samples)
        polls = statistics.median(s[1] for s in samples)
        cpu = statistics.median(s[2] for s in samples)
        print(f"| {name} | {us:.1f} | {us / base:.2f}x | {polls:,.0f} | {cpu:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
