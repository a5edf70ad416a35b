"""Heterogeneous pairings through real sidecars and engine processes, bit-exact (issue 3's matrix)."""

from __future__ import annotations

import itertools
import math

import pytest

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together

from .conftest import spec_dict

MLA = {"num_kv_heads": 1, "head_dim": 32, "layout": "mla"}
CASES: dict[str, tuple[dict, dict, int]] = {
    # name: (prefill overrides, decode overrides, start_token)
    "tp1-to-tp2": ({"tp_size": 1}, {"tp_size": 2}, 0),
    "tp2-to-tp1": ({"tp_size": 2}, {"tp_size": 1}, 0),
    "tp2-to-tp4": ({"tp_size": 2}, {"tp_size": 4}, 0),
    "tp4-to-tp2": ({"tp_size": 4}, {"tp_size": 2}, 0),
    "nhd-to-hnd": ({}, {"layout": "flash_attn_hnd"}, 0),
    "flashinfer-to-flashattn": ({"layout": "flashinfer_nhd"}, {"layout": "flash_attn_nhd"}, 0),
    "flashattn-to-flashinfer-hnd": ({}, {"layout": "flashinfer_hnd", "tp_size": 2}, 0),
    "block16-to-32": ({"block_size": 16}, {"block_size": 32}, 0),
    "block32-to-16": ({"block_size": 32}, {"block_size": 16}, 0),
    "mla-tp2-to-tp1": (MLA | {"tp_size": 2}, MLA | {"tp_size": 1}, 0),
    "mla-tp1-to-tp2": (MLA | {"tp_size": 1}, MLA | {"tp_size": 2}, 0),
    "prefix-hit-hnd": ({}, {"layout": "flash_attn_hnd", "block_size": 32}, 32),
    "packed-kernel-blocks": ({"layout": "packed"}, {"kernel_block_size": 8, "tp_size": 2}, 0),
    # packed_nhd is vLLM's default GPU layout (LBNHC); cross-layer, BLNHC.
    "packed-nhd-tp1-to-hnd-tp2": ({"layout": "packed_nhd"}, {"layout": "flash_attn_hnd", "tp_size": 2}, 0),
    "packed-nhd-block16-to-packed-32": ({"layout": "packed_nhd"}, {"layout": "packed", "block_size": 32}, 0),
    "packed-nhd-cross-layer-to-packed-nhd": (
        {"layout": "packed_nhd", "cross_layer": True},
        {"layout": "packed_nhd", "tp_size": 2},
        0,
    ),
    "flashinfer-tp4-to-packed-nhd-prefix-kernel-blocks": (
        {"layout": "flashinfer_hnd", "tp_size": 4},
        {"layout": "packed_nhd", "block_size": 32, "kernel_block_size": 8},
        32,
    ),
    # Same geometry on both sides: NIXL reads straight into the decode blocks, no staging.
    "packed-nhd-identity-tp2": (
        {"layout": "packed_nhd", "tp_size": 2},
        {"layout": "packed_nhd", "tp_size": 2},
        16,
    ),
    "packed-nhd-cross-layer-identity": (
        {"layout": "packed_nhd", "cross_layer": True},
        {"layout": "packed_nhd", "cross_layer": True},
        0,
    ),
}
IDENTITY = ("packed-nhd-identity-tp2", "packed-nhd-cross-layer-identity")
_ids = itertools.count()


# The direct path runs the same host executor as the staged path's conversion step; a few cases suffice there.
DIRECT = (
    "tp2-to-tp1",
    "nhd-to-hnd",
    "block32-to-16",
    "mla-tp1-to-tp2",
    "packed-nhd-tp1-to-hnd-tp2",
    "packed-nhd-cross-layer-to-packed-nhd",
)


@pytest.mark.parametrize(("case", "where"), [(c, "nixl") for c in CASES] + [(c, "direct") for c in DIRECT])
def test_pairing_is_bit_exact(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], case: str, where: str
) -> None:
    a, b = sidecar_pair
    p_over, d_over, start = CASES[case]
    pspec = EngineSpec.from_dict(spec_dict(**p_over))
    dspec = EngineSpec.from_dict(spec_dict(**d_over))
    tokens = 75  # not a multiple of any block size: the last block is partial
    n = next(_ids)
    prefill, decode = together(
        lambda: EngineProcess(a.socket, f"p-{case}-{n}", pspec),
        lambda: EngineProcess(a.socket if where == "direct" else b.socket, f"d-{case}-{n}", dspec),
    )
    try:
        src = [pspec.num_blocks - 1 - 3 * j for j in range(math.ceil(tokens / pspec.block_size))]
        dst = [5 * j + 1 for j in range(math.ceil(tokens / dspec.block_size) - start // dspec.block_size)]
        pub = prefill.send(
            {"cmd": "prefill", "request_id": "r", "block_ids": src, "num_tokens": tokens, "seed": n}
        )
        assert pub["ok"], pub
        res = decode.send(
            {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": n, "start_token": start}
        )
        assert res["ok"], res
        assert res["verified"], res["errors"]
        nixl_path = "host-nixl" if case in IDENTITY else "host-nixl-staged"
        assert res["path"] == ("host-direct" if where == "direct" else nixl_path)
        for _ in range(pspec.tp_size):  # every prefill rank is told, read from or not (MLA)
            ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
            assert (ev["kind"], ev["request_id"]) == ("consumed", "r"), ev
    finally:
        prefill.stop()
        decode.stop()
