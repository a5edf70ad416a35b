"""One exception type that carries a gRPC status, and the adapter that applies it."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kv_sidecar.memory.shm import HandleError
from kv_sidecar.plan.spec import PlanError

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
Code = grpc.StatusCode


class SidecarError(Exception):
    def __init__(
        self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


def as_sidecar_error(e: Exception) -> SidecarError:
    if isinstance(e, SidecarError):
        return e
    if isinstance(e, PlanError):
        return SidecarError(getattr(Code, e.code, Code.INVALID_ARGUMENT), str(e))
    if isinstance(e, HandleError):
        return SidecarError(Code.INVALID_ARGUMENT, str(e))
    return SidecarError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def handler_error(e: Exception) -> SidecarError:
    """What a handler's exception tells the caller; an internal error is logged with its stack."""
    err = as_sidecar_error(e)
    if err.code is Code.INTERNAL:
        log.exception("internal error in handler")
    return err


def _abort(context: grpc.ServicerContext, e: Exception) -> None:
    err = handler_error(e)
    if err.metadata:
        context.set_trailing_metadata(err.metadata)
    context.abort(err.code, err.message)


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


_MAX_ID = 256


def check_id(kind: str, value: str) -> str:
    if not value:
        raise SidecarError(Code.INVALID_ARGUMENT, f"{kind} must not be empty")
    if len(value) > _MAX_ID or any(ord(c) < 32 for c in value):
        raise SidecarError(Code.INVALID_ARGUMENT, f"{kind} must be at most {_MAX_ID} printable characters")
    return value


# host:port, host a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}$")


def check_address(kind: str, value: str) -> str:
    """A peer address gRPC can dial; anything else would fail later, less clearly."""
    if not _ADDRESS.match(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise SidecarError(Code.INVALID_ARGUMENT, f"{kind} {value[:100]!r} is not a host:port address")
    return value
