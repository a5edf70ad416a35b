"""A stand-in inference engine in its own process: owns KV tensors on one GPU, exports them over CUDA IPC.

The sidecar side of a test (or the bench) talks to it over two queues:
it answers the start with every tensor's `CudaIpcExport`, then serves
"dump" (CPU copies of its tensors, to check what a pull wrote) until "exit".
Run with the spawn start method: CUDA cannot be used in a forked child.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ALIGN = 512  # byte alignment of tensors carved from one allocation (like the caching allocator)


@dataclass(frozen=True)
class Job:
    """One rank's cache to create: `spec` as a dict, filled from `seed` (kvcases.random_tensors)."""

    key: str
    spec: dict[str, Any]
    rank: int
    seed: int
    one_allocation: bool = False  # carve every tensor of the rank from one cudaMalloc (with gaps)
    # "random": kvcases.random_tensors(seed), reproducible; "device": random on the GPU (fast, big caches)
    fill: str = "random"


def _make(job: Job, device: Any) -> tuple[list[Any], Any]:
    import torch

    from kv_sidecar.plan.spec import EngineSpec

    spec = EngineSpec.from_dict(job.spec)
    dtype = getattr(torch, spec.dtype)
    shapes = spec.rank_tensor_shapes()
    nbytes = [int(torch.Size(s).numel()) * spec.element_size for s in shapes]
    if job.fill == "random":
        import kvcases

        host = kvcases.random_tensors(spec, job.seed)
    else:
        host = None
    if job.one_allocation:
        steps = [-(-n // ALIGN) * ALIGN + ALIGN for n in nbytes]  # a gap after every tensor
        big = torch.full((sum(steps) + ALIGN,), 0x5A, dtype=torch.uint8, device=device)
        out, at = [], ALIGN
        for n, step, shape in zip(nbytes, steps, shapes, strict=True):
            out.append(big[at : at + n].view(dtype).view(shape))
            at += step
        owner = big
    else:
        out = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        owner = out
    for i, t in enumerate(out):
        if host is not None:
            t.copy_(host[i])
        else:
            flat = t.view(torch.uint8).view(-1)
            torch.manual_seed(job.seed + i)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=device))
    return out, owner


def engine_main(device: int, jobs: Sequence[Job], commands: Any, replies: Any, env: dict[str, str]) -> None:
    """Process body: create every job's tensors on `device`, export them, serve commands."""
    import os

    os.environ.update(env)
    try:
        import torch

        if env.get("EXPANDABLE") == "1":
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        from kv_sidecar_client.cuda_ipc import export_tensor

        torch.cuda.set_device(device)
        tensors: dict[str, list[Any]] = {}
        owners: dict[str, Any] = {}
        exports: dict[str, Any] = {}
        for job in jobs:
            ts, owner = _make(job, torch.device("cuda", device))
            tensors[job.key] = ts
            owners[job.key] = owner
            try:
                exports[job.key] = [export_tensor(t) for t in ts]
            except Exception as exc:
                exports[job.key] = exc  # e.g. the VMM refusal, reported to the test
        torch.cuda.synchronize()
        replies.put(("ready", exports))
        while True:
            cmd, arg = commands.get()
            if cmd == "exit":
                break
            if cmd == "dump":
                torch.cuda.synchronize()
                replies.put(("dump", {k: [t.cpu() for t in tensors[k]] for k in arg}))
            if cmd == "gaps":  # bytes of a one-allocation rank that belong to no tensor
                torch.cuda.synchronize()
                keep = torch.ones(owners[arg].numel(), dtype=torch.bool, device=owners[arg].device)
                base = owners[arg].data_ptr()
                for t in tensors[arg]:
                    at = t.data_ptr() - base
                    keep[at : at + t.numel() * t.element_size()] = False
                replies.put(("gaps", owners[arg][keep].cpu()))
    except Exception:
        replies.put(("error", traceback.format_exc()))


class Engine:
    """Parent-side handle of an engine process."""

    def __init__(self, device: int, jobs: Sequence[Job], env: dict[str, str] | None = None) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self._commands: mp.Queue[Any] = ctx.Queue()
        self._replies: mp.Queue[Any] = ctx.Queue()
        self.process = ctx.Process(
            target=engine_main,
            args=(device, list(jobs), self._commands, self._replies, env or {}),
            daemon=True,
        )
        self.process.start()
        self.device = device
        self.exports: dict[str, Any] = self._reply("ready", timeout=300)

    def _reply(self, kind: str, timeout: float) -> Any:
        got, value = self._replies.get(timeout=timeout)
        if got == "error":
            raise RuntimeError(f"engine process on cuda:{self.device} failed:\n{value}")
        assert got == kind, (got, kind)
        return value

    def dump(self, keys: Sequence[str]) -> dict[str, list[Any]]:
        self._commands.put(("dump", list(keys)))
        return self._reply("dump", timeout=300)

    def gaps(self, key: str) -> Any:
        self._commands.put(("gaps", key))
        return self._reply("gaps", timeout=300)

    def close(self) -> None:
        if self.process.is_alive():
            self._commands.put(("exit", None))
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
