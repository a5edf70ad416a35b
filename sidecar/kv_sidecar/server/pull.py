"""A pull: admit it, choose its path, retry a stale handshake once, report.

The paths, each in its own module:
- host-direct, gpu-direct: the prefill engine is registered on this sidecar (server/pull_direct.py);
  no NIXL. A prefill engine spread over this sidecar and others (docs/multinode.md) too, where every
  rank the pull reads is here; a pull that needs others too reads those as below and copies the ranks
  held here (server/own_ranks.py).
- host-nixl: another sidecar, the plan the identity (same layout, TP, block size): NIXL READs every
  block chunk straight into the destination blocks; posted early, before OpenRead answers, where the
  lease surely holds (server/lease_view.py).
- host-nixl-staged: another sidecar, the bytes converted (layout, TP, block size): READs into staging
  memory, then the host executor.
- gpu-staged, host-ring: the staged protocol, the source WRITEs chunks into our ring
  (server/staged_reader.py): GPU engines, or host engines with `host_transfer: ring`; a one-read pull's
  Push carries the open.
The validated job they share is server/pull_job.py; the bytes move on the data plane (dataplane/plane.py:
local copies, NIXL READs, the staged protocol's receiving end).

Across sidecars, every OpenRead/CloseRead, READ and completion notification
goes to the sidecar that holds the source rank (server/routing.py): the one
peer of a one-node engine, or, for an engine whose ranks span several nodes,
the holder named in the map its leader returned at handshake (docs/multinode.md).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from kv_sidecar.config import Settings
from kv_sidecar.dataplane.jobs import BlockReads, ConvertedRead, StateRead
from kv_sidecar.dataplane.plane import DataPlane, PostedRead
from kv_sidecar.errors import Code, SidecarError, as_sidecar_error, check_address
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.blocks import check_start
from kv_sidecar.plan.spec import PlanError
from kv_sidecar.server.after_answer import Joined, Later, run_later
from kv_sidecar.server.engines import EngineRegistry, RankEntry
from kv_sidecar.server.inflight import InflightPulls, PullTicket, stopped_error
from kv_sidecar.server.lease_view import LeaseView
from kv_sidecar.server.own_ranks import Own, OwnRanks
from kv_sidecar.server.peers import Holder, Peers, RemoteEngine
from kv_sidecar.server.pull_direct import PATH_DIRECT, DirectPulls, spread_state_refused
from kv_sidecar.server.pull_job import (
    PullJob,
    build_job,
    build_state_job,
    state_blocks,
    state_group,
    unfilled_blocks,
)
from kv_sidecar.server.pull_steps import Apart, DirectCopy, Made, Steps, Want, run_steps
from kv_sidecar.server.routing import DoneReads, Opener, Opening, done_messages, holders_needed
from kv_sidecar.server.staged_common import PATH_HOST_RING, PATH_STAGED
from kv_sidecar.server.staged_reader import StagedRead, StagedReader
from kv_sidecar.server.transfers import TransferTracker
from kv_sidecar.transport.nixl_driver import AgentDisconnected, NixlDriver, ucx_emulation_disabled
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2

log = logging.getLogger(__name__)

PATH_STATE = "host-nixl-state"  # a Mamba group's state converted: its runs READ into the state blocks


class DoneNotices(Joined):
    """A pull's done notifications, sent after its answer: with those of the other pulls whose work runs
    with it (a PullBatch's members that ended together), one notification per source agent that takes
    them joined (Puller.send_done)."""

    def __init__(
        self,
        send_done: Callable[[list[DoneNotices]], None],
        req: engine_pb2.PullRequest,
        remote: RemoteEngine,
        job: PullJob,
        own: Own | None = None,
    ) -> None:
        super().__init__(send_done)
        self.req, self.remote, self.job = req, remote, job
        self.own = frozenset(own or ())  # prefill ranks held here: marked done here (OwnRanks.done)


class _Retry(Exception):
    """The first attempt of a remote pull met a stale handshake; try once more."""


MAX_READ_FROM = 4096  # peer addresses remembered as read from (Puller._read_from)


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


def _held(msg: peer_pb2.OpenReadResponse | common_pb2.TransferParams) -> tuple[list[int], int, int]:
    """What a source holds of a request, as its params or its OpenRead answer say."""
    return list(msg.block_ids), msg.num_tokens, msg.first_token


def _ring_path(job: PullJob) -> str:
    """The staged protocol's path label: through GPU rings, or host rings (`host_transfer: ring`)."""
    return PATH_STAGED if any(e.on_gpu for e in job.local) else PATH_HOST_RING


def _block_reads(job: PullJob, remote: RemoteEngine) -> BlockReads:
    """host-nixl's READs: each local rank reads all of the same rank (the plan is the identity)."""
    reads = []
    for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
        (read,) = rplan.reads
        reads.append((entry.key, remote.remote_rank(read.prefill_rank)))
    return BlockReads(tuple(reads), job.tokens)


class Puller:
    """Every pull of this sidecar's engines, on whichever path its two engines take."""

    def __init__(
        self,
        sidecar_id: str,
        settings: Settings,
        engines: EngineRegistry,
        pulls: InflightPulls,
        transfers: TransferTracker,
        lease_view: LeaseView,
        peers: Peers,
        opener: Opener,
        direct: DirectPulls,
        own: OwnRanks,
        plane: DataPlane,
        staged: StagedReader,
        nixl: NixlDriver,
        metrics: Metrics,
    ) -> None:
        """settings: pull_timeout_ms (a pull's default deadline) and host_transfer (the host paths)."""
        self._sidecar_id = sidecar_id
        self._default_timeout_s = settings.pull_timeout_ms / 1000
        self._host_ring = settings.host_transfer.lower() == "ring"
        self._engines = engines
        self._pulls = pulls
        self._transfers = transfers
        self._lease_view = lease_view
        self._peers = peers
        self._opener = opener
        self._direct = direct
        self._own = own
        self._plane = plane
        self._staged_reader = staged
        self._nixl = nixl
        self._metrics = metrics
        # Peer addresses a remote pull succeeded from: a transport reaches them, so an agent that shows
        # as disconnected there again after a new handshake is a peer that restarts or stalls, not one
        # that no transport reaches (_no_native_path). Bounded: cleared when it grows past this.
        self._read_from: set[str] = set()

    # -- entry point ------------------------------------------------------
    def pull(
        self, req: engine_pb2.PullRequest, cancel: PullTicket, later: Later | None = None
    ) -> engine_pb2.PullResponse:
        """`later`: see engine_calls.pull. What is left there (the pull's log record, "consumed"
        events of a same-sidecar pull) waits for nothing the engine needs: ~0.07 ms of a 0.5 ms
        same-sidecar pull (bench/trace_pull.py --local)."""
        return run_steps(self.pull_steps(req, cancel, later), self.move)

    def pull_steps(
        self, req: engine_pb2.PullRequest, cancel: PullTicket, later: Later | None = None
    ) -> Steps[engine_pb2.PullResponse]:
        """`pull`, yielding what moves its bytes for its caller to move (`move` alone, or with a
        PullBatch's other members' moves: `move_all`)."""
        after: Later = [] if later is None else later
        try:
            return (yield from self._pull(req, cancel, after))
        finally:
            if later is None:
                run_later(after)

    def move(self, want: Want) -> int:
        """Move one pull's bytes on this thread: a staged read, or a copy between ranks of this node
        (`Apart`, alone: nothing to move)."""
        if isinstance(want, Apart):
            return 0
        if isinstance(want, DirectCopy):
            return self._plane.copy_local(want.copy, want.job)
        return self._staged_reader.read(want)

    def move_all(self, wants: Sequence[Want], pool: Executor, made: Made) -> None:
        """Several pulls' moves (a PullBatch's), `made([(i, bytes or what failed it), ..])` with those that
        ended together: the copies first, launched together with one wait, on this thread; then the staged
        reads together (StagedReader.read_all: one thread per source rank pair, this one the first)."""
        copies = [(i, w) for i, w in enumerate(wants) if isinstance(w, DirectCopy)]
        if copies:
            moves = self._plane.copy_local_all([(w.copy, w.job) for _, w in copies])
            made([(i, moved) for (i, _), moved in zip(copies, moves, strict=True)])
        reads = [(i, w) for i, w in enumerate(wants) if isinstance(w, StagedRead)]
        if reads:
            self._staged_reader.read_all(
                [w for _, w in reads], pool, lambda ended: made([(reads[k][0], moved) for k, moved in ended])
            )

    def goes_together(self, req: engine_pb2.PullRequest) -> bool:
        """Whether a pull may run with a PullBatch's others on one thread (pull_batch.py): it moves by a
        copy on this node or a staged read, from a source whose handshake is cached. What it checks is
        cheap; a member that must wait for a peer after all (an OpenRead: TP gather, several holders,
        params that do not plan; a handshake again) steps `Apart` first, and the unit lets it go."""
        p = req.params
        if p.sidecar_id == self._sidecar_id or self._direct.follows(p.engine_id):
            return True  # a copy here; else, read from the engine's other sidecars, it steps Apart first
        remote = self._peers.known_engine(
            p.sidecar_address, p.engine_id, req.engine_id, p.sidecar_id, p.map_version
        )
        # GPU sources always stage; host ones only with host_transfer: ring (else NIXL READs, posted early)
        return remote is not None and (remote.memory_kind == "VRAM" or self._host_ring)

    def _pull(
        self, req: engine_pb2.PullRequest, cancel: PullTicket, after: Later
    ) -> Steps[engine_pb2.PullResponse]:
        p = req.params
        timeout_s = req.timeout_ms / 1000 if req.timeout_ms else self._default_timeout_s
        start = time.perf_counter()
        remote_here = p.sidecar_id == self._sidecar_id
        # The path a failed pull is counted and logged under: the one it was taking when it failed.
        route = ["host-direct" if remote_here else "host-nixl"]
        track = self._transfers.begin_pull(
            req.engine_id, p.request_id, p.engine_id, "local" if remote_here else p.sidecar_address
        )
        try:
            # A pull from before the range the params say is held fails here, before it opens the request
            # (which would fix this engine as its reader); the source's record is checked again later.
            check_start(req.start_token, p.first_token, p.num_tokens)
            local = self._local_ranks(req, cancel.ranks)
            if remote_here != self._direct.serves(p.engine_id, local, remote_here):
                # An engine spread over this sidecar and others: copied here where every rank the pull
                # reads is held here, else read from the others (and here, as copies: own_ranks.py).
                remote_here = not remote_here
                route[0] = "host-direct" if remote_here else "host-nixl"
                track.peer = "local" if remote_here else p.sidecar_address
            if remote_here:
                deadline = time.monotonic() + timeout_s
                if any(e.on_gpu for e in local):
                    route[0] = PATH_DIRECT
                nbytes, path = yield from self._direct.pull(
                    req, local, cancel, deadline, after, self._release_now
                )
            else:
                nbytes, path = yield from self._pull_remote_fresh(
                    req, local, cancel, time.monotonic() + timeout_s, after, route
                )
        except Exception as e:
            path = route[0]
            err = as_sidecar_error(e)
            outcome = {Code.CANCELLED: "cancelled", Code.DEADLINE_EXCEEDED: "timeout"}.get(err.code, "error")
            self._metrics.pulls.labels(path, outcome).inc()
            self._metrics.failures.labels(f"pull_{err.code.name.lower()}").inc()
            after.append(self._transfers.end_pull(track, 0, path, outcome, f"{err.code.name}: {err.message}"))
            named, trailer = unfilled_blocks(req.block_ids)
            raise SidecarError(
                err.code,
                f"{err.message}; local blocks not filled: {named}",
                (("kvsidecar-unfilled-blocks", trailer),),
            ) from None
        elapsed = time.perf_counter() - start
        after.append(functools.partial(self._metrics.pull_ok(path).moved, nbytes, elapsed))
        after.append(self._transfers.end_pull(track, nbytes, path, "ok"))
        return engine_pb2.PullResponse(bytes=nbytes, duration_us=int(elapsed * 1e6), path=path)

    def _local_ranks(self, req: engine_pb2.PullRequest, ranks: Sequence[int]) -> list[RankEntry]:
        """The local ranks to fill: `ranks` as the pull was admitted with (the request's, or every
        rank registered when it arrived)."""
        reg = self._engines
        if len(set(ranks)) != len(ranks):
            raise SidecarError(Code.INVALID_ARGUMENT, f"ranks {list(ranks)} contain duplicates")
        if not ranks:
            return reg.engine_ranks(req.engine_id)  # NOT_FOUND: no rank of it registered
        return [reg.get(req.engine_id, r) for r in ranks]

    def _release_now(self, ticket: PullTicket) -> bool:
        """A failed pull that moves no byte any more: may the source free the request's blocks now?
        Only if the reader is gone for good and no other pull of the request still moves bytes."""
        last = self._pulls.last_to_end(ticket)
        return ticket.release_source and last

    # -- another sidecar ------------------------------------------------------
    def _pull_remote_fresh(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
        route: list[str],
    ) -> Steps[tuple[int, str]]:
        """_pull_remote, dropping a cached handshake that went stale (the peer restarted).

        A peer that forgot our plan, or whose NIXL agent is gone, fails the pull; handshake
        again and retry once within the same deadline. Rewriting destination blocks that a
        failed attempt partly wrote is harmless: OpenRead checks the lease again first.
        """
        address = req.params.sidecar_address
        try:
            done = yield from self._pull_remote(req, local, cancel, deadline, after, route, may_retry=True)
        except _Retry as first:
            try:
                done = yield from self._pull_remote(
                    req, local, cancel, deadline, after, route, may_retry=False
                )
            except SidecarError as again:
                # The peer answered a new handshake, yet its agent is "disconnected" again at the READ:
                # no transport reaches it, unless one did before (then it restarts or stalls:
                # bench/chaos.py on loopback drew this diagnosis for a peer it had read from all along).
                lost = _agent_lost(first) and _agent_lost(again)
                if lost and address not in self._read_from and ucx_emulation_disabled():
                    self._metrics.ucx_emulation.inc()
                    raise _no_native_path(address) from again
                raise
        # Only a READ proves a transport reaches the peer's memory: a staged pull's source WRITEs.
        if done[1] not in (PATH_STAGED, PATH_HOST_RING) and address not in self._read_from:
            if len(self._read_from) >= MAX_READ_FROM:
                self._read_from.clear()
            self._read_from.add(address)
        return done

    def _pull_remote(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
        route: list[str],
        may_retry: bool,
    ) -> Steps[tuple[int, str]]:
        p = req.params
        ranks = [e.rank for e in local]
        opened_on: list[Holder] = []
        early: list[PostedRead] = []
        opening: Opening | None = None
        own: Own = {}
        try:
            check_address("params.sidecar_address", p.sidecar_address)
            known = self._peers.known_engine(
                p.sidecar_address, p.engine_id, req.engine_id, p.sidecar_id, p.map_version
            )
            if known is not None and known.plan.decode == local[0].spec:
                remote = known  # the cached handshake, as remote_engine would return it, without its locks
            else:
                yield Apart()  # a handshake (again) waits for the peer
                _, remote = self._peers.remote_engine(
                    p.sidecar_address,
                    p.engine_id,
                    req.engine_id,
                    local[0].spec,
                    max(0.001, deadline - time.monotonic()),
                    cancel,
                    lambda: stopped_error(cancel, p.request_id),
                    p.sidecar_id,
                )
            # Each source rank's sidecar: the leader for a one-node engine, else from the leader's map;
            # ranks of a spread engine that this sidecar holds itself are copied here (own_ranks.py).
            own = self._own.held(p.engine_id, remote.plan, local)
            holders = list(
                holders_needed(remote, [remote.plan.decode_ranks[r] for r in ranks], self._sidecar_id, own)
            )
            if own:
                if not holders:  # DirectPulls.serves takes these; the ranks here changed in between
                    raise SidecarError(
                        Code.FAILED_PRECONDITION,
                        f"every rank of engine {p.engine_id!r} that the pull reads is registered here now; "
                        "try again",
                    )
                # Opened on the other holders and on this sidecar's own record, which must agree; then
                # each read from another holder as from any peer, from a rank held here as a copy.
                yield Apart()  # the opens wait for the other holders
                item = self._own.open(req, remote.plan, local, own, deadline)
                opening = self._opener.open(remote, holders, req, ranks)
                opened_on = opening.touched
                opened = opening.finish(deadline)
                opened_on = holders
                self._own.agree(item, opened, holders[0].address)
                return (
                    yield from self._read_remote(
                        req, local, remote, opened, cancel, deadline, after, route, own
                    )
                )
            pushed = self._push_with_open(req, local, remote, holders, cancel, deadline)
            if pushed is not None:
                opened_on = holders  # a failure closes the read that the Push opened
                route[0] = _ring_path(pushed)
                (rplan,) = pushed.rank_plans()
                nbytes = yield StagedRead(
                    pushed,
                    remote,
                    pushed.local[0],
                    rplan.reads[0].prefill_rank,
                    open_msg=self._opener.request(remote, req, ranks, pushed=True),
                )
                after.append(DoneNotices(self.send_done, req, remote, pushed))
                return nbytes, _ring_path(pushed)
            # The open waits for the source, which may hang: not on a thread other pulls share.
            yield Apart()
            # Opens by notification are queued to the NIXL thread first, then the READ, which runs while
            # the opens (or OpenRead calls) are on their way when that is safe (server/lease_view.py).
            # The NIXL thread sends and posts both once this thread waits, in `finish`.
            opening = self._opener.open(remote, holders, req, ranks)
            opened_on = opening.touched
            early_job = self._early_job(req, local, remote, cancel, deadline)
            if early_job is not None:
                early = self._plane.post_reads(_block_reads(early_job, remote), early_job)
            # A blocking call: a future that a stop could cancel costs ~0.08 ms more per pull (measured),
            # so a pull stopped while its source hangs in OpenRead ends at its deadline.
            opened = opening.finish(deadline)
            opened_on = holders
            if early_job is not None:
                if _held(opened) == _held(p):
                    nbytes = self._plane.finish_reads(early, early_job)
                    after.append(DoneNotices(self.send_done, req, remote, early_job))
                    return nbytes, "host-nixl"
                self._plane.abandon_reads(
                    early
                )  # the source holds other blocks than the params say: read those
            early = []
            return (yield from self._read_remote(req, local, remote, opened, cancel, deadline, after, route))
        except Exception as e:
            self._plane.abandon_reads(early)  # no byte moves once the engine has its answer
            if opening is not None:
                opening.abandon()
            stale = isinstance(e, SidecarError) and (
                e.code is Code.UNAVAILABLE
                or (e.code is Code.FAILED_PRECONDITION and "handshake" in e.message)
            )
            if stale:
                self._peers.forget_engine(p.sidecar_address, p.engine_id, req.engine_id)
            retry = stale and may_retry and not cancel.is_set() and time.monotonic() < deadline
            # A pull about to retry still moves bytes: it neither counts as ended nor releases.
            release = not retry and self._release_now(cancel)
            if opened_on:
                self._opener.close_reads(opened_on, req, ranks, failed=True, release=release)
            if own:
                self._own.failed(req, release)
            if retry:
                log.warning(
                    "pull of %r from %s failed (%s): handshake again and retry once",
                    p.request_id,
                    p.sidecar_address,
                    e,
                )
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
        if not remote.plan.is_identity() or remote.memory_kind != "DRAM" or any(e.on_gpu for e in local):
            return None
        if self._host_ring:
            return None
        if not self._lease_view.surely_held(
            p.sidecar_id, p.engine_id, p.request_id, p.lease_deadline_unix_ms
        ):
            return None
        try:
            return build_job(
                req, local, remote.plan, p.block_ids, p.num_tokens, cancel, deadline, p.first_token
            )
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
        if not self._one_push(req, local, remote, holders):
            return None
        try:
            return build_job(
                req, local, remote.plan, p.block_ids, p.num_tokens, cancel, deadline, p.first_token
            )
        except (SidecarError, PlanError):
            return None  # the usual path reports it, after OpenRead

    def _one_push(
        self, req: engine_pb2.PullRequest, local: list[RankEntry], remote: RemoteEngine, holders: list[Holder]
    ) -> bool:
        """Whether the pull is one staged read from one holder, which its Push opens."""
        if not self._staged(remote, local) or state_group(req, remote.plan) is not None:
            return False  # a converted Mamba state: the usual path says what is wrong
        if len({remote.memory_kind == "VRAM", *(e.on_gpu for e in local)}) > 1:
            return False  # host and GPU memory mixed: the usual path says what is wrong
        return len(holders) == 1 and sum(len(remote.plan.decode_ranks[e.rank].reads) for e in local) == 1

    def _staged(self, remote: RemoteEngine, local: list[RankEntry]) -> bool:
        """Whether a pull across sidecars runs the staged protocol: always where either side is in GPU
        memory, between host engines only with `host_transfer: ring`."""
        on_gpu = remote.memory_kind == "VRAM" or any(e.on_gpu for e in local)
        return on_gpu or self._host_ring

    def _read_remote(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        remote: RemoteEngine,
        opened: peer_pb2.OpenReadResponse,
        cancel: PullTicket,
        deadline: float,
        after: Later,
        route: list[str],
        own: Own | None = None,
    ) -> Steps[tuple[int, str]]:
        """`own`: ranks held here, each read as a copy (own_ranks.py); the rest from their holders."""
        p = req.params
        group = state_group(req, remote.plan)
        if group is not None:
            if own:
                raise spread_state_refused(p.engine_id, req.engine_id)
            route[0] = PATH_STATE
            return self._read_state(req, local, remote, group, opened, cancel, deadline, after)
        job = build_job(
            req,
            local,
            remote.plan,
            opened.block_ids,
            opened.num_tokens,
            cancel,
            deadline,
            opened.first_token,
        )
        identity = remote.plan.is_identity()
        ring = self._staged(remote, local)  # the staged protocol (staged_reader.py)
        if any(e.on_gpu for e in local) and remote.memory_kind != "VRAM":
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {p.engine_id!r} is in host memory while local engine {req.engine_id!r} is in GPU "
                "memory; host<->GPU pulls are not supported",
            )
        route[0] = _ring_path(job) if ring else "host-nixl" if identity else "host-nixl-staged"
        nbytes = 0
        if identity and not ring and not own:
            nbytes = self._plane.finish_reads(self._plane.post_reads(_block_reads(job, remote), job), job)
        else:
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
                for read in rplan.reads:
                    job.remaining()  # stopped before touching (possibly unregistered) memory
                    if own and read.prefill_rank in own:
                        nbytes += yield self._own.copy(job, entry, own[read.prefill_rank], read.heads)
                    elif ring:
                        nbytes += yield StagedRead(job, remote, entry, read.prefill_rank)
                    else:
                        src = remote.remote_rank(read.prefill_rank)
                        converted = ConvertedRead(entry.key, src, job.plan, read.heads, job.tokens)
                        nbytes += self._plane.read_converted(converted, job)
        if own:
            after.append(self._own.done(job, own))
        after.append(DoneNotices(self.send_done, req, remote, job, own))
        return nbytes, route[0]

    def _read_state(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        remote: RemoteEngine,
        group: int,
        opened: peer_pb2.OpenReadResponse,
        cancel: PullTicket,
        deadline: float,
        after: Later,
    ) -> tuple[int, str]:
        """host-nixl-state: a Mamba group's state converted between TP sizes (or page geometries), its
        runs READ straight into each local rank's state block. Host memory over NIXL READs only."""
        if remote.memory_kind != "DRAM" or any(e.on_gpu for e in local) or self._host_ring:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"KV cache group {group} (layer {remote.plan.decode.groups[group].layers[0]}) holds Mamba state "
                "that these engines keep differently (another TP size or page geometry); it is converted only "
                "between host-memory engines over NIXL READs, not on GPU memory or with host_transfer: ring",
            )
        job = build_state_job(req, local, remote.plan, group, list(opened.block_ids), cancel, deadline)
        nbytes = 0
        for entry, block in zip(job.local, state_blocks(job, group), strict=True):
            job.remaining()  # stopped before touching (possibly unregistered) memory
            sources = tuple(remote.remote_rank(q) for q in sorted({m.src_rank for m in block.moves}))
            nbytes += self._plane.read_state(StateRead(entry.key, sources, block), job)
        after.append(DoneNotices(self.send_done, req, remote, job))
        return nbytes, PATH_STATE

    def send_done(self, pulls: list[DoneNotices]) -> None:
        """Tell each source sidecar which of its ranks each local rank of these pulls is done with
        (routing.done_messages: joined per source agent that takes them so). Runs after the pulls'
        answers, which do not wait for the driver thread to send them either (NixlDriver.notify)."""
        reads = (
            DoneReads(
                d.remote,
                d.req.params.request_id,
                d.req.engine_id,
                [(e.rank, plan) for e, plan in zip(d.job.local, d.job.rank_plans(), strict=True)],
                d.own,
            )
            for d in pulls
        )
        messages, addresses = done_messages(reads, self._sidecar_id)
        for agent, msg in messages:
            self._nixl.notify(agent, msg)
        for address in addresses:
            self._peers.link(address).read_completed()  # later opens may go as notifications
