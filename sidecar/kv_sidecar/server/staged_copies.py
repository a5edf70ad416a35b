"""What both ends of the staged protocol share: the copies into and out of ring slots, on GPUs or host
memory, and the protocol's constants.

gpu-staged: the source engine is behind another sidecar. The reader
(server/staged_reader.py) takes receive slots from its GPU's ring and asks the
sidecar holding the source rank, in one `Push` call, to send the tokens into
them. That sidecar (server/staged_source.py) gathers chunk after chunk, already
in the reader's layout, into slots of its send ring on a CUDA stream; its NIXL
driver thread WRITEs each chunk as soon as the chunk's CUDA event completes and
a receive slot is free, as one descriptor with a notification naming the chunk.
The reader's notification launches the scatter on its stream, and its driver
thread gives the slot back (a credit notification) as soon as the scatter's
event completes. Gather, wire and scatter overlap across the slots with no host
synchronisation between stages and no gRPC message per chunk
(server/staged_protocol.py holds the bookkeeping; docs/gpu.md the protocol).
host-ring: the same protocol between host-memory engines, through host rings and
the host executor (`host_transfer: ring`; how CI runs it without GPUs).

Engine memory is never registered with NIXL (DESIGN.md section 1): only the
rings, which the sidecars own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kv_sidecar.execute import gpu, host
from kv_sidecar.execute import gpu_geometry as geo
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server import staged_protocol as sp
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.gpu_staging import Ring
from kv_sidecar.server.pull_job import CANCEL_WAIT_S

PATH_STAGED = "gpu-staged"
PATH_HOST_RING = "host-ring"

# Slots a peer may still write into (it never confirmed the end of its transfer) rejoin their pool
# this long after the Push call ended: a source whose call went away stops and cancels its WRITEs
# within CANCEL_WAIT_S.
QUARANTINE_S = 2 * CANCEL_WAIT_S
MAX_SLOTS = 4096


def read_heads(plan: PairPlan, decode_rank: int, prefill_rank: int) -> tuple[int, int] | None:
    for read in plan.decode_ranks[decode_rank].reads:
        if read.prefill_rank == prefill_rank:
            return read.heads
    raise SidecarError(
        Code.INVALID_ARGUMENT,
        f"decode rank {decode_rank} reads nothing from prefill rank {prefill_rank} under this plan",
    )


class GpuCopies:
    """Chunk copies on the transfer's CUDA stream; each launch's marker is a CUDA event on it."""

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
