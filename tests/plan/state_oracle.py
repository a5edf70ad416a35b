"""The reference for Mamba/SSM state between TP sizes: a model-wide state, sharded as vLLM 0.32's Mamba-2
weight loader shards it (`mamba_v2_sharded_weight_loader`: each segment of the sharded dim split evenly,
or, for the one group of B and C when TP > 1, whole on every rank). The plan's tests
(tests/plan/test_state_tp.py) and the real sidecars' (tests/e2e/test_state_tp.py) check against it."""

from __future__ import annotations

from typing import Any

import numpy as np

from kv_sidecar.plan.spec import DTYPE_SIZES


def mamba2_state(tp: int, heads: int, head_dim: int, d_state: int) -> list[dict[str, Any]]:
    """A Mamba-2 layer's state at `tp`, described as vLLM 0.32 shards it (one group, conv kernel 4, conv
    layout SD): conv (3, heads * head_dim / tp + 2 * d_state), its x channels split and the group's B and
    C whole on every rank when tp > 1; SSM (heads / tp, head_dim, d_state), split by heads."""
    x = heads * head_dim // tp
    return [
        {
            "name": "conv",
            "shape": (3, x + 2 * d_state),
            "dtype": "float32",
            "offset": 0,
            "tp_dim": 1,
            "segments": [
                {"size": heads * head_dim},
                {"size": d_state, "replicated": tp > 1},
                {"size": d_state, "replicated": tp > 1},
            ],
        },
        {
            "name": "ssm",
            "shape": (heads // tp, head_dim, d_state),
            "dtype": "float32",
            "offset": 3 * (x + 2 * d_state) * 4,
            "tp_dim": 0,
            "segments": [{"size": heads}],
        },
    ]


def model_state(arrays: list[dict[str, Any]], seed: int) -> list[np.ndarray]:
    """Each array over the whole model (its sharded dim the sum of the segments), distinct bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for a in arrays:
        shape = list(a["shape"])
        shape[a["tp_dim"]] = sum(s["size"] for s in a["segments"])
        n = int(np.prod(shape)) * DTYPE_SIZES[a["dtype"]]
        out.append(rng.integers(0, 256, size=n, dtype=np.uint8).reshape(*shape, DTYPE_SIZES[a["dtype"]]))
    return out


def shard(arrays: list[dict[str, Any]], model: list[np.ndarray], tp: int, rank: int, page: int) -> np.ndarray:
    """One rank's state block: each array's share (vLLM's loader: rank r takes [r * n / tp, (r + 1) * n /
    tp) of each split segment, all of a replicated one), at its offset; the rest of the page zero."""
    block = np.zeros(page, dtype=np.uint8)
    for a, whole in zip(arrays, model, strict=True):
        k, start, parts = a["tp_dim"], 0, []
        for s in a["segments"]:
            seg = np.take(whole, range(start, start + s["size"]), axis=k)
            start += s["size"]
            n = s["size"] if s.get("replicated") else s["size"] // tp
            first = 0 if s.get("replicated") else rank * n
            parts.append(np.take(seg, range(first, first + n), axis=k))
        data = np.concatenate(parts, axis=k).reshape(-1)
        block[a["offset"] : a["offset"] + data.size] = data
    return block
