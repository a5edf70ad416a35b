"""The engine API's core, with no transport around it: register, publish, pull, keep-alive, abort.

EngineServicer (gRPC) and EngineLane (a plain unix socket, Publish and Pull only) are thin adapters
over `EngineCalls`; both map a raised SidecarError to their own status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor

from kv_sidecar.errors import Code, SidecarError, as_sidecar_error, check_address, check_id
from kv_sidecar.plan.blocks import check_published
from kv_sidecar.server.after_answer import Later, run_later
from kv_sidecar.server.engines import EngineRegistry, RankEntry, generations, spec_from_proto
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.inflight import InflightPulls, PullTicket
from kv_sidecar.server.lease_view import LeaseView
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.peer_calls import PeerCallError
from kv_sidecar.server.peers import Peers
from kv_sidecar.server.publish_refusals import PublishRefusals
from kv_sidecar.server.published import Published, PublishedStore
from kv_sidecar.server.pull_batch import OnOutcomes, PullBatches, Together
from kv_sidecar.server.pull_steps import Made, Steps, Want, run_steps
from kv_sidecar.server.release import Releases
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2

log = logging.getLogger(__name__)

# Registers what to run when the engine goes away mid-call (the gRPC call ends, the lane closes).
OnHangup = Callable[[Callable[[], None]], None]
# One admitted pull's steps (Puller.pull_steps): the request, its ticket, where to leave work for later.
PullFn = Callable[[engine_pb2.PullRequest, PullTicket, Later | None], Steps[engine_pb2.PullResponse]]


KEEP_ALIVE_TIMEOUT_S = 5.0


class EngineCalls:
    """What engines ask of this sidecar."""

    def __init__(
        self,
        identity: Identity,
        lease_ms: int,
        pull_timeout_s: float,
        engines: EngineRegistry,
        published: PublishedStore,
        membership: Membership,
        pulls: InflightPulls,
        run_pull: PullFn,
        goes_together: Callable[[engine_pb2.PullRequest], bool],
        move: Callable[[Want], int],
        move_all: Callable[[Sequence[Want], Executor, Made], None],
        releases: Releases,
        peers: Peers,
        lease_view: LeaseView,
        on_published: Callable[[Published, Iterable[RankEntry]], None],
        refusals: PublishRefusals,
        max_pull_batch: int,
        batch_threads: int,
        observe_batch: Callable[[int], None] = lambda n: None,
        batch_reads_together: bool = False,
    ) -> None:
        """run_pull, goes_together, move, move_all: Puller.pull_steps (a pull's steps), goes_together
        (which PullBatch members run as one unit), move and move_all (how the steps' bytes move, alone
        and a batch's together); on_published: a request was just published here
        (PushThreads.expect_read); refusals: where a refused Publish is counted; max_pull_batch,
        batch_threads: PullBatch's most members, and the threads its members from other sidecars wait
        on; observe_batch: each batch's size (metrics); batch_reads_together: a batch's members run as
        one unit (staged_batch_reads)."""
        self._me = identity
        self._lease_ms = lease_ms
        self._pull_timeout_s = pull_timeout_s
        self._engines = engines
        self._published = published
        self._membership = membership
        self._pulls = pulls
        self._run_pull = run_pull
        self._move = move
        self._releases = releases
        self._peers = peers
        self._lease_view = lease_view
        self._on_published = on_published
        self._refusals = refusals
        self._batches = PullBatches(
            self.pull,
            max_pull_batch,
            identity.sidecar_id,
            batch_threads,
            observe_batch,
            Together(self.pull_steps, goes_together, move_all, move) if batch_reads_together else None,
        )

    def close(self) -> None:
        self._batches.stop()

    # -- registration ------------------------------------------------------------------
    def register_rank(
        self,
        engine_id: str,
        rank: int,
        spec_msg: common_pb2.EngineSpec | None,
        tensors: Sequence[common_pb2.TensorHandle],
        leader_address: str,
    ) -> engine_pb2.RegisterRankResponse:
        check_id("engine_id", engine_id)
        if spec_msg is None:
            raise SidecarError(Code.INVALID_ARGUMENT, "spec is required")
        spec = spec_from_proto(spec_msg)
        # A member of a multi-node engine also reports the rank to its leader (docs/multinode.md).
        leader = self._membership.register_rank(engine_id, rank, spec, list(tensors), leader_address)
        return engine_pb2.RegisterRankResponse(
            sidecar_id=self._me.sidecar_id, peer_address=self._me.peer_address, leader_address=leader
        )

    def rank(self, engine_id: str, rank: int) -> RankEntry:
        """A registered rank (its event queue, for the Events stream); NOT_FOUND if none."""
        return self._engines.get(engine_id, rank)

    def unregister(self, engine_id: str, rank: int) -> None:
        self._engines.get(engine_id, rank)  # NOT_FOUND before touching anything
        # Pulls into this rank stop, and finish, before its memory is unmapped and deregistered.
        stopped = self._pulls.stop_rank(engine_id, rank, f"engine {engine_id!r} rank {rank} was unregistered")
        if not self._pulls.wait_finished(stopped, self._pull_timeout_s):
            log.warning(
                "pulls into engine %s rank %d did not stop in time; unregistering anyway", engine_id, rank
            )
        self._engines.unregister(engine_id, rank)
        self._membership.after_unregister(engine_id)
        if not any(e.engine_id == engine_id for e in self._engines.all()):
            dropped = self._published.drop_engine(engine_id)
            if dropped:
                log.info("released %d published requests of engine %s", dropped, engine_id)

    # -- a request's life ----------------------------------------------------------------
    def publish(self, request: engine_pb2.PublishRequest) -> engine_pb2.PublishResponse:
        try:
            return self._publish(request)
        except Exception as e:
            self._refusals.record(request.engine_id, as_sidecar_error(e))
            raise

    def _publish(self, request: engine_pb2.PublishRequest) -> engine_pb2.PublishResponse:
        check_id("engine_id", request.engine_id)
        check_id("request_id", request.request_id)
        ranks = self._engines.engine_ranks(request.engine_id)  # those registered here now: one look
        spec = ranks[0].spec
        # The blocks of tokens [first_token, num_tokens): all of the prompt, or a sliding-window
        # request's window, whose engine freed (and never names) the blocks before it.
        check_published(
            "prefill",
            request.block_ids,
            request.num_tokens,
            request.first_token,
            spec.block_size,
            spec.num_blocks,
        )
        self._membership.check_publish(request.engine_id, spec.tp_size)
        lease_ms = request.lease_ms or self._lease_ms
        item = self._published.publish(
            request.engine_id,
            request.request_id,
            list(request.block_ids),
            request.num_tokens,
            lease_ms / 1000,
            ranks=self._membership.held_here(request.engine_id),
            first_token=request.first_token,
            block_size=spec.block_size,
            generations=generations(ranks),
        )
        try:  # a multi-node engine: hold it on the member sidecars too
            self._membership.publish_on_members(
                request.engine_id,
                request.request_id,
                request.block_ids,
                request.num_tokens,
                lease_ms,
                request.first_token,
            )
        except BaseException:
            self._published.abort(request.engine_id, request.request_id)
            raise
        self._on_published(item, ranks)
        params = common_pb2.TransferParams(
            engine_id=request.engine_id,
            sidecar_address=self._me.peer_address,
            sidecar_id=self._me.sidecar_id,
            request_id=request.request_id,
            block_ids=request.block_ids,
            num_tokens=request.num_tokens,
            lease_deadline_unix_ms=item.deadline_unix_ms(),
            first_token=request.first_token,
            map_version=self._membership.map_version(request.engine_id),
        )
        return engine_pb2.PublishResponse(params=params)

    def pull(
        self, request: engine_pb2.PullRequest, on_hangup: OnHangup, later: Later | None = None
    ) -> engine_pb2.PullResponse:
        """`later`: where the pull leaves work for after its answer (the caller runs it once the answer is
        out, then `run_later`); None: it runs before this returns."""
        return run_steps(self.pull_steps(request, on_hangup, later), self._move)

    def pull_steps(
        self, request: engine_pb2.PullRequest, on_hangup: OnHangup, later: Later | None = None
    ) -> Steps[engine_pb2.PullResponse]:
        """`pull`, yielding what moves its bytes to its caller (a PullBatch moves its members' together)."""
        check_id("engine_id", request.engine_id)
        check_id("params.request_id", request.params.request_id)
        check_id("params.engine_id", request.params.engine_id)
        # Pulls of one request into different ranks run side by side (a TP engine's workers each pull
        # their own rank); no ranks means every rank registered now.
        ranks = list(request.ranks) or self._engines.ranks_of(request.engine_id)
        ticket = self._pulls.begin(request.engine_id, request.params.request_id, ranks)
        # The engine went away (or gave up the call): stop, and let the source free its blocks.
        on_hangup(lambda: ticket.stop("the engine's call ended", release_source=True))
        try:
            return (yield from self._run_pull(request, ticket, later))
        finally:
            self._pulls.end(ticket)

    def pull_batch(
        self,
        request: engine_pb2.PullBatchRequest,
        on_hangup: OnHangup,
        later: Later | None = None,
        on_outcome: OnOutcomes | None = None,
    ) -> engine_pb2.PullBatchResponse:
        """Every member run as `pull` runs it, side by side; `later` as for `pull`; `on_outcome`: told
        members' outcomes as they end, those of members that ended together at once (the lane sends
        them ahead)."""
        after: Later = [] if later is None else later
        try:
            return self._batches.run(request, on_hangup, after, on_outcome)
        finally:
            if later is None:
                run_later(after)

    def keep_alive(self, params: Sequence[common_pb2.TransferParams]) -> list[int]:
        """Extend the leases of requests, here or on the sidecars that published them."""
        me = self._me.sidecar_id
        for i, p in enumerate(params):
            check_id(f"params[{i}].engine_id", p.engine_id)
            check_id(f"params[{i}].request_id", p.request_id)
            if p.sidecar_id != me:
                check_address(f"params[{i}].sidecar_address", p.sidecar_address)
        out: list[int] = []
        for p in params:
            if p.sidecar_id == me:
                out.extend(self._membership.keep_alive(p.engine_id, [p.request_id]))
                continue
            msg = peer_pb2.PeerKeepAliveRequest(engine_id=p.engine_id, request_ids=[p.request_id])
            try:
                resp = self._peers.link(p.sidecar_address).client.keep_alive(msg, KEEP_ALIVE_TIMEOUT_S)
            except PeerCallError as e:
                raise e.explain(p.sidecar_address, "keep-alive") from None
            for deadline in resp.lease_deadline_unix_ms:
                self._lease_view.extended(p.sidecar_id, p.engine_id, p.request_id, deadline)
            out.extend(resp.lease_deadline_unix_ms)
        return out

    def abort(self, engine_id: str, request_id: str, params: common_pb2.TransferParams | None) -> bool:
        """The engine gives up a request: one it published (the prefill side), or one it pulls (the
        decode side, `params` naming where it was published). Whether any was found."""
        found = self._published.abort(engine_id, request_id)
        if found:
            self._membership.abort_on_members(engine_id, request_id)
        # Every pull of the request stops; the last one to end releases the source (PullTicket.release_source).
        if self._pulls.stop_request(engine_id, request_id, "aborted by the engine"):
            found = True
        elif params is not None and params.request_id:
            if params.request_id != request_id:
                raise SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"params are for request {params.request_id!r}, not {request_id!r}",
                )
            found = self._releases.source(params, engine_id, "aborted by the reader") or found
        return found
