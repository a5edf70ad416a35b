"""The engine lane: Publish, Pull and PullBatch over a plain unix socket beside the gRPC engine socket.

One unary gRPC call from Python costs ~0.45 ms on loopback, as much as the rest of a same-sidecar
pull; one frame of multiprocessing.connection costs ~0.02 ms (docs/benchmarks.md). The protocol
(LaneHello, LaneCall, LaneAnswer) is in protos/kvsidecar/v1/engine.proto; the calls themselves are
engine_calls', exactly as the gRPC service runs them.

A connection carries one call at a time, so each has its own thread, as a gRPC sync server gives
each call one. A watcher thread notices a connection that closes while its pull runs (the engine
cancelled, timed out or died) and stops that pull, as ending its gRPC call would.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from kv_sidecar.errors import Code, SidecarError, handler_error
from kv_sidecar.metrics import Metrics
from kv_sidecar.server.after_answer import Later, run_later
from kv_sidecar.server.drain import Drain, draining_message
from kv_sidecar.server.engine_calls import EngineCalls
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2
from kv_sidecar_client.lane import LANE_VERSION, shut_down

log = logging.getLogger(__name__)

_A = TypeVar("_A")


class EngineLane:
    def __init__(
        self,
        calls: EngineCalls,
        drain: Drain,
        metrics: Metrics,
        sidecar_id: str,
        path: str,
        max_connections: int,
        max_call_bytes: int,
    ) -> None:
        self._calls = calls
        self._drain = drain
        self._metrics = metrics
        self._sidecar_id = sidecar_id
        self.path = path
        self._max_connections = max_connections
        self._max_call_bytes = max_call_bytes
        self._listener: Listener | None = None
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        # Connections whose pull is running, with what stops it.
        self._busy: dict[Connection, Callable[[], None]] = {}
        self._stopped = threading.Event()

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # a stale socket from a previous run
        self._listener = Listener(self.path, family="AF_UNIX", backlog=128)
        threading.Thread(target=self._accept, name="lane-accept", daemon=True).start()
        threading.Thread(target=self._watch, name="lane-watch", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()  # unlinks the socket file
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            shut_down(conn)  # wakes its thread's recv

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- connections -----------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn = self._listener.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                log.exception("engine lane: accept failed")
                continue
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn)  # a hello fits the new socket's empty buffer: no wait
            else:
                threading.Thread(target=self._serve, args=(conn,), name="lane", daemon=True).start()

    def _hello(self, refused: str = "") -> bytes:
        return engine_pb2.LaneHello(
            version=LANE_VERSION,
            sidecar_id=self._sidecar_id,
            max_call_bytes=self._max_call_bytes,
            refused=refused,
        ).SerializeToString()

    def _refuse(self, conn: Connection) -> None:
        reason = (
            f"{self._max_connections} engine lane connections are open, the most this sidecar takes "
            "(engine_workers)"
        )
        try:
            conn.send_bytes(self._hello(reason))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: Connection) -> None:
        self._metrics.engine_lane_connections.inc()
        lock = threading.Lock()

        def send(answer: engine_pb2.LaneAnswer) -> None:
            # One frame at a time: a PullBatch's members send their outcomes from their own threads.
            with lock:
                conn.send_bytes(answer.SerializeToString())

        try:
            conn.send_bytes(self._hello())
            while not self._stopped.is_set():
                try:
                    data = conn.recv_bytes(self._max_call_bytes)
                except (EOFError, ConnectionError):  # the engine closed it, or went away
                    return
                except OSError as e:  # a longer frame than the hello allowed: the stream is lost
                    if not self._stopped.is_set():
                        self._metrics.failures.labels("engine_lane_bad_frame").inc()
                        log.warning("engine lane: closing a connection: %s", e)
                    return
                later: Later = []
                answer, counted = self._answer(conn, data, later, send)
                try:
                    send(answer)
                finally:
                    run_later(later)  # the pull's log record, "consumed" events
                    if counted:  # a drain waits until the pull's answer is out, then stop() cuts
                        self._drain.leave()
        except OSError:
            pass  # the engine closed the connection before its answer
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._busy.pop(conn, None)
            conn.close()
            self._metrics.engine_lane_connections.dec()

    # -- calls ------------------------------------------------------------------------
    def _answer(
        self,
        conn: Connection,
        data: bytes,
        later: Later,
        send: Callable[[engine_pb2.LaneAnswer], None],
    ) -> tuple[engine_pb2.LaneAnswer, bool]:
        """The call's answer, and whether it is a pull the drain counts (until its answer is sent)."""
        counted = False
        try:
            call = engine_pb2.LaneCall.FromString(data)
            kind = call.WhichOneof("call")
            if kind in ("pull", "pull_batch"):
                if not self._drain.enter():
                    raise SidecarError(
                        Code.UNAVAILABLE, draining_message("PullBatch" if kind == "pull_batch" else "Pull")
                    )
                counted = True
                if kind == "pull_batch":
                    return self._pull_batch(conn, call.pull_batch, later, send), counted
                pull = self._busy_while(conn, self._calls.pull, call.pull, later)
                return engine_pb2.LaneAnswer(pull=pull), counted
            if kind == "publish":
                if self._drain.draining:
                    raise SidecarError(Code.UNAVAILABLE, draining_message("Publish"))
                return engine_pb2.LaneAnswer(publish=self._calls.publish(call.publish)), counted
            raise SidecarError(Code.INVALID_ARGUMENT, "a LaneCall must carry pull, pull_batch or publish")
        except DecodeError:
            err = SidecarError(Code.INVALID_ARGUMENT, "not a LaneCall message")
        except Exception as e:
            err = handler_error(e)
        answer = engine_pb2.LaneAnswer(code=err.code.name, message=err.message, trailers=dict(err.metadata))
        return answer, counted

    def _pull_batch(
        self,
        conn: Connection,
        request: engine_pb2.PullBatchRequest,
        later: Later,
        send: Callable[[engine_pb2.LaneAnswer], None],
    ) -> engine_pb2.LaneAnswer:
        """A PullBatch; with stream_outcomes, members' outcomes go ahead as they end: a frame each, or with
        group_outcomes one frame for those that ended together."""

        def ahead(outcomes: list[engine_pb2.PullOutcome]) -> None:
            if request.group_outcomes and len(outcomes) > 1:
                send(engine_pb2.LaneAnswer(pull_outcomes=engine_pb2.PullOutcomes(outcomes=outcomes)))
                return
            for outcome in outcomes:
                send(engine_pb2.LaneAnswer(pull_outcome=outcome))

        streamed = ahead if request.stream_outcomes else None
        batch = self._busy_while(
            conn, lambda req, hangup, lt: self._calls.pull_batch(req, hangup, lt, streamed), request, later
        )
        return engine_pb2.LaneAnswer(pull_batch=batch)

    def _busy_while(self, conn: Connection, call: Callable[..., _A], request: Any, later: Later) -> _A:
        """Run a pull (or batch) call; while it runs, the connection's closing stops it."""
        try:
            return call(request, lambda stop: self._set_busy(conn, stop), later)
        finally:
            with self._lock:
                self._busy.pop(conn, None)

    def _set_busy(self, conn: Connection, stop: Callable[[], None]) -> None:
        with self._lock:
            self._busy[conn] = stop

    def _watch(self) -> None:
        """Stop the pulls whose engine closed the connection (cancelled, timed out, or died)."""
        while not self._stopped.is_set():
            with self._lock:
                busy = list(self._busy)
            if not busy:
                self._stopped.wait(0.05)
                continue
            try:
                ready = wait(busy, timeout=0.1)
            except (OSError, ValueError):  # one was closed meanwhile: look again
                continue
            for conn in ready:
                assert isinstance(conn, Connection)
                if not _closed_by_peer(conn):
                    continue  # the next call arrived just as this one finished
                with self._lock:
                    stop = self._busy.pop(conn, None)
                if stop is not None:
                    stop()


def _closed_by_peer(conn: Connection) -> bool:
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # a dup: closing it leaves conn's fd
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
