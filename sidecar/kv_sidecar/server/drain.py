"""Graceful drain: refuse new work, let in-flight work finish up to a deadline.

One `Drain` per sidecar; each gRPC server gets a `gate` interceptor that refuses
the methods that start new work with UNAVAILABLE once draining began, and counts
the in-flight calls of the methods the drain waits for. Counting in the
interceptor (under the same lock as the draining flag) means no call can slip in
between "checked the flag" and "counted as in flight".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kv_sidecar.security import refusing_handler

log = logging.getLogger(__name__)


class Drain:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._draining = False
        self._cut_short = False
        self._inflight = 0

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def inflight(self) -> int:
        return self._inflight

    def gate(self, refused: Iterable[str], waited: Iterable[str]) -> grpc.ServerInterceptor:
        return _Gate(self, frozenset(refused), frozenset(waited))

    def begin(self) -> None:
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def cut_short(self) -> None:
        """A second signal: stop waiting."""
        with self._cond:
            self._cut_short = True
            self._cond.notify_all()

    def wait(self, timeout_s: float, other_busy: Callable[[], int] = lambda: 0) -> int:
        """Wait until no waited call (and no `other_busy` work) is left; returns what is left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._cut_short:
                left = self._inflight + other_busy()
                remaining = deadline - time.monotonic()
                if left == 0 or remaining <= 0:
                    return left
                # other_busy() changes without notifying us: poll it.
                self._cond.wait(min(remaining, 0.05))
            return self._inflight + other_busy()

    def enter(self) -> bool:
        """Count a call as in flight, unless draining began (then False: refuse it)."""
        with self._cond:
            if self._draining:
                return False
            self._inflight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()


def draining_message(method: str) -> str:
    name = method.rsplit("/", 1)[-1]
    return f"sidecar is draining (shutting down): {name} is refused; retry on another sidecar"


class _Gate(grpc.ServerInterceptor):
    def __init__(self, drain: Drain, refused: frozenset[str], waited: frozenset[str]) -> None:
        self._drain = drain
        self._refused = refused
        self._waited = waited

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method not in self._refused | self._waited:
            return handler
        drain = self._drain

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAVAILABLE, draining_message(method))

        if method not in self._waited:
            return handler if not drain.draining else refusing_handler(handler, refuse)
        if handler.request_streaming or handler.response_streaming:
            raise TypeError(f"drain can only wait for unary methods, not {method}")
        inner = handler.unary_unary

        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            if not drain.enter():
                return refuse(request, context)
            try:
                return inner(request, context)
            finally:
                drain.leave()

        return grpc.unary_unary_rpc_method_handler(
            counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
