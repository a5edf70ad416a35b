"""Control shards on GPUs: a front door with two shards, GPU engines placed by their rank 0's GPU.

On two GPUs, GPU 0's engines go to shard 0 and GPU 1's to shard 1: a prefill engine on GPU 0 and a
decode engine on GPU 1 pull across shards (gpu-staged between the two shard processes), and two
engines whose rank 0 share GPU 0 pull gpu-direct within shard 0. Bytes checked bit for bit, as in
test_gpu_server.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kv_sidecar.plan.spec import EngineSpec  # noqa: E402
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess  # noqa: E402
from kv_sidecar_client import SidecarClient  # noqa: E402

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs: one per shard", allow_module_level=True)

BASE: dict[str, Any] = {
    "tp_size": 1,
    "num_layers": 2,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": "bfloat16",
    "block_size": 16,
    "num_blocks": 40,
    "layout": "flash_attn_nhd",
}
TOKENS = 150


@pytest.fixture(scope="module")
def node() -> Iterator[SidecarProcess]:
    # Two GPUs over two shards: GPU 0 -> shard 0, GPU 1 -> shard 1 (contiguous groups, one GPU each
    # on a two-GPU machine; on four, GPUs 0-1 and 2-3).
    s = SidecarProcess("gpu-shards", extra=["--control-shards", "2"])
    yield s
    assert s.stop() == 0, "\n".join(s.stderr_tail)


CASES = {
    # name: (prefill devices, decode overrides, decode devices, path)
    "across-shards": (["cuda:0"], {}, [f"cuda:{torch.cuda.device_count() - 1}"], "gpu-staged"),
    "across-shards-tp1-to-tp2": (
        ["cuda:0"],
        {"tp_size": 2},
        [f"cuda:{torch.cuda.device_count() - 1}", "cuda:0"],
        "gpu-staged",
    ),
    "within-a-shard": (["cuda:0"], {}, ["cuda:0"], "gpu-direct"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_engines_pull_bit_exact_on_and_across_shards(node: SidecarProcess, name: str) -> None:
    pdev, dover, ddev, path = CASES[name]
    pspec, dspec = EngineSpec.from_dict(BASE), EngineSpec.from_dict(BASE | dover)
    prefill = EngineProcess(node.socket, f"p-{name}", pspec, devices=pdev)
    decode = EngineProcess(node.socket, f"d-{name}", dspec, devices=ddev)
    try:
        with SidecarClient(node.socket, lane=False) as client:
            shards = client.status().shards
        placed = {r.engine_id: k for k, s in enumerate(shards) for r in s.ranks}
        last = len(shards) - 1
        # The front door says which GPUs each shard serves: every GPU once, GPU 0 on shard 0.
        gpus = [list(s.shard_gpus) for s in shards]
        assert (
            sorted(g for s in gpus for g in s) == list(range(torch.cuda.device_count())) and gpus[0][0] == 0
        ), gpus
        assert placed[f"p-{name}"] == 0 and placed[f"d-{name}"] == (0 if path == "gpu-direct" else last), (
            placed
        )
        src = list(range(pspec.num_blocks - 1, -1, -3))[: -(-TOKENS // pspec.block_size)]
        dst = list(range(1, dspec.num_blocks, 2))[: -(-TOKENS // dspec.block_size)]
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "r", "block_ids": src, "num_tokens": TOKENS, "seed": 3}
        )
        assert pub["ok"], pub
        res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 3})
        assert res["ok"] and res["path"] == path and res["verified"], res
        assert prefill.send({"cmd": "next_event", "timeout_s": 30})["kind"] == "consumed"
    finally:
        prefill.stop()
        decode.stop()
