"""NIXL READs for host-memory pulls across sidecars: the identity path (`host-nixl`: every block
chunk straight into the destination blocks, from per-block descriptor lists prepared once per rank,
or with `host_read_merge` one descriptor per run of consecutive block ids) and the
converting one (`host-nixl-staged`: the source blocks into sidecar-owned staging memory, laid out as
the source engine's cache, then the host executor converts them into the destination blocks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from kv_sidecar.dataplane.jobs import CANCEL_WAIT_S, BlockReads, ConvertedRead, Halt, RemoteRank, StateRead
from kv_sidecar.dataplane.ranks import MappedRanks
from kv_sidecar.dataplane.state_copies import dst_pages, remote_pages, state_descriptors
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.execute.host import copy_request, rank_view
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.blocks import needed_src_blocks
from kv_sidecar.plan.chunks import (
    block_runs,
    by_destination,
    chunk_geometry,
    chunk_indices,
    descriptor_table,
    descriptors,
    merged_segments,
    segment_descriptors,
)
from kv_sidecar.transport.nixl_driver import NixlDriver, ended

# With `merge` on, host-nixl posts lists built for the pull (one descriptor per run of consecutive block
# ids) only when that at least halves the descriptors: building and initialising a list costs 50-300 us
# more than indexing the prepared per-block lists (NIXL 1.5.1, CPU machine), which a fragmented pull
# does not win back.
MERGE_MIN_SHRINK = 2


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
    """Posts, waits for and abandons READs into host ranks here; one per sidecar (descriptor lists
    are prepared once per rank, ours and the peers')."""

    def __init__(
        self, ranks: MappedRanks, nixl: NixlDriver, metrics: Metrics, staging_bytes: int, merge: bool = False
    ) -> None:
        self._ranks, self._nixl, self._metrics = ranks, nixl, metrics
        self._merge = merge
        self._staging = Staging(nixl, metrics, staging_bytes)
        self._dlist_lock = threading.Lock()
        self._remote_dlists: dict[tuple[str, int, str, int, tuple[int, ...]], int] = {}

    def wait(self, fut: Future[None], halt: Halt) -> None:
        while True:
            try:
                left = halt.remaining()
            except SidecarError:
                # Stopped or timed out: cancel the transfer and let it end, so that no byte
                # lands in blocks the engine is told were not filled (it may reuse them).
                self._nixl.cancel(fut)
                with contextlib.suppress(Exception):
                    fut.result(timeout=CANCEL_WAIT_S)
                raise
            if not ended([fut], min(0.05, left)):
                continue
            try:
                fut.result()
                return
            except TimeoutError:
                continue  # its NIXL deadline passed, which is the halt's: the halt raises next turn
            except Exception as e:
                # The cause stays attached: the puller tells a lost agent from a missing UCX path.
                raise SidecarError(Code.UNAVAILABLE, f"transfer from peer failed: {e}") from e

    def _remote_dlist(self, src: RemoteRank) -> int:
        # The agent's generation: a peer that restarted under the same name (and, forked alike, maps
        # its memory at the same addresses) voids the lists prepared against its old agent.
        key = (src.agent, self._nixl.generation(src.agent), src.engine_id, src.rank, src.region_bases)
        with self._dlist_lock:
            if key not in self._remote_dlists:
                for stale in [k for k in self._remote_dlists if k[0] == src.agent and k[1] != key[1]]:
                    del self._remote_dlists[stale]  # the driver released them when it loaded the agent again
                table = descriptor_table(chunk_geometry(src.spec), list(src.region_bases))
                self._remote_dlists[key] = self._nixl.prep_dlist(src.agent, table)
            return self._remote_dlists[key]

    def post(self, job: BlockReads, halt: Halt) -> list[PostedRead]:
        """Same geometry both sides: one READ per local rank, each source chunk into the matching
        destination chunk, by index into the per-block lists prepared once; with `merge`, runs of
        consecutive block ids (on both sides) go as one descriptor per region and outer index, in
        lists built for this pull, where that shrinks the list enough. Posted, not waited for."""
        t = job.tokens
        reads: list[PostedRead] = []
        try:
            for dst_key, src in job.reads:
                first = t.start_token // src.spec.block_size
                src_ids = t.src_blocks[first : first + len(t.dst_blocks)]
                halt.remaining()  # stopped before touching (possibly unregistered) memory
                dst = self._ranks.host(dst_key)
                src_geo = chunk_geometry(src.spec)
                n = len(src_ids)
                # A one-block pull (the latency-bound case) skips even counting runs.
                if (
                    self._merge
                    and n >= MERGE_MIN_SHRINK
                    and len(block_runs(t.dst_blocks, src_ids)) * MERGE_MIN_SHRINK <= n
                ):
                    segments = merged_segments(dst.geometry, src_geo, t.dst_blocks, src_ids)
                    local, remote = segment_descriptors(segments, dst.region_bases, list(src.region_bases))
                    fut = self._nixl.read(src.agent, local, remote, b"", halt.remaining())
                    count, nbytes = len(local), int(segments[:, 3].sum())
                else:
                    # By destination id: NIXL coalesces prepared descriptors that are neighbours in the
                    # list and in memory on both sides (docs/benchmarks.md, "host-nixl descriptor
                    # merging"), which a table running backwards on both sides then is.
                    dst_ids, ordered_src = by_destination(t.dst_blocks, src_ids)
                    local_idx = chunk_indices(dst.geometry, dst_ids)
                    fut = self._nixl.read_prepped(
                        self._ranks.local_dlist(dst),
                        local_idx,
                        self._remote_dlist(src),
                        chunk_indices(src_geo, ordered_src),
                        b"",
                        halt.remaining(),
                    )
                    count, nbytes = len(local_idx), len(local_idx) * dst.geometry.chunk
                self._metrics.nixl_descriptors.observe(count)
                self._metrics.inflight.inc()
                reads.append(PostedRead(fut, nbytes))
        except BaseException:
            self.abandon(reads)
            raise
        return reads

    def finish(self, reads: list[PostedRead], halt: Halt) -> int:
        """Wait for posted READs; on a failure or a stop, cancel the others and let them end."""
        try:
            for r in reads:
                self.wait(r.future, halt)
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

    def read_converted(self, job: ConvertedRead, halt: Halt) -> int:
        """READ the needed source blocks into staging (source layout), then convert into the destination."""
        geo = chunk_geometry(job.src.spec)
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
        t = job.tokens
        with self._staging.lock:
            buf = self._staging.buffer()
            self._metrics.staging_in_use.inc(self._staging.nbytes)
            try:
                t0 = t.start_token
                while t0 < t.num_tokens:
                    t1 = min(t.num_tokens, (t0 // step) * step + round_tokens)
                    nbytes += self._converted_round(job, halt, buf, t0, t1)
                    t0 = t1
            finally:
                self._metrics.staging_in_use.dec(self._staging.nbytes)
        return nbytes

    def _converted_round(self, job: ConvertedRead, halt: Halt, buf: torch.Tensor, t0: int, t1: int) -> int:
        t, src = job.tokens, job.src
        positions = needed_src_blocks(job.plan, t.src_blocks, t1, t0)
        k = len(positions)
        mini = dataclasses.replace(job.plan.prefill, num_blocks=k)
        mini_geo = chunk_geometry(mini)
        # Staging holds a k-block cache in the source's layout: region i at i * region_bytes.
        dtype = getattr(torch, mini.dtype)
        tensors = [
            buf[i * mini_geo.region_bytes : (i + 1) * mini_geo.region_bytes].view(dtype).view(shape)
            for i, shape in enumerate(mini.rank_tensor_shapes())
        ]
        bases = [x.data_ptr() for x in tensors]
        src_ids = np.asarray([t.src_blocks[i] for i in positions], dtype=np.int64)
        local = descriptors(mini_geo, bases, np.arange(k))
        remote_descs = descriptors(chunk_geometry(src.spec), list(src.region_bases), src_ids)
        fut = self._nixl.read(src.agent, local, remote_descs, b"", halt.remaining())
        self._metrics.nixl_descriptors.observe(len(local))
        self._metrics.inflight.inc()
        try:
            self.wait(fut, halt)
        finally:
            self._metrics.inflight.dec()
        view = rank_view(mini, src.rank, tensors)
        # Staging block j holds source position positions[j]; earlier positions are never read.
        staged_ids = [0] * positions[0] + list(range(k))
        bd = job.plan.decode.block_size
        first_dst = (t0 - t.start_token) // bd
        last_dst = math.ceil((t1 - t.start_token) / bd)
        dst = self._ranks.host(job.dst)
        return copy_request(view, dst.view, job.heads, staged_ids, t.dst_blocks[first_dst:last_dst], t1, t0)

    def read_state(self, job: StateRead, halt: Halt) -> int:
        """A Mamba state block's runs, one READ per source rank straight into the destination block
        (no staging: the runs are already where the destination keeps them); all posted, then waited."""
        halt.remaining()  # stopped before touching (possibly unregistered) memory
        pages = dst_pages(self._ranks, job)
        src_pages = remote_pages(job)
        posted: list[PostedRead] = []
        try:
            for src in job.sources:
                local, remote = state_descriptors(job.block, src.rank, src_pages[src.rank], pages)
                if not len(local):
                    continue
                fut = self._nixl.read(src.agent, local, remote, b"", halt.remaining())
                self._metrics.nixl_descriptors.observe(len(local))
                self._metrics.inflight.inc()
                posted.append(PostedRead(fut, int(local[:, 1].sum())))
        except BaseException:
            self.abandon(posted)
            raise
        self.finish(posted, halt)
        return job.block.nbytes
