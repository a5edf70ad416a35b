"""The peer API's core, with no transport around it: what other sidecars ask of this one.

PeerServicer (server/adapters/peer_service.py) decodes, calls these, encodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.dataplane.jobs import RankKey
from kv_sidecar.errors import Code, SidecarError, check_id
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.engines import EngineRegistry, RankEntry, spec_from_proto, spec_to_proto
from kv_sidecar.server.identity import Identity
from kv_sidecar.server.membership import Membership, rank_memory
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import PublishedStore
from kv_sidecar.server.push_runs import PushKeys, PushRuns
from kv_sidecar.server.reads import SourceReads
from kv_sidecar.server.release import Releases
from kv_sidecar.server.staged_source import PushCall, StagedSource
from kv_sidecar.server.transfers import TransferTracker
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

log = logging.getLogger(__name__)


class PeerRequests:
    def __init__(
        self,
        identity: Identity,
        notifications: bool,
        engines: EngineRegistry,
        published: PublishedStore,
        membership: Membership,
        reads: SourceReads,
        staged: StagedSource,
        releases: Releases,
        transfers: TransferTracker,
        push_keys: PushKeys,
        push_runs: PushRuns,
        nixl: NixlDriver,
        metrics: Metrics,
        worker_agents: Callable[[RankKey], tuple[str, bytes] | None] = lambda key: None,
    ) -> None:
        """notifications: the push_notifications setting (readers get keys to push and open by notification).
        worker_agents: the agent that runs a rank's staged transfers, if not ours (DataPlane.worker_agent)."""
        self._me = identity
        self._notifications = notifications
        self._engines = engines
        self._published = published
        self._membership = membership
        self._reads = reads
        self._staged = staged
        self._releases = releases
        self._transfers = transfers
        self._push_keys = push_keys
        self._push_runs = push_runs
        self._nixl = nixl
        self._metrics = metrics
        self._worker_agents = worker_agents

    def handshake(self, request: peer_pb2.HandshakeRequest, peer: str) -> peer_pb2.HandshakeResponse:
        if request.protocol_version != PROTOCOL_VERSION:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not supported; this sidecar speaks {PROTOCOL_VERSION}",
            )
        check_id("engine_id", request.engine_id)
        ranks = self._engines.engine_ranks(request.engine_id)
        spec = ranks[0].spec
        if not request.HasField("reader_spec"):
            raise SidecarError(Code.INVALID_ARGUMENT, "reader_spec is required")
        plan = cached_plan(spec, spec_from_proto(request.reader_spec))
        self._reads.plans.add(plan)
        self._transfers.handshake_from(
            request.sidecar_id, peer, request.engine_id, request.reader_engine_id, plan.hash()
        )
        log.info(
            "handshake from %s (engine %s reads %s)",
            request.sidecar_id,
            request.reader_engine_id,
            request.engine_id,
        )
        members, map_version = self._membership.members_and_version(request.engine_id)
        return peer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            sidecar_id=self._me.sidecar_id,
            agent_name=self._me.sidecar_id,
            agent_metadata=self._nixl.metadata(),
            spec=spec_to_proto(spec),
            plan_hash=plan.hash(),
            ranks=[rank_memory(e, self._worker_agent(e)) for e in ranks],
            members=members,
            map_version=map_version,
            push_key=self._push_key(request, peer),
            push_members=True,  # server/staged_source.py takes Pushes of several requests
            push_members_v2=True,  # ... each from its own start, decode blocks a multiple of ours
            staged_workers=True,  # server/staged_source.py takes reader_worker_agent and source_in_worker
            done_batches=True,  # server/reads.py: SourceReads.readers_done
        )

    def _worker_agent(self, entry: RankEntry) -> tuple[str, bytes] | None:
        """The rank's worker agent; None (our own agent, the transfer then runs here) if it cannot start."""
        try:
            return self._worker_agents(entry.key)
        except SidecarError as e:
            log.warning(
                "rank %s of %s: its staged transfers run in the sidecar: %s", entry.rank, entry.engine_id, e
            )
            return None

    def _push_key(self, request: peer_pb2.HandshakeRequest, peer: str) -> bytes:
        """The reader's push key: its Pushes and opens may then go as notifications too, which we poll
        for at the serving rate from now on (server/push_runs.py). A reader that handshook may read soon.
        Its agent is loaded here, so that we can answer its opens by notification
        (server/notified_opens.py); a reader whose agent we cannot load gets no key."""
        self._push_runs.reader_seen()
        agent = request.agent_name
        if not (self._notifications and agent and request.agent_metadata):
            return b""
        if agent == self._me.sidecar_id:
            return b""  # this sidecar itself (a misrouted pull, refused by the reader): nothing to load
        try:
            self._nixl.load_remote(agent, request.agent_metadata)
        except Exception as e:
            log.warning(
                "could not load the NIXL agent of reader %s; it pushes and opens by call: %s", agent, e
            )
            return b""
        return self._push_keys.grant(agent, peer)

    def open_read(self, request: peer_pb2.OpenReadRequest, peer: str) -> peer_pb2.OpenReadResponse:
        self._push_runs.reader_seen()  # its next opens may come as notifications: poll for them
        return self._reads.open_read(request, peer)

    def keep_alive(self, request: peer_pb2.PeerKeepAliveRequest) -> list[int]:
        # On a multi-node engine's leader this extends the lease on its members too.
        return self._membership.keep_alive(request.engine_id, list(request.request_ids))

    def close_read(self, request: peer_pb2.CloseReadRequest) -> None:
        self._reads.closed(request)  # released or failed, its reader READs no more of it
        if request.release:
            check_id("engine_id", request.engine_id)
            check_id("request_id", request.request_id)
            reason = "the reader failed and gave up" if request.failed else "the reader gave it up"
            self._releases.here(request.engine_id, request.request_id, request.reader_engine_id, reason)
        elif request.failed:
            # Keep the blocks: the reader may retry until the lease runs out.
            self._metrics.failures.labels("remote_read_failed").inc()
            self._transfers.serve_failed(
                request.engine_id, request.request_id, request.reader_engine_id, request.reader_ranks
            )
            self._published.read_failed(request.engine_id, request.request_id, request.reader_engine_id)
            log.warning(
                "reader %s failed to read request %s of engine %s",
                request.reader_engine_id,
                request.request_id,
                request.engine_id,
            )

    def push(self, request: peer_pb2.PushRequest, call: PushCall) -> peer_pb2.PushResponse:
        return self._staged.serve(request, call)

    def report_ranks(self, request: peer_pb2.ReportRanksRequest) -> str:
        """The leader's id, once it took a member's report."""
        self._membership.accept_report(request)
        return self._me.sidecar_id

    def publish(self, request: peer_pb2.PeerPublishRequest) -> None:
        self._membership.accept_publish(request)

    def abort(self, request: peer_pb2.PeerAbortRequest) -> bool:
        return self._published.abort(request.engine_id, request.request_id)
