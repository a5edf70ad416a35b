"""Executing a pull: validate, agree on the plan, move the bytes, report.

Three paths, chosen per request:
- host-direct: the prefill engine is registered on this sidecar; copy with the
  host executor, no NIXL.
- host-nixl: another sidecar, and the plan is the identity (same layout, TP,
  block size): NIXL READs every block chunk straight into the destination
  blocks, from descriptor lists prepared once per rank.
- host-nixl-staged: another sidecar, and the bytes must be converted (layout,
  TP, block size): NIXL READs the source blocks into sidecar-owned staging
  memory laid out as the source engine's cache, then the host executor converts
  them into the destination blocks.
- gpu-direct and gpu-staged: the same two situations in GPU memory
  (`kv_sidecar.server.gpu_direct`, `staged_reader`); host-ring: the staged protocol of
  gpu-staged between host-memory engines (setting `host_transfer: ring`).

Across sidecars, every OpenRead/CloseRead, READ and completion notification
goes to the sidecar that holds the source rank (server/routing.py): the one
peer of a one-node engine, or, for an engine whose ranks span several nodes,
the holder named in the map its leader returned at handshake (docs/multinode.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kv_sidecar.execute.host import copy_request, rank_view
from kv_sidecar.plan.blocks import check_pull, needed_src_blocks
from kv_sidecar.plan.chunks import chunk_geometry, chunk_indices, descriptor_table, descriptors
from kv_sidecar.plan.pair import DecodeRankPlan, PairPlan
from kv_sidecar.plan.spec import PlanError
from kv_sidecar.server import gpu_direct, staged_copies, staged_reader
from kv_sidecar.server.engine_calls import Later, run_later
from kv_sidecar.server.engines import RankEntry
from kv_sidecar.server.errors import Code, SidecarError, as_sidecar_error, check_address
from kv_sidecar.server.inflight import PullTicket, stopped_error
from kv_sidecar.server.notifications import done_notification
from kv_sidecar.server.peers import Holder, RemoteEngine, cached_plan
from kv_sidecar.server.release import release_here
from kv_sidecar.server.routing import (
    Opening,
    by_holder,
    close_reads,
    depends_on,
    holders_needed,
    open_read_request,
)
from kv_sidecar.transport.nixl_driver import AgentDisconnected, ucx_emulation_disabled
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)


class _Retry(Exception):
    """The first attempt of a remote pull met a stale handshake; try once more."""


def _agent_lost(e: BaseException | None) -> bool:
    """Whether NIXL's "agent disconnected" at the start of a READ is among the causes of `e`."""
    while e is not None:
        if isinstance(e, AgentDisconnected):
            return True
        e = e.__cause__
    return False


def _no_native_path(address: str) -> SidecarError:
    return SidecarError(
        Code.FAILED_PRECONDITION,
        f"peer sidecar {address} answers, but NIXL cannot READ from it: its agent shows as disconnected "
        "at every READ, which is what UCX does when no transport reaches the peer's memory without "
        "emulation (UCX_PROTO_EMULATION_ENABLE=n, the sidecar's default), e.g. two nodes with only TCP "
        "between them. Give the pods RDMA (deploy/k8s/components/rdma), or, to move host memory over "
        "TCP, set UCX_PROTO_EMULATION_ENABLE=y in this (reading) sidecar's environment, or set "
        "host_transfer: ring on it (the source then WRITEs, which TCP does natively; "
        "docs/operations.md, 5.9)",
    )


@dataclass
class _Read:
    """A posted NIXL READ: its completion, the bytes it moves, and whether the in-flight gauge still counts it."""

    future: Future[None]
    nbytes: int
    counted: bool = True

    def settle(self, metrics: Any) -> None:
        if self.counted:
            self.counted = False
            metrics.inflight.dec()


_CANCEL_WAIT_S = 5.0  # how long a stopped pull waits for NIXL to end its transfer


# A failed pull names the blocks it left unfilled in its status message and in a trailer. Both travel
# as gRPC headers, which gRPC caps at 8 KiB by default (a longer one turns the answer into
# RESOURCE_EXHAUSTED): long lists are named by count, and the trailer says "all" of the request's.
_NAMED_BLOCKS = 32
_TRAILER_CHARS = 2048
UNFILLED_ALL = "all"


def _ring_path(job: PullJob) -> str:
    """The staged protocol's path label: through GPU rings, or host rings (`host_transfer: ring`)."""
    return (
        staged_copies.PATH_STAGED
        if any(e.gpu is not None for e in job.local)
        else staged_copies.PATH_HOST_RING
    )


def unfilled_blocks(block_ids: Sequence[int]) -> tuple[str, str]:
    """(the failed pull's message fragment, its kvsidecar-unfilled-blocks trailer), both short.

    A pull fails whole, so every requested block is unfilled."""
    listed = ",".join(str(b) for b in block_ids)
    trailer = listed if len(listed) <= _TRAILER_CHARS else UNFILLED_ALL
    if len(block_ids) <= _NAMED_BLOCKS:
        return f"[{listed}]", trailer
    return f"all {len(block_ids)} requested (first {block_ids[0]}, last {block_ids[-1]})", trailer


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


@dataclass
class PullJob:
    """One validated pull, before any byte moves."""

    params: common_pb2.TransferParams
    local: list[RankEntry]
    plan: PairPlan
    src_blocks: np.ndarray  # int64, validated against the plan
    dst_blocks: np.ndarray
    num_tokens: int
    start_token: int
    deadline: float
    cancel: threading.Event

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if self.cancel.is_set():
            raise stopped_error(self.cancel, self.params.request_id)
        if left <= 0:
            raise SidecarError(
                Code.DEADLINE_EXCEEDED, f"pull of request {self.params.request_id!r} timed out"
            )
        return left

    def rank_plans(self) -> list[DecodeRankPlan]:
        return [self.plan.decode_ranks[e.rank] for e in self.local]


class Staging:
    """Sidecar-owned memory for conversions: allocated and NIXL-registered once, used by one pull at a time."""

    def __init__(self, sidecar: Sidecar, nbytes: int) -> None:
        self._sc = sidecar
        self.nbytes = nbytes
        self.lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8)
            self._sc.nixl.register([(self._buf.data_ptr(), self.nbytes, 0)])
            self._sc.metrics.staging_capacity.inc(self.nbytes)  # GPU rings add theirs
        return self._buf


class Puller:
    def __init__(self, sidecar: Sidecar) -> None:
        self._sc = sidecar
        self.sidecar = sidecar
        self._staging = Staging(sidecar, sidecar.settings.staging_bytes)
        self._dlist_lock = threading.Lock()

    # -- entry point ------------------------------------------------------
    def pull(
        self, req: engine_pb2.PullRequest, cancel: PullTicket, later: Later | None = None
    ) -> engine_pb2.PullResponse:
        """`later`: see engine_calls.pull. What is left there (the pull's log record, "consumed"
        events of a same-sidecar pull) waits for nothing the engine needs: ~0.07 ms of a 0.5 ms
        same-sidecar pull (bench/trace_pull.py --local)."""
        after: Later = [] if later is None else later
        try:
            return self._pull(req, cancel, after)
        finally:
            if later is None:
                run_later(after)

    def _pull(self, req: engine_pb2.PullRequest, cancel: PullTicket, after: Later) -> engine_pb2.PullResponse:
        sc = self._sc
        p = req.params
        timeout_s = (req.timeout_ms or sc.settings.pull_timeout_ms) / 1000
        start = time.perf_counter()
        remote_here = p.sidecar_id == sc.sidecar_id
        path = "host-direct" if remote_here else "host-nixl"
        track = sc.transfers.begin_pull(
            req.engine_id, p.request_id, p.engine_id, "local" if remote_here else p.sidecar_address
        )
        try:
            local = self._local_ranks(req, cancel.ranks)
            if remote_here:
                nbytes, path = self._pull_direct(req, local, cancel, time.monotonic() + timeout_s, after)
            else:
                nbytes, path = self._pull_remote_fresh(
                    req, local, cancel, time.monotonic() + timeout_s, after
                )
        except Exception as e:
            err = as_sidecar_error(e)
            outcome = {Code.CANCELLED: "cancelled", Code.DEADLINE_EXCEEDED: "timeout"}.get(err.code, "error")
            sc.metrics.pulls.labels(path, outcome).inc()
            sc.metrics.failures.labels(f"pull_{err.code.name.lower()}").inc()
            after.append(sc.transfers.end_pull(track, 0, path, outcome, f"{err.code.name}: {err.message}"))
            named, trailer = unfilled_blocks(req.block_ids)
            raise SidecarError(
                err.code,
                f"{err.message}; local blocks not filled: {named}",
                (("kvsidecar-unfilled-blocks", trailer),),
            ) from None
        elapsed = time.perf_counter() - start
        sc.metrics.pulls.labels(path, "ok").inc()
        sc.metrics.pull_bytes.labels(path).inc(nbytes)
        sc.metrics.pull_duration.labels(path).observe(elapsed)
        sc.metrics.pull_throughput.labels(path).observe(nbytes / elapsed if elapsed > 0 else 0)
        after.append(sc.transfers.end_pull(track, nbytes, path, "ok"))
        return engine_pb2.PullResponse(bytes=nbytes, duration_us=int(elapsed * 1e6), path=path)

    def _local_ranks(self, req: engine_pb2.PullRequest, ranks: Sequence[int]) -> list[RankEntry]:
        """The local ranks to fill: `ranks` as the pull was admitted with (the request's, or every
        rank registered when it arrived)."""
        reg = self._sc.engines
        if len(set(ranks)) != len(ranks):
            raise SidecarError(Code.INVALID_ARGUMENT, f"ranks {list(ranks)} contain duplicates")
        if not ranks:
            return reg.engine_ranks(req.engine_id)  # NOT_FOUND: no rank of it registered
        return [reg.get(req.engine_id, r) for r in ranks]

    def _release_now(self, ticket: PullTicket) -> bool:
        """A failed pull that moves no byte any more: may the source free the request's blocks now?
        Only if the reader is gone for good and no other pull of the request still moves bytes."""
        last = self._sc.pulls.last_to_end(ticket)
        return ticket.release_source and last

    def _job(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        plan: PairPlan,
        src_blocks: list[int],
        num_tokens: int,
        cancel: threading.Event,
        deadline: float,
    ) -> PullJob:
        # Block ids arrive as protobuf repeated uint32 (never bools or negatives): as int64 arrays,
        # every later check (the executors validate again) takes the vectorised path. As Python
        # lists, validation was a quarter of a 1 GiB same-node GPU pull (py-spy, 2x H200).
        src = np.fromiter(src_blocks, dtype=np.int64, count=len(src_blocks))
        dst = np.fromiter(req.block_ids, dtype=np.int64, count=len(req.block_ids))
        check_pull(plan, src, num_tokens, dst, req.start_token)
        return PullJob(
            req.params,
            local,
            plan,
            src,
            dst,
            num_tokens,
            req.start_token,
            deadline,
            cancel,
        )

    # -- same sidecar -------------------------------------------------------
    def _pull_direct(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
    ) -> tuple[int, str]:
        sc, p = self._sc, req.params
        if sc.membership.is_split(p.engine_id):
            raise SidecarError(
                Code.UNIMPLEMENTED,
                f"engine {p.engine_id!r} spans this sidecar and others: pulling from an engine that spans "
                f"the reading sidecar and others is not supported",
            )
        src_ranks = sc.engines.engine_ranks(p.engine_id)
        plan = cached_plan(src_ranks[0].spec, local[0].spec)
        if len(src_ranks) != plan.prefill.tp_size:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {p.engine_id!r} has {len(src_ranks)} of {plan.prefill.tp_size} ranks registered",
            )
        item = sc.published.open_read(
            p.engine_id,
            p.request_id,
            req.engine_id,
            plan,
            [e.rank for e in local],
            deadline - time.monotonic(),
        )
        job = self._job(req, local, plan, item.block_ids, item.num_tokens, cancel, deadline)
        try:
            return self._copy_direct(job, src_ranks, after)
        except Exception:
            if self._release_now(cancel):
                release_here(sc, p.engine_id, p.request_id, req.engine_id, "the reader gave it up")
            raise

    def _copy_direct(self, job: PullJob, src_ranks: list[RankEntry], after: Later) -> tuple[int, str]:
        """The copies, then "consumed" once the pull has answered (`after`): the prefill engine frees
        its blocks no sooner than the bytes are in place, and the event's wake-up of the prefill's
        event stream no longer competes with the answer."""
        sc, p = self._sc, job.params
        done_ranks = [
            (entry, [r.prefill_rank for r in rplan.reads] + list(rplan.notify_only))
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True)
        ]

        def consumed() -> None:
            for entry, done in done_ranks:
                sc.published.mark_done(p.engine_id, p.request_id, entry.engine_id, entry.rank, done)

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

    # -- another sidecar ------------------------------------------------------
    def _pull_remote_fresh(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
    ) -> tuple[int, str]:
        """_pull_remote, dropping a cached handshake that went stale (the peer restarted).

        A peer that forgot our plan, or whose NIXL agent is gone, fails the pull; handshake
        again and retry once within the same deadline. Rewriting destination blocks that a
        failed attempt partly wrote is harmless: OpenRead checks the lease again first.
        """
        try:
            return self._pull_remote(req, local, cancel, deadline, after, may_retry=True)
        except _Retry as first:
            try:
                return self._pull_remote(req, local, cancel, deadline, after, may_retry=False)
            except SidecarError as again:
                # The peer answered a new handshake, yet its agent is "disconnected" again at the READ.
                if _agent_lost(first) and _agent_lost(again) and ucx_emulation_disabled():
                    self._sc.metrics.ucx_emulation.inc()
                    raise _no_native_path(req.params.sidecar_address) from again
                raise

    def _pull_remote(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
        may_retry: bool,
    ) -> tuple[int, str]:
        sc, p = self._sc, req.params
        ranks = [e.rank for e in local]
        opened_on: list[Holder] = []
        early: list[_Read] = []
        opening: Opening | None = None
        try:
            check_address("params.sidecar_address", p.sidecar_address)
            _, remote = sc.peers.remote_engine(
                p.sidecar_address,
                p.engine_id,
                req.engine_id,
                local[0].spec,
                max(0.001, deadline - time.monotonic()),
                cancel,
                lambda: stopped_error(cancel, p.request_id),
            )
            # Each source rank's sidecar: the leader for a one-node engine, else from the leader's map.
            holders = list(
                holders_needed(remote, [remote.plan.decode_ranks[r] for r in ranks], sc.sidecar_id)
            )
            pushed = self._push_with_open(req, local, remote, holders, cancel, deadline)
            if pushed is not None:
                opened_on = holders  # a failure closes the read that the Push opened
                (rplan,) = pushed.rank_plans()
                nbytes = staged_reader.read_staged(
                    self,
                    pushed,
                    remote,
                    pushed.local[0],
                    rplan.reads[0].prefill_rank,
                    open_msg=open_read_request(sc, remote, req, ranks),
                )
                after.append(functools.partial(self._notify_done, req, remote, pushed))
                return nbytes, _ring_path(pushed)
            # Opens by notification are queued to the NIXL thread first, then the READ, which runs while
            # the opens (or OpenRead calls) are on their way when that is safe (server/lease_view.py).
            # The NIXL thread sends and posts both once this thread waits, in `finish`.
            opening = Opening(sc, remote, holders, req, ranks)
            opened_on = opening.touched
            early_job = self._early_job(req, local, remote, cancel, deadline)
            if early_job is not None:
                early = self._post_identity(early_job, remote)
            # A blocking call: a future that a stop could cancel costs ~0.08 ms more per pull (measured),
            # so a pull stopped while its source hangs in OpenRead ends at its deadline.
            opened = opening.finish(deadline)
            opened_on = holders
            if early_job is not None:
                if (list(opened.block_ids), opened.num_tokens) == (list(p.block_ids), p.num_tokens):
                    nbytes = self._finish(early_job, early)
                    after.append(functools.partial(self._notify_done, req, remote, early_job))
                    return nbytes, "host-nixl"
                self._abandon(early)  # the source holds other blocks than the params say: read those
            early = []
            return self._read_remote(req, local, remote, opened, cancel, deadline, after)
        except Exception as e:
            self._abandon(early)  # no byte moves once the engine has its answer
            if opening is not None:
                opening.abandon()
            stale = isinstance(e, SidecarError) and (
                e.code is Code.UNAVAILABLE
                or (e.code is Code.FAILED_PRECONDITION and "handshake" in e.message)
            )
            if stale:
                sc.peers.forget_engine(p.sidecar_address, p.engine_id, req.engine_id)
            retry = stale and may_retry and not cancel.is_set() and time.monotonic() < deadline
            # A pull about to retry still moves bytes: it neither counts as ended nor releases.
            release = not retry and self._release_now(cancel)
            if opened_on:
                close_reads(sc, opened_on, req, ranks, failed=True, release=release)
            if retry:
                raise _Retry() from e
            raise

    def _early_job(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        remote: RemoteEngine,
        cancel: PullTicket,
        deadline: float,
    ) -> PullJob | None:
        """The job to READ before OpenRead answers, from the params' blocks; None where it must wait:
        not the host identity READ path, or the request not surely held by its source (its lease close
        to running out, or released by this sidecar)."""
        p = req.params
        if not remote.plan.is_identity() or remote.memory_kind != "DRAM" or any(e.gpu for e in local):
            return None
        if self._sc.settings.host_transfer.lower() == "ring":
            return None
        if not self._sc.lease_view.surely_held(
            p.sidecar_id, p.engine_id, p.request_id, p.lease_deadline_unix_ms
        ):
            return None
        try:
            return self._job(req, local, remote.plan, list(p.block_ids), p.num_tokens, cancel, deadline)
        except (SidecarError, PlanError):
            return None  # the usual path reports it, after OpenRead

    def _push_with_open(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        remote: RemoteEngine,
        holders: list[Holder],
        cancel: PullTicket,
        deadline: float,
    ) -> PullJob | None:
        """The job of a staged pull whose one Push carries the open, planned from the params; None where
        the usual OpenRead-then-Push applies: not the ring path, or more than one read (TP gather,
        several local ranks, several holders). Unlike an early READ this needs no lease check: the
        source opens and checks the request before it WRITEs anything."""
        p = req.params
        if not self._staged(remote, local):
            return None
        if len({remote.memory_kind == "VRAM", *(e.gpu is not None for e in local)}) > 1:
            return None  # host and GPU memory mixed: the usual path says what is wrong
        if len(holders) != 1 or sum(len(remote.plan.decode_ranks[e.rank].reads) for e in local) != 1:
            return None
        try:
            return self._job(req, local, remote.plan, list(p.block_ids), p.num_tokens, cancel, deadline)
        except (SidecarError, PlanError):
            return None  # the usual path reports it, after OpenRead

    def _staged(self, remote: RemoteEngine, local: list[RankEntry]) -> bool:
        """Whether a pull across sidecars runs the staged protocol: always where either side is in GPU
        memory, between host engines only with `host_transfer: ring`."""
        on_gpu = remote.memory_kind == "VRAM" or any(e.gpu is not None for e in local)
        return on_gpu or self._sc.settings.host_transfer.lower() == "ring"

    def _read_remote(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        remote: RemoteEngine,
        opened: peer_pb2.OpenReadResponse,
        cancel: PullTicket,
        deadline: float,
        after: Later,
    ) -> tuple[int, str]:
        p = req.params
        job = self._job(req, local, remote.plan, list(opened.block_ids), opened.num_tokens, cancel, deadline)
        identity = remote.plan.is_identity()
        ring = self._staged(remote, local)  # the staged protocol (staged_reader.py)
        if any(e.gpu is not None for e in local) and remote.memory_kind != "VRAM":
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {p.engine_id!r} is in host memory while local engine {req.engine_id!r} is in GPU "
                "memory; host<->GPU pulls are not supported",
            )
        nbytes = 0
        if identity and not ring:
            nbytes = self._finish(job, self._post_identity(job, remote))
        else:
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
                for read in rplan.reads:
                    job.remaining()  # stopped before touching (possibly unregistered) memory
                    if ring:
                        nbytes += staged_reader.read_staged(self, job, remote, entry, read.prefill_rank)
                    else:
                        nbytes += self._read_staged(job, remote, entry, read.prefill_rank, read.heads)
        after.append(functools.partial(self._notify_done, req, remote, job))
        if ring:
            return nbytes, _ring_path(job)
        return nbytes, "host-nixl" if identity else "host-nixl-staged"

    def _notify_done(self, req: engine_pb2.PullRequest, remote: RemoteEngine, job: PullJob) -> None:
        """Tell each source sidecar which of its ranks each local rank is done with. A pull runs this
        after its answer (`after`), which does not wait for the driver thread to send them either
        (NixlDriver.notify)."""
        sc, p = self._sc, req.params
        for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
            for holder, done in by_holder(remote, depends_on(rplan), sc.sidecar_id).items():
                sc.nixl.notify(
                    holder.agent_name,
                    done_notification(p.engine_id, p.request_id, req.engine_id, entry.rank, done),
                )
                sc.peers.link(holder.address).read_completed()  # later opens may go as notifications

    def wait(self, fut: Future[None], job: PullJob) -> None:
        while True:
            try:
                left = job.remaining()
            except SidecarError:
                # Stopped or timed out: cancel the transfer and let it end, so that no byte
                # lands in blocks the engine is told were not filled (it may reuse them).
                self._sc.nixl.cancel(fut)
                with contextlib.suppress(Exception):
                    fut.result(timeout=_CANCEL_WAIT_S)
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
                entry.local_dlist = self._sc.nixl.prep_dlist(
                    "", descriptor_table(entry.geometry, entry.region_bases)
                )
            return entry.local_dlist

    def _remote_dlist(self, remote: RemoteEngine, rank: int) -> int:
        with self._dlist_lock:
            if rank not in remote.dlists:
                if rank not in remote.regions:
                    raise SidecarError(
                        Code.FAILED_PRECONDITION,
                        f"peer does not hold rank {rank} of engine {remote.engine_id!r}",
                    )
                table = descriptor_table(remote.geometry, remote.regions[rank])
                remote.dlists[rank] = self._sc.nixl.prep_dlist(remote.agent_of(rank), table)
            return remote.dlists[rank]

    def _post_identity(self, job: PullJob, remote: RemoteEngine) -> list[_Read]:
        """Same geometry both sides: one READ per local rank, each source chunk into the matching
        destination chunk, from descriptor lists prepared once. Posted, not waited for."""
        first = job.start_token // job.plan.prefill.block_size
        src = job.src_blocks[first : first + len(job.dst_blocks)]
        reads: list[_Read] = []
        try:
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
                (read,) = rplan.reads  # identity: rank r reads all of rank r
                job.remaining()  # stopped before touching (possibly unregistered) memory
                local_idx = chunk_indices(entry.geometry, job.dst_blocks)
                remote_idx = chunk_indices(remote.geometry, src)
                fut = self._sc.nixl.read_prepped(
                    self._local_dlist(entry),
                    local_idx,
                    self._remote_dlist(remote, read.prefill_rank),
                    remote_idx,
                    b"",
                    job.remaining(),
                )
                self._sc.metrics.nixl_descriptors.observe(len(local_idx))
                self._sc.metrics.inflight.inc()
                reads.append(_Read(fut, len(local_idx) * entry.geometry.chunk))
        except BaseException:
            self._abandon(reads)
            raise
        return reads

    def _finish(self, job: PullJob, reads: list[_Read]) -> int:
        """Wait for posted READs; on a failure or a stop, cancel the others and let them end."""
        try:
            for r in reads:
                self.wait(r.future, job)
        except BaseException:
            self._abandon(reads)
            raise
        finally:
            for r in reads:
                r.settle(self._sc.metrics)
        return sum(r.nbytes for r in reads)

    def _abandon(self, reads: list[_Read]) -> None:
        """Cancel READs still in flight and wait for them to end (no byte may land after the answer)."""
        for r in reads:
            if not r.future.done():
                self._sc.nixl.cancel(r.future)
            with contextlib.suppress(Exception):
                r.future.result(timeout=_CANCEL_WAIT_S)
            r.settle(self._sc.metrics)

    def _read_staged(
        self,
        job: PullJob,
        remote: RemoteEngine,
        entry: RankEntry,
        src_rank: int,
        heads: tuple[int, int] | None,
    ) -> int:
        """READ the needed source blocks into staging (source layout), then convert into the destination."""
        sc, geo = self._sc, remote.geometry
        if src_rank not in remote.regions:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"peer does not hold rank {src_rank} of engine {remote.engine_id!r}"
            )
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
            sc.metrics.staging_in_use.inc(self._staging.nbytes)
            try:
                t0 = job.start_token
                while t0 < job.num_tokens:
                    t1 = min(job.num_tokens, (t0 // step) * step + round_tokens)
                    nbytes += self._staged_round(job, remote, entry, src_rank, heads, buf, t0, t1)
                    t0 = t1
            finally:
                sc.metrics.staging_in_use.dec(self._staging.nbytes)
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
        sc, geo = self._sc, remote.geometry
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
        remote_descs = descriptors(geo, remote.regions[src_rank], src_ids)
        fut = sc.nixl.read(remote.agent_of(src_rank), local, remote_descs, b"", job.remaining())
        sc.metrics.nixl_descriptors.observe(len(local))
        sc.metrics.inflight.inc()
        try:
            self.wait(fut, job)
        finally:
            sc.metrics.inflight.dec()
        view = rank_view(mini, src_rank, tensors)
        # Staging block j holds source position positions[j]; earlier positions are never read.
        staged_ids = [0] * positions[0] + list(range(k))
        bd = job.plan.decode.block_size
        first_dst = (t0 - job.start_token) // bd
        last_dst = math.ceil((t1 - job.start_token) / bd)
        return copy_request(
            view, entry.host_view, heads, staged_ids, job.dst_blocks[first_dst:last_dst], t1, t0
        )
