"""The worker side of the connector: one per TP rank, in the process that owns the rank's KV cache.

It registers the rank's KV tensors with the node's sidecar (and keeps them
registered across sidecar restarts), pulls the blocks of remote-prefilled
requests on threads so the model keeps running, and turns the sidecar's
per-rank events into vLLM's "finished sending": a prefill block is freed only
when the sidecar says it was consumed, its lease expired, or its reader gave
it up. vLLM frees a request's blocks once every worker has reported it.

No vLLM import: the glue in connector.py feeds it plain values.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv_sidecar_client.client import BatchPull, Event, PendingPull, PullResult, params_from_json
from kv_sidecar_client.polled import PolledPulls
from kv_sidecar_client.session import EngineSession
from kv_sidecar_client.vllm.config import ConnectorConfig, wait_for_sidecar
from kv_sidecar_client.vllm.kv_layout import KVDescription
from kv_sidecar_client.vllm.metadata import PullOrder, StepOrders
from kv_sidecar_client.vllm.shm_pool import ShmKVPool

log = logging.getLogger(__name__)

# Events after which the sidecar no longer needs a published request's blocks.
RELEASING_EVENTS = ("consumed", "lease_expired", "released")
# A release that beats the step's orders is kept this long for them. The orders follow their Publish
# within a scheduler step; a release that no order ever claims (a Publish that timed out in the
# scheduler, which then withdrew it, but that the sidecar carried out) is dropped after that.
RELEASED_EARLY_TTL_S = 60.0


@dataclass(frozen=True)
class PullRecord:
    """One finished pull, with monotonic timestamps (seconds) for the overhead benchmark."""

    request_id: str
    ordered_at: float  # the step's orders reached this worker
    started_at: float  # the Pull call went out
    ended_at: float  # its answer came back
    result: PullResult


def connect_session(config: ConnectorConfig, socket: str, on_event: Any) -> EngineSession:
    """An EngineSession on this rank's sidecar socket, or an error naming it (engine start fails)."""
    session = EngineSession(
        socket, on_event, timeout_s=config.pull_timeout_s, placement=config.shard_placement
    )
    wait_for_sidecar(session.client, config, socket)
    return session


class SidecarWorker:
    def __init__(self, config: ConnectorConfig, engine_id: str, rank: int, on_cpu: bool) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.pool = ShmKVPool(f"{engine_id}-r{rank}") if on_cpu else None
        self._lock = threading.Lock()
        # Prefill side: published requests not yet released, and releases that came before
        # the step's orders told us the request was published (the sidecar can be that fast).
        self._holding: set[str] = set()
        self._released_early: dict[str, float] = {}  # request id -> when its release came
        self._finished_sending: set[str] = set()
        # Hybrid models (groups.py): each held sidecar record's request, and each request's records
        # not yet released; the request is freed when the last one is.
        self._parent: dict[str, str] = {}
        self._parts_left: dict[str, set[str]] = {}
        # Decode side: finished pulls, and the local blocks that failed ones left unfilled.
        self._finished_recving: set[str] = set()
        self._unfilled: dict[str, set[int]] = {}
        self._invalid_blocks: set[int] = set()
        # Failed pulls that vLLM must compute from the request's start (sliding-window requests), and
        # those of them reported as finished: vLLM wants them as failed receives in the same step.
        self._restart: set[str] = set()
        self._failed_recving: set[str] = set()
        # Pulls in flight by (request, part): a hybrid model's request has one per KV cache group.
        self._inflight: dict[tuple[str, int], tuple[PendingPull, PullOrder, float, float]] = {}
        self._pulls_left: dict[str, int] = {}  # requests whose parts have not all finished: how many left
        self._part_failed: set[str] = set()  # such requests with a failed part
        self.socket = config.socket_for(rank)
        self.session = connect_session(config, self.socket, self._on_event)
        # Pulls run on a loop that vLLM's own thread steps in finished() (no thread hand-off behind
        # the busy engine loop); a thread that already runs an asyncio loop uses the client's futures.
        try:
            self._polled: PolledPulls | None = PolledPulls(self.socket)
        except RuntimeError:
            self._polled = None
        self.pull_log: list[PullRecord] = []  # the last pulls, for tests and benchmarks
        self.pull_count = 0

    # -- registration ---------------------------------------------------------------------
    def register(self, desc: KVDescription) -> None:
        if self.pool is not None:
            handles = self._shm_handles(desc.regions)
        else:
            from kv_sidecar_client.cuda_ipc import tensor_handles

            handles = tensor_handles(desc.regions)
        self.session.register_rank(
            self.engine_id, self.rank, desc.spec, handles, leader_address=self.config.leader_address
        )
        if self._polled is not None and self.session.client.routes.sharded:
            # A front door of control shards: this rank's pulls go to its shard, as its registration did.
            self._polled.close()
            self._polled = PolledPulls(self.session.client.engine_target(self.engine_id, self.rank))
        log.info(
            "KVSidecarConnector: engine %s rank %d registered with kv-sidecar at %s: %s",
            self.engine_id,
            self.rank,
            self.socket,
            desc.spec,
        )

    def _shm_handles(self, regions: Sequence[torch.Tensor]) -> list[Any]:
        from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2

        assert self.pool is not None
        out = []
        for t in regions:
            name, offset = self.pool.locate(t)
            out.append(
                common_pb2.TensorHandle(
                    shm=common_pb2.ShmTensor(name=name, offset=offset),
                    shape=list(t.shape),
                    strides=list(t.stride()),
                    dtype=str(t.dtype).removeprefix("torch."),
                )
            )
        return out

    # -- each step ------------------------------------------------------------------------
    def take_orders(self, orders: StepOrders) -> None:
        with self._lock:
            for req_id in orders.published:
                if self._released_early.pop(req_id, None) is not None:
                    self._finished_sending.add(req_id)
                else:
                    self._holding.add(req_id)
            for req_id, records in orders.parts.items():
                left = set()
                for record in records:
                    if self._released_early.pop(record, None) is None:
                        self._holding.add(record)
                        self._parent[record] = req_id
                        left.add(record)
                if left:
                    self._parts_left[req_id] = left
                else:
                    self._finished_sending.add(req_id)
        now = time.monotonic()
        starts = [(req_id, order, 0) for req_id, order in orders.pulls.items()]
        for req_id, parts in orders.group_pulls.items():
            with self._lock:
                self._pulls_left[req_id] = len(parts)
            starts += [(req_id, order, part) for part, order in enumerate(parts)]
        if self.config.pull_batch and self._polled is not None and len(starts) > 1:
            self._start_batch(starts, now)
            return
        for req_id, order, part in starts:
            self._start_pull(req_id, order, now, part)

    def _start_batch(self, starts: list[tuple[str, PullOrder, int]], ordered_at: float) -> None:
        """The step's pulls in PullBatch calls of at most `pull_batch_max` (`pull_batch`): each member still
        fails alone, and is done when its own outcome arrives (over the engine lane; over gRPC, when its
        call answers)."""
        assert self._polled is not None
        started = time.monotonic()
        members: list[tuple[str, PullOrder, int]] = []
        batch: list[BatchPull] = []
        for req_id, order, part in starts:
            if order.error:
                self._fail_now(req_id, order, ordered_at, "FAILED_PRECONDITION", order.error, [])
                continue
            try:
                params = params_from_json(order.params)
            except Exception as e:  # never lose a request: report it with every block unfilled
                self._fail_now(req_id, order, ordered_at, "INTERNAL", str(e), list(order.block_ids))
                continue
            members.append((req_id, order, part))
            batch.append(BatchPull(params, order.block_ids, [self.rank], order.start_token, order.group))
        most = max(1, self.config.pull_batch_max)
        for at in range(0, len(batch), most):
            self._send_batch(members[at : at + most], batch[at : at + most], ordered_at, started)

    def _send_batch(
        self,
        members: list[tuple[str, PullOrder, int]],
        batch: list[BatchPull],
        ordered_at: float,
        started: float,
    ) -> None:
        assert self._polled is not None
        try:
            calls = self._polled.start_batch(self.engine_id, batch, timeout_s=self.config.pull_timeout_s)
        except Exception as e:
            for req_id, order, _ in members:
                self._fail_now(req_id, order, ordered_at, "INTERNAL", str(e), list(order.block_ids))
            return
        with self._lock:
            for (req_id, order, part), call in zip(members, calls, strict=True):
                self._inflight[(req_id, part)] = (call, order, ordered_at, started)

    def _fail_now(
        self, req_id: str, order: PullOrder, ordered_at: float, code: str, error: str, unfilled: list[int]
    ) -> None:
        now = time.monotonic()
        failed = PullResult(False, error_code=code, error=error, unfilled_blocks=unfilled)
        self._record(req_id, order, (ordered_at, now, now), failed)

    def _start_pull(self, req_id: str, order: PullOrder, ordered_at: float, part: int = 0) -> None:
        # Issued from vLLM's own thread and advanced in finished(): a pull costs this loop no thread
        # switch (each one can wait a whole GIL switch interval behind the busy engine loop).
        started = time.monotonic()
        if order.error:
            self._fail_now(req_id, order, ordered_at, "FAILED_PRECONDITION", order.error, [])
            return
        try:
            start = self._polled.start if self._polled is not None else self.session.client.pull_async
            call = start(
                params_from_json(order.params),
                self.engine_id,
                order.block_ids,
                ranks=[self.rank],
                start_token=order.start_token,
                timeout_s=self.config.pull_timeout_s,
                group=order.group,
            )
        except Exception as e:  # never lose a request: report it with every block unfilled
            self._fail_now(req_id, order, ordered_at, "INTERNAL", str(e), list(order.block_ids))
            return
        with self._lock:
            self._inflight[(req_id, part)] = (call, order, ordered_at, started)

    def _collect(self) -> None:
        if self._polled is not None and self._inflight:
            self._polled.poll()
        with self._lock:
            done = [(r, v) for r, v in self._inflight.items() if v[0].done()]
            for key, _ in done:
                del self._inflight[key]
        for (req_id, _), (call, order, ordered_at, started) in done:
            times = (ordered_at, started, call.done_at or time.monotonic())
            self._record(req_id, order, times, call.result())

    def _record(
        self, req_id: str, order: PullOrder, times: tuple[float, float, float], result: PullResult
    ) -> None:
        if not result.ok:
            log.warning(
                "KVSidecarConnector: pull of request %s into rank %d failed (%s: %s); vLLM recomputes %s",
                req_id,
                self.rank,
                result.error_code,
                result.error,
                "the request from its start"
                if order.restart_on_failure or order.error
                else f"{len(result.unfilled_blocks)} block(s)",
            )
        with self._lock:
            self.pull_log.append(PullRecord(req_id, *times, result))
            del self.pull_log[:-64]
            left = self._pulls_left.get(req_id)
            if left is not None:  # one group of a hybrid model's request: finished with its last group
                if not result.ok:
                    self._part_failed.add(req_id)
                if left > 1:
                    self._pulls_left[req_id] = left - 1
                    return
                del self._pulls_left[req_id]
                if req_id in self._part_failed:
                    self._part_failed.discard(req_id)
                    self._restart.add(req_id)  # its groups' orders all restart on failure
            elif not result.ok and (order.restart_on_failure or order.error):
                # The blocks before the first unfilled one no longer hold the window its token needs:
                # vLLM recomputes the whole request (a failed receive frees its blocks).
                self._restart.add(req_id)
            elif not result.ok:
                # Only blocks of this request: the sidecar's list never names others, but a
                # wrong id here would make vLLM recompute someone else's blocks.
                self._unfilled[req_id] = set(result.unfilled_blocks) & set(order.block_ids)
            self._finished_recving.add(req_id)
            self.pull_count += 1

    def finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) since the last call; failed pulls' blocks move to
        `load_errors()`, and the requests to restart to `failed_receives()`, in the same breath, as
        vLLM wants them in the same step."""
        self._collect()
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            for req_id in recving:
                self._invalid_blocks |= self._unfilled.pop(req_id, set())
                if req_id in self._restart:
                    self._restart.discard(req_id)
                    self._failed_recving.add(req_id)
        return sending, recving

    def failed_receives(self) -> set[str]:
        """Requests whose pull failed and that vLLM must compute from their start (reported finished too)."""
        with self._lock:
            failed, self._failed_recving = self._failed_recving, set()
        return failed

    def load_errors(self) -> set[int]:
        with self._lock:
            blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    # -- sidecar events (EngineSession's thread) -------------------------------------------
    def _on_event(self, engine_id: str, rank: int, ev: Event) -> None:
        with self._lock:
            if ev.kind in RELEASING_EVENTS:
                if ev.request_id in self._holding:
                    self._holding.discard(ev.request_id)
                    self._release_record(ev.request_id)
                else:
                    self._keep_early_release(ev.request_id)
                if ev.kind != "consumed":
                    log.info("KVSidecarConnector: request %s %s (%s)", ev.request_id, ev.kind, ev.reason)
            elif ev.kind == "reconnected":
                # A restarted sidecar knows none of the requests we published: free them all
                # (their readers get NOT_FOUND and recompute).
                if self._holding:
                    log.warning(
                        "KVSidecarConnector: kv-sidecar restarted; freeing %d published request(s)",
                        len(self._holding),
                    )
                self._finished_sending |= {self._parent.get(r, r) for r in self._holding}
                self._holding = set()
                self._parent.clear()
                self._parts_left.clear()

    def _release_record(self, record: str) -> None:
        """A held sidecar record was released: free its request, or (a hybrid model's group) its request
        once every group's record is released. Under the lock."""
        req_id = self._parent.pop(record, None)
        if req_id is None:
            self._finished_sending.add(record)
            return
        left = self._parts_left.get(req_id, set())
        left.discard(record)
        if not left:
            self._parts_left.pop(req_id, None)
            self._finished_sending.add(req_id)

    def _keep_early_release(self, req_id: str) -> None:
        """Hold a release until the orders that publish `req_id` arrive, dropping ones no order claimed."""
        now = time.monotonic()
        stale = [r for r, at in self._released_early.items() if now - at > RELEASED_EARLY_TTL_S]
        for r in stale:
            del self._released_early[r]
        self._released_early[req_id] = now

    def shutdown(self) -> None:
        with self._lock:
            calls, self._inflight = list(self._inflight.values()), {}
            self._pulls_left.clear()
        for call, *_ in calls:
            call.cancel()
        if self._polled is not None:
            self._polled.close()
        self.session.close()
        if self.pool is not None:
            self.pool.close()
