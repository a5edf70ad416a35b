"""PeerService: what other sidecars ask of this one."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.server import staged_source
from kv_sidecar.server.adapters.grpc_status import rpc
from kv_sidecar.server.engines import spec_from_proto, spec_to_proto
from kv_sidecar.server.errors import Code, SidecarError, check_id
from kv_sidecar.server.membership import rank_memory
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.reads import open_read
from kv_sidecar.server.release import release_here
from kv_sidecar.server.status import build_status
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc, status_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._sc = sidecar

    @rpc
    def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: grpc.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        sc = self._sc
        if request.protocol_version != PROTOCOL_VERSION:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not supported; this sidecar speaks {PROTOCOL_VERSION}",
            )
        check_id("engine_id", request.engine_id)
        ranks = sc.engines.engine_ranks(request.engine_id)
        spec = ranks[0].spec
        if not request.HasField("reader_spec"):
            raise SidecarError(Code.INVALID_ARGUMENT, "reader_spec is required")
        plan = cached_plan(spec, spec_from_proto(request.reader_spec))
        sc.read_plans.add(plan)
        sc.transfers.handshake_from(
            request.sidecar_id, context.peer(), request.engine_id, request.reader_engine_id, plan.hash()
        )
        log.info(
            "handshake from %s (engine %s reads %s)",
            request.sidecar_id,
            request.reader_engine_id,
            request.engine_id,
        )
        return peer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            sidecar_id=sc.sidecar_id,
            agent_name=sc.sidecar_id,
            agent_metadata=sc.nixl.metadata(),
            spec=spec_to_proto(spec),
            plan_hash=plan.hash(),
            ranks=[rank_memory(e) for e in ranks],
            members=sc.membership.members(request.engine_id),
            push_key=self._push_key(request, context.peer()),
        )

    def _push_key(self, request: peer_pb2.HandshakeRequest, peer: str) -> bytes:
        """The reader's push key: its Pushes and opens may then go as notifications too, which we poll
        for at the serving rate from now on (server/push_runs.py). A reader that handshook may read soon.
        Its agent is loaded here, so that we can answer its opens by notification
        (server/notified_opens.py); a reader whose agent we cannot load gets no key."""
        sc = self._sc
        sc.push_runs.reader_seen()
        agent = request.agent_name
        if not (sc.settings.push_notifications and agent and request.agent_metadata):
            return b""
        if agent == sc.sidecar_id:
            return b""  # this sidecar itself (a misrouted pull, refused by the reader): nothing to load
        try:
            sc.nixl.load_remote(agent, request.agent_metadata)
        except Exception as e:
            log.warning(
                "could not load the NIXL agent of reader %s; it pushes and opens by call: %s", agent, e
            )
            return b""
        return sc.push_keys.grant(agent, peer)

    @rpc
    def OpenRead(
        self, request: peer_pb2.OpenReadRequest, context: grpc.ServicerContext
    ) -> peer_pb2.OpenReadResponse:
        self._sc.push_runs.reader_seen()  # its next opens may come as notifications: poll for them
        return open_read(self._sc, request, context.peer())

    @rpc
    def KeepAlive(
        self, request: peer_pb2.PeerKeepAliveRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerKeepAliveResponse:
        # On a multi-node engine's leader this extends the lease on its members too.
        return peer_pb2.PeerKeepAliveResponse(
            lease_deadline_unix_ms=self._sc.membership.keep_alive(
                request.engine_id, list(request.request_ids)
            )
        )

    @rpc
    def CloseRead(
        self, request: peer_pb2.CloseReadRequest, context: grpc.ServicerContext
    ) -> peer_pb2.CloseReadResponse:
        if request.release:
            check_id("engine_id", request.engine_id)
            check_id("request_id", request.request_id)
            reason = "the reader failed and gave up" if request.failed else "the reader gave it up"
            release_here(self._sc, request.engine_id, request.request_id, request.reader_engine_id, reason)
        elif request.failed:
            # Keep the blocks: the reader may retry until the lease runs out.
            self._sc.metrics.failures.labels("remote_read_failed").inc()
            self._sc.transfers.serve_failed(
                request.engine_id, request.request_id, request.reader_engine_id, request.reader_ranks
            )
            log.warning(
                "reader %s failed to read request %s of engine %s",
                request.reader_engine_id,
                request.request_id,
                request.engine_id,
            )
        return peer_pb2.CloseReadResponse()

    @rpc
    def Push(self, request: peer_pb2.PushRequest, context: grpc.ServicerContext) -> peer_pb2.PushResponse:
        return staged_source.serve_push(self._sc, request, context)

    @rpc
    def ReportRanks(
        self, request: peer_pb2.ReportRanksRequest, context: grpc.ServicerContext
    ) -> peer_pb2.ReportRanksResponse:
        self._sc.membership.accept_report(request)
        return peer_pb2.ReportRanksResponse(leader_id=self._sc.sidecar_id)

    @rpc
    def Publish(
        self, request: peer_pb2.PeerPublishRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerPublishResponse:
        self._sc.membership.accept_publish(request)
        return peer_pb2.PeerPublishResponse()

    @rpc
    def Abort(
        self, request: peer_pb2.PeerAbortRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerAbortResponse:
        found = self._sc.published.abort(request.engine_id, request.request_id)
        return peer_pb2.PeerAbortResponse(found=found)

    @rpc
    def Status(
        self, request: status_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> status_pb2.StatusResponse:
        return build_status(self._sc)
