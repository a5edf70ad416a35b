"""NIXL READs for host-memory pulls across sidecars: the identity path (`host-nixl`: every block
chunk straight into the destination blocks, from descriptor lists prepared once per rank) and the
converting one (`host-nixl-staged`: the source blocks into sidecar-owned staging memory, laid out as
the source engine's cache, then the host executor converts them into the destination blocks).

Given the NIXL driver, the metrics and the staging size; knows no gRPC and no `Sidecar`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

from kv_sidecar.execute.host import copy_request, rank_view
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.blocks import needed_src_blocks
from kv_sidecar.plan.chunks import chunk_geometry, chunk_indices, descriptor_table, descriptors
from kv_sidecar.server.engines import RankEntry
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.peers import RemoteEngine
from kv_sidecar.server.pull_job import CANCEL_WAIT_S, PullJob
from kv_sidecar.transport.nixl_driver import NixlDriver


@dataclass
class PostedRead:
    """A posted NIXL READ: its completion, the bytes it moves, and whether the in-flight gauge still counts it."""

    future: Future[None]
    nbytes: int
    counted: bool = True

    def settle(self, metrics: Metrics) -> None:
        if self.counted:
            self.counted = False
            metrics.inflight.dec()


class Staging:
    """Sidecar-owned memory for conversions: allocated and NIXL-registered once, used by one pull at a time."""

    def __init__(self, nixl: NixlDriver, metrics: Metrics, nbytes: int) -> None:
        self._nixl, self._metrics = nixl, metrics
        self.nbytes = nbytes
        self.lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8)
            self._nixl.register([(self._buf.data_ptr(), self.nbytes, 0)])
            self._metrics.staging_capacity.inc(self.nbytes)  # GPU rings add theirs
        return self._buf


class NixlReads:
    """Posts, waits for and abandons a pull's READs; one per sidecar (descriptor lists are cached on
    the ranks and remote engines they describe)."""

    def __init__(self, nixl: NixlDriver, metrics: Metrics, staging_bytes: int) -> None:
        self._nixl, self._metrics = nixl, metrics
        self._staging = Staging(nixl, metrics, staging_bytes)
        self._dlist_lock = threading.Lock()

    def wait(self, fut: Future[None], job: PullJob) -> None:
        while True:
            try:
                left = job.remaining()
            except SidecarError:
                # Stopped or timed out: cancel the transfer and let it end, so that no byte
                # lands in blocks the engine is told were not filled (it may reuse them).
                self._nixl.cancel(fut)
                with contextlib.suppress(Exception):
                    fut.result(timeout=CANCEL_WAIT_S)
                raise
            try:
                fut.result(timeout=min(0.05, left))
                return
            except FutureTimeout:
                continue
            except Exception as e:
                # The cause stays attached: _pull_remote_fresh tells a lost agent from a missing UCX path.
                raise SidecarError(Code.UNAVAILABLE, f"transfer from peer failed: {e}") from e

    def _local_dlist(self, entry: RankEntry) -> int:
        with self._dlist_lock:
            if entry.local_dlist is None:
                entry.local_dlist = self._nixl.prep_dlist(
                    "", descriptor_table(entry.geometry, entry.region_bases)
                )
            return entry.local_dlist

    def _remote_dlist(self, remote: RemoteEngine, rank: int) -> int:
        with self._dlist_lock:
            if rank not in remote.dlists:
                table = descriptor_table(remote.geometry, _regions(remote, rank))
                remote.dlists[rank] = self._nixl.prep_dlist(remote.agent_of(rank), table)
            return remote.dlists[rank]

    def post_identity(self, job: PullJob, remote: RemoteEngine) -> list[PostedRead]:
        """Same geometry both sides: one READ per local rank, each source chunk into the matching
        destination chunk, from descriptor lists prepared once. Posted, not waited for."""
        first = job.start_token // job.plan.prefill.block_size
        src = job.src_blocks[first : first + len(job.dst_blocks)]
        reads: list[PostedRead] = []
        try:
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
                (read,) = rplan.reads  # identity: rank r reads all of rank r
                job.remaining()  # stopped before touching (possibly unregistered) memory
                local_idx = chunk_indices(entry.geometry, job.dst_blocks)
                remote_idx = chunk_indices(remote.geometry, src)
                fut = self._nixl.read_prepped(
                    self._local_dlist(entry),
                    local_idx,
                    self._remote_dlist(remote, read.prefill_rank),
                    remote_idx,
                    b"",
                    job.remaining(),
                )
                self._metrics.nixl_descriptors.observe(len(local_idx))
                self._metrics.inflight.inc()
                reads.append(PostedRead(fut, len(local_idx) * entry.geometry.chunk))
        except BaseException:
            self.abandon(reads)
            raise
        return reads

    def finish(self, job: PullJob, reads: list[PostedRead]) -> int:
        """Wait for posted READs; on a failure or a stop, cancel the others and let them end."""
        try:
            for r in reads:
                self.wait(r.future, job)
        except BaseException:
            self.abandon(reads)
            raise
        finally:
            for r in reads:
                r.settle(self._metrics)
        return sum(r.nbytes for r in reads)

    def abandon(self, reads: list[PostedRead]) -> None:
        """Cancel READs still in flight and wait for them to end (no byte may land after the answer)."""
        for r in reads:
            if not r.future.done():
                self._nixl.cancel(r.future)
            with contextlib.suppress(Exception):
                r.future.result(timeout=CANCEL_WAIT_S)
            r.settle(self._metrics)

    def read_staged(
        self,
        job: PullJob,
        remote: RemoteEngine,
        entry: RankEntry,
        src_rank: int,
        heads: tuple[int, int] | None,
    ) -> int:
        """READ the needed source blocks into staging (source layout), then convert into the destination."""
        geo = remote.geometry
        _regions(remote, src_rank)  # refused before any staging is taken
        block_bytes = geo.regions * geo.outer * geo.chunk
        cap = self._staging.nbytes // block_bytes
        bs, bd = job.plan.prefill.block_size, job.plan.decode.block_size
        step = math.lcm(bs, bd)
        # Tokens per round: a multiple of lcm(Bs, Bd) so every round starts on both block grids.
        round_tokens = ((cap - 1) * bs // step) * step
        if round_tokens <= 0:
            raise SidecarError(
                Code.RESOURCE_EXHAUSTED,
                f"staging_bytes {self._staging.nbytes} cannot hold one conversion round "
                f"({math.ceil(step / bs) + 1} blocks of {block_bytes} bytes)",
            )
        nbytes = 0
        with self._staging.lock:
            buf = self._staging.buffer()
            self._metrics.staging_in_use.inc(self._staging.nbytes)
            try:
                t0 = job.start_token
                while t0 < job.num_tokens:
                    t1 = min(job.num_tokens, (t0 // step) * step + round_tokens)
                    nbytes += self._staged_round(job, remote, entry, src_rank, heads, buf, t0, t1)
                    t0 = t1
            finally:
                self._metrics.staging_in_use.dec(self._staging.nbytes)
        return nbytes

    def _staged_round(
        self,
        job: PullJob,
        remote: RemoteEngine,
        entry: RankEntry,
        src_rank: int,
        heads: tuple[int, int] | None,
        buf: torch.Tensor,
        t0: int,
        t1: int,
    ) -> int:
        geo = remote.geometry
        positions = needed_src_blocks(job.plan, job.src_blocks, t1, t0)
        k = len(positions)
        mini = dataclasses.replace(job.plan.prefill, num_blocks=k)
        mini_geo = chunk_geometry(mini)
        # Staging holds a k-block cache in the source's layout: region i at i * region_bytes.
        dtype = getattr(torch, mini.dtype)
        tensors = [
            buf[i * mini_geo.region_bytes : (i + 1) * mini_geo.region_bytes].view(dtype).view(shape)
            for i, shape in enumerate(mini.rank_tensor_shapes())
        ]
        bases = [t.data_ptr() for t in tensors]
        src_ids = np.asarray([job.src_blocks[i] for i in positions], dtype=np.int64)
        local = descriptors(mini_geo, bases, np.arange(k))
        remote_descs = descriptors(geo, _regions(remote, src_rank), src_ids)
        fut = self._nixl.read(remote.agent_of(src_rank), local, remote_descs, b"", job.remaining())
        self._metrics.nixl_descriptors.observe(len(local))
        self._metrics.inflight.inc()
        try:
            self.wait(fut, job)
        finally:
            self._metrics.inflight.dec()
        view = rank_view(mini, src_rank, tensors)
        # Staging block j holds source position positions[j]; earlier positions are never read.
        staged_ids = [0] * positions[0] + list(range(k))
        bd = job.plan.decode.block_size
        first_dst = (t0 - job.start_token) // bd
        last_dst = math.ceil((t1 - job.start_token) / bd)
        return copy_request(
            view, entry.host_view, heads, staged_ids, job.dst_blocks[first_dst:last_dst], t1, t0
        )


def _regions(remote: RemoteEngine, rank: int) -> list[int]:
    """The base addresses of a source rank's regions, as its holder told us."""
    if rank not in remote.regions:
        raise SidecarError(
            Code.FAILED_PRECONDITION, f"peer does not hold rank {rank} of engine {remote.engine_id!r}"
        )
    return remote.regions[rank]
