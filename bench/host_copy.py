"""The host executor's copy (execute/host.py: copy_request) by runs against one indexed copy, side by side.

A host pull that converts (another layout, block size or TP size: host-nixl-staged) or goes through a
host ring (`host_transfer: ring`: the source's gather into a slot, the reader's scatter out of it)
moves its bytes with copy_request. It moves tokens that follow each other on both sides as one
strided copy each (a run) where that is cheaper than one advanced-index gather and index_put, which
torch's CPU kernels do an element at a time. This bench times both on host ranks of a model's shape in
one process, the two alternating call by call, and prints a table (written to docs/benchmarks.md
unless --no-write):

    python bench/host_copy.py [--iters 50] [--threads N] [--no-write]

"runs where they pay" is what the sidecar does; "indexed always" is the executor's copy before runs
(one gather and one index_put per layer pair), forced. Each row's bytes are checked equal between the
two before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "sidecar"), str(ROOT / "client"), str(ROOT / "bench")]
import latency  # noqa: E402
from report import gpus, write_section  # noqa: E402

from kv_sidecar.execute import host  # noqa: E402
from kv_sidecar.plan.spec import EngineSpec, Layout  # noqa: E402

SECTION = "Host copies by runs (bench/host_copy.py)"

# bench/latency.py's one-block rank, node_scaling.py's host rank: 4 layers, 8 KV heads, head_dim 128, bf16,
# 16-token blocks (256 KiB a block); 320 blocks, room for every case's scattered ids.
MODEL = dataclasses.replace(latency.SPEC, num_blocks=320)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    src: EngineSpec
    dst: EngineSpec
    blocks: int  # source blocks (whole ones)
    scattered: bool  # ids in no order (else consecutive on both sides)
    heads: tuple[int, int] | None = (0, 8)
    fused: bool = True  # a rank's layers back to back in one allocation (else one tensor each, apart)


CASES = [
    Case("1 block", MODEL, MODEL, 1, False),
    Case("16 blocks in a row", MODEL, MODEL, 16, False),
    Case("16 blocks scattered", MODEL, MODEL, 16, True),
    Case("256 blocks scattered", MODEL, MODEL, 256, True),
    Case("16 blocks scattered, layers apart", MODEL, MODEL, 16, True, fused=False),
    Case(
        "16 blocks, 16 -> 32-token blocks",
        MODEL,
        dataclasses.replace(MODEL, block_size=32, num_blocks=160),
        16,
        True,
    ),
    Case("16 blocks, NHD -> HND", MODEL, dataclasses.replace(MODEL, layout=Layout.FLASH_ATTN_HND), 16, True),
    Case(
        "16 blocks, vllm_cpu 16 -> 32-token blocks",
        dataclasses.replace(MODEL, layout=Layout.VLLM_CPU),
        dataclasses.replace(MODEL, layout=Layout.VLLM_CPU, block_size=32, num_blocks=160),
        16,
        True,
    ),
    Case(
        "16 blocks, TP 1 -> 2 (half the heads)",
        MODEL,
        dataclasses.replace(MODEL, tp_size=2),
        16,
        True,
        heads=(0, 4),
    ),
    Case(
        "48 one-token blocks, 1 head of 8 (tiny)",
        dataclasses.replace(MODEL, num_layers=1, num_kv_heads=1, head_dim=8, block_size=1),
        dataclasses.replace(MODEL, num_layers=1, num_kv_heads=1, head_dim=8, block_size=1),
        48,
        True,
        heads=(0, 1),
    ),
]


def rank(spec: EngineSpec, fused: bool, rng: np.random.Generator) -> host.RankView:
    shapes = spec.rank_tensor_shapes()
    dtype = getattr(torch, spec.dtype)
    if fused:
        size = int(np.prod(shapes[0]))
        big = torch.from_numpy(rng.integers(-(2**15), 2**15, len(shapes) * size, dtype=np.int16)).view(dtype)
        tensors = [big[i * size : (i + 1) * size].view(shapes[0]) for i in range(len(shapes))]
    else:
        tensors = [
            torch.from_numpy(rng.integers(-(2**15), 2**15, int(np.prod(s)), dtype=np.int16))
            .view(dtype)
            .view(s)
            for s in shapes
        ]
    return host.rank_view(spec, 0, tensors)


def args_of(case: Case, rng: np.random.Generator) -> tuple[Any, ...]:
    src, dst = rank(case.src, case.fused, rng), rank(case.dst, case.fused, rng)
    tokens = case.blocks * case.src.block_size
    n_dst = -(-tokens // case.dst.block_size)
    if case.scattered:
        src_ids = rng.permutation(case.src.num_blocks)[: case.blocks].tolist()
        dst_ids = rng.permutation(case.dst.num_blocks)[:n_dst].tolist()
    else:
        src_ids, dst_ids = list(range(3, 3 + case.blocks)), list(range(7, 7 + n_dst))
    return src, dst, case.heads, src_ids, dst_ids, tokens


def timed(fn: Callable[[], int]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_case(case: Case, iters: int, rng: np.random.Generator) -> dict[str, Any]:
    args = args_of(case, rng)
    dst = args[1]
    real = host._runs_pay
    seen: list[tuple[int, bool]] = []

    def recorded(runs: int, pairs: int, nbytes: int) -> bool:
        seen.append((runs, real(runs, pairs, nbytes)))
        return seen[-1][1]

    def forced(runs: bool | None) -> Callable[[], int]:
        def copy() -> int:
            if runs is None:
                return host.copy_request(*args)
            with mock.patch.object(host, "_runs_pay", lambda *_: runs):
                return host.copy_request(*args)

        return copy

    before = [t.clone() for t in dst.layers]
    with mock.patch.object(host, "_runs_pay", recorded):
        nbytes = host.copy_request(*args)
    (runs, chose), written = seen[0], [t.clone() for t in dst.layers]
    for way in (True, False):  # each way writes the same bytes, from the same destination
        for t, b in zip(dst.layers, before, strict=True):
            t.copy_(b)
        assert forced(way)() == nbytes
        assert all(torch.equal(a, b) for a, b in zip(written, dst.layers, strict=True)), case.name
    ways = {"tree": forced(None), "runs": forced(True), "indexed": forced(False)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(3):
        for fn in ways.values():
            fn()
    for _ in range(iters):
        for k, fn in ways.items():
            times[k].append(timed(fn))
    return {"case": case.name, "bytes": nbytes, "n_runs": runs, "chose": "runs" if chose else "indexed"} | {
        k: statistics.median(v) * 1e3 for k, v in times.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch's intra-op threads (default: torch's, as a sidecar)"
    )
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    lines = [
        "| copy | bytes | runs per layer pair | the executor takes | this tree, ms | runs forced, ms "
        "| indexed forced (as before), ms | before / this tree | GB/s, this tree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        row = run_case(case, a.iters, rng)
        lines.append(
            f"| {row['case']} | {row['bytes'] / 2**10:,.0f} KiB | {row['n_runs']} | {row['chose']} "
            f"| {row['tree']:.3f} | {row['runs']:.3f} | {row['indexed']:.3f} "
            f"| {row['indexed'] / row['tree']:.2f}x | {row['bytes'] / row['tree'] / 1e6:.1f} |"
        )
        print(lines[-1], flush=True)
    cmd = "python bench/host_copy.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            f"Command: `{cmd.strip()}`  ",
            f"Machine: {platform.machine()}, {gpus()}, torch {torch.__version__}, {torch.get_num_threads()} intra-op "
            f"thread(s), Python {platform.python_version()}  ",
            f"Date: {datetime.date.today().isoformat()}  ",
            "",
            "Median of each copy over the iterations, the three ways alternating call by call in one process: "
            "this tree (runs where its cost model says they pay, else one indexed copy), runs forced, and "
            "the indexed copy forced, which is what every copy did before runs. Both ways wrote the same "
            "bytes in every row (checked).",
            "",
            *lines,
        ]
    )
    print(body)
    if not a.no_write:
        write_section(ROOT / "docs" / "benchmarks.md", SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
