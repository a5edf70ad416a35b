"""PeerService: what other sidecars ask of this one."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.server.engines import spec_from_proto, spec_to_proto
from kv_sidecar.server.errors import Code, SidecarError, check_id, rpc
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.release import release_here
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._sc = sidecar
        self._plans: dict[str, PairPlan] = {}  # plan hash -> plan agreed in a handshake
        self._lock = threading.Lock()

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
        with self._lock:
            self._plans[plan.hash()] = plan
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
            ranks=[
                peer_pb2.RankMemory(
                    rank=e.rank,
                    memory_kind="DRAM",
                    regions=[
                        peer_pb2.MemoryRegion(address=a, length=n, device_id=d) for a, n, d in e.regions
                    ],
                )
                for e in ranks
            ],
        )

    @rpc
    def OpenRead(
        self, request: peer_pb2.OpenReadRequest, context: grpc.ServicerContext
    ) -> peer_pb2.OpenReadResponse:
        sc = self._sc
        with self._lock:
            plan = self._plans.get(request.plan_hash)
        if plan is None:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"unknown plan {request.plan_hash!r}: handshake before reading"
            )
        if sc.engines.spec(request.engine_id) != plan.prefill:
            raise SidecarError(
                Code.FAILED_PRECONDITION,
                f"engine {request.engine_id!r} changed since the handshake; handshake again",
            )
        item = sc.published.open_read(
            request.engine_id,
            request.request_id,
            request.reader_engine_id,
            plan,
            list(request.reader_ranks),
            sc.settings.pull_timeout_ms / 1000,
        )
        return peer_pb2.OpenReadResponse(
            block_ids=item.block_ids,
            num_tokens=item.num_tokens,
            lease_deadline_unix_ms=item.deadline_unix_ms(),
        )

    @rpc
    def KeepAlive(
        self, request: peer_pb2.PeerKeepAliveRequest, context: grpc.ServicerContext
    ) -> peer_pb2.PeerKeepAliveResponse:
        return peer_pb2.PeerKeepAliveResponse(
            lease_deadline_unix_ms=[
                self._sc.published.keep_alive(request.engine_id, r) for r in request.request_ids
            ]
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
            log.warning(
                "reader %s failed to read request %s of engine %s",
                request.reader_engine_id,
                request.request_id,
                request.engine_id,
            )
        return peer_pb2.CloseReadResponse()
