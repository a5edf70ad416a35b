"""Graceful drain on SIGTERM, with real processes.

A pull is held in flight honestly: the prefill sidecar is frozen with SIGSTOP,
so the decode sidecar's OpenRead waits on a live TCP connection; SIGCONT lets
it go on. Meanwhile the decode sidecar gets SIGTERM.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess
from kv_sidecar.server.engines import spec_to_proto
from kv_sidecar_client import BatchPull, KVSidecarError, SidecarClient, params_from_json
from kv_sidecar_client._proto.kvsidecar.v1 import (
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    status_pb2,
)

from .conftest import frozen, in_background, pulls_in_flight, spec_dict, wait_for

SPEC = EngineSpec.from_dict(spec_dict())
_ids = itertools.count()


@pytest.fixture(scope="module")
def prefill_side() -> Iterator[tuple[SidecarProcess, EngineProcess]]:
    a = SidecarProcess("drain-prefill")
    engine = EngineProcess(a.socket, "drain-p", SPEC)
    yield a, engine
    engine.stop()
    assert a.stop() == 0


def _publish(engine: EngineProcess, blocks: list[int], tokens: int) -> dict[str, Any]:
    pub = engine.send(
        {
            "cmd": "prefill",
            "request_id": f"drain-{next(_ids)}",
            "block_ids": blocks,
            "num_tokens": tokens,
            "seed": 9,
        }
    )
    assert pub["ok"], pub
    return pub["params"]


def _status(socket: str) -> status_pb2.StatusResponse:
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        return engine_pb2_grpc.EngineServiceStub(ch).Status(status_pb2.StatusRequest(), timeout=10)


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_sigterm_drains_in_flight_pull_and_refuses_new_work(
    prefill_side: tuple[SidecarProcess, EngineProcess],
) -> None:
    a, prefill = prefill_side
    b = SidecarProcess("drain-decode", extra=["--drain-timeout-s", "120"])
    decode = EngineProcess(b.socket, "drain-d", SPEC)
    try:
        warm = decode.send({"cmd": "pull", "params": _publish(prefill, [1], 16), "block_ids": [1], "seed": 9})
        assert warm["ok"] and warm["verified"], warm
        held = _publish(prefill, [4, 5, 6], 48)
        spare = _publish(prefill, [7], 16)
        with frozen(a):
            result = in_background(
                lambda: decode.send(
                    {"cmd": "pull", "params": held, "block_ids": [30, 31, 32], "seed": 9, "timeout_s": 120}
                )
            )
            wait_for("the pull to be in flight", lambda: pulls_in_flight(b.socket, held["request_id"]))
            b.proc.send_signal(signal.SIGTERM)
            wait_for(
                "NOT_SERVING",
                lambda: _health(f"unix:{b.socket}") == health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            assert _health(b.peer_address) == health_pb2.HealthCheckResponse.NOT_SERVING
            st = _status(b.socket)
            assert st.draining and [t.request_id for t in st.inflight] == [held["request_id"]]

            with SidecarClient(b.socket) as client:
                res = client.pull(params_from_json(spare), decode.engine_id, [40])
                assert (res.ok, res.error_code) == (False, "UNAVAILABLE"), res
                assert "sidecar is draining" in res.error and "Pull is refused" in res.error
                # A PullBatch too, over the lane and over gRPC: every member fails with the drain's status.
                for lane in (True, False):
                    with SidecarClient(b.socket, lane=lane) as batcher:
                        (member,) = batcher.pull_batch(
                            decode.engine_id, [BatchPull(params_from_json(spare), [41])]
                        )
                    assert member.error_code == "UNAVAILABLE" and "PullBatch is refused" in member.error, (
                        member
                    )
                for call in (
                    lambda: client.publish(decode.engine_id, "new", [0], 1),
                    lambda: client.register_rank("late-engine", 0, SPEC.to_dict(), []),
                ):
                    with pytest.raises(KVSidecarError) as info:
                        call()
                    assert info.value.code == "UNAVAILABLE" and "draining" in info.value.message
            with grpc.insecure_channel(b.peer_address) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    peer_pb2_grpc.PeerServiceStub(ch).OpenRead(peer_pb2.OpenReadRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "OpenRead is refused" in err.value.details()
            assert b.alive, "the sidecar must wait for its in-flight pull"
        # Prefill thawed: the held pull completes bit-exact, then the sidecar exits.
        res = result()
        assert res["ok"] and res["verified"], res
        assert res["bytes"] == 3 * 2 * 2 * 16 * 4 * 16 * 2
        assert b.proc.wait(60) == 0
        assert not os.path.exists(b.socket), "the engine socket must be removed"
        log = "\n".join(b.stderr_tail)
        assert "draining: 1 transfers in flight" in log and "msg=drained" in log, log[-3000:]
    finally:
        decode.stop()
        b.stop()


def test_drain_deadline_bounds_the_wait(prefill_side: tuple[SidecarProcess, EngineProcess]) -> None:
    a, prefill = prefill_side
    b = SidecarProcess("drain-deadline", extra=["--drain-timeout-s", "1"])
    decode = EngineProcess(b.socket, "drain-dl", SPEC)
    try:
        held = _publish(prefill, [10, 11], 32)
        with frozen(a):
            result = in_background(
                lambda: decode.send(
                    {"cmd": "pull", "params": held, "block_ids": [12, 13], "seed": 9, "timeout_s": 120}
                )
            )
            wait_for("the pull to be in flight", lambda: pulls_in_flight(b.socket, held["request_id"]))
            t0 = time.monotonic()
            b.proc.send_signal(signal.SIGTERM)
            assert b.proc.wait(60) == 0
            waited = time.monotonic() - t0
            res = result()
        assert waited >= 1, waited  # the drain waited its full second for the frozen peer
        assert not res["ok"] and res["unfilled_blocks"] == [12, 13], res
        assert not os.path.exists(b.socket)
        assert "drain deadline passed with 1 transfers still in flight" in "\n".join(b.stderr_tail)
    finally:
        decode.stop()
        b.stop()


def test_drain_waits_for_reads_served_to_other_sidecars() -> None:
    """The prefill side keeps an opened read's blocks readable until the reader is done."""
    a = SidecarProcess("drain-serving", extra=["--drain-timeout-s", "120"])
    prefill = EngineProcess(a.socket, "drain-sp", SPEC)
    try:
        params = _publish(prefill, [2, 3], 20)
        with grpc.insecure_channel(a.peer_address) as ch:
            # This test is the reader: it opens the read like a decode sidecar would.
            peer = peer_pb2_grpc.PeerServiceStub(ch)
            hs = peer.Handshake(
                peer_pb2.HandshakeRequest(
                    protocol_version=PROTOCOL_VERSION,
                    sidecar_id="test-reader",
                    engine_id=prefill.engine_id,
                    reader_engine_id="reader",
                    reader_spec=spec_to_proto(SPEC),
                ),
                timeout=30,
            )
            read = dict(
                engine_id=prefill.engine_id, request_id=params["request_id"], reader_engine_id="reader"
            )
            peer.OpenRead(
                peer_pb2.OpenReadRequest(**read, reader_ranks=[0], plan_hash=hs.plan_hash), timeout=30
            )
            a.proc.send_signal(signal.SIGTERM)
            wait_for("draining", lambda: _status(a.socket).draining)
            st = _status(a.socket)
            assert [(t.kind, t.request_id) for t in st.inflight] == [("serve", params["request_id"])]
            assert st.inflight[0].bytes == 2 * 2 * 2 * 16 * 4 * 16 * 2  # the two opened blocks
            time.sleep(1)
            assert a.alive, "the sidecar must wait for the read it serves"
            peer.CloseRead(peer_pb2.CloseReadRequest(**read, reader_ranks=[0], failed=True), timeout=30)
        assert a.proc.wait(60) == 0
        assert not os.path.exists(a.socket)
    finally:
        prefill.stop()
        a.stop()
