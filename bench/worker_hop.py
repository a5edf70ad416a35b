"""What the hand-off to a device worker costs a PullBatch's copies, apart from the sidecar's load.

No sidecar, no engines: one `DataPlane` (its own NIXL agent, as in the sidecar) with two host ranks in
shared memory, and a batch of `--members` one-block host copies (model-shaped blocks, `--block-kib`)
made through `DataPlane.copy_local_all` with `device_workers` off (the copies in this process) and on
(one message to the host's worker process, its answer awaited), alternating, `--iters` times each.
The difference is the hand-off itself: pickling, the pipe both ways, the worker's threads and this
process's answer thread. Under load the sidecar adds its own waits for the GIL on top
(bench/trace_pull.py --batch 16 --sidecar-args="--device-workers=true" shows them).

    python bench/worker_hop.py                       # batches of 1, 4 and 16
    python bench/worker_hop.py --members 16 --iters 400
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from kv_sidecar.config import Settings
from kv_sidecar.dataplane.jobs import LocalCopy, RankKey, RankRead, Tokens
from kv_sidecar.dataplane.plane import DataPlane
from kv_sidecar.dataplane.workers import HOST
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.spec import EngineSpec, Layout, rank_block_bytes
from kv_sidecar.server.engines import shm_tensors
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client.shm import ShmKVCache


class _Go:
    def remaining(self) -> float:
        return 60.0


def _wait_ready(plane: DataPlane, timeout_s: float = 60) -> None:
    """Until the host's worker answers: until then a copy runs in this process (the first copy only
    starts the worker), and the row would time no hand-off."""
    assert plane.workers is not None
    deadline = time.monotonic() + timeout_s
    while plane.workers.ready(HOST) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the host's worker did not answer within {timeout_s:.0f} s")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", default="1,4,16", help="copies per batch (comma-separated)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--block-kib", type=int, default=256, help="bytes of one block, in KiB")
    args = ap.parse_args()
    head_dim = 128
    layers = max(1, args.block_kib * 1024 // (2 * 16 * 8 * head_dim * 2))
    spec = EngineSpec(
        tp_size=1,
        num_layers=layers,
        num_kv_heads=8,
        head_dim=head_dim,
        dtype="bfloat16",
        block_size=16,
        num_blocks=64,
        layout=Layout.FLASH_ATTN_NHD,
    )
    nixl = NixlDriver("worker-hop")
    nixl.start()
    planes = {
        w: DataPlane(replace(Settings(), device_workers="true" if w else "false"), nixl, Metrics())
        for w in (False, True)
    }
    src_key, dst_key = RankKey("p", 0), RankKey("d", 0)
    rows = []
    with (
        ShmKVCache(spec.rank_tensor_shapes(), torch.bfloat16) as src,
        ShmKVCache(spec.rank_tensor_shapes(), torch.bfloat16) as dst,
    ):
        for plane in planes.values():
            plane.attach_host(src_key, spec, shm_tensors(src.handles()))
            plane.attach_host(dst_key, spec, shm_tensors(dst.handles()))
        read = RankRead(dst_key, src_key, (0, spec.num_kv_heads))
        for n in [int(m) for m in args.members.split(",")]:
            jobs = [
                (LocalCopy((read,), Tokens(np.array([i]), np.array([32 + i]), 16, 0), True), _Go())
                for i in range(n)
            ]
            times: dict[bool, list[float]] = {False: [], True: []}
            for plane in planes.values():  # warm-up: the worker's start, its first mapping
                plane.copy_local_all(jobs)
            _wait_ready(planes[True])
            planes[True].copy_local_all(jobs)  # the worker's own first copies
            for _ in range(args.iters):
                for w, plane in planes.items():
                    t0 = time.perf_counter()
                    out = plane.copy_local_all(jobs)
                    times[w].append(time.perf_counter() - t0)
                    assert all(isinstance(o, int) and o > 0 for o in out), out
            here, there = (statistics.median(times[w]) * 1e3 for w in (False, True))
            rows.append((n, here, there))
        for plane in planes.values():
            plane.close()
    nixl.stop()
    print(
        f"One-block host copies of {rank_block_bytes(spec) // 1024} KiB, median of {args.iters} batches each:\n"
    )
    print(
        "| copies a batch | in this process, ms | through the worker, ms | hand-off, ms | hand-off a copy, us |"
    )
    print("|---|---|---|---|---|")
    for n, here, there in rows:
        print(f"| {n} | {here:.3f} | {there:.3f} | {there - here:.3f} | {(there - here) / n * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
