"""The gRPC adapter's error mapping (server/adapters/grpc_status.py), through a real gRPC server on
loopback: a handler's error becomes its status, its message and its trailers, and the trailers a
handler set before it failed (a Push's "nothing in flight" marker) stay beside the error's own."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.server.adapters.grpc_status import rpc
from kv_sidecar.server.adapters.peer_client import PUSH_ENDED

UNFILLED = ("kvsidecar-unfilled-blocks", "3,4")


class _Service:
    @rpc
    def marked_then_failed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((PUSH_ENDED,))
        raise SidecarError(Code.UNAVAILABLE, "the worker died", (UNFILLED,))

    @rpc
    def failed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise SidecarError(Code.NOT_FOUND, "no such request", (UNFILLED,))

    @rpc
    def marked_then_plain_error(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((PUSH_ENDED,))
        raise SidecarError(Code.FAILED_PRECONDITION, "refused")


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    service = _Service()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(service, name))
        for name in ("marked_then_failed", "failed", "marked_then_plain_error")
    }
    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Status", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        server.stop(None)


def _call(channel: grpc.Channel, method: str) -> Any:
    call = channel.unary_unary(f"/test.Status/{method}")
    with pytest.raises(grpc.RpcError) as info:
        call(b"", timeout=10)
    return info.value


@pytest.mark.parametrize(
    ("method", "code", "message", "trailers"),
    [
        ("marked_then_failed", grpc.StatusCode.UNAVAILABLE, "the worker died", {PUSH_ENDED, UNFILLED}),
        ("failed", grpc.StatusCode.NOT_FOUND, "no such request", {UNFILLED}),
        ("marked_then_plain_error", grpc.StatusCode.FAILED_PRECONDITION, "refused", {PUSH_ENDED}),
    ],
)
def test_an_error_keeps_the_trailers_its_handler_set_and_adds_its_own(
    channel: grpc.Channel, method: str, code: grpc.StatusCode, message: str, trailers: set[tuple[str, str]]
) -> None:
    err = _call(channel, method)
    assert (err.code(), err.details()) == (code, message)
    assert set(err.trailing_metadata() or ()) == trailers
