"""The thin client's non-blocking pulls against a real sidecar: SidecarClient.pull_async (a future) and
PolledPulls (advanced only by the caller's polls), on success, failure and cancellation, over gRPC and
over the engine lane."""

from __future__ import annotations

import time

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import BatchPull, SidecarClient, TransferParams
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


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
@pytest.mark.parametrize("kind", ["future", "polled"])
def test_a_batch_in_flight_gives_each_member_its_outcome_when_the_call_answers(
    kind: str, lane: bool, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """pull_batch_async / PolledPulls.start_batch: a PendingPull per member, each with its own outcome (here: an unknown local engine, then an unknown request), and a batch the sidecar refuses
    whole (too many members) fails every member with its status and blocks."""
    a, b = sidecar_pair
    members = [BatchPull(unknown_request(a), [5, 6]), BatchPull(unknown_request(a), [7])]
    too_many = [BatchPull(unknown_request(a), [i]) for i in range(300)]  # max_pull_batch is 256
    pulls = PolledPulls(b.socket, lane=lane) if kind == "polled" else None
    try:
        with SidecarClient(b.socket, lane=lane) as c:
            if pulls is None:
                calls = c.pull_batch_async("nobody-local", members, timeout_s=5)
                refused = c.pull_batch_async("nobody-local", too_many, timeout_s=5)
            else:
                calls = pulls.start_batch("nobody-local", members, timeout_s=5)
                refused = pulls.start_batch("nobody-local", too_many, timeout_s=5)
            deadline = time.monotonic() + 10
            while not all(x.done() for x in (*calls, *refused)) and time.monotonic() < deadline:
                if pulls is not None:
                    pulls.poll()
                time.sleep(0.001)
            assert all(x.done() for x in (*calls, *refused)), "the calls must complete"
            results = [x.result() for x in calls]
    finally:
        if pulls is not None:
            pulls.close()
    # The first member is refused for the unknown local engine; the second repeats its request.
    assert [r.error_code for r in results] == ["NOT_FOUND", "INVALID_ARGUMENT"], results
    assert [r.unfilled_blocks for r in results] == [[5, 6], [7]]
    # Over gRPC both end with the call; over the lane each member's outcome arrives as it ends.
    assert calls[0].done_at > 0 and calls[1].done_at > 0
    if not lane:
        assert calls[0].done_at == calls[1].done_at
    over = [x.result() for x in refused]
    assert all(r.error_code == "INVALID_ARGUMENT" and "max_pull_batch 256" in r.error for r in over), over[0]
    assert [r.unfilled_blocks for r in over] == [[i] for i in range(300)]
