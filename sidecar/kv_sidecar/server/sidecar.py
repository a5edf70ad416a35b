"""A running sidecar: its state, its two gRPC servers, health, metrics and lease reaper."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kv_sidecar.config import Settings
from kv_sidecar.metrics import Metrics
from kv_sidecar.security import PeerSecurity
from kv_sidecar.server import notified_opens
from kv_sidecar.server.adapters.drain_gate import drain_gate
from kv_sidecar.server.adapters.engine_lane import EngineLane
from kv_sidecar.server.adapters.engine_service import EngineServicer
from kv_sidecar.server.adapters.peer_service import PeerServicer
from kv_sidecar.server.drain import Drain
from kv_sidecar.server.engines import EngineRegistry
from kv_sidecar.server.gpu_staging import GpuStaging
from kv_sidecar.server.inflight import InflightPulls
from kv_sidecar.server.lease_view import LeaseView
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.notifications import OPEN_TAG, PUSH_TAG, parse_done_notification
from kv_sidecar.server.peers import Peers
from kv_sidecar.server.published import Published, PublishedStore
from kv_sidecar.server.pull import Puller
from kv_sidecar.server.push_runs import PushKeys, PushRuns
from kv_sidecar.server.reads import ReadPlans
from kv_sidecar.server.staged_source import push_from_notif
from kv_sidecar.server.transfers import TransferTracker
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kv_sidecar_client.lane import LANE_SUFFIX

log = logging.getLogger(__name__)

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name
# Refused with UNAVAILABLE while draining; the drain waits for in-flight Pulls.
DRAIN_REFUSED_ENGINE = tuple(f"/{ENGINE_SERVICE}/{m}" for m in ("RegisterRank", "Publish", "Pull"))
DRAIN_REFUSED_PEER = tuple(f"/{PEER_SERVICE}/{m}" for m in ("Handshake", "OpenRead"))
DRAIN_WAITED = (f"/{ENGINE_SERVICE}/Pull",)


class Sidecar:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sidecar_id = (
            settings.sidecar_id or f"kvs-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.security = PeerSecurity.from_settings(settings)  # ConfigError before anything starts
        self.metrics = Metrics()
        self.drain = Drain()
        self.transfers = TransferTracker(stale_s=settings.pull_timeout_ms / 1000)
        self.started_at = time.monotonic()
        # Staged Pushes that readers also send as NIXL notifications (server/push_runs.py).
        self.push_keys = PushKeys()
        notified = settings.push_notifications
        self.push_runs = PushRuns(on_recent=(lambda: self.nixl.wake()) if notified else None)
        recent = self.push_runs.recent if notified else (lambda: False)
        self.nixl = NixlDriver(
            self.sidecar_id,
            on_notif=self._on_notif,
            busy_wait_s=settings.nixl_busy_poll_us / 1e6,
            quiet_wait_s=settings.nixl_quiet_poll_ms / 1e3,
            # Poll at the serving rate while reads are served, or while readers push (a Push
            # notification waits for our next poll: at the idle rate, 2 ms, it would lose to gRPC).
            serving=lambda: self.transfers.any_serving() or recent(),
        )
        self.metrics.bind_nixl(self.nixl.counts)
        self.metrics.bind_gpu_launches(_gpu_launch_counts)
        self.gpu_staging = GpuStaging(self)
        self.engines = EngineRegistry(self.nixl, on_gpu_device=self.gpu_staging.ensure)
        # A request that ends early (released, aborted, expired) ends the reads of it that were open.
        self.published = PublishedStore(
            self._on_consumed,
            self._on_expired,
            on_ended=self.transfers.end_serves,
        )
        self.metrics.bind_registry(self.engines.all, lambda: len(self.published))
        self.peers = Peers(self)
        self.read_plans = ReadPlans()
        self.membership = Membership(self)
        self.puller = Puller(self)
        self.pulls = InflightPulls()
        self.lease_view = LeaseView()
        self.peer_address = ""
        self.peer_port = 0
        self.metrics_port = 0
        self._engine_server: grpc.Server | None = None
        self.engine_lane: EngineLane | None = None
        self._peer_server: grpc.Server | None = None
        self._health = [health.HealthServicer(), health.HealthServicer()]
        self._http: Any = None
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        self.nixl.start()
        opts = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
        ]
        # A gRPC sync server runs each call, streams included, on one pool thread; when every thread
        # is taken, new calls wait in a queue. Event streams live as long as their rank, so they may
        # take at most event_stream_limit threads, and unary calls always find one.
        self._engine_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.engine_workers, thread_name_prefix="engine"),
            options=opts,
            interceptors=[drain_gate(self.drain, DRAIN_REFUSED_ENGINE, DRAIN_WAITED)],
        )
        engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(self), self._engine_server)
        self._peer_server = grpc.server(
            # GPU Gather streams hold a thread each (waiting for their ring included): the same
            # on-demand bound as the engine API keeps them from starving OpenRead and handshakes.
            futures.ThreadPoolExecutor(max_workers=s.engine_workers, thread_name_prefix="peer"),
            options=opts,
            interceptors=[
                *self.security.interceptors(self._peer_refused),
                drain_gate(self.drain, DRAIN_REFUSED_PEER, ()),
            ],
        )
        peer_pb2_grpc.add_PeerServiceServicer_to_server(PeerServicer(self), self._peer_server)
        for server, hs, name in (
            (self._engine_server, self._health[0], ENGINE_SERVICE),
            (self._peer_server, self._health[1], PEER_SERVICE),
        ):
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
            reflection.enable_server_reflection(
                (name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server,
            )
        sock = s.engine_socket
        os.makedirs(os.path.dirname(os.path.abspath(sock)), exist_ok=True)
        if os.path.exists(sock):
            os.unlink(sock)  # a stale socket from a previous run
        self._engine_server.add_insecure_port(f"unix:{sock}")
        self.peer_port = self._add_peer_port(self._peer_server)
        host = s.peer_host if s.peer_host not in ("0.0.0.0", "::", "") else socket.gethostname()
        adv = s.advertise_address
        # A bare host (e.g. the pod IP from the downward API) gets our peer port.
        self.peer_address = (
            adv
            if ":" in adv.strip("[]") or (adv.startswith("[") and "]:" in adv)
            else f"{adv or host}:{self.peer_port}"
        )
        self._engine_server.start()
        self._peer_server.start()
        if s.engine_lane:
            self._start_lane(sock + LANE_SUFFIX)
        if s.metrics_port >= 0:
            self._http, _ = start_http_server(
                s.metrics_port, addr=s.peer_host or "0.0.0.0", registry=self.metrics.registry
            )
            self.metrics_port = self._http.server_port
        self._reaper.start()
        for hs, name in zip(self._health, (ENGINE_SERVICE, PEER_SERVICE), strict=True):
            hs.set("", health_pb2.HealthCheckResponse.SERVING)
            hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "sidecar %s up: engine socket %s, peer %s (advertised %s, %s), metrics :%d",
            self.sidecar_id,
            sock,
            self.peer_port,
            self.peer_address,
            self.security.describe(),
            self.metrics_port,
        )
        if self.security.token and not self.security.tls:
            log.warning("the peer token is sent in plaintext: set tls_cert/tls_key to encrypt it")

    def _start_lane(self, path: str) -> None:
        lane = EngineLane(self, path, self.settings.engine_workers)
        try:
            lane.start()
        except OSError as e:  # e.g. a path past the 107 bytes a unix socket takes: gRPC still serves
            log.warning("engine lane not served at %s: %s; engines use gRPC for every call", path, e)
            return
        self.engine_lane = lane

    def _add_peer_port(self, server: grpc.Server) -> int:
        s = self.settings
        address = f"{s.peer_host}:{s.peer_port}"
        creds = self.security.server_credentials()
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        return port

    def drain_in_flight(self, timeout_s: float) -> None:
        """SIGTERM: report NOT_SERVING, refuse new work, let in-flight pulls and served reads finish."""
        for hs, name in zip(self._health, (ENGINE_SERVICE, PEER_SERVICE), strict=True):
            hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.drain.begin()
        busy = self.drain.inflight + self.transfers.serving()
        log.info("draining: %d transfers in flight, waiting up to %g s", busy, timeout_s)
        left = self.drain.wait(timeout_s, self.transfers.serving)
        if left:
            log.warning("drain deadline passed with %d transfers still in flight: stopping anyway", left)
        else:
            log.info("drained")

    def stop(self, grace_s: float = 5.0) -> None:
        for hs in self._health:
            hs.enter_graceful_shutdown()
        self._stop.set()
        if self.engine_lane is not None:
            self.engine_lane.stop()
        events = [srv.stop(grace_s) for srv in (self._engine_server, self._peer_server) if srv is not None]
        for ev in events:
            ev.wait(grace_s + 1)
        self.peers.close()
        self.engines.close()
        self.nixl.stop()  # deregisters the GPU rings before their memory goes
        self.gpu_staging.close()
        if self._http is not None:
            self._http.shutdown()
        sock = self.settings.engine_socket
        if os.path.exists(sock):
            os.unlink(sock)
        log.info("sidecar %s stopped", self.sidecar_id)

    def wait(self) -> None:
        self._stop.wait()

    # -- helpers for the services ---------------------------------------------
    def peer_channel(self, address: str) -> grpc.Channel:
        s = self.settings
        opts = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
        ]
        return self.security.channel(address, opts)

    def peer_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.security.call_metadata()

    def _peer_refused(self, method: str, peer: str, reason: str) -> None:
        self.metrics.failures.labels(f"peer_token_{reason}").inc()
        log.warning(
            "refused %s from %s: peer token %s",
            method,
            peer,
            reason,
            extra={"fields": {"event": "peer_refused", "method": method, "peer": peer, "reason": reason}},
        )

    # -- callbacks --------------------------------------------------------------
    def _on_notif(self, agent: str, msg: bytes) -> None:
        if msg.startswith(PUSH_TAG):
            push_from_notif(self, agent, msg)
            return
        if msg.startswith(OPEN_TAG):
            notified_opens.answer(self, agent, msg)
            return
        parsed = parse_done_notification(msg)
        if parsed is None:
            log.warning("ignoring malformed notification from %s", agent)
            self.metrics.failures.labels("bad_notification").inc()
            return
        engine_id, request_id, reader, decode_rank, prefill_ranks = parsed
        self.published.mark_done(engine_id, request_id, reader, decode_rank, prefill_ranks)
        self.transfers.serve_rank_done(engine_id, request_id, reader, decode_rank)

    def _rank_event(self, engine_id: str, rank: int, event: engine_pb2.Event) -> None:
        try:
            self.engines.get(engine_id, rank).emit(event)
        except Exception:
            log.warning(
                "no registered rank %d of engine %s to tell about %s",
                rank,
                engine_id,
                event.WhichOneof("kind"),
            )

    def _on_consumed(self, engine_id: str, rank: int, item: Published) -> None:
        ev = engine_pb2.Event(
            consumed=engine_pb2.RequestConsumed(request_id=item.request_id, block_ids=item.block_ids)
        )
        self._rank_event(engine_id, rank, ev)

    def _on_expired(self, item: Published) -> None:
        self.metrics.lease_expiries.inc()
        ev = engine_pb2.Event(
            lease_expired=engine_pb2.LeaseExpired(request_id=item.request_id, block_ids=item.block_ids)
        )
        for entry in self.engines.all():
            if entry.engine_id == item.engine_id:
                entry.emit(ev)

    def _reap(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.published.expire()
                self.transfers.expire_stale()  # a reader that never reported keeps none open
            except Exception:
                log.exception("lease reaper failed")


def _gpu_launch_counts() -> dict[str, int]:
    """The GPU copy kernel's launches in this process; none before its module (and Triton) is loaded,
    which the first GPU copy does: a scrape must not import Triton."""
    kernels = sys.modules.get("kv_sidecar.execute.gpu_kernels")
    return kernels.launch.counts() if kernels is not None else {}
