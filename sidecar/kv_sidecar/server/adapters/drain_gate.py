"""The drain's gate on a gRPC server: an interceptor that refuses new work once draining began and
counts the calls the drain waits for (server/drain.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kv_sidecar.security import refusing_handler
from kv_sidecar.server.drain import Drain, draining_message


def drain_gate(drain: Drain, refused: Iterable[str], waited: Iterable[str]) -> grpc.ServerInterceptor:
    return _Gate(drain, frozenset(refused), frozenset(waited))


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
