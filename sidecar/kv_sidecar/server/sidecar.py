"""The composition root: builds a sidecar's components in dependency order, and starts and stops it.

The only module that knows every component. Each gets what it uses through its constructor
(docs/architecture.md); the listeners are bound before the core is built, so that the identity every
component is given (its id, its peer address) is fixed before anything serves.
"""

from __future__ import annotations

import functools
import logging
import threading

from kv_sidecar.config import Settings
from kv_sidecar.dataplane.plane import DataPlane
from kv_sidecar.metrics import Metrics
from kv_sidecar.security import PeerSecurity
from kv_sidecar.server.adapters.engine_lane import EngineLane
from kv_sidecar.server.adapters.engine_service import EngineServicer
from kv_sidecar.server.adapters.peer_client import grpc_connect, probe_sidecar
from kv_sidecar.server.adapters.peer_service import PeerServicer
from kv_sidecar.server.adapters.servers import Servers
from kv_sidecar.server.drain import Drain
from kv_sidecar.server.engine_calls import EngineCalls
from kv_sidecar.server.engines import EngineRegistry
from kv_sidecar.server.gone_readers import GoneReaders
from kv_sidecar.server.identity import Identity, advertised_address, sidecar_id
from kv_sidecar.server.inflight import InflightPulls
from kv_sidecar.server.lease_view import LeaseView
from kv_sidecar.server.membership import Membership
from kv_sidecar.server.notified_opens import NotifiedOpens, OpenAnswers
from kv_sidecar.server.own_ranks import OwnRanks
from kv_sidecar.server.peer_requests import PeerRequests
from kv_sidecar.server.peers import Peers
from kv_sidecar.server.publish_refusals import PublishRefusals
from kv_sidecar.server.published import Published, PublishedStore
from kv_sidecar.server.pull import Puller
from kv_sidecar.server.pull_direct import DirectPulls
from kv_sidecar.server.push_runs import PushKeys, PushRuns
from kv_sidecar.server.push_threads import PushThreads
from kv_sidecar.server.reads import ReadPlans, SourceReads
from kv_sidecar.server.release import Releases
from kv_sidecar.server.routing import Opener
from kv_sidecar.server.staged_reader import StagedReader
from kv_sidecar.server.staged_source import StagedSource
from kv_sidecar.server.status import StatusReport
from kv_sidecar.server.transfers import TransferTracker
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar.transport.notifications import (
    DONES_TAG,
    OPEN_TAG,
    PUSH_FAILED_TAG,
    PUSH_REFUSED_TAG,
    PUSH_TAG,
    NotificationRoutes,
)
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

log = logging.getLogger(__name__)


class Sidecar:
    def __init__(self, settings: Settings) -> None:
        s = self.settings = settings
        self.security = PeerSecurity.from_settings(s)  # ConfigError before anything starts
        self.metrics = metrics = Metrics()
        self.drain = Drain()
        # -- the listeners, bound first: the peer address is part of who we are ----------------------
        self.servers = Servers(s, self.security, self.drain, self._peer_refused)
        try:
            self.peer_port = self.servers.bind()
        except BaseException:
            self.servers.stop(0)
            raise
        me = self.identity = Identity(sidecar_id(s), advertised_address(s, self.peer_port))
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)

        # -- state that owns its locks and knows nothing else ----------------------------------------
        transfers = self.transfers = TransferTracker(stale_s=s.pull_timeout_ms / 1000)
        # Staged Pushes that readers also send as NIXL notifications (server/push_runs.py).
        push_keys = PushKeys()
        notified = s.push_notifications
        push_runs = PushRuns(on_recent=(lambda: nixl.wake()) if notified else None)
        recent = push_runs.recent if notified else (lambda: False)
        pulls = InflightPulls()
        lease_view = LeaseView()

        # -- the data plane's agent, and where its notifications go (set once, below) ----------------
        routes = NotificationRoutes()
        nixl = self.nixl = NixlDriver(
            me.sidecar_id,
            on_notif=routes.dispatch,
            busy_wait_s=s.nixl_busy_poll_us / 1e6,
            lone_wait_s=s.nixl_lone_poll_us / 1e6,
            quiet_wait_s=s.nixl_quiet_poll_ms / 1e3,
            # Poll at the serving rate while reads are served, or while readers push (a Push
            # notification waits for our next poll: at the idle rate, 2 ms, it would lose to gRPC).
            serving=lambda: transfers.any_serving() or recent(),
        )
        metrics.bind_nixl(nixl.counts)
        # Every device's memory, rings and byte moves; the core hands it jobs (dataplane/plane.py).
        plane = self.plane = DataPlane(s, nixl, metrics)
        metrics.bind_gpu_launches(plane.gpu_launches)
        metrics.bind_workers(plane.worker_metrics)

        # -- the core ---------------------------------------------------------------------------------
        threads = self.push_threads = PushThreads(s, plane, push_runs)
        engines = self.engines = EngineRegistry(plane)
        # A request that ends early (released, aborted, expired) ends the reads of it that were open.
        published = self.published = PublishedStore(
            self._on_consumed,
            self._on_expired,
            on_ended=transfers.end_serves,
            on_dropped=plane.forget_ids,
            on_taken_over=self._on_taken_over,
        )
        metrics.bind_registry(engines.all, lambda: len(published))
        peers = self.peers = Peers(me.sidecar_id, nixl, metrics, grpc_connect(s, self.security))
        membership = Membership(
            me,
            engines,
            published,
            peers,
            nixl,
            s.lease_ms,
            threads.expect_read,
            s.leader_wait_ms / 1000,
            plane.ready_worker_agent,
            s.member_refresh_ms / 1000,
        )
        # A member's worker replaced: its leader hears at once that the worker agent it handed out is gone,
        # and, once the next one (or the first) is ready, which agent sends instead.
        plane.on_worker_change = lambda device: membership.refresh_now()
        releases = Releases(me.sidecar_id, published, engines, membership, peers, lease_view)
        pull_timeout_s = s.pull_timeout_ms / 1000
        refusals = PublishRefusals(metrics)
        gone = GoneReaders(probe_sidecar(s, self.security), s.reader_probe_ms / 1000)
        reads = SourceReads(
            engines, published, transfers, nixl, ReadPlans(), pull_timeout_s, metrics, gone, plane
        )
        staged_source = StagedSource(
            engines,
            published,
            reads,
            plane,
            threads,
            metrics,
            push_keys,
            push_runs,
            notified,
            pull_timeout_s,
            functools.partial(nixl.notify, only_loaded=True),
            me.sidecar_id,  # our NIXL agent's name
        )
        open_answers = OpenAnswers(reads, push_keys, push_runs, self.drain, nixl, metrics)
        opener = Opener(
            me,
            peers,
            NotifiedOpens(notified, s.open_answer_wait_us / 1e6, peers, nixl, metrics),
            metrics,
        )
        staged_reader = StagedReader(
            me.sidecar_id, peers, plane, threads, nixl, metrics, s.staged_group_reads
        )
        puller = Puller(
            me.sidecar_id,
            s,
            engines,
            pulls,
            transfers,
            lease_view,
            peers,
            opener,
            DirectPulls(engines, plane, membership, published, releases.source),
            OwnRanks(engines, published, membership, releases.here, gone),
            plane,
            staged_reader,
            nixl,
            metrics,
        )
        self.engine_calls = EngineCalls(
            me,
            s.lease_ms,
            pull_timeout_s,
            engines,
            published,
            membership,
            pulls,
            puller.pull_steps,
            puller.goes_together,
            puller.move,
            puller.move_all,
            releases,
            peers,
            lease_view,
            threads.expect_read,
            refusals,
            s.max_pull_batch,
            s.engine_workers,
            self.metrics.pull_batch_pulls.observe,
            s.staged_batch_reads,
        )
        self.peer_requests = PeerRequests(
            me,
            notified,
            engines,
            published,
            membership,
            reads,
            staged_source,
            releases,
            transfers,
            push_keys,
            push_runs,
            nixl,
            metrics,
            plane.worker_agent,
        )
        self.status = StatusReport(
            me,
            self.security.describe(),
            self.drain,
            engines,
            published,
            peers,
            transfers,
            self.servers.lane_state,
            refusals,
            lambda: (str(s.device_workers).lower(), plane.worker_states()),
        )
        # Staged transfers' notifications (and OpenRead answers, under the same tag) go to whoever listens
        # for them (the data plane routes the tag: DataPlane); the rest by tag.
        routes.set(
            {
                PUSH_TAG: staged_source.from_notification,
                OPEN_TAG: open_answers.answer,
                DONES_TAG: reads.readers_done,
                PUSH_FAILED_TAG: staged_reader.source_failed,
                PUSH_REFUSED_TAG: staged_reader.source_refused,
            },
            other=reads.reader_done,
        )

    @property
    def sidecar_id(self) -> str:
        return self.identity.sidecar_id

    @property
    def peer_address(self) -> str:
        return self.identity.peer_address

    @property
    def metrics_port(self) -> int:
        return self.servers.metrics_port

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        self.nixl.start()
        self.servers.serve(
            EngineServicer(self.engine_calls, self.status.build, s.engine_workers),
            PeerServicer(self.peer_requests, self.status.build),
            self._lane if s.engine_lane else None,
            self.metrics.registry,
        )
        self._reaper.start()
        log.info(
            "sidecar %s up: engine socket %s, peer %s (advertised %s, %s), metrics :%d",
            self.sidecar_id,
            s.engine_socket,
            self.peer_port,
            self.peer_address,
            self.security.describe(),
            self.metrics_port,
        )
        if self.security.token and not self.security.tls:
            log.warning("the peer token is sent in plaintext: set tls_cert/tls_key to encrypt it")

    def _lane(self, path: str) -> EngineLane:
        s = self.settings
        return EngineLane(
            self.engine_calls,
            self.drain,
            self.metrics,
            self.sidecar_id,
            path,
            s.engine_workers,
            s.max_message_bytes,
        )

    def drain_in_flight(self, timeout_s: float) -> None:
        """SIGTERM: report NOT_SERVING, refuse new work, let in-flight pulls and served reads finish."""
        self.servers.set_serving(False)
        self.drain.begin()
        busy = self.drain.inflight + self.transfers.serving()
        log.info("draining: %d transfers in flight, waiting up to %g s", busy, timeout_s)
        left = self.drain.wait(timeout_s, self.transfers.serving)
        if left:
            log.warning("drain deadline passed with %d transfers still in flight: stopping anyway", left)
        else:
            log.info("drained")

    def stop(self, grace_s: float = 5.0) -> None:
        self._stop.set()
        self.drain.begin()  # peers' new reads refused meanwhile, as in a drain
        self.servers.stop_engine_side(grace_s)
        self.engines.close()
        self.nixl.stop()  # deregisters the GPU rings before their memory goes
        self.push_threads.close()
        self.engine_calls.close()
        self.plane.close()
        self.peers.close()
        # Last: a source that finds this port refusing takes our engines' reads over (gone_readers.py),
        # which is sound only once nothing here can READ (the NIXL agent, the workers' agents) any more.
        self.servers.stop_peer_side(grace_s)
        log.info("sidecar %s stopped", self.sidecar_id)

    def wait(self) -> None:
        self._stop.wait()

    # -- callbacks --------------------------------------------------------------
    def _peer_refused(self, method: str, peer: str, reason: str) -> None:
        self.metrics.failures.labels(f"peer_token_{reason}").inc()
        log.warning(
            "refused %s from %s: peer token %s",
            method,
            peer,
            reason,
            extra={"fields": {"event": "peer_refused", "method": method, "peer": peer, "reason": reason}},
        )

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

    def _on_taken_over(self, engine_id: str, request_id: str, reader: str) -> None:
        """Another engine took a request over from `reader`, whose read failed: that read ends, failed."""
        self.metrics.failures.labels("read_taken_over").inc()
        self.transfers.serve_failed(engine_id, request_id, reader)

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
