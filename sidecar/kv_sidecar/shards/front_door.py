"""The front door of control shards: the node sidecar's engine socket, peer port and metrics port, where
engines learn their shard (Route) and operators see the node (Status, health, /metrics). It moves no
bytes and holds no engine: every other engine call is refused with the way to the shards, so that an
engine with a client from before Route fails at once and clearly, instead of registering nowhere.

The only module of shards/ that knows gRPC.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kv_sidecar import __version__
from kv_sidecar.config import Settings
from kv_sidecar.listeners import listen_engine_socket, listen_peer_port
from kv_sidecar.security import PeerSecurity
from kv_sidecar.shards.children import ShardSet
from kv_sidecar.shards.metrics import ShardMetrics
from kv_sidecar.shards.placement import EngineShards, Placement
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc, status_pb2

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
STATUS_TIMEOUT_S = 2.0


def _fail(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("context.abort returned")  # it raises; the type stubs do not say so


class FrontDoorEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(
        self,
        placement: Placement,
        shards: ShardSet,
        leader_wait_s: float,
        identity: tuple[str, str],
        draining: threading.Event,
        security: str = "",
        spread: bool = False,
    ) -> None:
        """`identity`: the front door's (sidecar id, peer address); `security`: its peer port's mode;
        `spread`: an engine's ranks on their own shards (control_shard_ranks)."""
        self._placement = placement
        self._spread = spread
        self._shards = shards
        self._engines = EngineShards()
        self._wait_s = leader_wait_s
        self._identity = identity
        self._draining = draining
        self._security = security
        self._started = time.monotonic()
        self._status_stubs = [
            engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(s.target)) for s in shards.shards
        ]

    def Route(
        self, request: engine_pb2.RouteRequest, context: grpc.ServicerContext
    ) -> engine_pb2.RouteResponse:
        targets = [s.target for s in self._shards.shards]
        engine = request.engine_id
        if not engine:  # a call that names no engine of its own (KeepAlive): any shard forwards it
            shard = 0
        elif request.HasField("rank") and request.rank > 0 and self._spread and not request.own_leader:
            return self._spread_rank(request, context)
        elif request.HasField("rank") and (request.rank == 0 or not request.device_uuid):
            # Rank 0 places the engine; a host engine's every rank goes by its key or id alone.
            shard = self._placement.shard_of(engine, request.device_uuid, request.placement)
            self._engines.set(engine, shard)
        elif request.HasField("rank") and request.own_leader:
            # Ranks of an engine led from another node, without their rank 0 here: by their GPU.
            shard = self._placement.shard_of(engine, request.device_uuid, request.placement)
        else:
            shard = self._rank0_shard(engine, context)
        return engine_pb2.RouteResponse(engine_target=targets[shard], shard=shard)

    def _rank0_shard(self, engine: str, context: grpc.ServicerContext) -> int:
        """The shard of the engine's rank 0, waited for as a member waits for its leader; else refused."""
        shard = self._engines.wait(engine, self._wait_s)
        if shard is None:
            _fail(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine {engine!r}: its rank 0 was not routed within {self._wait_s:g} s; this node "
                f"sidecar runs {len(self._shards.shards)} control shards and places an engine by its rank "
                "0 (register rank 0 too, or name a leader_address of the engine's own)",
            )
        return shard

    def _spread_rank(
        self, request: engine_pb2.RouteRequest, context: grpc.ServicerContext
    ) -> engine_pb2.RouteResponse:
        """A rank other than 0 of an engine spread over shards: on its own shard; where that is not its
        rank 0's, it registers there as a member of the engine, led by rank 0's shard."""
        shards = self._shards.shards
        engine = request.engine_id
        leader = self._rank0_shard(engine, context)
        own = self._placement.rank_shard(engine, request.rank, request.device_uuid, request.placement)
        address = ""
        if own != leader:
            info = shards[leader].info
            if info is None:
                _fail(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"engine {engine!r}: shard {leader}, which leads it, is starting again; try again",
                )
            address = info.peer_address
        return engine_pb2.RouteResponse(engine_target=shards[own].target, shard=own, leader_address=address)

    def Status(
        self, request: status_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> status_pb2.StatusResponse:
        answers = [
            stub.Status.future(status_pb2.StatusRequest(), timeout=STATUS_TIMEOUT_S)
            for stub in self._status_stubs
        ]
        shards = []
        for index, answer in enumerate(answers):
            try:
                shard = answer.result()
            except grpc.RpcError:
                shard = status_pb2.StatusResponse()  # not answering: an empty id says so
            shard.shard_gpus.extend(self._placement.gpus_of(index))
            shards.append(shard)
        sidecar_id, peer_address = self._identity
        return status_pb2.StatusResponse(
            sidecar_id=sidecar_id,
            version=__version__,
            peer_address=peer_address,
            peer_security=self._security,
            draining=self._draining.is_set(),
            uptime_s=time.monotonic() - self._started,
            published_requests=sum(s.published_requests for s in shards),
            shards=shards,
        )

    def _refuse(self, context: grpc.ServicerContext) -> Any:
        _fail(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this node sidecar runs {len(self._shards.shards)} control shards: ask Route which shard serves "
            "the engine and call it (kv-sidecar-client does); a client from before Route can name a shard's "
            f"socket itself, {self._shards.shards[0].socket} and on",
        )

    def RegisterRank(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def UnregisterRank(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def Events(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def Publish(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def Pull(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def PullBatch(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def KeepAlive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)

    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._refuse(context)


class FrontDoorServers:
    """The engine socket (EngineService's Route and Status, health, reflection), the peer port (health
    and reflection: Kubernetes probes it; peers call the shards) and the merged /metrics."""

    def __init__(self, settings: Settings, security: PeerSecurity) -> None:
        self._settings = settings
        self._security = security
        # A GPU engine's ranks other than 0 each hold a thread while their Route waits for rank 0's.
        self._engine = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="door"))
        self._peer = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="door-peer"))
        self._health = [health.HealthServicer(), health.HealthServicer()]
        for server, hs in zip((self._engine, self._peer), self._health, strict=True):
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        reflection.enable_server_reflection((ENGINE_SERVICE, _HEALTH, reflection.SERVICE_NAME), self._engine)
        reflection.enable_server_reflection((_HEALTH, reflection.SERVICE_NAME), self._peer)
        self.metrics_port = 0
        self._http: Any = None

    def bind(self) -> int:
        """Listen on the engine socket and the peer port; the peer port (the one given for 0)."""
        s = self._settings
        listen_engine_socket(self._engine, s.engine_socket)
        return listen_peer_port(self._peer, s.peer_host, s.peer_port, self._security)

    def serve(self, engine: FrontDoorEngine, metrics: ShardMetrics) -> None:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, self._engine)
        self._engine.start()
        self._peer.start()
        s = self._settings
        if s.metrics_port >= 0:
            registry = CollectorRegistry()
            registry.register(metrics)
            self._http, _ = start_http_server(
                s.metrics_port, addr=s.metrics_host or s.peer_host or "0.0.0.0", registry=registry
            )
            self.metrics_port = self._http.server_port

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for hs in self._health:
            hs.set("", status)
        self._health[0].set(ENGINE_SERVICE, status)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for server in (self._engine, self._peer):
            server.stop(1.0).wait(2.0)
        if os.path.exists(self._settings.engine_socket):
            os.unlink(self._settings.engine_socket)
