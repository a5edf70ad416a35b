"""gRPC status codes for the core's errors, and the wrappers that apply them to servicers' handlers.

The one place where a `SidecarError` becomes a gRPC status (and a peer's gRPC status a `Code`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kv_sidecar.errors import Code, handler_error

F = TypeVar("F", bound=Callable[..., Any])


def to_grpc(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def from_grpc(code: grpc.StatusCode) -> Code:
    return Code[code.name]


def _abort(context: grpc.ServicerContext, e: Exception) -> None:
    err = handler_error(e)
    if err.metadata:
        # Added to what the handler set (a Push's "nothing in flight" marker): setting replaces it.
        context.set_trailing_metadata((*(context.trailing_metadata() or ()), *err.metadata))
    context.abort(to_grpc(err.code), err.message)


def rpc(fn: F) -> F:
    """Map exceptions raised by a unary handler to gRPC statuses."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as e:
            if isinstance(e, grpc.RpcError) and not isinstance(e, grpc.Call):
                raise  # context.abort() already ran
            _abort(context, e)

    return wrapper  # type: ignore[return-value]


def stream_rpc(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, request, context)
        except Exception as e:
            if isinstance(e, grpc.RpcError) and not isinstance(e, grpc.Call):
                raise
            _abort(context, e)

    return wrapper  # type: ignore[return-value]
