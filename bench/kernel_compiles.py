"""What compiling the copy kernel costs a pull: how many pulls of a serving mix between two ranks meet a
kernel not compiled yet and how long each waits, with Triton's on-disk cache empty (a new pod) and
filled (a restarted container that kept it); and what the kernel's specialisation does to its speed.

One GPU, in this process: the model-shaped rank of bench/node_scaling.py as both source and destination
(torch tensors on cuda:0), and pulls of the sizes and prefix starts a serving engine asks for (whole
blocks, a partial last block, one token, prefix hits that start mid-request). Each pull is timed to
its end; "compiled" counts the kernels Triton compiled for it. Variants:

- as-built: the kernel as the sidecar ships it, warmed as registration warms it (execute/gpu.warm_up)
  unless --no-warm-up;
- specialised: the same kernel with Triton's default specialisation on every int's value (being 1,
  divisible by 16) and on the id lists' alignment, as the kernel was built until 2026-11-29; every
  launch through Triton.

Then the kernel alone (GPU time between CUDA events, the stream kept busy ahead of it so that no host
gap counts) over a 1 GiB copy of whole blocks (a row count that is a multiple of 16) and one token
short (not): as built, specialised, and (--baseline-tree) another tree's kernel, alternated in one
process. Each row of the first table runs in a fresh process with its own TRITON_CACHE_DIR.

    python bench/kernel_compiles.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (num_tokens, start_token): whole blocks, partial blocks, one token, prefix hits (whole blocks) mid-request.
MIX = [
    (32, 0), (48, 0), (33, 0), (47, 0), (1, 0), (16, 0), (17, 0), (512, 0), (300, 0),
    (64, 16), (70, 16), (64, 32), (90, 32), (200, 96), (33, 32), (17, 16), (256, 128), (1000, 992),
]  # fmt: skip
BANDWIDTH_BLOCKS = 512  # 1 GiB of 2 MiB blocks


def _variant(name: str) -> tuple[Any, Any]:
    """(kernel, launcher) of a variant."""
    import triton

    from kv_sidecar.execute import gpu_kernels

    if name == "as-built":
        return gpu_kernels.kv_copy_kernel, gpu_kernels.Launcher()
    kernel = triton.jit(gpu_kernels.kv_copy_kernel.fn)  # Triton's defaults: specialised on every value
    launcher = gpu_kernels.Launcher()
    launcher._direct = False  # its key would reuse kernels across the values they were specialised on
    return kernel, launcher


def _use(kernel: Any, launcher: Any) -> None:
    from kv_sidecar.execute import gpu_kernels

    gpu_kernels.kv_copy_kernel, gpu_kernels.launch = kernel, launcher


def _compiled(kernel: Any) -> int:
    """Kernels Triton holds compiled for `kernel`, on every device."""
    return sum(len(c[0]) for c in getattr(kernel, "device_caches", {}).values())


def _ranks(blocks: int) -> tuple[Any, Any, Any]:
    import node_scaling
    import torch

    from kv_sidecar.execute import gpu

    spec = dataclasses.replace(node_scaling.GPU_SPEC, num_blocks=blocks)
    dev = torch.device("cuda", 0)
    src_t = [torch.randn(s, device=dev).to(torch.bfloat16) for s in spec.rank_tensor_shapes()]
    dst_t = [torch.zeros(s, device=dev, dtype=torch.bfloat16) for s in spec.rank_tensor_shapes()]
    torch.cuda.synchronize()
    return spec, gpu.gpu_rank_view(spec, 0, src_t, dev), gpu.gpu_rank_view(spec, 0, dst_t, dev)


def _mix(variant: str, blocks: int, warm: bool) -> dict[str, Any]:
    import torch

    from kv_sidecar.execute import gpu

    kernel, launcher = _variant(variant)
    _use(kernel, launcher)
    spec, src, dst = _ranks(blocks)
    warm_ms = 0.0
    if warm and variant == "as-built":
        t = time.perf_counter()
        gpu.warm_up(dst)
        warm_ms = (time.perf_counter() - t) * 1e3
    heads = (0, spec.num_kv_heads)
    bs = spec.block_size
    pulls = []
    for n, start in MIX:
        src_ids = list(range(-(-n // bs)))
        dst_ids = [blocks - 1 - i for i in range(start // bs, -(-n // bs))]
        before = _compiled(kernel)
        t = time.perf_counter()
        gpu.copy_request(src, dst, heads, src_ids, dst_ids, n, start)
        ms = (time.perf_counter() - t) * 1e3
        pulls.append({"tokens": n, "start": start, "ms": ms, "compiled": _compiled(kernel) - before})
    return {"warm_ms": warm_ms, "pulls": pulls, "gpu": torch.cuda.get_device_name(0)}


def _baseline_kernel(tree: str) -> Any:
    """kv_copy_kernel as another tree's gpu_kernels.py builds it."""
    import importlib.util

    path = Path(tree) / "sidecar" / "kv_sidecar" / "execute" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("baseline_gpu_kernels", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kv_copy_kernel


def _bandwidth(blocks: int, baseline: str, rounds: int = 5, reps: int = 10) -> dict[str, dict[str, float]]:
    """GB/s (bytes written per kernel GPU time, median) over BANDWIDTH_BLOCKS blocks, whole (the row
    count a multiple of 16) and one token short (not), by kernel: as built, the same specialised on
    every int's value (Triton's default), and a baseline tree's."""
    import torch
    import triton

    from kv_sidecar.execute import gpu, gpu_kernels

    spec, src, dst = _ranks(blocks)
    heads = (0, spec.num_kv_heads)
    ids = list(range(BANDWIDTH_BLOCKS))
    dst_ids = [b + blocks - BANDWIDTH_BLOCKS for b in ids]
    whole = BANDWIDTH_BLOCKS * spec.block_size
    kernels = {
        "as built": gpu_kernels.kv_copy_kernel,
        "as built, every value specialised": triton.jit(gpu_kernels.kv_copy_kernel.fn),
    }
    if baseline:
        kernels[f"{Path(baseline).name} (baseline tree)"] = _baseline_kernel(baseline)
    variants = {}
    for name, kernel in kernels.items():
        launcher = gpu_kernels.Launcher()
        launcher._direct = name == "as built"  # the others' specialisation is not what its key knows
        variants[name] = (kernel, launcher)
    sizes = {"whole blocks": whole, "one token short": whole - 1}
    times: dict[tuple[str, str], list[float]] = {(v, z): [] for v in variants for z in sizes}
    stream = torch.cuda.current_stream(0)
    for r in range(rounds + 1):
        for name, (kernel, launcher) in variants.items():
            _use(kernel, launcher)
            for size, tokens in sizes.items():
                for _ in range(reps):
                    torch.cuda._sleep(20_000_000)  # the GPU busy while the host enqueues: no gap is timed
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    gpu.copy_request(src, dst, heads, ids, dst_ids, tokens, synchronize=False)
                    end.record(stream)
                    end.synchronize()
                    if r:  # round 0 compiles
                        times[name, size].append(start.elapsed_time(end) / 1e3)
    per_token = spec.rank_bytes() // spec.num_blocks // spec.block_size
    return {
        name: {
            size: tokens * per_token / statistics.median(times[name, size]) / 1e9
            for size, tokens in sizes.items()
        }
        for name in variants
    }


def _run(args: list[str], cache: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, *args],
        env={**os.environ, "TRITON_CACHE_DIR": cache}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{args} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks of each rank (2 MiB each)")
    ap.add_argument("--no-warm-up", action="store_true", help="as-built without the registration's warm-up")
    ap.add_argument("--parts", default="mix,bandwidth", help="mix and/or bandwidth, comma-separated")
    ap.add_argument("--baseline-tree", default="", help="also the kernel of this tree, in the bandwidth part")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "bandwidth":
        print(json.dumps(_bandwidth(args.blocks, args.baseline_tree)))
        return 0
    if args.child:
        print(json.dumps(_mix(args.child, args.blocks, not args.no_warm_up)))
        return 0
    rows = []
    parts = args.parts.split(",")
    for variant in ("as-built", "specialised") if "mix" in parts else ():
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            for cache_state in ("empty", "filled"):
                extra = ["--no-warm-up"] if args.no_warm_up else []
                rows.append(
                    (
                        variant,
                        cache_state,
                        _run(["--child", variant, "--blocks", str(args.blocks), *extra], cache),
                    )
                )
    gbps: dict[str, dict[str, float]] = {}
    if "bandwidth" in parts:
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            base = ["--baseline-tree", str(Path(args.baseline_tree).resolve())] if args.baseline_tree else []
            gbps = _run(["--child", "bandwidth", "--blocks", str(args.blocks), *base], cache)
    import torch

    print(
        f"{torch.cuda.get_device_name(0)}, host {os.uname().nodename}; two ranks of one GPU, 2 MiB blocks\n"
    )
    if rows:
        warmed = "no warm-up" if args.no_warm_up else "warmed as at registration"
        print(
            "| kernel | Triton cache | warm-up ms | pulls | compiled | first pull ms | slowest other ms | p50 ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for variant, state, r in rows:
            ms = [p["ms"] for p in r["pulls"]]
            label = f"{variant} ({warmed})" if variant == "as-built" else variant
            print(
                f"| {label} | {state} | {r['warm_ms']:.0f} | {len(ms)} | {sum(p['compiled'] for p in r['pulls'])} | "
                f"{ms[0]:.1f} | {max(ms[1:]):.1f} | {statistics.median(ms):.2f} |"
            )
        print("\npulls (tokens, start) that compiled a kernel:")
    for variant, state, r in rows:
        which = ", ".join(f"({p['tokens']},{p['start']})" for p in r["pulls"] if p["compiled"])
        print(f"  {variant}, {state}: {which or 'none'}")
    if not gbps:
        return 0
    print(f"\nthe kernel alone, {BANDWIDTH_BLOCKS} blocks (1 GiB), GB/s written (median of GPU times):\n")
    sizes = list(next(iter(gbps.values())))
    print("| kernel | " + " | ".join(sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, by_size in gbps.items():
        print(f"| {name} | " + " | ".join(f"{by_size[z]:.0f}" for z in sizes) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
