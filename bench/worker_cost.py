"""What device workers cost a GPU node besides their hand-off: the time from an engine's registration
to its first gpu-direct pull, and the GPU memory of the sidecar's processes, with `device_workers`
off and on (docs/operations.md, "GPU memory headroom").

For each setting, a fresh sidecar and two reference engines (prefill on GPU0, decode on GPU1, or both
on GPU0 where there is one; the model-shaped rank of bench/node_scaling.py, 64 blocks each): the first
pull right after both engines registered (a worker starts at the first copy into its GPU, which runs in
the sidecar, as copies do until the worker answered), then 20 more; then the wait until the workers
answer, 20 pulls through them, and `nvidia-smi` per process for the sidecar and its children, by GPU.
Every pull is verified. Each setting runs twice on its own TRITON_CACHE_DIR: empty (a new pod), then
filled by the first (a restarted container that kept it).

    python bench/worker_cost.py                     # off and on
    python bench/worker_cost.py --settings auto     # what the default does on this machine
    python bench/worker_cost.py --settings false --decode-block-size 32 --settle-s 5
        # a heterogeneous pairing (decode blocks of 32 tokens), its first pull 5 s after registration
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, gpu_memory_by_process

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node_scaling

SPEC = dataclasses.replace(node_scaling.GPU_SPEC, num_blocks=64)


def _gpu_memory(pids: set[int]) -> dict[str, int]:
    """MiB each GPU holds for these processes, by GPU index."""
    out: dict[str, int] = {}
    for pid, held in gpu_memory_by_process().items():
        if pid in pids:
            for gpu, mib in held.items():
                out[gpu] = out.get(gpu, 0) + mib
    return out


def _pull(prefill: EngineProcess, decode: EngineProcess, i: int, decode_block_size: int) -> float:
    src = [i % 32, 32 + i % 32]
    pub = prefill.send(
        {"cmd": "prefill", "request_id": f"r{i}", "block_ids": src, "num_tokens": 32, "seed": i}
    )
    assert pub["ok"], pub
    dst = list(range(40, 40 + -(-32 // decode_block_size)))
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": i})
    assert res["ok"] and res["verified"] and res["path"] == "gpu-direct", res
    return float(res["wall_s"]) * 1e3  # the engine's pull call, not its checks after


def _wait_for_workers(sc: SidecarProcess, timeout_s: float = 120) -> float:
    """Seconds until every worker the sidecar started has answered (a worker starts at the first copy
    into its GPU; copies run in the sidecar until it answers): 0 without workers."""
    start = time.monotonic()
    while len(sc.answering_workers()) < len(sc.worker_pids()):
        assert time.monotonic() - start < timeout_s, "workers did not answer"
        time.sleep(0.05)
    return time.monotonic() - start


def _runs(settings: list[str]) -> Iterator[tuple[str, str, str]]:
    """(setting, "empty" or "filled", its Triton cache directory) for each run."""
    for setting in settings:
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            yield setting, "empty", cache
            yield setting, "filled", cache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="false,true", help="device_workers values, comma-separated")
    ap.add_argument(
        "--decode-block-size", type=int, default=SPEC.block_size, help="the decode engine's block size"
    )
    ap.add_argument(
        "--settle-s", type=float, default=0.0, help="wait this long between registration and pulls"
    )
    args = ap.parse_args()
    decode_spec = dataclasses.replace(SPEC, block_size=args.decode_block_size)
    bs = args.decode_block_size
    gpus = torch.cuda.device_count()
    assert gpus >= 1, "needs a GPU"
    decode_gpu = "cuda:1" if gpus >= 2 else "cuda:0"
    rows = []
    for setting, cache_state, cache in _runs(args.settings.split(",")):
        env = {"TRITON_CACHE_DIR": cache}
        sc = SidecarProcess(f"worker-cost-{setting}", extra=["--device-workers", setting], env=env)
        try:
            t0 = time.perf_counter()
            prefill = EngineProcess(sc.socket, f"wc-p-{setting}", SPEC, devices=["cuda:0"])
            decode = EngineProcess(sc.socket, f"wc-d-{setting}", decode_spec, devices=[decode_gpu])
            registered = time.perf_counter() - t0
            time.sleep(args.settle_s)
            try:
                first = _pull(prefill, decode, 0, bs)
                later = statistics.median(_pull(prefill, decode, i, bs) for i in range(1, 21))
                answered = _wait_for_workers(sc)
                through = statistics.median(_pull(prefill, decode, i, bs) for i in range(21, 41))
                workers = sc.worker_pids()
                mine = _gpu_memory({sc.proc.pid})
                theirs = _gpu_memory(set(workers))
            finally:
                prefill.stop()
                decode.stop()
        finally:
            sc.stop()
        rows.append(
            (
                f"{setting}, {cache_state}",
                registered,
                first,
                later,
                answered,
                through,
                len(workers),
                mine,
                theirs,
            )
        )
    host = os.uname().nodename
    print(
        f"{gpus} GPUs ({torch.cuda.get_device_name(0)}), host {host}; 2 MiB blocks, pulls of 2 blocks; decode "
        f"blocks of {bs} tokens; first pull {args.settle_s:g} s after registration\n"
    )
    print(
        "| device_workers, Triton cache | engines registered, s | first pull, ms | next 20 p50, ms | "
        "workers answering after, s | 20 more p50, ms | workers | GPU MiB, sidecar process | GPU MiB, its workers |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for setting, registered, first, later, answered, through, n, mine, theirs in rows:
        show = lambda m: ", ".join(f"GPU{g} {v}" for g, v in sorted(m.items())) or "-"  # noqa: E731
        print(
            f"| {setting} | {registered:.1f} | {first:.1f} | {later:.2f} | {answered:.1f} | {through:.2f} | {n} | "
            f"{show(mine)} | {show(theirs)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
