"""Host cost of a staged transfer's copies on one GPU, step by step, in one process (no sidecars).

A one-block staged pull pays two copy launches (the source's gather, the
reader's scatter) and their set-up; bench/trace_pull.py shows them on the
critical path. This script times each host step alone, so that the trace's
spans can be split into what the steps cost and what waiting for the GIL adds:

    python bench/launch_cost.py [--iters 300] [--blocks 1] [--busy] [--beside-us 30]

--busy adds a thread that wakes every 0.1 ms and runs a little Python, as the
sidecar's NIXL driver thread does while it polls for notifications. --beside-us N
adds one that sleeps 20 us and then holds the GIL for N us, over and over, as
the driver does while a transfer is in flight (its turn polls transfers,
notifications and the staged pollers). Every CUDA call gives the GIL up; with
such a thread beside it, taking it back can wait for the thread's turn to end.
--gap-us N sleeps N us before each timed call: a sidecar's pulls come one at a time,
each after an idle stretch, not in a hot loop. --members K also times the ids of a source's
transfer of K requests (a PullBatch's staged members as one Push): uploaded at once from the host,
as StagedCopies does, against joining on the transfer's stream the ids each request uploaded at its
Publish (a record_stream each, then a cat), as it did until 2026-11-30. Medians in microseconds;
needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_latency import MODEL

from kv_sidecar.dataplane.chunk_copies import GpuCopies
from kv_sidecar.execute import gpu
from kv_sidecar.plan.blocks import check_copy
from kv_sidecar.plan.spec import EngineSpec


def timed(fn: Callable[[], Any], iters: int, gap_s: float = 0.0) -> tuple[float, Any]:
    out: Any = None
    xs = []
    for _ in range(iters):
        if gap_s:
            time.sleep(gap_s)  # idle between calls, as a sidecar is between pulls
        t0 = time.perf_counter()
        out = fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6, out


def main() -> int:
    import numpy as np
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--busy", action="store_true", help="a thread polling every 0.1 ms alongside")
    ap.add_argument("--gap-us", type=float, default=0, help="sleep this long before each timed call")
    ap.add_argument(
        "--beside-us", type=float, default=0, help="a thread holding the GIL N us per 20 us sleep"
    )
    ap.add_argument("--members", type=int, default=16, help="requests of the joined set-up rows (0: none)")
    args = ap.parse_args()
    spec = EngineSpec.from_dict(MODEL | {"num_blocks": 64})
    dev = torch.device("cuda", 0)
    cache = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in spec.rank_tensor_shapes()]
    view = gpu.gpu_rank_view(spec, 0, cache, 0)
    n = args.blocks
    ring = torch.empty(gpu.staging_bytes(spec, n) + 4096, dtype=torch.uint8, device=dev)
    slot = ring.data_ptr()
    ids = list(range(n))
    tokens = n * spec.block_size
    heads = (0, spec.num_kv_heads)
    stop = threading.Event()

    def poller() -> None:
        x = 0
        while not stop.is_set():
            time.sleep(0.0001)
            x = sum(range(50)) + x % 7

    def holder() -> None:
        while not stop.is_set():
            time.sleep(20e-6)
            end = time.perf_counter() + args.beside_us * 1e-6
            while time.perf_counter() < end:
                pass

    if args.busy:
        threading.Thread(target=poller, daemon=True).start()
    if args.beside_us:
        threading.Thread(target=holder, daemon=True).start()
    rows: list[tuple[str, float]] = []

    def staged(into: bool) -> gpu.StagedCopies:
        return gpu.StagedCopies(view, spec, 0, heads, ids, tokens, into_staging=into)

    def add(name: str, fn: Callable[[], Any]) -> Any:
        us, out = timed(fn, args.iters, args.gap_us * 1e-6)
        rows.append((name, us))
        return out

    for _ in range(20):  # warm-up: Triton's compile, the caching allocator, layer tables
        c = GpuCopies(staged(True))
        c.launch(0, tokens, slot)
        c.synchronize()
    add("check_copy", lambda: check_copy(spec, 0, spec, 0, heads, ids, ids, tokens, 0))
    add("ids upload (from_numpy .to)", lambda: torch.from_numpy(np.asarray(ids, np.int32)).to(dev))
    add("arange on device", lambda: torch.arange(n, dtype=torch.int32, device=dev))
    add("cuda Event + record", lambda: torch.cuda.Event().record(torch.cuda.current_stream(dev)))
    add("torch.cuda.Stream()", lambda: torch.cuda.Stream(0))
    s = torch.cuda.Stream(0)

    def contexts() -> None:
        with torch.cuda.device(dev), torch.cuda.stream(s):
            pass

    add("device + stream contexts", contexts)
    add("StagedCopies.__init__ (gather)", lambda: staged(True))
    k = args.members
    if k:
        # A source's Send of k requests of n blocks each; the ids of each went up at its Publish.
        pieces = [gpu.upload_block_ids(ids, 0) for _ in range(k)]

        def joined() -> torch.Tensor:
            stream = torch.cuda.Stream(dev)
            for p in pieces:
                p.record_stream(stream)
            with torch.cuda.stream(stream):
                return torch.cat(pieces)

        add(f"{k} requests' ids: joined on a new stream", joined)
        add(
            f"{k} requests' ids: uploaded at once on a new stream",
            lambda: gpu._upload_ids(ids * k, (), dev, torch.cuda.Stream(dev)),
        )
        add(
            f"StagedCopies.__init__ (gather), {k} requests",
            lambda: gpu.StagedCopies(view, spec, 0, heads, ids * k, k * tokens, into_staging=True),
        )

    firsts: list[float] = []  # a transfer's first launch, then the same chunk again
    agains: list[float] = []

    def first_launch() -> None:
        c = GpuCopies(staged(True))
        t0 = time.perf_counter()
        c.launch(0, tokens, slot)
        firsts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.launch(0, tokens, slot)
        agains.append(time.perf_counter() - t0)
        c.synchronize()

    add("set-up + 2 launches + sync (whole)", first_launch)
    rows.append(("GpuCopies.launch, first of a transfer", statistics.median(firsts) * 1e6))
    rows.append(("GpuCopies.launch, same chunk again", statistics.median(agains) * 1e6))
    sc = staged(True)
    add("_template (a new slot or size)", lambda: sc._template(n, slot))
    tpl = sc._template(n, slot)
    la = tpl.la
    tids = (sc._ids, sc._stage_ids)
    kargs = (n * spec.block_size * la.constexprs["NH"] * la.constexprs["NC"], 0, 0, 0, *la.args[4:])
    grid = (-(-kargs[0] // la.rows), la.planes)
    from kv_sidecar.execute import gpu_kernels

    def raw() -> None:
        with torch.cuda.stream(s):
            gpu_kernels.kv_copy_kernel[grid](
                tpl.anchor, *tpl.tables, *tids, *kargs, **la.constexprs, num_warps=la.num_warps
            )

    add("kernel[grid](...) alone", raw)
    s.synchronize()
    dview = gpu.gpu_rank_view(spec, 0, [torch.zeros_like(t) for t in cache], 0)

    def direct() -> None:  # the form c226751 tried and e317b26 dropped: a pool stream made current
        pool = torch.cuda.Stream(0)
        with torch.cuda.stream(pool):
            gpu.copy_request(view, dview, heads, ids, ids, tokens, synchronize=False)
        pool.synchronize()

    add("gpu-direct copy, a pool stream made current (whole)", direct)
    add(
        "gpu-direct copy on the default stream (whole)",
        lambda: gpu.copy_request(view, dview, heads, ids, ids, tokens),
    )
    add("ids upload, pageable, on a stream", lambda: gpu._upload_ids(ids, ids, dev, s))
    # The ids here are one run (0..n-1): since 2026-11-30 a copy reads them from the device's 0..n-1
    # table. The same copy with the run not looked for uploads them, as every copy did before.
    add("ids in a row, views of the device's table", lambda: gpu._device_ids(ids, ids, dev, s))

    def no_run(ids: np.ndarray) -> int | None:
        return None

    def uploaded_copy() -> None:
        run_start, gpu._run_start = gpu._run_start, no_run
        try:
            gpu.copy_request(view, dview, heads, ids, ids, tokens)
        finally:
            gpu._run_start = run_start

    add("gpu-direct copy on the default stream, ids uploaded (whole)", uploaded_copy)
    add(
        "gpu-direct copy on the default stream, ids in a row (whole)",
        lambda: gpu.copy_request(view, dview, heads, ids, ids, tokens),
    )

    def pinned() -> torch.Tensor:
        host = torch.empty(2 * len(ids), dtype=torch.int32, pin_memory=True)
        host.numpy()[:] = ids + ids
        with torch.cuda.stream(s):
            return host.to(dev, non_blocking=True)

    add("ids upload, pinned + non_blocking, on a stream", pinned)

    stop.set()
    print(
        f"blocks {n}, iters {args.iters}, busy thread {args.busy}, beside {args.beside_us} us, gap {args.gap_us} us: median us"
    )
    print("| step | us |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
