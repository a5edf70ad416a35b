"""Staged pulls (host-ring) of this tree next to another revision's, interleaved, in one run.

The staged protocol (docs/gpu.md) runs on host memory with `host_transfer: ring`;
there its fixed cost per pull is control flow (Push, notifications, credits,
thread hand-offs), which is what a GPU pull pays besides its kernels. Two
sidecar pairs, one per revision (bench/baseline.py), serve the same engines'
caches (this process plays both engines); every round pulls once through each
pair, alternating which goes first, so that the noise of a shared machine falls
on both alike.

    python bench/ring_latency.py --baseline HEAD~3            # 1, 16, 256 blocks of 32 KiB
    python bench/ring_latency.py --baseline main --blocks 1 --iters 300 --ring-bytes 8388608
    python bench/ring_latency.py --gpu --baseline-tree DIR    # gpu-staged, 2 MiB model blocks
    python bench/ring_latency.py --gpu --local --baseline-tree DIR   # gpu-direct: one sidecar per tree
    python bench/ring_latency.py --host-nixl --idle 1.5 --baseline HEAD~1 --blocks 1 --iters 20
                                                   # plain READs, each pull after a quiet second
    python bench/ring_latency.py --gpu --batch 16 --blocks 1 --baseline-tree DIR
                                                   # each call a PullBatch of 16 one-block pulls

--gpu: the engines' caches on GPUs (decode on cuda:1 where there is one, else on
cuda:0 with the prefill), the rings at their default size, path gpu-staged.
--local: one sidecar per revision serving both engines (path gpu-direct with --gpu,
host-direct without).
--baseline-tree: an exported tree (python -c "import baseline; print(baseline.export(REF))"
in bench/) for machines where the checkout has no git history.
--batch N: each call a PullBatch of N pulls of --blocks blocks, into blocks of their own (target 1's
row of issue 32 with one batch in flight: pulls/s = N / the call's time); the rows are per call and
the sidecar columns the slowest member's. Calls of the two trees alternate one by one, as pulls do: a
comparison of traced or separate runs read 0.83x where this reads 1.0x (docs/benchmarks.md,
twenty-eighth session).
--pin N: each sidecar process on N cores of its own and this process on the rest, so that where the
scheduler puts the sidecars' threads stops varying between calls and runs.
--aa: a third set of sidecars running this tree ("again"), its calls in turn with the other two, and
the ratios new / old and new / again: two copies of one tree differed by up to 8 % on gpu-direct rows
(docs/benchmarks.md, twenty-ninth session), so a ratio means something only beside its A/A.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline
from gpu_latency import HOST_MODEL, MODEL
from report import quantile

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import SidecarProcess, pin_tasks, together
from kv_sidecar_client import BatchPull, SidecarClient

# bench/gpu_latency.py's ranks: --host's 32 KiB blocks (4 layers, 2 heads, head_dim 64, bf16, 16 tokens)
# and, for --gpu, the model rank's 2 MiB blocks (32 layers, 8 heads, head_dim 128).
SPEC = EngineSpec.from_dict(HOST_MODEL | {"num_blocks": 640})
GPU_SPEC = EngineSpec.from_dict(MODEL | {"num_blocks": 600})


def main() -> int:
    import numpy as np
    import torch

    from kv_sidecar_client.shm import ShmKVCache

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="GIT_REF", help="revision to compare with (omit: this tree only)")
    ap.add_argument("--baseline-tree", metavar="DIR", help="an exported tree to compare with, instead")
    ap.add_argument("--gpu", action="store_true", help="GPU caches and rings (path gpu-staged)")
    ap.add_argument("--local", action="store_true", help="one sidecar per tree: gpu-direct / host-direct")
    ap.add_argument("--blocks", default="1,16,256", help="blocks per pull, comma-separated")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument(
        "--idle",
        type=float,
        default=0.001,
        help="seconds to sleep after each pull, so each tree's sidecars idle at least this long between "
        "their pulls (a sidecar quiet for a second polls less often)",
    )
    ap.add_argument(
        "--host-nixl",
        action="store_true",
        help="without --gpu or --local: plain NIXL READs (path host-nixl) instead of the staged ring",
    )
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--ring-bytes", type=int, default=0, help="gpu_staging_bytes (0: 8 MiB host, default GPU)"
    )
    ap.add_argument("--slots", type=int, default=0, help="gpu_staging_slots (0: default)")
    ap.add_argument("--old-args", default="", help="extra `serve` flags for the old tree's sidecars")
    ap.add_argument("--new-args", default="", help="extra `serve` flags for this tree's sidecars")
    ap.add_argument("--batch", type=int, default=0, help="each call a PullBatch of N pulls (0: Pull calls)")
    ap.add_argument(
        "--aa",
        action="store_true",
        help="also a second set of this tree's sidecars ('again'), its calls in turn with the others': "
        "the spread between two copies of one tree, in the same run",
    )
    ap.add_argument(
        "--pin",
        type=int,
        default=0,
        metavar="N",
        help="each sidecar process on N cores of its own, this process (both engines) on the rest "
        "(0: where the scheduler puts them)",
    )
    args = ap.parse_args()
    spec = GPU_SPEC if args.gpu else SPEC
    ring_bytes = args.ring_bytes or (0 if args.gpu else 8 << 20)
    if args.local:  # one sidecar: no ring, no host transfer setting in play
        path, extra = ("gpu-direct" if args.gpu else "host-direct"), []
    else:
        path = "gpu-staged" if args.gpu else "host-nixl" if args.host_nixl else "host-ring"
        extra = ["--host-transfer", "ring"] if path == "host-ring" else []
        extra += ["--gpu-staging-bytes", str(ring_bytes)] if ring_bytes else []
        extra += ["--gpu-staging-slots", str(args.slots)] if args.slots else []
    trees: dict[str, str | None] = {"new": None}
    if args.baseline or args.baseline_tree:
        trees = {"old": args.baseline_tree or baseline.export(args.baseline), "new": None}
    elif args.old_args:
        trees = {"old": None, "new": None}  # this tree twice, with different flags
    if args.aa:
        trees["again"] = None  # this tree's sidecars once more: what two copies of one tree differ by
    flags = {"old": args.old_args, "new": args.new_args, "again": args.new_args}
    env_of = {k: (baseline.env(t) if t else {}) | {"OMP_NUM_THREADS": "1"} for k, t in trees.items()}
    jobs = [(k, role) for k in trees for role in (("p",) if args.local else ("p", "d"))]
    starts = [
        lambda j=j: SidecarProcess(
            f"ring-{j[0]}-{j[1]}",
            extra=extra + flags[j[0]].split(),
            env=env_of[j[0]],
            start_timeout_s=180,
        )
        for j in jobs
    ]
    procs = dict(zip(jobs, together(*starts), strict=True))
    pinned = pin_apart(list({id(sc): sc for sc in procs.values()}.values()), args.pin) if args.pin else ""
    if args.local:  # both engines on the one sidecar of each tree
        procs.update({(k, "d"): procs[(k, "p")] for k in trees})
    shapes = spec.rank_tensor_shapes()
    if args.gpu:
        from kv_sidecar.refengine.gpu_cache import GpuKVCache

        d_dev = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
        pcache: Any = GpuKVCache(shapes, torch.bfloat16, torch.device("cuda", 0))
        dcache: Any = GpuKVCache(shapes, torch.bfloat16, d_dev)
    else:
        pcache, dcache = ShmKVCache(shapes, torch.bfloat16), ShmKVCache(shapes, torch.bfloat16)
    for t in pcache.tensors:
        t.view(torch.uint8).random_()
    if args.gpu:  # the sidecars read it from their own processes: only once the kernels are done
        torch.cuda.synchronize(0)
    clients = {j: SidecarClient(sc.socket) for j, sc in procs.items()}
    rng = np.random.default_rng(3)
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    try:
        for k in trees:
            clients[(k, "p")].register_rank(f"{k}-p", 0, spec.to_dict(), pcache.handles())
            clients[(k, "d")].register_rank(f"{k}-d", 0, spec.to_dict(), dcache.handles())
        seq = iter(range(10**9))
        for n in (int(x) for x in args.blocks.split(",")):
            for k in trees:
                results[(k, n)] = {"wall": [], "side": []}
            members = max(1, args.batch)
            if members * n > spec.num_blocks:
                raise SystemExit(
                    f"--batch {args.batch} of {n} blocks: more than the {spec.num_blocks} blocks"
                )
            for i in range(args.warmup + args.iters):
                src = [rng.permutation(spec.num_blocks)[:n].tolist() for _ in range(members)]
                # Each member its own destination blocks (a batch's members never share one).
                spread = rng.permutation(spec.num_blocks)[: members * n].tolist()
                dst = [spread[m * n : (m + 1) * n] for m in range(members)]
                names = list(trees)  # the trees' calls in turn, each tree first as often as the others
                if len(names) == 2:
                    order = names if i % 2 else names[::-1]
                else:
                    order = names[i % len(names) :] + names[: i % len(names)]
                for k in order:
                    pub = clients[(k, "p")]
                    params = [pub.publish(f"{k}-p", f"r{next(seq)}", s, n * spec.block_size) for s in src]
                    t0 = time.perf_counter()
                    if args.batch:
                        got = clients[(k, "d")].pull_batch(
                            f"{k}-d",
                            [BatchPull(p, d) for p, d in zip(params, dst, strict=True)],
                            timeout_s=60,
                        )
                    else:
                        got = [clients[(k, "d")].pull(params[0], f"{k}-d", dst[0], timeout_s=60)]
                    wall = time.perf_counter() - t0
                    for res in got:
                        if not res.ok:
                            raise RuntimeError(
                                f"{k}: pull of {n} blocks failed: {res.error_code}: {res.error}"
                            )
                        if res.path != path:
                            raise RuntimeError(f"{k}: path {res.path}, not {path}")
                    if i >= args.warmup:
                        results[(k, n)]["wall"].append(wall)
                        results[(k, n)]["side"].append(max(res.duration_s for res in got))
                    time.sleep(args.idle)
            same = all(
                torch.equal(p[:, s].view(torch.int16), d[:, t].to(p.device).view(torch.int16))
                for p, d in zip(pcache.tensors, dcache.tensors, strict=True)
                for s, t in zip(src, dst, strict=True)
            )
            if not same:
                raise RuntimeError(f"{n} blocks: bytes differ")
    finally:
        for c in clients.values():
            c.close()
        for sc in set(procs.values()):
            sc.stop()
        pcache.close()
        dcache.close()
    ref = args.baseline_tree or (baseline.describe(args.baseline) if args.baseline else "")
    print(
        f"{path}, {spec.rank_bytes() // spec.num_blocks // 1024} KiB blocks, "
        f"{'one sidecar' if args.local else 'two sidecars' if path == 'host-nixl' else 'rings ' + (f'{ring_bytes} B' if ring_bytes else 'default')}"
        f"{f' / {args.slots} slots' if args.slots and not args.local else ''}, {args.iters} {'calls' if args.batch else 'pulls'} per row, "
        f"{f'PullBatches of {args.batch}, ' if args.batch else ''}{args.idle:g} s idle after each, "
        f"load {os.getloadavg()[0]:.1f}{f'; old = {ref}' if ref else ''}{pinned}"
    )
    print("| blocks | tree | engine wall p50 ms | p90 ms | sidecar p50 ms | sidecar p90 ms |")
    print("|---|---|---|---|---|---|")
    for (k, n), r in results.items():
        w, s = r["wall"], r["side"]
        print(
            f"| {n} | {k} | {statistics.median(w) * 1e3:.3f} | {quantile(w, 0.9) * 1e3:.3f} | "
            f"{statistics.median(s) * 1e3:.3f} | {quantile(s, 0.9) * 1e3:.3f} |"
        )
    if len(trees) > 2 or args.aa:
        print("\n| blocks | ratio | engine wall p50 | sidecar p50 |\n|---|---|---|---|")
        for n in sorted({n for _, n in results}):
            for a, b in (("new", "old"), ("new", "again")):
                if (a, n) in results and (b, n) in results:
                    ra, rb = results[(a, n)], results[(b, n)]
                    print(
                        f"| {n} | {a} / {b} | {statistics.median(ra['wall']) / statistics.median(rb['wall']):.3f}x | "
                        f"{statistics.median(ra['side']) / statistics.median(rb['side']):.3f}x |"
                    )
    return 0


def pin_apart(procs: list[SidecarProcess], n: int) -> str:
    """Each sidecar process on `n` cores of its own, from the last ones up, and this process on the
    rest; what was done, for the table's heading."""
    cpus = sorted(os.sched_getaffinity(0))
    if n * len(procs) + 2 > len(cpus):
        raise SystemExit(
            f"--pin {n}: {len(procs)} sidecars need {n * len(procs)} of {len(cpus)} cores and 2 left"
        )
    for k, sc in enumerate(procs):
        sc.pin(cpus[len(cpus) - n * (k + 1) : len(cpus) - n * k])
    pin_tasks(os.getpid(), cpus[: len(cpus) - n * len(procs)])
    return f"; each sidecar on {n} cores of its own, the engines on {len(cpus) - n * len(procs)}"


if __name__ == "__main__":
    sys.exit(main())
