"""A Publish the sidecar refuses is seen: kvsidecar_publishes_refused_total by reason on /metrics, and
the engine, reason, count and last message in `kv-sidecar status` (text and JSON)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client.shm import ShmKVCache

from .conftest import metric, spec_dict

SPEC = EngineSpec.from_dict(spec_dict())
REFUSED = "kvsidecar_publishes_refused_total"


def test_refused_publishes_are_counted_and_shown(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    sc = sidecar_pair[0]
    before = {
        r: metric(sc.metrics_port, REFUSED, f'{{reason="{r}"}}') for r in ("invalid_argument", "not_found")
    }
    cache = ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16)
    with SidecarClient(sc.socket) as client:
        client.register_rank("refuse-p", 0, SPEC.to_dict(), cache.handles())
        try:
            # A sliding-window engine's block table: vLLM's null block (0) where blocks left the window.
            with pytest.raises(KVSidecarError) as dup:
                client.publish("refuse-p", "windowed", [0, 0, 7], 40)
            with pytest.raises(KVSidecarError):
                client.publish("refuse-p", "too-far", [SPEC.num_blocks], 16)
            with pytest.raises(KVSidecarError):
                client.publish("refuse-nobody", "r", [1], 16)
            client.publish("refuse-p", "fine", [3], 16)  # an accepted one counts nowhere
            status = client.status()
        finally:
            client.unregister_rank("refuse-p", 0)
            cache.close()
    assert dup.value.code == "INVALID_ARGUMENT"
    assert metric(sc.metrics_port, REFUSED, '{reason="invalid_argument"}') == before["invalid_argument"] + 2
    assert metric(sc.metrics_port, REFUSED, '{reason="not_found"}') == before["not_found"] + 1
    mine = {(r.engine_id, r.reason): r for r in status.publish_refusals if r.engine_id.startswith("refuse-")}
    assert {k: r.count for k, r in mine.items()} == {
        ("refuse-p", "invalid_argument"): 2,
        ("refuse-nobody", "not_found"): 1,
    }
    assert "out of range" in mine[("refuse-p", "invalid_argument")].last_message
    # What an operator runs.
    text = subprocess.run(
        [sys.executable, "-m", "kv_sidecar", "status", "--engine-socket", sc.socket],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    line = next(ln for ln in text.splitlines() if "refuse-nobody" in ln)
    assert "not_found" in line and "x1" in line and "unknown engine" in line, text
    doc = json.loads(
        subprocess.run(
            [sys.executable, "-m", "kv_sidecar", "status", "--engine-socket", sc.socket, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    assert any(r["engine_id"] == "refuse-p" and r["count"] == "2" for r in doc["publish_refusals"]), doc
