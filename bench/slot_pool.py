"""What a staging ring's slot pool costs when pulls queue for its slots, in one process (no sidecars).

C threads share a pool of S slots (the default ring: 4). Each round a thread takes one slot, holds
it while it "transfers" (HOLD_US asleep, as a pull waits for its GPU work and the wire, plus
WORK_US of Python holding the GIL, as its host steps do) and gives it back. With C > S the others
queue in `SlotPool.acquire`, as pulls on one GPU did in the concurrent rows of bench/gpu_latency.py.
The table gives rounds per second and the process's CPU time per round: whatever the queue costs
beyond the work itself. It is printed and written to docs/benchmarks.md (--no-write: printed only).

    python bench/slot_pool.py [--baseline REV] [--threads 1,4,16] [--rounds 300] [--repeats 3] [--no-write]

--baseline REV runs REV's `SlotPool` (its server/staged_protocol.py, loaded from git) too, the two
alternating run by run, so that both see the same machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import baseline  # noqa: E402
from report import gpus, write_section  # noqa: E402

SECTION = "Slot pool under queueing (bench/slot_pool.py)"
MODULE = "sidecar/kv_sidecar/server/staged_protocol.py"


def load_pool(ref: str | None) -> Any:
    """`SlotPool` of this tree, or of git revision `ref` (exported as bench/baseline.py does)."""
    if ref is None:
        sys.path.insert(0, str(ROOT / "sidecar"))
        from kv_sidecar.dataplane.staged_protocol import SlotPool

        return SlotPool
    path = Path(baseline.export(ref)) / MODULE
    spec = importlib.util.spec_from_file_location("staged_protocol_base", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.SlotPool


def forever() -> float:
    return 60.0


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def run(
    pool_cls: Any, slots: int, threads: int, rounds: int, hold_us: float, work_us: float
) -> dict[str, float]:
    pool = pool_cls(slots)
    waits: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)

    def worker() -> None:
        mine = []
        start.wait()
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = pool.acquire(1, forever)
            mine.append(time.perf_counter() - t0)
            time.sleep(hold_us * 1e-6)
            spin(work_us)
            pool.release(got)
        with lock:
            waits.extend(mine)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = threads * rounds
    assert pool.free == slots and pool.waiting == 0
    return {
        "rounds_per_s": n / wall,
        "cpu_us_per_round": cpu / n * 1e6,
        "wait_p50_ms": statistics.median(waits) * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="REV", help="also run this revision's SlotPool, alternating")
    ap.add_argument("--threads", default="1,4,16")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=300, help="rounds per thread")
    ap.add_argument("--hold-us", type=float, default=1000, help="asleep while holding a slot")
    ap.add_argument("--work-us", type=float, default=100, help="Python holding the GIL per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    pools = {"this tree": load_pool(None)}
    if args.baseline:
        pools[args.baseline] = load_pool(args.baseline)
    setting = (
        f"slots {args.slots}, {args.rounds} rounds per thread, hold {args.hold_us:g} us asleep + "
        f"{args.work_us:g} us of Python; median of {args.repeats} runs, alternating"
    )
    lines = [
        "| threads | SlotPool | rounds/s | CPU us per round | acquire wait p50 ms |",
        "|---|---|---|---|---|",
    ]
    print(setting + "\n\n" + "\n".join(lines), flush=True)
    for c in (int(x) for x in args.threads.split(",")):
        results: dict[str, list[dict[str, float]]] = {name: [] for name in pools}
        for _ in range(args.repeats):
            for name, cls in pools.items():
                results[name].append(run(cls, args.slots, c, args.rounds, args.hold_us, args.work_us))
        for name, rs in results.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            lines.append(
                f"| {c} | {name} | {med['rounds_per_s']:.0f} | {med['cpu_us_per_round']:.1f} | "
                f"{med['wait_p50_ms']:.2f} |"
            )
            print(lines[-1], flush=True)
    if not args.no_write:
        command = "python bench/slot_pool.py " + " ".join(sys.argv[1:])
        machine = (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()} ({gpus()})"
        )
        body = (
            f"Command: `{command.strip()}` · machine: {machine} · date: {datetime.date.today()}\n\n"
            f"In one process, C threads share a {args.slots}-slot pool. Each round a thread takes a slot, "
            f"sleeps {args.hold_us:g} µs holding it (a pull waiting on its GPU work and the wire), spins "
            f"{args.work_us:g} µs of Python (its host steps) and gives the slot back. "
            + ("The two trees' pools alternate run by run. " if args.baseline else "")
            + f"Medians of {args.repeats} runs.\n\n"
            + "\n".join(lines)
            + "\n"
        )
        write_section(ROOT / "docs" / "benchmarks.md", SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
