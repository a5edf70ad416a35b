"""The prefill ranks of a pull from another sidecar's engine that this sidecar holds itself.

An engine spread over several sidecars (docs/multinode.md; control shards' `spread` within a node) may
have ranks on the reading sidecar too: its leader, or a member the leader forwarded the request to. A
pull that reads some of its ranks here and others elsewhere reads the others as from any peer
(server/pull.py) and these as a copy on this node (`DirectCopy`, as server/pull_direct.py copies): opened
on this sidecar's own record of the request, marked done there, released there if the reader gives up.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from kv_sidecar.dataplane.jobs import LocalCopy, RankRead
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.server.engines import EngineRegistry, RankEntry, generations
from kv_sidecar.server.gone_readers import GoneReaders
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.published import Published, PublishedStore, ReadByAnother
from kv_sidecar.server.pull_direct import needed_ranks_here
from kv_sidecar.server.pull_job import PullJob
from kv_sidecar.server.pull_steps import DirectCopy
from kv_sidecar.server.reads import prove_reader_gone
from kv_sidecar.server.routing import depends_on
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, peer_pb2

Own = dict[int, RankEntry]  # prefill rank -> its registration here


class OwnRanks:
    def __init__(
        self,
        engines: EngineRegistry,
        published: PublishedStore,
        membership: Membership,
        release: Callable[[str, str, str, str], object],
        gone: GoneReaders,
    ) -> None:
        """release(engine, request, reader, reason): end a request held here (Releases.here); gone: tells
        whether another reader's sidecars are gone, as for an OpenRead (server/gone_readers.py)."""
        self._engines, self._published, self._membership = engines, published, membership
        self._release = release
        self._gone = gone

    def held(self, engine_id: str, plan: PairPlan, local: Sequence[RankEntry]) -> Own:
        """The prefill ranks `local` read or notify that are registered here; none unless the engine is
        spread over this sidecar and others (a one-sidecar engine elsewhere shares no rank with us)."""
        if not self._membership.is_split(engine_id):
            return {}
        try:
            src_ranks = self._engines.engine_ranks(engine_id)
        except SidecarError:  # a member whose last rank of it left meanwhile
            return {}
        return needed_ranks_here(plan, local, src_ranks)[0]

    def open(
        self,
        req: engine_pb2.PullRequest,
        plan: PairPlan,
        local: Sequence[RankEntry],
        own: Own,
        deadline: float,
    ) -> Published:
        """Open this sidecar's record of the request for the reader, as a holder opens it for OpenRead:
        it fixes the reader, holds the lease while the pull runs, and refuses a rank registered again
        since the publish (its blocks hold other bytes). A request that another engine reads is taken
        over where that reader's sidecars are proven gone, as the other holders' OpenRead takes it
        (a router retries a request on another decode instance once the first one's sidecar died)."""
        p = req.params

        def open_it() -> Published:
            return self._published.open_read(
                p.engine_id,
                p.request_id,
                req.engine_id,
                plan,
                [e.rank for e in local],
                max(0.0, deadline - time.monotonic()),
                sources=generations(list(own.values())),
            )

        try:
            return open_it()
        except ReadByAnother as e:
            prove_reader_gone(self._gone, self._published, p.engine_id, p.request_id, e)
        return open_it()

    @staticmethod
    def agree(item: Published, opened: peer_pb2.OpenReadResponse, address: str) -> None:
        """The other holders' answer must name the blocks and tokens that this sidecar holds."""
        mine = (list(item.block_ids), item.num_tokens, item.first_token)
        if mine != (list(opened.block_ids), opened.num_tokens, opened.first_token):
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"sidecars of engine {item.engine_id!r} disagree on request {item.request_id!r} (this one "
                f"and {address})",
            )

    @staticmethod
    def copy(job: PullJob, entry: RankEntry, src: RankEntry, heads: tuple[int, int] | None) -> DirectCopy:
        """One read of a prefill rank held here, into local rank `entry`, as a copy on this node."""
        read = RankRead(entry.key, src.key, heads)
        return DirectCopy(LocalCopy((read,), job.tokens, whole_blocks=job.plan.is_identity()), job)

    def done(self, job: PullJob, own: Own) -> Callable[[], None]:
        """What marks the ranks held here done for each local rank once the pull has answered."""
        return functools.partial(self._mark_done, job, frozenset(own))

    def _mark_done(self, job: PullJob, own: frozenset[int]) -> None:
        p = job.params
        for entry, rplan in zip(job.local, job.rank_plans(), strict=True):
            done = [r for r in depends_on(rplan) if r in own]
            if done:
                self._published.mark_done(p.engine_id, p.request_id, entry.engine_id, entry.rank, done)

    def failed(self, req: engine_pb2.PullRequest, release: bool) -> None:
        """The pull failed and moves nothing any more: another reader may take the request over here,
        or, where the reader is gone for good (`release`), the request ends here now."""
        p = req.params
        if release:
            self._release(p.engine_id, p.request_id, req.engine_id, "the reader gave it up")
        else:
            self._published.read_failed(p.engine_id, p.request_id, req.engine_id)
