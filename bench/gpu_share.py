"""What a copy costs on a GPU that another process is copying on: why one-GPU staged rows are not a link's.

With both engines of a pair on one GPU (bench/node_scaling.py on a one-GPU machine), a staged pull runs its
gathers in the prefill sidecar's process and its scatters in the decode sidecar's: two CUDA contexts on one
GPU. Without MPS a GPU runs one context's kernels at a time and switches between them by time slices, so a
scatter launched while the other sidecar's gathers run may wait for their slice to end. This measures that
wait with the staged path's shape: one 64 MiB copy (an SM kernel reading and writing 64 MiB, as a gather or
scatter of a 64 MiB chunk) after an idle millisecond, timed from its launch to its end on the host and by
CUDA events, 200 times (medians and p90):

  alone               nothing else runs on the GPU
  other stream        a thread of this process copies back to back on another stream (one context)
  other process       another process copies back to back (two contexts, as two sidecars on one GPU,
                      or a sidecar beside an engine's forward passes)
  memcpy, ...         the same bytes by cudaMemcpyAsync (device to device) instead of an SM kernel, with
                      the other process's kernels running, and alone
  other process, matmuls   another process runs bf16 matmuls back to back (8192 x 8192, ~1.5 ms each):
                      a GPU an engine keeps busy without a gap
  other process, decode steps   another process runs decode-step-shaped work: 64 short matmuls (256 x 4096
                      by 4096 x 4096), a wait for their end, 0.5 ms of host time, again

Under CUDA MPS (a control daemon started for the run: `nvidia-cuda-mps-control -d`) the processes'
kernels may run side by side; the table says whether MPS was on, as the driver answers for this process's
contexts (the sidecar's `kvsidecar_gpu_mps` asks the same).

    python bench/gpu_share.py                       # prints the table
    python bench/gpu_share.py --write               # and writes its section of docs/benchmarks.md
    python bench/gpu_share.py --load matmuls --load-s 60 &   # only the other process's loop, for 60 s:
                                                    # a busy GPU to time something else beside
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import gpus, write_section  # noqa: E402

TITLE = "Copies on a GPU another process copies on (bench/gpu_share.py)"
CHUNK_BYTES = 64 << 20


class _Flag(Protocol):
    """A threading.Event or a multiprocessing one: `_busy`'s stop and started, in a thread or a process."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def _buffers(device: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    n = CHUNK_BYTES // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=f"cuda:{device}")
    return src, torch.empty_like(src)


def _copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    import torch

    torch.mul(src, 1, out=dst)  # an SM kernel, as the copy kernel is (not a copy engine's memcpy)


def _memcpy(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)  # same dtype, contiguous: cudaMemcpyAsync device to device


def _busy(device: int, stop: _Flag, started: _Flag, work: str = "copies") -> None:
    """Copies (or matmuls) back to back on a stream of its own until `stop` is set (a thread, or another
    process)."""
    import torch

    torch.cuda.set_device(device)
    if work == "matmuls":
        a = torch.ones(8192, 8192, dtype=torch.bfloat16, device=f"cuda:{device}")
        b, out = torch.ones_like(a), torch.empty_like(a)

        def step() -> None:
            torch.matmul(a, b, out=out)
    elif work == "decode":
        # A decode step's shape: 64 short matmuls (256 tokens through 4096 x 4096 weights, tens of us
        # each), then the host waits for the step's end and schedules the next (0.5 ms).
        x = torch.ones(256, 4096, dtype=torch.bfloat16, device=f"cuda:{device}")
        w, y = torch.ones(4096, 4096, dtype=x.dtype, device=x.device), torch.empty_like(x)

        def step() -> None:
            for _ in range(64):
                torch.matmul(x, w, out=y)
            torch.cuda.current_stream().synchronize()
            time.sleep(0.0005)
    else:
        src, dst = _buffers(device)

        def step() -> None:
            _copy(src, dst)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(4):
            step()
        stream.synchronize()
        started.set()
        while not stop.is_set():
            for _ in range(8):
                step()
            stream.synchronize()


def _measure(
    device: int, iters: int, idle_s: float, how: Callable[[torch.Tensor, torch.Tensor], None]
) -> tuple[list[float], list[float]]:
    """(host ms from launch to end, GPU ms by events) of `iters` lone copies (`how`), each after `idle_s`."""
    import torch

    src, dst = _buffers(device)
    stream = torch.cuda.Stream()
    walls, gpu = [], []
    with torch.cuda.stream(stream):
        for i in range(iters + 10):
            time.sleep(idle_s)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record(stream)
            how(src, dst)
            end.record(stream)
            end.synchronize()
            t1 = time.perf_counter()
            if i >= 10:
                walls.append((t1 - t0) * 1e3)
                gpu.append(start.elapsed_time(end))
    return walls, gpu


def _start_beside(beside: str, device: int, work: str) -> tuple[_Flag, threading.Thread | BaseProcess]:
    """`_busy` doing `work` in a thread of this process or in another process (`beside`), started and
    running: its stop flag, and the thread or process."""
    stop: _Flag
    started: _Flag
    other: threading.Thread | BaseProcess
    if beside == "thread":
        stop, started = threading.Event(), threading.Event()
        other = threading.Thread(target=_busy, args=(device, stop, started, work), daemon=True)
    else:  # "process"
        ctx = mp.get_context("spawn")
        stop, started = ctx.Event(), ctx.Event()
        other = ctx.Process(target=_busy, args=(device, stop, started, work), daemon=True)
    other.start()
    if not started.wait(120):
        raise SystemExit(f"the other {beside} did not start")
    return stop, other


def mps_state(device: int) -> str:
    """ "on" or "off": whether this process's contexts on `device` are CUDA MPS clients, by the driver's
    answer that the sidecar reports too (`memory/cuda_ipc.mps_enabled`); "unknown" where it gives none."""
    from kv_sidecar.memory.cuda_ipc import mps_enabled

    mps = mps_enabled(device)
    return "unknown" if mps is None else "on" if mps else "off"


def _p(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--idle-ms", type=float, default=1.0)
    ap.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    ap.add_argument(
        "--load", choices=["copies", "matmuls", "decode"], help="only run this loop (for --load-s), no table"
    )
    ap.add_argument("--load-s", type=float, default=60.0)
    args = ap.parse_args()
    import torch

    if args.load:
        stop, started = threading.Event(), threading.Event()
        threading.Timer(args.load_s, stop.set).start()
        _busy(args.device, stop, started, args.load)
        return 0

    torch.cuda.set_device(args.device)
    idle = args.idle_ms / 1000
    # (row, how this process copies, what else runs: None, "thread" or "process", the other's work)
    plan = [
        ("alone", _copy, None, ""),
        ("other stream", _copy, "thread", "copies"),
        ("other process", _copy, "process", "copies"),
        ("memcpy, other process", _memcpy, "process", "copies"),
        ("memcpy, alone", _memcpy, None, ""),
        ("other process, matmuls", _copy, "process", "matmuls"),
        ("other process, decode steps", _copy, "process", "decode"),
    ]
    rows = []
    for name, how, beside, work in plan:
        other = None if beside is None else _start_beside(beside, args.device, work)
        try:
            walls, gpu = _measure(args.device, args.iters, idle, how)
        finally:
            if other is not None:
                other_stop, other_runs = other
                other_stop.set()
                other_runs.join(60)
        rows.append((name, walls, gpu))
    base = statistics.median(rows[0][1])
    lines = [
        "| the copy, and what else runs | launch to end, p50 ms | p90 ms | GPU time (events), p50 ms | p90 ms | p50 / alone |",
        "|---|---|---|---|---|---|",
    ]
    for name, walls, gpu in rows:
        lines.append(
            f"| {name} | {statistics.median(walls):.3f} | {_p(walls, 0.9):.3f} | {statistics.median(gpu):.3f} | "
            f"{_p(gpu, 0.9):.3f} | {statistics.median(walls) / base:.2f}x |"
        )
    mps = mps_state(args.device)
    table = "\n".join(lines)
    print(f"CUDA MPS: {mps}")
    print(table)
    if args.write:
        cmd = " ".join(["python", "bench/gpu_share.py", *sys.argv[1:]])
        body = (
            f"Command: `{cmd}`  \nMachine: {platform.machine()}, {gpus()}  \n"
            f"Date: {datetime.date.today().isoformat()}  \n\n"
            f"One 64 MiB copy (an SM kernel reading and writing 64 MiB) after {args.idle_ms:g} ms idle, "
            f"{args.iters} times, while nothing else, a thread of this process on another stream, or another "
            f"process copies (or multiplies) back to back on the same GPU; CUDA MPS {mps}."
            f"\n\n{table}\n"
        )
        write_section(HERE.parent / "docs" / "benchmarks.md", TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
