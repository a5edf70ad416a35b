"""Keep an engine's ranks registered with its sidecar across sidecar restarts.

`SidecarClient` is one connection; when the sidecar restarts (a crash, a
rolling update) its registrations are gone. `EngineSession` registers ranks,
follows each rank's event stream on a thread, and when a stream breaks it
retries with exponential backoff and jitter until the sidecar answers again,
then registers the rank again with the same tensors and reopens its stream.
The engine hears a "reconnected" event per rank: requests it published before
are unknown to the new sidecar, so it should free their blocks (their readers
get NOT_FOUND), as on "lease_expired".
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_sidecar_client.client import (
    EngineSpec,
    Event,
    EventStream,
    KVSidecarError,
    SidecarClient,
    TensorHandle,
    spec_message,
)

log = logging.getLogger(__name__)
EventHandler = Callable[[str, int, Event], None]  # (engine_id, rank, event)


@dataclass(frozen=True)
class Backoff:
    """Delays between reconnection attempts: exponential, capped, with jitter.

    Each delay is drawn from [d/2, d] for the current step d, so that the
    engines of a node that lost their sidecar together do not retry in lockstep.
    The cap is short because until a rank has registered again its engine can
    neither publish nor pull (a prefill engine's requests go unpublished, and
    their decode engines compute them), and a try costs one call on a local socket.
    """

    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        rng = rng or random.Random()
        step = self.initial_s
        while True:
            yield rng.uniform(step / 2, step)
            step = min(self.max_s, step * self.multiplier)


@dataclass
class _Rank:
    engine_id: str
    rank: int
    spec: EngineSpec
    tensors: list[TensorHandle]
    leader_address: str = ""  # the engine's leader sidecar, where its ranks span several sidecars
    live: threading.Event = field(default_factory=threading.Event)
    stopped: threading.Event = field(default_factory=threading.Event)
    stream: EventStream | None = None


def reconnect_options(backoff: Backoff = Backoff()) -> tuple[tuple[str, int], ...]:
    """gRPC channel options whose own reconnect timer waits no longer than `backoff`: a channel to a
    sidecar that went away otherwise waits up to gRPC's default (minutes) before it sees a restarted one."""
    return (
        ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff.initial_s * 1000))),
        ("grpc.min_reconnect_backoff_ms", max(1, int(backoff.initial_s * 1000))),
        ("grpc.max_reconnect_backoff_ms", int(backoff.max_s * 1000)),
    )


class EngineSession:
    """Registered ranks that survive sidecar restarts. Use `client` for publish, pull, abort."""

    def __init__(
        self,
        target: str,
        on_event: EventHandler | None = None,
        backoff: Backoff = Backoff(),
        timeout_s: float = 30.0,
        placement: str = "",
    ) -> None:
        """`placement`: SidecarClient's (host engines' shard by a key of their own)."""
        self._backoff = backoff
        self._on_event = on_event or (lambda engine_id, rank, ev: None)
        self.client = SidecarClient(
            target, timeout_s, channel_options=reconnect_options(backoff), placement=placement
        )
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.reconnects = 0  # successful re-registrations
        self.failed_attempts = 0  # attempts that found no sidecar (or were refused)
        self.last_error: KVSidecarError | None = None

    def register_rank(
        self,
        engine_id: str,
        rank: int,
        spec: Mapping[str, Any] | EngineSpec,
        tensors: Sequence[TensorHandle],
        ready_timeout_s: float = 30.0,
        leader_address: str = "",
    ) -> None:
        """Register (errors raise here, nothing is retried) and start following the rank's events.
        `leader_address`: peer address of the engine's leader sidecar where its ranks span several
        sidecars (docs/multinode.md); a registration again after a restart names it too."""
        r = _Rank(engine_id, rank, spec_message(spec), list(tensors), leader_address)
        self.client.register_rank(engine_id, rank, r.spec, r.tensors, leader_address)
        with self._lock:
            self._ranks[(engine_id, rank)] = r
        threading.Thread(target=self._follow, args=(r, False), name=f"kvs-events-{rank}", daemon=True).start()
        if not r.live.wait(ready_timeout_s):
            raise KVSidecarError("UNAVAILABLE", f"no event session for engine {engine_id!r} rank {rank}")

    def unregister_rank(self, engine_id: str, rank: int) -> None:
        with self._lock:
            r = self._ranks.pop((engine_id, rank), None)
        if r is not None:
            r.stopped.set()
        self.client.unregister_rank(engine_id, rank)
        if r is not None and r.stream is not None:
            r.stream.close()

    def wait_live(self, timeout_s: float) -> bool:
        """True once every rank has a live event session (e.g. after a reconnection)."""
        with self._lock:
            ranks = list(self._ranks.values())
        return all(r.live.wait(timeout_s) for r in ranks)

    def close(self) -> None:
        """Leave: unregister every rank (if the sidecar is there) and close the connection."""
        self._closed.set()
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
        for r in ranks:
            r.stopped.set()
            with contextlib.suppress(KVSidecarError):
                self.client.unregister_rank(r.engine_id, r.rank)
            if r.stream is not None:
                r.stream.close()
        self.client.close()

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the per-rank loop -------------------------------------------------------
    def _stopped(self, r: _Rank) -> bool:
        return r.stopped.is_set() or self._closed.is_set()

    def _follow(self, r: _Rank, reconnecting: bool) -> None:
        delays: Iterator[float] | None = None
        while not self._stopped(r):
            try:
                if reconnecting:
                    self._register_again(r)
                r.stream = self.client.events(r.engine_id, r.rank)
                for ev in r.stream:
                    if ev.kind == "ready":
                        r.live.set()
                        if reconnecting:
                            self.reconnects += 1
                            log.info("engine %s rank %d registered again", r.engine_id, r.rank)
                            self._on_event(r.engine_id, r.rank, Event("reconnected"))
                        reconnecting, delays = False, None
                    else:
                        self._on_event(r.engine_id, r.rank, ev)
            except KVSidecarError as e:
                self.last_error = e
                if reconnecting:
                    self.failed_attempts += 1
            except ValueError:  # the channel was closed under us: we are shutting down
                return
            if self._stopped(r):
                return
            # The stream ended or broke: the sidecar went away (or dropped the rank).
            r.live.clear()
            reconnecting = True
            delays = delays or self._backoff.delays()
            self._closed.wait(next(delays))

    def _register_again(self, r: _Rank) -> None:
        try:
            self.client.register_rank(r.engine_id, r.rank, r.spec, r.tensors, r.leader_address)
        except KVSidecarError as e:
            if e.code != "ALREADY_EXISTS":  # the same sidecar, still holding it
                raise
