"""A real KV cache moves between real engine processes through real sidecars, byte for byte."""

from __future__ import annotations

import itertools
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together

from .conftest import metric, spec_dict

_ids = itertools.count()


def _transfer(
    prefill: EngineProcess,
    decode: EngineProcess,
    src: list[int],
    dst: list[int],
    tokens: int,
    start_token: int = 0,
) -> dict[str, object]:
    rid = f"req-{next(_ids)}"
    pub = prefill.send(
        {"cmd": "prefill", "request_id": rid, "block_ids": src, "num_tokens": tokens, "seed": 7}
    )
    assert pub["ok"], pub
    res = decode.send(
        {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 7, "start_token": start_token}
    )
    assert res["ok"], res
    assert res["verified"], res["errors"]
    for _ in range(prefill.spec.tp_size):  # every prefill rank hears that its blocks were consumed
        ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
        assert (ev["kind"], ev["request_id"]) == ("consumed", rid), ev
    return res


@pytest.mark.parametrize("tp", [1, 2])
def test_pull_across_sidecars_over_nixl(sidecar_pair: tuple[SidecarProcess, SidecarProcess], tp: int) -> None:
    a, b = sidecar_pair
    spec = EngineSpec.from_dict(spec_dict(tp_size=tp))
    prefill, decode = together(
        lambda: EngineProcess(a.socket, f"p-tp{tp}", spec), lambda: EngineProcess(b.socket, f"d-tp{tp}", spec)
    )
    try:
        res = _transfer(prefill, decode, src=[5, 2, 9], dst=[1, 30, 7], tokens=45)
        assert res["path"] == "host-nixl"
        block = 16 * 4 // tp * 16 * 2  # tokens x local heads x dim x bytes, one layer, K or V
        assert res["bytes"] == 3 * 2 * 2 * block * tp  # blocks x layers x K/V, all ranks
        # Prefix hit: decode already holds the first block; only the tail moves.
        res = _transfer(prefill, decode, src=[11, 12, 13], dst=[40, 41], tokens=40, start_token=16)
        assert res["bytes"] == 2 * 2 * 2 * block * tp
    finally:
        prefill.stop()
        decode.stop()


def test_pull_within_one_sidecar_copies_directly(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    a, _ = sidecar_pair
    spec = EngineSpec.from_dict(spec_dict(tp_size=2))
    prefill, decode = together(
        lambda: EngineProcess(a.socket, "p-local", spec), lambda: EngineProcess(a.socket, "d-local", spec)
    )
    try:
        res = _transfer(prefill, decode, src=[0, 63], dst=[62, 1], tokens=20)
        assert res["path"] == "host-direct"
    finally:
        prefill.stop()
        decode.stop()


def test_health_reflection_and_metrics(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    a, b = sidecar_pair
    for target in (f"unix:{a.socket}", a.peer_address):
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            names = [
                s.name
                for r in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
                for s in r.list_services_response.service
            ]
            assert "grpc.health.v1.Health" in names
            assert any(n.startswith("kvsidecar.v1.") for n in names)
    before = metric(b.metrics_port, "kvsidecar_pulls_total", '{outcome="ok",path="host-nixl"}')
    spec = EngineSpec.from_dict(spec_dict())
    prefill, decode = together(
        lambda: EngineProcess(a.socket, "p-metrics", spec), lambda: EngineProcess(b.socket, "d-metrics", spec)
    )
    try:
        _transfer(prefill, decode, src=[1], dst=[2], tokens=16)
    finally:
        prefill.stop()
        decode.stop()
    after = metric(b.metrics_port, "kvsidecar_pulls_total", '{outcome="ok",path="host-nixl"}')
    assert after == before + 1
    assert metric(b.metrics_port, "kvsidecar_pull_bytes_total", '{path="host-nixl"}') > 0
    assert metric(b.metrics_port, "kvsidecar_handshakes_total", '{outcome="ok"}') >= 1
    # Exposed before any GPU copy (zero here: no GPU), without importing Triton for a scrape.
    text = urllib.request.urlopen(f"http://127.0.0.1:{b.metrics_port}/metrics", timeout=5).read().decode()
    assert 'kvsidecar_gpu_launches_total{by="direct"} 0.0' in text, text[-2000:]
    # Every metric family a sidecar exports has a place on the shipped dashboard.
    exported = {
        n for n in re.findall(r"^# TYPE (kvsidecar_\S+) ", text, re.MULTILINE) if not n.endswith("_created")
    }
    dashboard = (Path(__file__).resolve().parents[2] / "deploy/grafana/kv-sidecar-dashboard.json").read_text()
    missing = sorted(n for n in exported if n not in dashboard)
    assert len(exported) > 20 and not missing, f"not on deploy/grafana's dashboard: {missing}"
