"""`kv-sidecar demo` end to end: two sidecars and two engine processes, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys

SMALL = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "dtype": "float16", "num_blocks": 64}


def test_demo_moves_a_packed_nhd_cache_into_another_layout_and_tp() -> None:
    prefill = SMALL | {"layout": "packed_nhd", "cross_layer": True}
    decode = SMALL | {"layout": "flash_attn_hnd", "tp_size": 2, "block_size": 32}
    argv = ["demo", "--prefill", json.dumps(prefill), "--decode", json.dumps(decode), "--tokens", "300"]
    result = subprocess.run(
        [sys.executable, "-m", "kv_sidecar", *argv, "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "prefill: TP1 packed_nhd block 16; decode: TP2 flash_attn_hnd block 32; 300 tokens" in result.stdout
    )
    rows = [line.split() for line in result.stdout.splitlines() if line.lstrip().startswith("demo-")]
    assert [(r[1], r[5], r[6]) for r in rows] == [("host-nixl-staged", "yes", "1/1")], result.stdout
    assert "demo passed" in result.stdout
