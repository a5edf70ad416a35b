"""PullBatch (a decode engine's pulls of one step in one call) against real sidecars and engine processes:
members of different requests, sizes, sources and layouts arrive bit-exact; a bad member fails alone with
the status a lone Pull gets; aborting one member's request stops only it; the engine going away stops
them all; a batch that is empty or too large is refused whole."""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing.connection import Client
from typing import Any

import grpc
import pytest

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import BatchPull, SidecarClient, params_from_json
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kv_sidecar_client.lane import ENV_SWITCH, LANE_SUFFIX

from .conftest import (
    Spawn,
    batch_with_one_unpublished,
    consumed_events,
    frozen,
    in_background,
    metric,
    no_transfer_in_flight,
    prefilled,
    pulls_in_flight,
    spec_dict,
    wait_for,
)

SPEC = EngineSpec.from_dict(spec_dict())
HND = EngineSpec.from_dict(spec_dict(layout="flash_attn_hnd"))
BLOCK32 = EngineSpec.from_dict(spec_dict(block_size=32, num_blocks=32))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    """Sidecars of this module; the decode side takes at most 8 pulls a batch."""
    a, b = together(
        lambda: SidecarProcess("batch-p"),
        lambda: SidecarProcess("batch-d", extra=["--max-pull-batch", "8"]),
    )
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0)


@pytest.mark.parametrize("lane", ["1", "0"])
def test_members_of_other_requests_sizes_sources_and_layouts_arrive_bit_exact(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, lane: str
) -> None:
    a, b = pair
    env = {ENV_SWITCH: lane}
    same, hnd, local, local32, decode = spawn.together(
        lambda: EngineProcess(a.socket, f"bx{lane}-same", SPEC, env=env),
        lambda: EngineProcess(a.socket, f"bx{lane}-hnd", HND, env=env),
        lambda: EngineProcess(b.socket, f"bx{lane}-local", SPEC, env=env),
        lambda: EngineProcess(b.socket, f"bx{lane}-local32", BLOCK32, env=env),
        lambda: EngineProcess(b.socket, f"bx{lane}-d", SPEC, env=env),
    )
    members = [
        # (source, its blocks, tokens, the decode blocks, start_token, the path it takes)
        (same, [5, 2, 9], 45, [1, 30, 7], 0, "host-nixl"),
        (same, [11], 16, [12], 0, "host-nixl"),
        (hnd, [3, 4], 20, [20, 21], 0, "host-nixl-staged"),
        (local, [6, 8, 10, 12], 64, [40, 41], 32, "host-direct"),  # the decode side holds a prefix
        (local32, [2, 3], 50, [50, 51, 52, 53], 0, "host-direct"),
    ]
    pulls = []
    for i, (src, blocks, tokens, dst, start, _) in enumerate(members):
        params = prefilled(src, f"m{i}", blocks, tokens, seed=10 + i)
        pulls.append({"params": params, "block_ids": dst, "seed": 10 + i, "start_token": start})
    batches = metric(b.metrics_port, "kvsidecar_pull_batch_pulls_count")
    members_before = metric(b.metrics_port, "kvsidecar_pull_batch_pulls_sum")
    out = decode.send({"cmd": "pull_many", "pulls": pulls})
    assert out["ok"] and out["untouched_outside"], out
    assert metric(b.metrics_port, "kvsidecar_pull_batch_pulls_count") == batches + 1
    assert metric(b.metrics_port, "kvsidecar_pull_batch_pulls_sum") == members_before + len(members)
    for res, (*_, path) in zip(out["results"], members, strict=True):
        assert res["verified"] and res["path"] == path, res
    # Each member answered its own "consumed" to its own source, once.
    for src, n in ((same, 2), (hnd, 1), (local, 1), (local32, 1)):
        assert consumed_events(src, n) == n, src.engine_id
    no_transfer_in_flight(a, b)


@pytest.mark.parametrize("source", ["identity", "converted"])
def test_same_sidecar_members_of_one_engine_go_joined_and_arrive_bit_exact(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, source: str
) -> None:
    """host-direct members from one prefill engine: their copies go joined (local_copies.copy_host_all:
    whole blocks as one run of memmoves for an identity plan, one executor call over their joined tokens
    for a converted one). Each lands exact: a partial last block inside the join, one past a prefix;
    nothing outside the members' blocks written; one naming a request never published fails alone."""
    _, b = pair
    tag = f"join-{source}"
    prefill, decode = spawn.together(
        lambda: EngineProcess(b.socket, f"{tag}-p", SPEC if source == "identity" else HND),
        lambda: EngineProcess(b.socket, f"{tag}-d", SPEC),
    )
    members = [
        ([1, 2, 3], 40, [10, 11, 12], 0),
        ([4], 16, [14], 0),
        ([5, 6, 7], 48, [17, 18], 16),
        ([8], 9, [20], 0),
    ]
    pulls = []
    for i, (blocks, tokens, dst, start) in enumerate(members):
        params = prefilled(prefill, f"{tag}-{i}", blocks, tokens, seed=30 + i)
        pulls.append({"params": params, "block_ids": dst, "seed": 30 + i, "start_token": start})
    batch_with_one_unpublished(decode, pulls, [30, 31, 32])
    assert consumed_events(prefill, len(members)) == len(members)


def test_a_bad_member_fails_alone_with_the_status_a_lone_pull_gets(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = pair
    prefill, local, decode = spawn.together(
        lambda: EngineProcess(a.socket, "bb-p", SPEC),
        lambda: EngineProcess(b.socket, "bb-local", SPEC),
        lambda: EngineProcess(b.socket, "bb-d", SPEC),
    )
    good0 = prefilled(prefill, "g0", [1, 2], 20, seed=1)
    good1 = prefilled(local, "g1", [3], 10, seed=2)
    bad_range = prefilled(prefill, "b0", [4, 5], 20, seed=3)
    short = prefilled(local, "b1", [6, 7], 30, seed=4)
    gone = params_from_json(good0)
    gone.request_id = "never-published"
    members = [
        {"params": good0, "block_ids": [10, 11], "seed": 1},
        {"params": bad_range, "block_ids": [12, 64], "seed": 3},  # block id out of range
        {"params": short, "block_ids": [14], "seed": 4},  # one block for two blocks' tokens
        {"params": _json(gone), "block_ids": [16, 17], "seed": 1},  # unknown request
        {"params": good0, "block_ids": [18, 19], "seed": 1},  # repeats member 0's request and ranks
        {"params": good1, "block_ids": [20], "seed": 2},
    ]
    out = decode.send({"cmd": "pull_many", "pulls": members})
    res = out["results"]
    assert out["untouched_outside"], out
    assert res[0]["ok"] and res[0]["verified"] and res[5]["ok"] and res[5]["verified"], res
    assert [r["error_code"] for r in res[1:5]] == [
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "INVALID_ARGUMENT",
    ], res
    assert "pulls[0]" in res[4]["error"] and "g0" in res[4]["error"], res[4]
    # The refused members get what a lone Pull of each gets, word for word, and their unfilled blocks.
    with SidecarClient(b.socket) as client:
        for i in (1, 2, 3):
            alone = client.pull(
                params_from_json(members[i]["params"]), decode.engine_id, members[i]["block_ids"]
            )
            assert (alone.error_code, alone.error) == (res[i]["error_code"], res[i]["error"]), (i, alone)
            assert res[i]["unfilled_blocks"] == members[i]["block_ids"], res[i]
    # The refused members' requests are still there: a good pull of each works afterwards.
    again = decode.send({"cmd": "pull", "params": bad_range, "block_ids": [30, 31], "seed": 3})
    assert again["ok"] and again["verified"], again
    no_transfer_in_flight(a, b)


def _json(params: Any) -> Any:
    from kv_sidecar_client import params_to_json

    return params_to_json(params)


def test_aborting_one_members_request_stops_only_it(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A member whose source hangs is aborted by its request id; the others finish, and the batch
    answers at once rather than at the hanging member's deadline."""
    _, b = pair
    far = spawn(SidecarProcess("batch-far"))
    hung, local, decode = spawn.together(
        lambda: EngineProcess(far.socket, "ba-far", SPEC),
        lambda: EngineProcess(b.socket, "ba-local", SPEC),
        lambda: EngineProcess(b.socket, "ba-d", SPEC),
    )
    stuck = prefilled(hung, "stuck", [1, 2], 20, seed=5)
    fine = prefilled(local, "fine", [3, 4], 20, seed=6)
    with frozen(far):
        answer = in_background(
            lambda: decode.send(
                {
                    "cmd": "pull_many",
                    "pulls": [
                        {"params": stuck, "block_ids": [8, 9], "seed": 5},
                        {"params": fine, "block_ids": [10, 11], "seed": 6},
                    ],
                    "timeout_s": 60,
                }
            )
        )
        wait_for("the stuck member to run", lambda: pulls_in_flight(b.socket, "stuck") == 1, 10)
        t0 = time.monotonic()
        with SidecarClient(b.socket) as client:
            assert client.abort(decode.engine_id, "stuck")
        out = answer()
        took = time.monotonic() - t0
    stuck_res, fine_res = out["results"]
    assert stuck_res["error_code"] == "CANCELLED" and "aborted by the engine" in stuck_res["error"], stuck_res
    assert fine_res["ok"] and fine_res["verified"], fine_res
    assert out["untouched_outside"], out
    assert took < 3, f"the batch answered {took:.1f} s after the abort"
    no_transfer_in_flight(b)


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_over_the_lane_a_member_is_done_when_it_ends_not_when_the_slowest_does(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, lane: bool
) -> None:
    """A batch with a member whose source hangs: over the lane the other member's outcome arrives at
    once (its engine can go on), and its source hears "consumed" (it can free the blocks); over gRPC
    both come with the call's answer, after the abort."""
    _, b = pair
    far = spawn(SidecarProcess(f"batch-far3-{lane}"))
    hung, local, decode = spawn.together(
        lambda: EngineProcess(far.socket, f"bs-far-{lane}", SPEC),
        lambda: EngineProcess(b.socket, f"bs-local-{lane}", SPEC),
        lambda: EngineProcess(b.socket, f"bs-d-{lane}", SPEC),
    )
    stuck = params_from_json(prefilled(hung, "stuck", [1, 2], 20, seed=5))
    fine = params_from_json(prefilled(local, "fine", [3, 4], 20, seed=6))
    with frozen(far), SidecarClient(b.socket, lane=lane) as client:
        slow, quick = client.pull_batch_async(
            decode.engine_id, [BatchPull(stuck, [8, 9]), BatchPull(fine, [10, 11])], timeout_s=60
        )
        wait_for("the stuck member to run", lambda: pulls_in_flight(b.socket, "stuck") == 1, 10)
        if lane:
            wait_for("the quick member's outcome", quick.done, 10)
            assert quick.result().ok and quick.result().path == "host-direct", quick.result()
        consumed = local.send({"cmd": "next_event", "timeout_s": 3 if lane else 0.3})
        assert not slow.done() and quick.done() == lane
        if lane:
            assert consumed["kind"] == "consumed" and consumed["request_id"] == "fine", consumed
        else:
            assert consumed == {"ok": False, "error": "no event"}, consumed
        assert client.abort(decode.engine_id, "stuck")
        wait_for("the batch's answer", lambda: slow.done() and quick.done(), 5)
    assert slow.result().error_code == "CANCELLED", slow.result()
    assert quick.result().ok, quick.result()
    assert quick.done_at < slow.done_at if lane else quick.done_at == slow.done_at
    if not lane:
        consumed = local.send({"cmd": "next_event", "timeout_s": 5})
        assert consumed["kind"] == "consumed" and consumed["request_id"] == "fine", consumed
    no_transfer_in_flight(b)


def test_batches_whose_outcomes_all_came_ahead_leave_their_lane_connection_for_the_next_call(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """Over the lane a batch is done when its last member's outcome arrives, before the call's own
    answer; its connection goes back to the client once that answer is read, even while the engine
    still holds the results, so that each batch does not open a connection (and a sidecar thread)."""
    a, b = pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "bc-p", SPEC),
        lambda: EngineProcess(b.socket, "bc-d", SPEC),
    )
    params = [params_from_json(prefilled(prefill, f"c{i}", [1 + i], 16, seed=i)) for i in range(8)]
    held = []
    with SidecarClient(b.socket, lane=True) as client:
        before = metric(b.metrics_port, "kvsidecar_engine_lane_connections")
        for k in range(4):
            pending = client.pull_batch_async(
                decode.engine_id, [BatchPull(params[2 * k + j], [10 + 2 * k + j]) for j in range(2)]
            )
            results = [p.result() for p in pending]
            assert all(r.ok and r.path == "host-nixl" for r in results), results
            held.append(pending)  # the engine keeps them: their connection must not stay theirs
            time.sleep(0.2)  # the call's answer follows its last outcome by well under this
        opened = metric(b.metrics_port, "kvsidecar_engine_lane_connections") - before
    assert opened == 1, f"4 batches in turn opened {opened} lane connections"
    for i in range(8):  # and every member's bytes are the source's
        want = prefill.send({"cmd": "digest", "block_ids": [1 + i]})["digests"]
        got = decode.send({"cmd": "digest", "block_ids": [10 + i]})["digests"]
        assert got == want, i


@pytest.mark.parametrize("grouped", [True, False])
def test_outcomes_of_members_that_end_together_come_in_one_frame_where_the_client_asks(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, grouped: bool
) -> None:
    """Same-sidecar members' copies end together: with group_outcomes their outcomes come in one frame
    ahead of the call's answer; a client that does not ask (one from before it) gets a frame each."""
    _, b = pair
    local, decode = spawn.together(
        lambda: EngineProcess(b.socket, f"bo-p-{grouped}", SPEC),
        lambda: EngineProcess(b.socket, f"bo-d-{grouped}", SPEC),
    )
    pulls = [
        engine_pb2.PullRequest(
            params=params_from_json(prefilled(local, f"o{i}", [1 + i], 16, seed=i)),
            engine_id=decode.engine_id,
            block_ids=[10 + i],
            timeout_ms=30_000,
        )
        for i in range(3)
    ]
    batch = engine_pb2.PullBatchRequest(pulls=pulls, stream_outcomes=True, group_outcomes=grouped)
    conn = Client(b.socket + LANE_SUFFIX, family="AF_UNIX")
    try:
        assert conn.poll(5)
        conn.recv_bytes()  # the hello
        conn.send_bytes(engine_pb2.LaneCall(pull_batch=batch).SerializeToString())
        frames = []
        while True:
            assert conn.poll(30), "no answer"
            frame = engine_pb2.LaneAnswer.FromString(conn.recv_bytes())
            frames.append(frame.WhichOneof("result"))
            if frame.WhichOneof("result") == "pull_outcomes":
                ahead = list(frame.pull_outcomes.outcomes)
            if frame.WhichOneof("result") == "pull_batch":
                break
    finally:
        conn.close()
    if grouped:
        assert frames == ["pull_outcomes", "pull_batch"], frames
        assert sorted(o.index for o in ahead) == [0, 1, 2] and all(o.response.bytes for o in ahead), ahead
    else:
        assert frames == ["pull_outcome"] * 3 + ["pull_batch"], frames
    for i in range(3):
        want = local.send({"cmd": "digest", "block_ids": [1 + i]})["digests"]
        assert decode.send({"cmd": "digest", "block_ids": [10 + i]})["digests"] == want, i


def test_the_engine_going_away_stops_every_member(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """The lane connection closing mid-batch (the engine died or gave up) stops every member."""
    _, b = pair
    far = spawn(SidecarProcess("batch-far2"))
    hung, decode = spawn.together(
        lambda: EngineProcess(far.socket, "bg-far", SPEC),
        lambda: EngineProcess(b.socket, "bg-d", SPEC),
    )
    pulls = [
        engine_pb2.PullRequest(
            params=params_from_json(prefilled(hung, f"h{i}", [1 + 2 * i, 2 + 2 * i], 20, seed=i)),
            engine_id=decode.engine_id,
            block_ids=[8 + 2 * i, 9 + 2 * i],
            timeout_ms=60_000,
        )
        for i in range(3)
    ]
    with frozen(far):
        conn = Client(b.socket + LANE_SUFFIX, family="AF_UNIX")
        assert conn.poll(5)
        conn.recv_bytes()  # the hello
        conn.send_bytes(
            engine_pb2.LaneCall(pull_batch=engine_pb2.PullBatchRequest(pulls=pulls)).SerializeToString()
        )
        wait_for("the members to run", lambda: sum(pulls_in_flight(b.socket, f"h{i}") for i in range(3)) == 3)
        t0 = time.monotonic()
        conn.close()
        wait_for(
            "every member to stop", lambda: sum(pulls_in_flight(b.socket, f"h{i}") for i in range(3)) == 0, 3
        )
        # At once, not at the members' 60 s deadline nor at the handshake's own timeout.
        assert time.monotonic() - t0 < 3, f"the members stopped {time.monotonic() - t0:.1f} s after the close"
    no_transfer_in_flight(b)


def test_a_batch_empty_or_over_the_limit_is_refused_whole(
    pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "bl-p", SPEC),
        lambda: EngineProcess(b.socket, "bl-d", SPEC),
    )
    params = params_from_json(prefilled(prefill, "l0", [1], 16, seed=1))
    stub = engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(f"unix:{b.socket}"))
    with pytest.raises(grpc.RpcError) as empty:
        stub.PullBatch(engine_pb2.PullBatchRequest(), timeout=10)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one" in empty.value.details()
    with SidecarClient(b.socket, lane=True) as lane, SidecarClient(b.socket, lane=False) as plain:
        nine = [BatchPull(params, [i]) for i in range(9)]
        for client in (lane, plain):
            results = client.pull_batch(decode.engine_id, nine)
            assert len(results) == 9 and all(r.error_code == "INVALID_ARGUMENT" for r in results), results
            assert "max_pull_batch 8" in results[0].error and results[0].unfilled_blocks == [0]
        # Nothing was pulled: the request is still there, and a batch within the limit fills it.
        (res,) = lane.pull_batch(decode.engine_id, [BatchPull(params, [20])])
        assert res.ok and res.path == "host-nixl", res
