"""The chunk copies of the staged protocol, into ring slots (a source's gathers) and out of them (a
reader's scatters): on a GPU with the Triton kernels on the transfer's CUDA stream, or in host memory
with the host executor (`host_transfer: ring`; how CI runs the protocol without GPUs).

The protocol itself: docs/gpu.md; its bookkeeping: dataplane/staged_protocol.py; its two ends:
dataplane/send.py and dataplane/receive.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.rings import Ring
from kv_sidecar.execute import gpu, host
from kv_sidecar.execute import gpu_geometry as geo
from kv_sidecar.plan.spec import EngineSpec


class GpuCopies:
    """Chunk copies on the transfer's CUDA stream; each launch's marker is a CUDA event on it."""

    enqueues = True  # `launch` returns once the copy is queued: a reader launches it on its NIXL thread

    def __init__(self, staged: gpu.StagedCopies) -> None:
        self.staged = staged
        self.stream = staged.stream

    def launch(self, t0: int, t1: int, address: int) -> tuple[Any, int]:
        nbytes = self.staged.launch(t0, t1, address)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event, nbytes

    @staticmethod
    def ready(marker: Any) -> bool:
        return bool(marker.query())

    def synchronize(self) -> None:
        self.stream.synchronize()


class HostCopies:
    """The same chunk copies with the host executor (synchronous: a marker is always ready)."""

    enqueues = False  # `launch` copies the bytes: a reader's NIXL thread would wait for them

    def __init__(
        self,
        engine: host.RankView,
        staging_spec: EngineSpec,
        staging_rank: int,
        heads: tuple[int, int] | None,
        engine_ids: np.ndarray,
        ring: Ring,
        into_staging: bool,
    ) -> None:
        self.engine = engine
        self.spec = staging_spec
        self.rank = staging_rank
        self.heads = heads
        self.ids = engine_ids
        self.ring = ring
        self.into = into_staging
        self.first = 0  # scatter: position of the start token's block in `ids`, set by the reader

    def _slot_view(self, address: int, k: int) -> host.RankView:
        """A slot as a k-block cache of the staging spec: the byte layout of `gpu.staging_view`."""
        mini = dataclasses.replace(self.spec, num_blocks=k)
        n = geo.tensor_nbytes(mini)
        off = address - self.ring.buffer.data_ptr()
        dtype = getattr(torch, mini.dtype)
        tensors = [
            self.ring.buffer[off + i * n : off + (i + 1) * n].view(dtype).view(shape)
            for i, shape in enumerate(mini.rank_tensor_shapes())
        ]
        return host.rank_view(mini, self.rank, tensors)

    def launch(self, t0: int, t1: int, address: int) -> tuple[Any, int]:
        bd = self.spec.block_size
        k = sp.blocks_in(bd, t0, t1)
        slot = self._slot_view(address, k)
        if self.into:
            return None, host.copy_request(self.engine, slot, self.heads, self.ids, range(k), t1, t0)
        first = t0 // bd - self.first
        dst = self.ids[first : first + k]
        return None, host.copy_request(slot, self.engine, self.heads, range(k), dst, t1, t0)

    @staticmethod
    def ready(marker: Any) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def block_size_of(copies: GpuCopies | HostCopies) -> int:
    spec = copies.staged.staging_spec if isinstance(copies, GpuCopies) else copies.spec
    return spec.block_size
