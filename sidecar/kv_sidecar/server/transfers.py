"""Transfers in flight and recently finished: one structured log record each, and `status`.

Two kinds:
- pull: this sidecar fills a local engine's blocks (decode side);
- serve: another sidecar reads a request published here (prefill side). It
  starts when the request is opened (OpenRead, or a Push carrying the open)
  and ends when the notification of every reader rank that reads a rank held
  here has arrived, when the reader reports a failure, when the request ends
  otherwise (released, aborted, expired), or when it goes quiet for `stale_s`. NIXL READs are one-sided: this side never sees the bytes move, so
  `bytes` of a served read is what the opened blocks hold for the ranks read
  (exact without a prefix hit, an upper bound with one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kv_sidecar.logs import TRANSFER_LOGGER

log = logging.getLogger(TRANSFER_LOGGER)  # its level says which records are kept (transfer_log)


def _nothing() -> None:
    """A pull's record where records of its outcome are off (`transfer_log: failed`)."""


@dataclass
class Transfer:
    kind: str  # "pull" | "serve"
    request_id: str
    engine_id: str  # the local engine: decode (pull) or prefill (serve)
    remote_engine: str  # source engine (pull) or reader engine (serve)
    peer: str  # pull: source sidecar address ("local" on this sidecar); serve: the reader's address
    started: float = field(default_factory=time.monotonic)
    started_unix: float = field(default_factory=time.time)
    bytes: int = 0
    path: str = ""
    pending: set[int] = field(default_factory=set)  # serve: reader ranks not done yet
    failed: set[int] = field(default_factory=set)  # serve: reader ranks that reported a failure

    def elapsed(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True)
class Recent:
    window_s: float
    pulls: int
    failed: int
    bytes: int
    busy_s: float  # summed duration of the successful pulls
    served: int


@dataclass(frozen=True)
class IncomingHandshake:
    sidecar_id: str
    peer: str
    engine_id: str
    reader_engine: str
    plan_hash: str
    at_unix: float


class TransferTracker:
    def __init__(self, window_s: float = 60.0, stale_s: float = 30.0) -> None:
        self.window_s = window_s
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._inflight: dict[int, Transfer] = {}
        self._serves: dict[tuple[str, str, str], Transfer] = {}
        # (end time, kind, ok, bytes, duration) of finished transfers within the window
        self._done: deque[tuple[float, str, bool, int, float]] = deque()
        self._handshakes: dict[tuple[str, str, str], IncomingHandshake] = {}

    # -- pulls (decode side) --------------------------------------------------
    def begin_pull(self, engine_id: str, request_id: str, source_engine: str, peer: str) -> Transfer:
        t = Transfer("pull", request_id, engine_id, source_engine, peer or "local")
        with self._lock:
            self._inflight[id(t)] = t
        return t

    def end_pull(
        self, t: Transfer, nbytes: int, path: str, outcome: str, error: str = ""
    ) -> Callable[[], None]:
        """Count the pull as ended now; returns what logs it, which a pull runs after its answer (its
        fields are put together there too: ~5 us a pull that a PullBatch's answer waited for)."""
        duration = t.elapsed()
        t.bytes, t.path = nbytes, path
        with self._lock:
            self._inflight.pop(id(t), None)
            self._record("pull", outcome == "ok", nbytes, duration)
        level = logging.INFO if outcome == "ok" else logging.WARNING
        if not log.isEnabledFor(level):
            return _nothing

        def record() -> None:
            fields = {
                "event": "pull",
                "request_id": t.request_id,
                "engine_id": t.engine_id,
                "source_engine": t.remote_engine,
                "peer": t.peer,
                "bytes": nbytes,
                "path": path,
                "duration_ms": round(duration * 1000, 3),
                "gbps": round(nbytes / duration / 1e9, 6) if duration > 0 else 0.0,
                "outcome": outcome,
            }
            if error:
                fields["error"] = error
            log.log(level, "pull finished", extra={"fields": fields})

        return record

    # -- served reads (prefill side) -----------------------------------------
    def begin_serve(
        self,
        engine_id: str,
        request_id: str,
        reader_engine: str,
        peer: str,
        ranks: Iterable[int],
        nbytes: int,
        path: str,
    ) -> None:
        key = (engine_id, request_id, reader_engine)
        with self._lock:
            t = self._serves.get(key)
            if t is None:
                t = self._serves[key] = Transfer(
                    "serve", request_id, engine_id, reader_engine, peer, path=path
                )
            elif set(ranks) <= t.pending:
                return  # the same open again (its notification and its call both came): nothing new
            t.pending.update(ranks)
            t.failed.difference_update(t.pending)  # a retry
            t.bytes += nbytes

    def serve_rank_done(self, engine_id: str, request_id: str, reader_engine: str, decode_rank: int) -> None:
        key = (engine_id, request_id, reader_engine)
        with self._lock:
            t = self._serves.get(key)
            if t is None:
                return
            t.pending.discard(decode_rank)
            if t.pending:
                return
            del self._serves[key]
        if t.failed:
            self._end_serve(t, "error", "the reader reported a failed read")
        else:
            self._end_serve(t, "ok")

    def serve_failed(
        self, engine_id: str, request_id: str, reader_engine: str, reader_ranks: Iterable[int] = ()
    ) -> None:
        """The reader's ranks `reader_ranks` (all, if none named) failed. Other ranks of the same
        reader may still be reading (each TP worker pulls its own rank): the served read ends, as
        failed, once none is left."""
        key = (engine_id, request_id, reader_engine)
        with self._lock:
            t = self._serves.get(key)
            if t is None:
                return
            ranks = set(reader_ranks) or set(t.pending)
            t.failed |= ranks
            t.pending -= ranks
            if t.pending:
                return
            del self._serves[key]
        self._end_serve(t, "error", "the reader reported a failed read")

    def end_serves(self, engine_id: str, request_id: str, why: str) -> None:
        """The request ended here (released, aborted, expired) while reads of it were open: no
        completion notification will come for them, so they end now rather than time out."""
        with self._lock:
            keys = [k for k in self._serves if k[:2] == (engine_id, request_id)]
            gone = [self._serves.pop(k) for k in keys]
        for t in gone:
            self._end_serve(t, why.split(" ", 1)[0], f"the request was {why} while being read")

    def _end_serve(self, t: Transfer, outcome: str, error: str = "") -> None:
        duration = t.elapsed()
        with self._lock:
            self._record("serve", outcome == "ok", t.bytes, duration)
        level = logging.INFO if outcome == "ok" else logging.WARNING
        if not log.isEnabledFor(level):
            return
        fields = {
            "event": "serve",
            "request_id": t.request_id,
            "engine_id": t.engine_id,
            "reader_engine": t.remote_engine,
            "peer": t.peer,
            "bytes": t.bytes,
            "path": t.path,
            "duration_ms": round(duration * 1000, 3),
            "outcome": outcome,
        }
        if error:
            fields["error"] = error
        log.log(level, "read served", extra={"fields": fields})

    def _expire_serves(self) -> None:
        with self._lock:
            stale = [k for k, t in self._serves.items() if t.elapsed() > self.stale_s]
            gone = [self._serves.pop(k) for k in stale]
        for t in gone:
            self._end_serve(t, "timeout", f"no completion notification within {self.stale_s:g} s")

    def serving(self) -> int:
        self._expire_serves()
        return len(self._serves)

    def any_serving(self) -> bool:
        """Cheap (no lock, no expiry): for the NIXL driver's poll loop."""
        return bool(self._serves)

    def expire_stale(self) -> None:
        self._expire_serves()

    # -- handshakes other sidecars made with us --------------------------------
    def handshake_from(
        self, sidecar_id: str, peer: str, engine_id: str, reader_engine: str, plan: str
    ) -> None:
        with self._lock:
            self._handshakes[(sidecar_id, engine_id, reader_engine)] = IncomingHandshake(
                sidecar_id, peer, engine_id, reader_engine, plan, time.time()
            )

    def incoming_handshakes(self) -> list[IncomingHandshake]:
        with self._lock:
            return sorted(self._handshakes.values(), key=lambda h: (h.sidecar_id, h.engine_id))

    # -- status ---------------------------------------------------------------
    def inflight(self) -> list[Transfer]:
        self._expire_serves()
        with self._lock:
            out = [*self._inflight.values(), *self._serves.values()]
        return sorted(out, key=lambda t: t.started)

    def recent(self) -> Recent:
        with self._lock:
            self._trim(time.monotonic())
            pulls = [d for d in self._done if d[1] == "pull"]
            ok = [d for d in pulls if d[2]]
            return Recent(
                window_s=self.window_s,
                pulls=len(pulls),
                failed=len(pulls) - len(ok),
                bytes=sum(d[3] for d in ok),
                busy_s=sum(d[4] for d in ok),
                served=sum(1 for d in self._done if d[1] == "serve" and d[2]),
            )

    def _record(self, kind: str, ok: bool, nbytes: int, duration: float) -> None:
        now = time.monotonic()
        self._done.append((now, kind, ok, nbytes, duration))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()
