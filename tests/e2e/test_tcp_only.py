"""Two sidecars whose UCX may use only TCP (`UCX_TLS=tcp`), as on two nodes without RDMA. UCX has no
remote read over TCP, only one emulated with messages, which the sidecar's default
(UCX_PROTO_EMULATION_ENABLE=n) forbids: the pull must say so by name and lose nothing; with emulation
allowed on the reader, the same pull moves every byte. Remote writes UCX does natively over TCP, so
host rings (the source WRITEs) need no emulation at all (docs/operations.md, 5.9)."""

from __future__ import annotations

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, tcp_only_env

from .conftest import Spawn, metric, no_transfer_in_flight, spec_dict
from .events import wait_event

TCP_ONLY = tcp_only_env()
EMULATED = tcp_only_env(emulation=True)
SPEC = EngineSpec.from_dict(spec_dict())
EMULATION = "kvsidecar_ucx_emulation_detected_total"


def test_without_emulation_a_tcp_only_pull_fails_by_name_and_loses_nothing(spawn: Spawn) -> None:
    a, b, fixed = spawn.together(
        lambda: SidecarProcess("tcp-prefill", env=TCP_ONLY),
        lambda: SidecarProcess("tcp-decode", env=TCP_ONLY),
        # the fixed reader: emulation allowed (started now, used at the end)
        lambda: SidecarProcess("tcp-decode-fixed", env=EMULATED),
    )
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "tcp-p", SPEC), lambda: EngineProcess(b.socket, "tcp-d", SPEC)
    )
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "t", "block_ids": [1, 2], "num_tokens": 30, "seed": 3}
    )
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [5, 6], "seed": 3})
    assert not res["ok"]
    assert res["error_code"] == "FAILED_PRECONDITION", res["error"]
    assert f"peer sidecar {a.peer_address} answers, but NIXL cannot READ from it" in res["error"]
    assert "set UCX_PROTO_EMULATION_ENABLE=y" in res["error"] and "host_transfer: ring" in res["error"]
    assert res["unfilled_blocks"] == [5, 6]
    assert res["untouched"] and res["verified"], res["errors"]  # no byte written anywhere
    assert metric(b.metrics_port, EMULATION) == 1
    no_transfer_in_flight(a, b)
    # Nothing is lost: the prefill engine keeps the blocks for that reader, which, once its sidecar
    # may emulate (the operator's fix: set the variable, restart the decode pod), gets every byte.
    decode.stop()
    b.stop()
    again = spawn(EngineProcess(fixed.socket, "tcp-d", SPEC))
    ok = again.send({"cmd": "pull", "params": pub["params"], "block_ids": [5, 6], "seed": 3})
    assert ok["ok"] and ok["verified"] and ok["path"] == "host-nixl", (ok["error_code"], ok["error"])
    wait_event(prefill, "consumed", "t")
    assert a.alive


def test_with_emulation_allowed_on_the_reader_a_tcp_only_pull_moves_every_byte(spawn: Spawn) -> None:
    a = spawn(SidecarProcess("tcp-prefill-e", env=TCP_ONLY))  # the source keeps the default
    b = spawn(SidecarProcess("tcp-decode-e", env=EMULATED))
    prefill = spawn(EngineProcess(a.socket, "tcp-pe", SPEC))
    decode = spawn(EngineProcess(b.socket, "tcp-de", SPEC))
    for i in range(2):  # the second pull rides the kept handshake
        pub = prefill.send(
            {"cmd": "prefill", "request_id": f"e{i}", "block_ids": [1 + i, 9], "num_tokens": 30, "seed": i}
        )
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [20 + i, 3], "seed": i})
        assert res["ok"] and res["verified"] and res["path"] == "host-nixl", res
        wait_event(prefill, "consumed", f"e{i}")
    assert metric(b.metrics_port, EMULATION) == 0


def test_host_rings_need_no_emulation_over_tcp(spawn: Spawn) -> None:
    """With `host_transfer: ring` on the reader the source WRITEs into the reader's ring, which UCX does
    natively over TCP: no emulation on either side, and the source needs no setting of its own."""
    a = spawn(SidecarProcess("tcp-prefill-r", env=TCP_ONLY))
    b = spawn(SidecarProcess("tcp-decode-r", extra=["--host-transfer", "ring"], env=TCP_ONLY))
    prefill = spawn(EngineProcess(a.socket, "tcp-pr", SPEC))
    decode = spawn(EngineProcess(b.socket, "tcp-dr", SPEC))
    pub = prefill.send(
        {"cmd": "prefill", "request_id": "r", "block_ids": [4, 1], "num_tokens": 30, "seed": 5}
    )
    res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": [2, 7], "seed": 5})
    assert res["ok"] and res["verified"] and res["path"] == "host-ring", res
    wait_event(prefill, "consumed", "r")
    assert metric(a.metrics_port, EMULATION) == metric(b.metrics_port, EMULATION) == 0
