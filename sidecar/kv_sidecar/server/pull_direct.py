"""Pulls from a prefill engine registered on this sidecar: `host-direct` (host memory) and
`gpu-direct` (GPU memory, one launch per read on the decode GPU, over NVLink). The copies are the
data plane's (dataplane/local_copies.py); no NIXL, no peer. A pull yields its copy (`DirectCopy`,
server/pull_steps.py), so that a PullBatch's copies launch together and wait once.

An engine spread over several sidecars (docs/multinode.md; control shards' `spread`) is read here when
every prefill rank the pull's decode ranks read or notify is registered here: this sidecar holds the
request for those ranks (its leader forwarded the publish, or it leads the engine), so its own record
and copies serve them. Where only some are, server/pull.py reads the others from their holders.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from kv_sidecar.dataplane.jobs import LocalCopy, RankRead, StateCopy
from kv_sidecar.dataplane.plane import DataPlane
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import PlanError
from kv_sidecar.server.after_answer import Later
from kv_sidecar.server.engines import EngineRegistry, RankEntry, generations
from kv_sidecar.server.inflight import PullTicket
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import PublishedStore
from kv_sidecar.server.pull_job import (
    PullJob,
    build_job,
    build_state_job,
    require_gpu,
    state_blocks,
    state_group,
)
from kv_sidecar.server.pull_steps import DirectCopy, Steps
from kv_sidecar.server.routing import depends_on
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2

PATH_DIRECT = "gpu-direct"


class DirectPulls:
    def __init__(
        self,
        engines: EngineRegistry,
        plane: DataPlane,
        membership: Membership,
        published: PublishedStore,
        release: Callable[[common_pb2.TransferParams, str, str], object],
    ) -> None:
        self._engines, self._plane, self._membership, self._published = engines, plane, membership, published
        # (params, reader, reason): end a request where it was published (its leader, for a spread engine)
        self._release = release

    def follows(self, engine_id: str) -> bool:
        """Whether this sidecar holds ranks of the engine `engine_id` as a member, led by another."""
        return self._membership.leader_of(engine_id) is not None

    def serves(self, engine_id: str, local: list[RankEntry], published_here: bool) -> bool:
        """Whether a pull of `engine_id`'s request into `local` is a copy here. `published_here`: its
        params name this sidecar. An engine spread over this sidecar and others (this sidecar leads it,
        or follows its leader) is copied here only where every prefill rank that `local` read or
        notify is registered here; else the pull reads from the other holders (server/pull.py, which
        copies the ranks held here: own_ranks.py). False also where the specs do not plan, for the
        handshake to say why."""
        if published_here and not self._membership.is_split(engine_id):
            return True
        if not published_here and not self.follows(engine_id):
            return False
        try:
            src_ranks = self._engines.engine_ranks(engine_id)
            plan = cached_plan(src_ranks[0].spec, local[0].spec)
        except (SidecarError, PlanError):
            return published_here  # the direct path reports it
        return not needed_ranks_here(plan, local, src_ranks)[1]

    def pull(
        self,
        req: engine_pb2.PullRequest,
        local: list[RankEntry],
        cancel: PullTicket,
        deadline: float,
        after: Later,
        release_now: Callable[[PullTicket], bool],
    ) -> Steps[tuple[int, str]]:
        """Copy the request's blocks from the prefill ranks registered here; "consumed" once answered."""
        p = req.params
        src_ranks = self._engines.engine_ranks(p.engine_id)
        plan = cached_plan(src_ranks[0].spec, local[0].spec)
        if self._membership.is_split(p.engine_id):
            self._check_spread(p.engine_id, req, plan, local, src_ranks)
        elif len(src_ranks) != plan.prefill.tp_size:
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
            sources=generations(src_ranks),
        )
        group = state_group(req, plan)
        try:
            if group is not None:
                job = build_state_job(req, local, plan, group, list(item.block_ids), cancel, deadline)
                return self._copy_state(job, group, src_ranks, after)
            job = build_job(
                req, local, plan, item.block_ids, item.num_tokens, cancel, deadline, item.first_token
            )
            return (yield from self._copy(job, src_ranks, after))
        except Exception:
            if release_now(cancel):
                self._release(p, req.engine_id, "the reader gave it up")
            raise

    @staticmethod
    def _check_spread(
        engine_id: str,
        req: engine_pb2.PullRequest,
        plan: PairPlan,
        local: list[RankEntry],
        src_ranks: list[RankEntry],
    ) -> None:
        """Every prefill rank the pull depends on must be registered here (`serves` said so); a Mamba
        state converted between TP sizes reads every prefill rank, so it needs the whole engine here."""
        away = needed_ranks_here(plan, local, src_ranks)[1]
        if away:  # registered here when the path was chosen, gone since
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"prefill ranks {away} of engine {engine_id!r}, which decode ranks {[e.rank for e in local]} "
                f"of engine {req.engine_id!r} read, are not registered on this sidecar any more; try again",
            )
        if state_group(req, plan) is not None:
            raise spread_state_refused(engine_id, req.engine_id)

    def _copy_state(
        self, job: PullJob, group: int, src_ranks: list[RankEntry], after: Later
    ) -> tuple[int, str]:
        """A Mamba group's state converted between TP sizes (or page geometries): its runs copied into
        each local rank's state block; host memory only. "consumed" as for `_copy`."""
        if any(e.on_gpu for e in [*src_ranks, *job.local]):
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"KV cache group {group} (layer {job.plan.decode.groups[group].layers[0]}) holds Mamba state that "
                "these engines keep differently (another TP size or page geometry); it is converted only between "
                "host-memory engines",
            )
        sources = tuple(e.key for e in src_ranks)
        nbytes = 0
        for entry, block in zip(job.local, state_blocks(job, group), strict=True):
            nbytes += self._plane.copy_state(StateCopy(entry.key, sources, block), job)
        after.append(functools.partial(self._mark_done, job))
        return nbytes, "host-direct"

    def _mark_done(self, job: PullJob) -> None:
        """Mark "consumed": every prefill rank each local rank read or only waited for is done with."""
        p = job.params
        for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
            done = [r.prefill_rank for r in rplan.reads] + list(rplan.notify_only)
            self._published.mark_done(p.engine_id, p.request_id, entry.engine_id, entry.rank, done)

    def _copy(self, job: PullJob, src_ranks: list[RankEntry], after: Later) -> Steps[tuple[int, str]]:
        """The copies, then "consumed" once the pull has answered (`after`): the prefill engine frees
        its blocks no sooner than the bytes are in place, and the event's wake-up of the prefill's
        event stream no longer competes with the answer."""
        by_rank = {e.rank: e for e in src_ranks}  # a spread engine's ranks here, not all of them
        reads = tuple(
            RankRead(entry.key, by_rank[read.prefill_rank].key, read.heads)
            for entry, rplan in zip(job.local, job.rank_plans(), strict=True)
            for read in rplan.reads
        )
        copy = LocalCopy(reads, job.tokens, whole_blocks=job.plan.is_identity())
        path = "host-direct"
        if any(e.on_gpu for e in [*src_ranks, *job.local]):
            require_gpu(src_ranks, "prefill")
            require_gpu(job.local, "decode")
            path = PATH_DIRECT
        nbytes = yield DirectCopy(copy, job)
        after.append(functools.partial(self._mark_done, job))
        return nbytes, path


def spread_state_refused(engine_id: str, reader: str) -> SidecarError:
    """A Mamba state converted between TP sizes (or page geometries) reads every prefill rank into each
    state block: refused from an engine spread over the reading sidecar and others."""
    return SidecarError(
        Code.UNIMPLEMENTED,
        f"engine {engine_id!r} spans this sidecar and others, and its Mamba state is converted for engine "
        f"{reader!r} (another TP size or page geometry): a conversion reads every prefill rank, so it needs "
        "the whole engine on one sidecar",
    )


def needed_ranks(plan: PairPlan, local: Sequence[RankEntry]) -> list[int]:
    """The prefill ranks that the decode ranks `local` read or only notify, in order."""
    return sorted({p for e in local for p in depends_on(plan.decode_ranks[e.rank])})


def needed_ranks_here(
    plan: PairPlan, local: Sequence[RankEntry], src_ranks: Sequence[RankEntry]
) -> tuple[dict[int, RankEntry], list[int]]:
    """The prefill ranks `local` read or notify, split: those among `src_ranks` (the engine's ranks
    registered here), by rank, and those not registered here, in order."""
    here = {e.rank: e for e in src_ranks}
    needed = needed_ranks(plan, local)
    return {r: here[r] for r in needed if r in here}, [r for r in needed if r not in here]
