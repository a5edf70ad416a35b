"""The engine lane (Publish and Pull on "<engine socket>.lane") against real sidecars: the same bytes,
statuses and cancellation as over gRPC; a bad frame, a full sidecar, an oversized call or no lane at
all fall back or fail cleanly, and nothing else is disturbed."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection

import pytest

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import KVSidecarError, SidecarClient, TransferParams, params_from_json
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2
from kv_sidecar_client.lane import ENV_SWITCH, LANE_SUFFIX, LANE_VERSION
from kv_sidecar_client.polled import PolledPulls

from .conftest import Spawn, frozen, metric, no_transfer_in_flight, pulls_in_flight, spec_dict, wait_for

SPEC = EngineSpec.from_dict(spec_dict())


@pytest.fixture(scope="module")
def lane_pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    """Sidecars of this module alone, so that their lane gauges count only its connections."""
    a, b = together(
        lambda: SidecarProcess("lane-p"),
        lambda: SidecarProcess("lane-d", extra=["--max-message-bytes", "65536"]),
    )
    yield a, b
    assert (a.stop(), b.stop()) == (0, 0)
    assert not os.path.exists(a.socket + LANE_SUFFIX), "the lane's socket must go with the sidecar"


def _connect(sidecar: SidecarProcess) -> tuple[Connection, engine_pb2.LaneHello]:
    conn = Client(sidecar.socket + LANE_SUFFIX, family="AF_UNIX")
    assert conn.poll(5), "no hello"
    return conn, engine_pb2.LaneHello.FromString(conn.recv_bytes())


def _ask(conn: Connection, data: bytes) -> engine_pb2.LaneAnswer:
    conn.send_bytes(data)
    assert conn.poll(30), "no answer"
    return engine_pb2.LaneAnswer.FromString(conn.recv_bytes())


def _lane_connections(sidecar: SidecarProcess) -> float:
    return metric(sidecar.metrics_port, "kvsidecar_engine_lane_connections")


@pytest.mark.parametrize("lane", ["1", "0"])
def test_pulls_fill_the_same_bytes_over_the_lane_and_over_grpc(
    lane_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, lane: str
) -> None:
    a, b = lane_pair
    before = _lane_connections(b), _lane_connections(a)
    prefill, decode, local = spawn.together(
        lambda: EngineProcess(a.socket, f"lane{lane}-p", SPEC, env={ENV_SWITCH: lane}),
        lambda: EngineProcess(b.socket, f"lane{lane}-d", SPEC, env={ENV_SWITCH: lane}),
        lambda: EngineProcess(b.socket, f"lane{lane}-dp", SPEC, env={ENV_SWITCH: lane}),
    )
    for source, path in ((prefill, "host-nixl"), (local, "host-direct")):
        for i in range(3):  # the second and third reuse the lane connection the first opened
            pub = source.send(
                {"cmd": "prefill", "request_id": f"r{i}", "block_ids": [5, 2, 9], "num_tokens": 45, "seed": i}
            )
            assert pub["ok"], pub
            res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [1, 30, 7], "seed": i})
            assert res["ok"] and res["verified"], res
            assert res["path"] == path
    after = _lane_connections(b), _lane_connections(a)
    if lane == "1":  # one kept connection per engine that called: the decode engine, and each prefill
        assert after == (before[0] + 2, before[1] + 1), (before, after)
    else:
        assert after == before, "KV_SIDECAR_ENGINE_LANE=0 must keep every call on gRPC"


def test_the_lane_answers_bad_input_as_grpc_does(
    lane_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = lane_pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "parity-p", SPEC),
        lambda: EngineProcess(b.socket, "parity-d", SPEC),
    )
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "par", "block_ids": [3, 4], "num_tokens": 20, "seed": 1}
    )
    params = params_from_json(pub["params"])
    gone = TransferParams(engine_id="nobody", sidecar_address=a.peer_address, request_id="x", num_tokens=4)
    gone.block_ids.append(1)
    pulls = [
        (params, "nobody-local", [1, 2]),  # unknown local engine
        (params, decode.engine_id, [1, 64]),  # block id out of range
        (params, decode.engine_id, [1]),  # one block for two blocks' tokens
        (gone, decode.engine_id, [9]),  # unknown remote request
    ]
    with SidecarClient(b.socket, lane=True) as lane, SidecarClient(b.socket, lane=False) as plain:
        for args in pulls:
            over_lane, over_grpc = lane.pull(*args), plain.pull(*args)
            assert not over_lane.ok and over_lane == over_grpc, (args, over_lane, over_grpc)
        for bad in (("parity-d", "p", [0], 0), ("parity-d", "p", [99], 5), ("nobody", "p", [0], 1)):
            with pytest.raises(KVSidecarError) as via_lane:
                lane.publish(*bad)
            with pytest.raises(KVSidecarError) as via_grpc:
                plain.publish(*bad)
            assert (via_lane.value.code, via_lane.value.message) == (
                via_grpc.value.code,
                via_grpc.value.message,
            )
        assert lane.lane is not None and lane.lane._idle, "the lane client sent nothing over the lane"
        # The refused calls disturbed nothing: the published request still pulls bit-exact.
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [8, 9], "seed": 1})
        assert res["ok"] and res["verified"], res


def test_bad_frames_get_a_status_or_a_closed_connection_and_the_sidecar_keeps_serving(
    lane_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    _, b = lane_pair
    conn, hello = _connect(b)
    try:
        assert (hello.version, hello.sidecar_id, hello.refused) == (LANE_VERSION, b.sidecar_id, "")
        assert hello.max_call_bytes == 65536  # the sidecar's max_message_bytes
        garbage = _ask(conn, b"\xff\x00 not protobuf")
        assert (garbage.code, garbage.message) == ("INVALID_ARGUMENT", "not a LaneCall message")
        empty = _ask(conn, b"")
        assert (empty.code, empty.message) == (
            "INVALID_ARGUMENT",
            "a LaneCall must carry pull, pull_batch or publish",
        )
        # The same connection still answers a real call.
        unknown = _ask(
            conn, engine_pb2.LaneCall(publish=engine_pb2.PublishRequest(engine_id="none")).SerializeToString()
        )
        assert unknown.code == "INVALID_ARGUMENT" and "request_id" in unknown.message
        # A frame over the hello's limit: the sidecar cannot find the next frame, so it hangs up.
        refused = metric(b.metrics_port, "kvsidecar_failures_total", '{reason="engine_lane_bad_frame"}')
        with contextlib.suppress(OSError):  # it may hang up before the whole frame is sent
            conn.send_bytes(b"\0" * (hello.max_call_bytes + 1))
        assert conn.poll(10)
        with pytest.raises((EOFError, ConnectionResetError)):  # reset: it closed with bytes unread
            conn.recv_bytes()
        after = metric(b.metrics_port, "kvsidecar_failures_total", '{reason="engine_lane_bad_frame"}')
        assert after == refused + 1
    finally:
        conn.close()
    with SidecarClient(b.socket) as client:
        assert client.status().sidecar_id == b.sidecar_id


def test_a_call_over_the_lanes_limit_goes_over_grpc_and_gets_grpcs_status(
    lane_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    a, b = lane_pair
    params = TransferParams(engine_id="e", sidecar_address=a.peer_address, request_id="big", num_tokens=1)
    with SidecarClient(b.socket) as client:
        res = client.pull(params, "big-engine", list(range(40_000)))  # ~120 KB, over 64 KiB
        assert (res.ok, res.error_code) == (False, "RESOURCE_EXHAUSTED"), res
        assert client.lane is not None and client.lane._idle, "the lane was not tried first"


def test_connections_past_the_limit_are_refused_in_the_hello_and_clients_use_grpc(spawn: Spawn) -> None:
    sc = spawn(SidecarProcess("lane-full", extra=["--engine-workers", "8"]))
    held = [_connect(sc) for _ in range(8)]
    try:
        assert all(not hello.refused for _, hello in held)
        extra, hello = _connect(sc)
        extra.close()
        assert "8 engine lane connections are open" in hello.refused
        with SidecarClient(sc.socket) as client:
            with pytest.raises(KVSidecarError) as info:
                client.publish("nobody", "r", [0], 1)
            assert info.value.code == "NOT_FOUND"  # answered, over gRPC
            assert client.lane is not None and not client.lane._idle
    finally:
        for conn, _ in held:
            conn.close()


def test_a_sidecar_without_its_lane_serves_everything_over_grpc(spawn: Spawn) -> None:
    sc = spawn(SidecarProcess("no-lane", extra=["--engine-lane", "false"]))
    assert not os.path.exists(sc.socket + LANE_SUFFIX)
    with SidecarClient(sc.socket) as client:
        with pytest.raises(KVSidecarError) as info:
            client.publish("nobody", "r", [0], 1)
        assert info.value.code == "NOT_FOUND"


def test_a_stale_connection_after_a_restart_is_replaced(spawn: Spawn) -> None:
    sc = spawn(SidecarProcess("lane-restart"))
    workdir, name = sc.workdir, "lane-restart"
    with SidecarClient(sc.socket) as client:
        with pytest.raises(KVSidecarError):
            client.publish("nobody", "r", [0], 1)
        assert client.lane is not None and len(client.lane._idle) == 1
        assert sc.stop() == 0
        again = spawn(SidecarProcess(name, workdir=workdir))
        with pytest.raises(KVSidecarError) as info:
            client.publish("nobody", "r", [0], 1)
        assert info.value.code == "NOT_FOUND"
        assert _lane_connections(again) == 1, "the call did not go over a new lane connection"


@pytest.mark.parametrize("idle", [True, False], ids=["idle-connection", "new-connection"])
def test_a_publish_to_a_silent_sidecar_ends_within_its_timeout(spawn: Spawn, idle: bool) -> None:
    """The timeout covers the whole call: the wait for a new lane connection's hello and the gRPC call
    after it (vLLM's scheduler loop waits for a Publish)."""
    sc = spawn(SidecarProcess("lane-silent"))
    with SidecarClient(sc.socket) as client:
        if idle:  # a connection kept from an earlier call: the Publish goes out on it
            with pytest.raises(KVSidecarError):
                client.publish("nobody", "r", [0], 1)
            assert client.lane is not None and len(client.lane._idle) == 1
        with frozen(sc):
            t0 = time.monotonic()
            with pytest.raises(KVSidecarError) as info:
                client.publish("nobody", "r", [0], 1, timeout_s=0.5)
            took = time.monotonic() - t0
        assert info.value.code == "DEADLINE_EXCEEDED", info.value
        assert took < 1.0, f"a Publish with a 0.5 s timeout took {took:.2f} s"
        with pytest.raises(KVSidecarError) as info:  # awake again: it answers
            client.publish("nobody", "r", [0], 1)
        assert info.value.code == "NOT_FOUND"


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_a_cancelled_pull_stops_at_once_even_while_its_source_hangs(
    lane_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn, lane: bool
) -> None:
    """The engine gives up a pull whose source sidecar hangs (SIGSTOP) in the handshake: over the lane
    (the connection closes) as over gRPC (the call is cancelled), the decode sidecar ends the pull at
    once instead of at its timeout, and both sidecars serve on afterwards."""
    a, b = lane_pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, f"cancel-p{lane}", SPEC),
        lambda: EngineProcess(b.socket, f"cancel-d{lane}", SPEC),
    )
    pub = prefill.send({"cmd": "prefill", "request_id": "c", "block_ids": [1], "num_tokens": 16, "seed": 2})
    pulls = PolledPulls(b.socket, lane=lane)
    try:
        with frozen(a):
            call = pulls.start(params_from_json(pub["params"]), decode.engine_id, [5], timeout_s=60)
            wait_for("the pull to start", lambda: pulls_in_flight(b.socket, "c"), 10)
            time.sleep(0.2)
            call.cancel()
            assert call.done() and call.result().error_code == "CANCELLED"
            wait_for(
                "the decode sidecar to end the cancelled pull", lambda: not pulls_in_flight(b.socket, "c"), 3
            )
    finally:
        pulls.close()
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [7], "seed": 2})
    assert res["ok"] and res["verified"], res  # the request was never opened: it is still there
    no_transfer_in_flight(a, b)
