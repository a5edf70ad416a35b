"""The thin client's non-blocking pulls against a real sidecar: SidecarClient.pull_async (a future) and
PolledPulls (advanced only by the caller's polls), on success, failure and cancellation, over gRPC and
over the engine lane."""

from __future__ import annotations

import time

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient, TransferParams
from kv_sidecar_client.polled import PolledPulls


def unknown_request(sidecar: SidecarProcess) -> TransferParams:
    return TransferParams(
        engine_id="nobody",
        sidecar_address=sidecar.peer_address,
        request_id="gone",
        block_ids=[1],
        num_tokens=4,
    )


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
@pytest.mark.parametrize("kind", ["future", "polled"])
def test_a_failed_pull_names_its_blocks_without_raising(
    kind: str, lane: bool, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    a, b = sidecar_pair
    params = unknown_request(a)
    if kind == "future":
        with SidecarClient(b.socket, lane=lane) as c:
            call = c.pull_async(params, "nobody-local", [5, 6], timeout_s=5)
            result = call.result()
    else:
        pulls = PolledPulls(b.socket, lane=lane)
        try:
            call = pulls.start(params, "nobody-local", [5, 6], timeout_s=5)
            deadline = time.monotonic() + 10
            while not call.done() and time.monotonic() < deadline:
                pulls.poll()
                time.sleep(0.001)
            assert call.done(), "polling must complete the call"
            result = call.result()
        finally:
            pulls.close()
    assert not result.ok and result.error_code == "NOT_FOUND", result
    assert result.unfilled_blocks == [5, 6]
    assert call.done_at > 0


def test_polled_grpc_pull_is_not_advanced_without_polls_and_can_be_cancelled(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    a, b = sidecar_pair
    pulls = PolledPulls(b.socket, lane=False)
    try:
        call = pulls.start(unknown_request(a), "nobody-local", [9], timeout_s=5)
        time.sleep(0.3)  # the answer is back in gRPC's core, but nobody polled
        assert not call.done()
        pulls.poll()
        deadline = time.monotonic() + 5
        while not call.done() and time.monotonic() < deadline:
            pulls.poll()
        assert call.done()
        second = pulls.start(unknown_request(a), "nobody-local", [3], timeout_s=5)
        second.cancel()
        assert second.result().error_code in ("CANCELLED", "NOT_FOUND")
    finally:
        pulls.close()
