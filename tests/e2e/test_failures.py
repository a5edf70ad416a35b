"""Failures of real processes (issue 5, item 4): a prefill sidecar killed mid-transfer, a decode
engine that dies mid-pull, and peers that send garbage or speak another protocol version."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc

from .conftest import Spawn, consumed_events, frozen, metric, prefilled, spec_dict
from .events import wait_event
from .long_pull import BLOCKS, DST, READS, SRC, STAGING_BYTES, start_long_pull, wait_transfer_started


@pytest.fixture(scope="module")
def slow_decode_sidecar() -> Iterator[SidecarProcess]:
    sc = SidecarProcess("slow-decode", extra=["--staging-bytes", str(STAGING_BYTES)])
    yield sc
    assert sc.alive, "the decode sidecar must survive every failure in this module"
    assert sc.stop() == 0


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _mapped(pid: int, fragment: str) -> list[str]:
    """Lines of /proc/<pid>/maps naming a shared-memory object that contains `fragment`."""
    with open(f"/proc/{pid}/maps") as fh:
        return [line for line in fh if fragment in line]


def test_prefill_sidecar_killed_mid_transfer(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], slow_decode_sidecar: SidecarProcess, spawn: Spawn
) -> None:
    doomed = spawn(SidecarProcess("doomed-prefill"))
    prefill = spawn(EngineProcess(doomed.socket, "kill-p", SRC))
    other = spawn(EngineProcess(sidecar_pair[0].socket, "kill-p-other", SRC))
    decode = spawn(EngineProcess(slow_decode_sidecar.socket, "kill-d", DST))
    timeout_s = 20
    reads = metric(slow_decode_sidecar.metrics_port, READS)
    dst, _ = start_long_pull(prefill, decode, timeout_s)
    wait_transfer_started(slow_decode_sidecar, reads)
    doomed.proc.send_signal(signal.SIGKILL)
    res = json.loads(decode.readline(timeout_s + 10))
    assert not res["ok"], "the pull finished before the kill; make it longer (BLOCKS)"
    assert res["error_code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), res["error"]
    assert res["wall_s"] < timeout_s, "the pull must fail within its timeout"
    assert res["unfilled_blocks"] == dst
    assert res["verified"], res["errors"]  # no byte outside the requested blocks changed
    assert not res["untouched"], "the kill came before any block was written"
    # The decode sidecar keeps serving: a pull from another prefill sidecar works.
    assert slow_decode_sidecar.alive and _serving(f"unix:{slow_decode_sidecar.socket}")
    pub = other.send(
        {"cmd": "prefill", "request_id": "after", "block_ids": [8, 9], "num_tokens": 30, "seed": 6}
    )
    ok = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [1, 2], "seed": 6})
    assert ok["ok"] and ok["verified"], ok


def test_decode_engine_dies_mid_pull(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], slow_decode_sidecar: SidecarProcess, spawn: Spawn
) -> None:
    a = sidecar_pair[0]
    sc = slow_decode_sidecar
    prefill = spawn(EngineProcess(a.socket, "die-p", SRC))
    decode = spawn(EngineProcess(sc.socket, "die-d", DST))
    pid = decode.proc.pid
    # Counted under the path it was taking: another layout, so host-nixl-staged (SRC -> DST).
    cancelled = metric(
        sc.metrics_port, "kvsidecar_pulls_total", '{outcome="cancelled",path="host-nixl-staged"}'
    )
    try:
        reads = metric(sc.metrics_port, READS)
        start_long_pull(prefill, decode, timeout_s=60)
        wait_transfer_started(sc, reads)
        assert _mapped(sc.proc.pid, f"kvsidecar-{pid}-")
        decode.kill()  # SIGKILL: its Events stream and its Pull call break
        # The prefill side is told at once that its blocks are free (not after the 30 s lease).
        ev = wait_event(prefill, "released", "long", timeout_s=15)
        assert ev["block_ids"] == list(range(BLOCKS))
        # The rank is unregistered and its shared memory unmapped from the sidecar.
        with SidecarClient(sc.socket) as c:
            deadline = time.monotonic() + 15
            while True:
                try:
                    c.publish("die-d", "probe", [0], 1)
                except KVSidecarError as e:
                    if e.code == "NOT_FOUND":
                        break
                assert time.monotonic() < deadline, "the dead engine's rank stayed registered"
                time.sleep(0.1)
        # The rank leaves the registry first, then its memory is deregistered from NIXL (a hop through the
        # NIXL thread) and unmapped: give that a moment, not the lease.
        deadline = time.monotonic() + 5
        while _mapped(sc.proc.pid, f"kvsidecar-{pid}-"):
            assert time.monotonic() < deadline, "the dead engine's memory is still mapped"
            time.sleep(0.05)
        after = metric(
            sc.metrics_port, "kvsidecar_pulls_total", '{outcome="cancelled",path="host-nixl-staged"}'
        )
        assert after == cancelled + 1, "the in-flight pull was not cancelled"
        assert sc.alive and _serving(f"unix:{sc.socket}")
    finally:
        for path in glob.glob(f"/dev/shm/kvsidecar-{pid}-*"):  # the dead engine could not clean up
            os.unlink(path)


def test_wrong_protocol_version_is_refused_by_name(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    with grpc.insecure_channel(sidecar_pair[0].peer_address) as ch, pytest.raises(grpc.RpcError) as info:
        peer_pb2_grpc.PeerServiceStub(ch).Handshake(
            peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION + 41, engine_id="x"), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol version {PROTOCOL_VERSION + 41} is not supported" in info.value.details()
    assert f"speaks {PROTOCOL_VERSION}" in info.value.details()


def test_garbage_on_the_peer_port_leaves_the_sidecar_serving(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = sidecar_pair
    host, port = a.peer_address.rsplit(":", 1)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    payloads = [
        os.urandom(64 << 10),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        preface + os.urandom(4096),
        preface + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00" + os.urandom(18),  # a lying SETTINGS frame
    ]
    idle = socket.create_connection((host, int(port)), timeout=5)  # opens, then says nothing
    for data in payloads:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(data)
            s.settimeout(2)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    # A well-formed gRPC frame whose body is not a protobuf message.
    with grpc.insecure_channel(a.peer_address) as ch:
        raw = ch.unary_unary("/kvsidecar.v1.PeerService/Handshake")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff garbage", timeout=5)
        assert info.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    assert a.alive and _serving(a.peer_address) and _serving(f"unix:{a.socket}")
    # Real work still flows through it.
    spec = EngineSpec.from_dict(spec_dict())
    prefill, decode = together(
        lambda: EngineProcess(a.socket, "garbage-p", spec), lambda: EngineProcess(b.socket, "garbage-d", spec)
    )
    try:
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "g", "block_ids": [1], "num_tokens": 9, "seed": 2}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [3], "seed": 2})
        assert res["ok"] and res["verified"], res
    finally:
        idle.close()
        prefill.stop()
        decode.stop()


def test_a_pull_that_runs_out_of_time_on_a_frozen_peer_says_so_and_keeps_the_handshake(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    """A peer that answers nothing (SIGSTOP) until the pull's own deadline passes, at the handshake
    and later at the open: DEADLINE_EXCEEDED naming the peer and the step, not UNAVAILABLE, which
    would tell the user the peer is down and have the sidecar drop its handshake with a peer that is
    up. Once the peer runs again, the next pull needs no new handshake."""
    reader = sidecar_pair[1]
    far = spawn(SidecarProcess("frozen-peer"))
    src, dst = spawn.together(
        lambda: EngineProcess(far.socket, "frz-p", SRC), lambda: EngineProcess(reader.socket, "frz-d", SRC)
    )
    pubs = [prefilled(src, f"frz{i}", [1 + 2 * i, 2 + 2 * i], 20, seed=i) for i in range(3)]

    def pull(i: int, timeout_s: float) -> dict[str, object]:
        cmd = {"cmd": "pull", "params": pubs[i], "block_ids": [20 + 2 * i, 21 + 2 * i], "seed": i}
        return dst.send(cmd | {"timeout_s": timeout_s}, timeout_s=timeout_s + 30)

    with frozen(far):
        late = pull(0, 0.5)
    assert late["error_code"] == "DEADLINE_EXCEEDED", late
    assert f"waiting for peer sidecar {far.peer_address} (the handshake)" in str(late["error"]), late
    done = pull(1, 20)
    assert done["ok"] and done["verified"], done
    before = metric(reader.metrics_port, "kvsidecar_handshakes_total", '{outcome="ok"}')
    assert before >= 1
    with frozen(far):
        late = pull(2, 0.5)
    assert late["error_code"] == "DEADLINE_EXCEEDED", late
    assert f"waiting for peer sidecar {far.peer_address} (to open request 'frz2')" in str(late["error"]), late
    assert late["verified"], late["errors"]  # no byte outside the requested blocks changed
    again = pull(2, 20)
    assert again["ok"] and again["verified"], again
    after = metric(reader.metrics_port, "kvsidecar_handshakes_total", '{outcome="ok"}')
    assert after == before, "the handshake with a live peer was dropped"
    # The source tells its engine at once that both pulled requests may be freed; the stale open the
    # thawed source answered holds nothing back.
    assert consumed_events(src, 2) == 2


def test_prefill_engine_dies_mid_pull(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], slow_decode_sidecar: SidecarProcess, spawn: Spawn
) -> None:
    """The prefill engine dies (SIGKILL) while its request is being read. Its sidecar unregisters it
    and unmaps its memory, the request ends (released), and the read in flight ends with it: the pull
    completes with the bytes it had or fails naming its unfilled blocks, no byte outside them
    changes, and both sidecars stay up and serve the next pull."""
    a, sc = sidecar_pair[0], slow_decode_sidecar
    prefill = spawn(EngineProcess(a.socket, "pdie-p", SRC))
    other = spawn(EngineProcess(a.socket, "pdie-p2", SRC))
    decode = spawn(EngineProcess(sc.socket, "pdie-d", DST))
    pid = prefill.proc.pid
    try:
        reads = metric(sc.metrics_port, READS)
        dst, _ = start_long_pull(prefill, decode, timeout_s=60)
        wait_transfer_started(sc, reads)
        prefill.kill()
        res = json.loads(decode.readline(75))
        assert res["verified"], res["errors"]  # no byte outside the pulled blocks changed
        if not res["ok"]:
            assert res["unfilled_blocks"] == dst, res
            assert res["wall_s"] < 30, res
        deadline = time.monotonic() + 15
        while _mapped(a.proc.pid, f"kvsidecar-{pid}-"):
            assert time.monotonic() < deadline, "the dead engine's memory is still mapped"
            time.sleep(0.05)
        assert a.alive and sc.alive and _serving(f"unix:{a.socket}") and _serving(f"unix:{sc.socket}")
        pub = other.send(
            {"cmd": "prefill", "request_id": "after", "block_ids": [8, 9], "num_tokens": 30, "seed": 7}
        )
        ok = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [1, 2], "seed": 7})
        assert ok["ok"] and ok["verified"], (ok.get("error_code"), ok.get("error"))
    finally:
        for path in glob.glob(f"/dev/shm/kvsidecar-{pid}-*"):  # the dead engine could not clean up
            os.unlink(path)
