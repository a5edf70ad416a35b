"""The engine lane, client side: Publish and Pull over "<engine socket>.lane" when the sidecar serves it.

A unary gRPC call from Python costs ~0.45 ms on loopback; a frame on this socket ~0.02 ms
(docs/benchmarks.md). The protocol is LaneHello / LaneCall / LaneAnswer in engine.proto. Each call
in flight has a connection of its own, kept for the next call once its answer is read. No thread of
ours is involved: an answer waits in its socket until the caller's thread looks (`done()`,
`result()`), so a pull costs a busy engine loop no thread switch.

Whatever the lane cannot take (no lane there, a refused connection, a call over its size limit)
goes over gRPC, which answers it with the same statuses.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterable
from multiprocessing.connection import Client, Connection

from google.protobuf.message import DecodeError

from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2
from kv_sidecar_client.results import (
    KVSidecarError,
    PullResult,
    batch_failed,
    batch_results,
    pull_failure,
    pull_success,
)

LANE_VERSION = 1
LANE_SUFFIX = ".lane"
ENV_SWITCH = "KV_SIDECAR_ENGINE_LANE"  # "0" turns the lane off in every client of this process
_LOOK_AGAIN_S = 1.0  # after the lane was not there, gRPC takes the calls this long before we look again
_HELLO_TIMEOUT_S = 2.0
# How long a connection may owe its call's answer before it is closed rather than kept.
_OWED_ANSWER_S = 5.0


def lane_path(target: str) -> str | None:
    """The lane beside a unix-socket gRPC target; None for other targets."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix) :] + LANE_SUFFIX
    return None


def lane_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def lane_for(target: str, wanted: bool | None) -> Lane | None:
    """A client's lane to `target`: `wanted` None follows the environment (on unless ENV_SWITCH says off)."""
    return Lane(target) if (lane_enabled() if wanted is None else wanted) else None


class Lane:
    """Connections to one sidecar's engine lane."""

    def __init__(self, target: str) -> None:
        self.path = lane_path(target)
        self._idle: list[Connection] = []
        # Connections whose call's answer is still on its way though its caller has all it needs (a
        # PullBatch whose every member's outcome came ahead), since when: reused once it is read.
        self._owing: dict[Connection, float] = {}
        self._lock = threading.Lock()
        self._look_at = 0.0
        self._max_call_bytes = 0

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            idle += self._owing
            self._owing.clear()
        for conn in idle:
            conn.close()

    def send(self, call: engine_pb2.LaneCall, timeout_s: float = _HELLO_TIMEOUT_S) -> Connection | None:
        """Send a call on a connection of its own; None: send it over gRPC instead. A new connection waits
        at most `timeout_s` for the sidecar's hello (a sidecar that does not answer: gRPC then)."""
        data = call.SerializeToString()
        for _ in range(2):  # an idle connection may have gone with a restarted sidecar: once more
            conn = self._take(timeout_s)
            if conn is None:
                return None
            if len(data) > self._max_call_bytes:
                self.give_back(conn)
                return None  # gRPC answers it (RESOURCE_EXHAUSTED when over its limit too)
            try:
                conn.send_bytes(data)
                return conn
            except OSError:  # nothing was taken: the sidecar reads whole frames only
                conn.close()
        return None

    def call(self, call: engine_pb2.LaneCall, timeout_s: float) -> engine_pb2.LaneAnswer | None:
        """Send a call and wait for its answer; None: send it over gRPC instead."""
        deadline = time.monotonic() + timeout_s
        conn = self.send(call, timeout_s)
        if conn is None:
            return None
        answer = read_answer(conn, deadline - time.monotonic())
        self.give_back(conn)
        return answer

    def give_back(self, conn: Connection) -> None:
        with self._lock:
            self._idle.append(conn)

    def give_back_owing(self, conn: Connection) -> None:
        """Keep `conn` for a later call once the answer of its call, still on its way, has been read.
        Without this the next call would open a connection (and the sidecar start a thread) of its own."""
        with self._lock:
            self._owing[conn] = time.monotonic()

    def _take(self, hello_timeout_s: float) -> Connection | None:
        with self._lock:
            self._settle_owing()
            while self._idle:
                conn = self._idle.pop()
                if not conn.poll(0):
                    return conn
                conn.close()  # something to read on an idle connection: the sidecar closed it
        return self._connect(hello_timeout_s)

    def _settle_owing(self) -> None:
        """Connections whose owed answer has arrived go idle; those that owe it too long are closed."""
        now = time.monotonic()
        for conn, since in list(self._owing.items()):
            try:
                ready = conn.poll(0)
            except OSError:
                ready, since = False, -_OWED_ANSWER_S  # closed: drop it below
            if ready:
                del self._owing[conn]
                try:
                    answer = engine_pb2.LaneAnswer.FromString(conn.recv_bytes())
                except (EOFError, OSError, DecodeError):
                    conn.close()
                    continue
                if answer.WhichOneof("result") in ("pull_outcome", "pull_outcomes"):  # not the answer
                    conn.close()
                else:
                    self._idle.append(conn)
            elif now - since > _OWED_ANSWER_S:
                del self._owing[conn]
                conn.close()

    def _connect(self, hello_timeout_s: float) -> Connection | None:
        now = time.monotonic()
        if self.path is None or now < self._look_at:
            return None
        try:
            conn = Client(self.path, family="AF_UNIX")
        except OSError:  # no lane (an older sidecar, lane off, not up yet): gRPC for a while
            self._look_at = now + _LOOK_AGAIN_S
            return None
        try:
            if not conn.poll(max(0.0, min(_HELLO_TIMEOUT_S, hello_timeout_s))):
                raise EOFError("no hello")
            hello = engine_pb2.LaneHello.FromString(conn.recv_bytes(1 << 16))
        except (EOFError, OSError, DecodeError):
            hello = None
        if hello is None or hello.version != LANE_VERSION or hello.refused:
            conn.close()
            self._look_at = now + _LOOK_AGAIN_S
            return None
        self._max_call_bytes = hello.max_call_bytes
        return conn


def read_answer(conn: Connection, timeout_s: float) -> engine_pb2.LaneAnswer:
    """The answer to the call sent on `conn`. On any failure `conn` is closed (a pull then stops)."""
    try:
        if not conn.poll(max(0.0, timeout_s)):
            conn.close()
            raise KVSidecarError("DEADLINE_EXCEEDED", f"no answer from the sidecar in {timeout_s:.1f} s")
        return engine_pb2.LaneAnswer.FromString(conn.recv_bytes())
    except (EOFError, OSError, DecodeError) as e:
        conn.close()
        raise KVSidecarError(
            "UNAVAILABLE", f"the sidecar closed the engine lane before answering ({e})"
        ) from None


def shut_down(conn: Connection) -> None:
    """Shut a connection's socket down both ways, leaving its fd to it: a thread waiting on it wakes
    (here, or at the other end); a closed one is left as it is."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def raise_for_answer(answer: engine_pb2.LaneAnswer) -> engine_pb2.LaneAnswer:
    if answer.code:
        raise KVSidecarError(answer.code, answer.message)
    return answer


class _LaneCallInFlight:
    """A pull call in flight on the lane, its frames polled from its connection: a PullBatch's members'
    outcomes ahead (`_ahead`), then the call's own answer; the subclass turns them (or the call's
    failure) into its results."""

    def __init__(self, lane: Lane, conn: Connection, deadline: float) -> None:
        self._lane = lane
        self._conn = conn
        self._deadline = deadline
        self._finished = False
        self._cancelled = False
        self.done_at = 0.0

    def done(self) -> bool:
        while not self._finished and (self._cancelled or self._ready()):
            self._take(0.0)
        return self._finished

    def cancel(self) -> None:
        """Give up; closing the connection stops the call on the sidecar, which releases the sources."""
        if self._finished:
            return
        self._cancelled = True
        shut_down(self._conn)  # not close: it also wakes a result() waiting on another thread

    def _wait(self) -> None:
        while not self._finished:
            self._take(self._deadline - time.monotonic())

    def _ready(self) -> bool:
        try:
            return self._conn.poll(0)
        except OSError:
            return True  # closed: _take says so

    def _take(self, timeout_s: float) -> None:
        """Read the next frame, waiting up to `timeout_s`; the call ends at its answer or a failure."""
        try:
            if self._cancelled:
                raise KVSidecarError("CANCELLED", "cancelled")
            answer = read_answer(self._conn, timeout_s)
        except KVSidecarError as e:
            self._conn.close()
            code = "CANCELLED" if self._cancelled else e.code
            self._failed(code, e.message if code == e.code else "cancelled")
        else:
            result = answer.WhichOneof("result")
            if result == "pull_outcome":
                self._ahead(answer.pull_outcome)
                return
            if result == "pull_outcomes":
                for outcome in answer.pull_outcomes.outcomes:
                    self._ahead(outcome)
                return
            self._lane.give_back(self._conn)
            if answer.code:
                self._failed(answer.code, answer.message, answer.trailers.items())
            else:
                self._answered(answer)
        self._finished = True
        self.done_at = time.monotonic()

    def _ahead(self, outcome: engine_pb2.PullOutcome) -> None:
        """A member's outcome before the call's answer (PullBatch.stream_outcomes)."""

    def _failed(self, code: str, message: str, trailers: Iterable[tuple[str, str]] = ()) -> None:
        raise NotImplementedError

    def _answered(self, answer: engine_pb2.LaneAnswer) -> None:
        raise NotImplementedError


class LanePull(_LaneCallInFlight):
    """A pull in flight on the lane; `done()`, `result()` and `cancel()` as on SidecarClient's."""

    def __init__(self, lane: Lane, conn: Connection, block_ids: list[int], deadline: float) -> None:
        super().__init__(lane, conn, deadline)
        self._block_ids = block_ids
        self._result: PullResult | None = None

    def result(self) -> PullResult:
        self._wait()
        assert self._result is not None
        return self._result

    def _failed(self, code: str, message: str, trailers: Iterable[tuple[str, str]] = ()) -> None:
        self._result = pull_failure(code, message, trailers, self._block_ids)

    def _answered(self, answer: engine_pb2.LaneAnswer) -> None:
        self._result = pull_success(answer.pull)


class LaneBatch(_LaneCallInFlight):
    """A PullBatch in flight on the lane (a PendingBatch), sent with stream_outcomes: each member is done
    when its own outcome arrives, ahead of the call's answer, so that it does not wait for the slowest."""

    def __init__(self, lane: Lane, conn: Connection, blocks: list[list[int]], deadline: float) -> None:
        super().__init__(lane, conn, deadline)
        self._blocks = blocks
        self._early: dict[int, tuple[PullResult, float]] = {}  # index -> (outcome, when it arrived)
        self._results: list[PullResult] | None = None

    def member_done(self, index: int) -> bool:
        if index not in self._early:
            self.done()  # takes in every frame that has arrived
        return index in self._early or self._finished

    def member_done_at(self, index: int) -> float:
        early = self._early.get(index)
        return early[1] if early is not None else self.done_at

    def member_result(self, index: int) -> PullResult:
        while index not in self._early and not self._finished:
            self._take(self._deadline - time.monotonic())
        early = self._early.get(index)
        if early is not None:
            return early[0]
        assert self._results is not None
        return self._results[index]

    def results(self) -> list[PullResult]:
        return [self.member_result(i) for i in range(len(self._blocks))]

    def _ahead(self, outcome: engine_pb2.PullOutcome) -> None:
        i = outcome.index
        if 0 <= i < len(self._blocks) and i not in self._early:
            (result,) = batch_results([outcome], [self._blocks[i]])
            self._early[i] = (result, time.monotonic())
            if len(self._early) == len(self._blocks):  # every member's outcome: the call's answer adds none
                self._lane.give_back_owing(self._conn)
                self._finished = True
                self.done_at = time.monotonic()

    def _failed(self, code: str, message: str, trailers: Iterable[tuple[str, str]] = ()) -> None:
        self._results = batch_failed(code, message, self._blocks)

    def _answered(self, answer: engine_pb2.LaneAnswer) -> None:
        self._results = batch_results(answer.pull_batch.outcomes, self._blocks)
