"""Pulls from a prefill engine registered on this sidecar: `host-direct` (a copy with the host
executor, whole blocks by memmove where the plan is the identity) and `gpu-direct` (server/gpu_direct.py).
No NIXL, no peer; knows no gRPC and no `Sidecar`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import numpy as np

from kv_sidecar.execute.host import copy_request
from kv_sidecar.plan.chunks import descriptors
from kv_sidecar.server import gpu_direct
from kv_sidecar.server.engine_calls import Later
from kv_sidecar.server.engines import EngineRegistry, RankEntry
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.inflight import PullTicket
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import PublishedStore
from kv_sidecar.server.pull_job import PullJob, build_job
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2


def copy_blocks(src: RankEntry, dst: RankEntry, src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """Copy whole blocks between two host ranks of the same geometry (an identity plan): one
    memmove per chunk, the runs NIXL's descriptor tables describe. Returns bytes copied.

    The ids were validated against both specs (check_pull); they are checked again here because
    memmove is not. Holding the tensors keeps their mappings alive should a rank unregister
    meanwhile (ShmMapper unmaps a segment only once no view of it is left).
    """
    src_t, dst_t = list(src.tensors), list(dst.tensors)
    sg, dg = src.geometry, dst.geometry
    if len(src_t) != sg.regions or len(dst_t) != dg.regions:
        raise SidecarError(Code.FAILED_PRECONDITION, "a rank of the pull was unregistered during it")
    if (sg.outer, sg.chunk, sg.regions) != (dg.outer, dg.chunk, dg.regions) or len(src_ids) != len(dst_ids):
        raise SidecarError(Code.INTERNAL, "block copy between ranks of different geometry")
    for ids, geo in ((src_ids, sg), (dst_ids, dg)):
        if len(ids) and not (int(np.min(ids)) >= 0 and int(np.max(ids)) < geo.num_blocks):
            raise SidecarError(Code.INTERNAL, f"block id out of range [0, {geo.num_blocks})")
    s_addr = descriptors(sg, [t.data_ptr() for t in src_t], src_ids)[:, 0].tolist()
    d_addr = descriptors(dg, [t.data_ptr() for t in dst_t], dst_ids)[:, 0].tolist()
    n = dg.chunk
    for d, s_ in zip(d_addr, s_addr, strict=True):
        ctypes.memmove(d, s_, n)
    return len(d_addr) * n


class DirectPulls:
    def __init__(
        self,
        engines: EngineRegistry,
        membership: Membership,
        published: PublishedStore,
        release: Callable[[str, str, str, str], object],
    ) -> None:
        self._engines, self._membership, self._published = engines, membership, published
        self._release = release  # (engine, request, reader, reason): end a request published here

    def pull(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
        release_now: Callable[[PullTicket], bool],
    ) -> tuple[int, str]:
        """Copy the request's blocks from the prefill ranks registered here; "consumed" once answered."""
        p = req.params
        if self._membership.is_split(p.engine_id):
            raise SidecarError(
                Code.UNIMPLEMENTED,
                f"engine {p.engine_id!r} spans this sidecar and others: pulling from an engine that spans "
                f"the reading sidecar and others is not supported",
            )
        src_ranks = self._engines.engine_ranks(p.engine_id)
        plan = cached_plan(src_ranks[0].spec, local[0].spec)
        if len(src_ranks) != plan.prefill.tp_size:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {p.engine_id!r} has {len(src_ranks)} of {plan.prefill.tp_size} ranks registered",
            )
        item = self._published.open_read(
            p.engine_id,
            p.request_id,
            req.engine_id,
            plan,
            [e.rank for e in local],
            deadline - time.monotonic(),
        )
        job = build_job(req, local, plan, item.block_ids, item.num_tokens, cancel, deadline, item.first_token)
        try:
            return self._copy(job, src_ranks, after)
        except Exception:
            if release_now(cancel):
                self._release(p.engine_id, p.request_id, req.engine_id, "the reader gave it up")
            raise

    def _copy(self, job: PullJob, src_ranks: list[RankEntry], after: Later) -> tuple[int, str]:
        """The copies, then "consumed" once the pull has answered (`after`): the prefill engine frees
        its blocks no sooner than the bytes are in place, and the event's wake-up of the prefill's
        event stream no longer competes with the answer."""
        p = job.params
        done_ranks = [
            (entry, [r.prefill_rank for r in rplan.reads] + list(rplan.notify_only))
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True)
        ]

        def consumed() -> None:
            for entry, done in done_ranks:
                self._published.mark_done(p.engine_id, p.request_id, entry.engine_id, entry.rank, done)

        if any(e.gpu is not None for e in [*src_ranks, *job.local]):
            nbytes = gpu_direct.pull_direct(job, src_ranks)
            after.append(consumed)
            return nbytes, gpu_direct.PATH_DIRECT
        nbytes = 0
        identity = job.plan.is_identity()
        for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
            for read in rplan.reads:
                job.remaining()
                if identity:  # whole blocks, as host-nixl moves them: no per-token indexing
                    first = job.start_token // job.plan.prefill.block_size
                    src_ids = job.src_blocks[first : first + len(job.dst_blocks)]
                    nbytes += copy_blocks(src_ranks[read.prefill_rank], entry, src_ids, job.dst_blocks)
                    continue
                nbytes += copy_request(
                    src_ranks[read.prefill_rank].host_view,
                    entry.host_view,
                    read.heads,
                    job.src_blocks,
                    job.dst_blocks,
                    job.num_tokens,
                    job.start_token,
                )
        after.append(consumed)
        return nbytes, "host-direct"
