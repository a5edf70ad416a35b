"""EngineService: the thin client's API (pod-local, on a unix socket)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from kv_sidecar.server import engine_calls
from kv_sidecar.server.adapters.grpc_status import rpc, stream_rpc
from kv_sidecar.server.engines import spec_from_proto
from kv_sidecar.server.errors import Code, SidecarError, check_address, check_id
from kv_sidecar.server.inflight import wait_finished
from kv_sidecar.server.peers import rpc_error
from kv_sidecar.server.release import release_source
from kv_sidecar.server.status import build_status
from kv_sidecar_client._proto.kvsidecar.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    status_pb2,
)

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._sc = sidecar
        # A sync gRPC server runs each Events stream on one engine_workers thread for the rank's life:
        # at most this many streams, so that register/publish/pull calls always find a thread.
        workers = sidecar.settings.engine_workers
        self._stream_limit = workers - max(4, workers // 4)
        self._streams = 0
        self._streams_lock = threading.Lock()

    @rpc
    def RegisterRank(
        self, request: engine_pb2.RegisterRankRequest, context: grpc.ServicerContext
    ) -> engine_pb2.RegisterRankResponse:
        check_id("engine_id", request.engine_id)
        if not request.HasField("spec"):
            raise SidecarError(Code.INVALID_ARGUMENT, "spec is required")
        spec = spec_from_proto(request.spec)
        # A member of a multi-node engine also reports the rank to its leader (docs/multinode.md).
        leader = self._sc.membership.register_rank(
            request.engine_id, request.rank, spec, list(request.tensors), request.leader_address
        )
        return engine_pb2.RegisterRankResponse(
            sidecar_id=self._sc.sidecar_id, peer_address=self._sc.peer_address, leader_address=leader
        )

    @rpc
    def UnregisterRank(
        self, request: engine_pb2.UnregisterRankRequest, context: grpc.ServicerContext
    ) -> engine_pb2.UnregisterRankResponse:
        self._unregister(request.engine_id, request.rank)
        return engine_pb2.UnregisterRankResponse()

    def _unregister(self, engine_id: str, rank: int) -> None:
        sc = self._sc
        sc.engines.get(engine_id, rank)  # NOT_FOUND before touching anything
        # Pulls into this rank stop, and finish, before its memory is unmapped and deregistered.
        stopped = sc.pulls.stop_rank(engine_id, rank, f"engine {engine_id!r} rank {rank} was unregistered")
        if not wait_finished(stopped, sc.settings.pull_timeout_ms / 1000):
            log.warning(
                "pulls into engine %s rank %d did not stop in time; unregistering anyway", engine_id, rank
            )
        sc.engines.unregister(engine_id, rank)
        sc.membership.after_unregister(engine_id)
        if not any(e.engine_id == engine_id for e in sc.engines.all()):
            dropped = sc.published.drop_engine(engine_id)
            if dropped:
                log.info("released %d published requests of engine %s", dropped, engine_id)

    @stream_rpc
    def Events(
        self, request: engine_pb2.EventsRequest, context: grpc.ServicerContext
    ) -> Iterator[engine_pb2.Event]:
        sc = self._sc
        entry = sc.engines.get(request.engine_id, request.rank)
        with self._streams_lock:
            if self._streams >= self._stream_limit:
                raise SidecarError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{self._streams} event streams are open, the most this sidecar takes: each holds one "
                    f"of its {sc.settings.engine_workers} engine_workers threads, and the rest are kept for "
                    f"register, publish and pull calls; raise engine_workers",
                )
            self._streams += 1
        closed = threading.Event()
        context.add_callback(closed.set)
        entry.sessions += 1
        try:
            yield engine_pb2.Event(ready=True)
            while not closed.is_set() and context.is_active():
                try:
                    event = entry.events.get(timeout=0.2)
                except queue.Empty:
                    continue
                if event is None:
                    return  # unregistered
                yield event
        finally:
            entry.sessions -= 1
            with self._streams_lock:
                self._streams -= 1
            if request.unregister_on_close and closed.is_set():
                try:
                    if self._sc.engines.get(request.engine_id, request.rank) is entry:
                        log.warning(
                            "session of engine %s rank %d ended: unregistering it",
                            request.engine_id,
                            request.rank,
                        )
                        self._unregister(request.engine_id, request.rank)
                except SidecarError:
                    pass

    @rpc
    def Publish(
        self, request: engine_pb2.PublishRequest, context: grpc.ServicerContext
    ) -> engine_pb2.PublishResponse:
        return engine_calls.publish(self._sc, request)

    @rpc
    def Pull(self, request: engine_pb2.PullRequest, context: grpc.ServicerContext) -> engine_pb2.PullResponse:
        return engine_calls.pull(self._sc, request, context.add_callback)

    @rpc
    def KeepAlive(
        self, request: engine_pb2.KeepAliveRequest, context: grpc.ServicerContext
    ) -> engine_pb2.KeepAliveResponse:
        sc = self._sc
        out: list[int] = []
        for i, p in enumerate(request.params):
            check_id(f"params[{i}].engine_id", p.engine_id)
            check_id(f"params[{i}].request_id", p.request_id)
            if p.sidecar_id != sc.sidecar_id:
                check_address(f"params[{i}].sidecar_address", p.sidecar_address)
        for p in request.params:
            if p.sidecar_id == sc.sidecar_id:
                out.extend(sc.membership.keep_alive(p.engine_id, [p.request_id]))
                continue
            link = sc.peers.link(p.sidecar_address)
            try:
                resp = link.stub.KeepAlive(
                    peer_pb2.PeerKeepAliveRequest(engine_id=p.engine_id, request_ids=[p.request_id]),
                    timeout=5,
                    metadata=sc.peer_metadata(),
                )
            except grpc.RpcError as e:
                raise rpc_error(e, p.sidecar_address, "keep-alive") from None
            for deadline in resp.lease_deadline_unix_ms:
                sc.lease_view.extended(p.sidecar_id, p.engine_id, p.request_id, deadline)
            out.extend(resp.lease_deadline_unix_ms)
        return engine_pb2.KeepAliveResponse(lease_deadline_unix_ms=out)

    @rpc
    def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> engine_pb2.AbortResponse:
        sc = self._sc
        found = sc.published.abort(request.engine_id, request.request_id)
        if found:
            sc.membership.abort_on_members(request.engine_id, request.request_id)
        # Every pull of the request stops; the last one to end releases the source (PullTicket.release_source).
        if sc.pulls.stop_request(request.engine_id, request.request_id, "aborted by the engine"):
            found = True
        elif request.HasField("params") and request.params.request_id:
            if request.params.request_id != request.request_id:
                raise SidecarError(
                    Code.INVALID_ARGUMENT,
                    f"params are for request {request.params.request_id!r}, not {request.request_id!r}",
                )
            found = release_source(sc, request.params, request.engine_id, "aborted by the reader") or found
        return engine_pb2.AbortResponse(found=found)

    @rpc
    def Status(
        self, request: status_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> status_pb2.StatusResponse:
        return build_status(self._sc)
