"""The sidecar's listeners: the engine API (gRPC on a unix socket, and the engine lane beside it), the
peer API (gRPC over TCP, with TLS and the token where configured), gRPC health and reflection on both,
and the Prometheus endpoint.

Bound first (`bind`), so that the composition root knows the peer address before it builds the core;
serving once the servicers exist (`serve`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kv_sidecar.config import Settings
from kv_sidecar.listeners import listen_engine_socket, listen_peer_port
from kv_sidecar.security import PeerSecurity
from kv_sidecar.server.adapters.drain_gate import drain_gate
from kv_sidecar.server.adapters.engine_lane import EngineLane
from kv_sidecar.server.adapters.peer_client import message_limits
from kv_sidecar.server.drain import Drain
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kv_sidecar_client.lane import LANE_SUFFIX

log = logging.getLogger(__name__)

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name
# Refused with UNAVAILABLE while draining; the drain waits for in-flight Pulls.
DRAIN_REFUSED_ENGINE = tuple(
    f"/{ENGINE_SERVICE}/{m}" for m in ("RegisterRank", "Publish", "Pull", "PullBatch")
)
DRAIN_REFUSED_PEER = tuple(f"/{PEER_SERVICE}/{m}" for m in ("Handshake", "OpenRead"))
DRAIN_WAITED = (f"/{ENGINE_SERVICE}/Pull", f"/{ENGINE_SERVICE}/PullBatch")
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Servers:
    def __init__(
        self,
        settings: Settings,
        security: PeerSecurity,
        drain: Drain,
        on_peer_refused: Callable[[str, str, str], None],
    ) -> None:
        """on_peer_refused(method, peer, reason): a peer call without the right token."""
        self._settings = settings
        self._drain = drain
        opts = message_limits(settings)
        # A gRPC sync server runs each call, streams included, on one pool thread; when every thread
        # is taken, new calls wait in a queue. Event streams live as long as their rank, so they may
        # take at most event_stream_limit threads, and unary calls always find one.
        self._engine = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.engine_workers, thread_name_prefix="engine"),
            options=opts,
            interceptors=[drain_gate(drain, DRAIN_REFUSED_ENGINE, DRAIN_WAITED)],
        )
        self._peer = grpc.server(
            # GPU Gather streams hold a thread each (waiting for their ring included): the same
            # on-demand bound as the engine API keeps them from starving OpenRead and handshakes.
            futures.ThreadPoolExecutor(max_workers=settings.engine_workers, thread_name_prefix="peer"),
            options=opts,
            interceptors=[*security.interceptors(on_peer_refused), drain_gate(drain, DRAIN_REFUSED_PEER, ())],
        )
        self._security = security
        self._health = [health.HealthServicer(), health.HealthServicer()]
        for server, hs, name in (
            (self._engine, self._health[0], ENGINE_SERVICE),
            (self._peer, self._health[1], PEER_SERVICE),
        ):
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
            reflection.enable_server_reflection((name, _HEALTH, reflection.SERVICE_NAME), server)
        self.lane: EngineLane | None = None
        self.metrics_port = 0
        self._http: Any = None

    def bind(self) -> int:
        """Listen on the engine socket and the peer port; returns the peer port (for port 0, the one given)."""
        s = self._settings
        listen_engine_socket(self._engine, s.engine_socket)
        return listen_peer_port(self._peer, s.peer_host, s.peer_port, self._security)

    def serve(
        self,
        engine: engine_pb2_grpc.EngineServiceServicer,
        peer: peer_pb2_grpc.PeerServiceServicer,
        lane: Callable[[str], EngineLane] | None,
        registry: CollectorRegistry,
    ) -> None:
        """Start serving; `lane(path)`: the engine lane to serve beside the engine socket (None: none)."""
        s = self._settings
        engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, self._engine)
        peer_pb2_grpc.add_PeerServiceServicer_to_server(peer, self._peer)
        self._engine.start()
        self._peer.start()
        if lane is not None:
            self._start_lane(lane)
        if s.metrics_port >= 0:
            self._http, _ = start_http_server(
                s.metrics_port, addr=s.metrics_host or s.peer_host or "0.0.0.0", registry=registry
            )
            self.metrics_port = self._http.server_port
        self.set_serving(True)

    def _start_lane(self, make: Callable[[str], EngineLane]) -> None:
        path = self._settings.engine_socket + LANE_SUFFIX
        lane = make(path)
        try:
            lane.start()
        except OSError as e:  # e.g. a path past the 107 bytes a unix socket takes: gRPC still serves
            log.warning("engine lane not served at %s: %s; engines use gRPC for every call", path, e)
            return
        self.lane = lane

    def lane_state(self) -> tuple[str, int]:
        lane = self.lane
        return (lane.path, lane.connections) if lane is not None else ("", 0)

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for hs, name in zip(self._health, (ENGINE_SERVICE, PEER_SERVICE), strict=True):
            hs.set("", status)
            hs.set(name, status)

    def stop(self, grace_s: float) -> None:
        self.stop_engine_side(grace_s)
        self.stop_peer_side(grace_s)

    def stop_engine_side(self, grace_s: float) -> None:
        """Everything but the peer port, which stays open until `stop_peer_side`."""
        if self._http is not None:
            # Its loop looks for a shutdown only every 0.5 s: it ends (and closes its port) on its own
            # thread, while the rest stops and the process exits, instead of adding 0.5 s to each stop.
            threading.Thread(target=_close_http, args=(self._http,), daemon=True).start()
        for hs in self._health:
            hs.enter_graceful_shutdown()
        if self.lane is not None:
            self.lane.stop()
        self._engine.stop(grace_s).wait(grace_s + 1)
        sock = self._settings.engine_socket
        if os.path.exists(sock):
            os.unlink(sock)

    def stop_peer_side(self, grace_s: float) -> None:
        """Closes the peer port: a peer that finds it refusing may take this sidecar's reads over
        (server/gone_readers.py), so the composition root calls this once nothing here reads any more."""
        self._peer.stop(grace_s).wait(grace_s + 1)


def _close_http(httpd: Any) -> None:
    httpd.shutdown()
    httpd.server_close()
