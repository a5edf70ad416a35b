"""CPU executor: view validation, fused-layer views, argument errors, dtypes."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kv_sidecar.execute import host as host_executor
from kv_sidecar.execute.host import copy_request, rank_view
from kv_sidecar.plan.spec import EngineSpec, PlanError


def spec(**over: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "tp_size": 2,
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 2,
        "dtype": "float16",
        "block_size": 4,
        "num_blocks": 5,
        "layout": "flash_attn_nhd",
    }
    if over.get("layout") == "mla":
        base["num_kv_heads"] = 1
    return EngineSpec(**{**base, **over})


def tensors(s: EngineSpec, fill: float = 0.0) -> list[torch.Tensor]:
    return [torch.full(shape, fill, dtype=getattr(torch, s.dtype)) for shape in s.rank_tensor_shapes()]


def test_rank_view_rejects_wrong_tensors() -> None:
    s = spec()
    good = tensors(s)
    with pytest.raises(PlanError, match="rank 0: expected 3 KV tensors, got 2"):
        rank_view(s, 0, good[:2])
    wrong_shape = "rank 1 tensor 1: shape (2, 5, 4, 2, 3) does not match spec (2, 5, 4, 2, 2)"
    with pytest.raises(PlanError, match=re.escape(wrong_shape)):
        rank_view(s, 1, [good[0], torch.zeros(2, 5, 4, 2, 3, dtype=torch.float16), good[2]])
    with pytest.raises(PlanError, match=r"tensor 0: dtype torch\.bfloat16 does not match spec float16"):
        rank_view(s, 0, [good[0].to(torch.bfloat16), *good[1:]])
    with pytest.raises(PlanError, match="rank 0 tensor 2: must be contiguous"):
        rank_view(s, 0, [*good[:2], torch.zeros(2, 5, 2, 4, 2, dtype=torch.float16).transpose(2, 3)])
    with pytest.raises(PlanError, match="rank 2 out of range for tp_size 2"):
        rank_view(s, 2, good)


def test_equally_spaced_layers_become_one_view() -> None:
    s = spec()
    shape = s.layer_tensor_shape()
    size = torch.Size(shape).numel()
    big = torch.zeros(3 * size + 30, dtype=torch.float16)
    spaced = [big[i * (size + 10) : i * (size + 10) + size].view(shape) for i in range(3)]
    assert rank_view(s, 0, spaced).is_single_view
    uneven = [big[o : o + size].view(shape) for o in (0, size + 3, 2 * size + 20)]
    assert not rank_view(s, 0, uneven).is_single_view
    assert not rank_view(s, 0, tensors(s)).is_single_view
    assert rank_view(spec(cross_layer=True), 0, tensors(spec(cross_layer=True))).is_single_view


def test_copy_argument_errors() -> None:
    s = spec()
    src, dst = rank_view(s, 0, tensors(s)), rank_view(s, 1, tensors(s))
    not_held = "heads [0, 2] are not all held by destination rank 1 (it holds [2, 4))"
    with pytest.raises(PlanError, match=re.escape(not_held)):
        copy_request(src, dst, (0, 2), [0], [0], 4)
    with pytest.raises(PlanError, match="heads must be a \\[start, stop\\) range for a non-mla cache"):
        copy_request(src, src, None, [0], [1], 4)
    with pytest.raises(PlanError, match="source block list has 1 ids; 8 tokens from 0 at block_size 4"):
        copy_request(src, src, (0, 2), [0], [1, 2], 8)
    with pytest.raises(PlanError, match=re.escape("destination block list has 1 ids; tokens [0, 8) at")):
        copy_request(src, src, (0, 2), [0, 1], [2], 8)
    with pytest.raises(PlanError, match="destination block id 5 at position 1 is out of range \\[0, 5\\)"):
        copy_request(src, src, (0, 2), [0, 1], [2, 5], 8)
    other = spec(head_dim=4)
    with pytest.raises(PlanError, match="head_dim differs: source 2, destination 4"):
        copy_request(src, rank_view(other, 0, tensors(other)), (0, 2), [0], [0], 4)
    mla = spec(layout="mla")
    m = rank_view(mla, 0, tensors(mla))
    with pytest.raises(PlanError, match="heads must be None for an mla cache"):
        copy_request(m, m, (0, 1), [0], [1], 4)


def test_copy_is_bitwise_for_nan_payloads_and_float8() -> None:
    for dtype, pattern in (("float16", 0x7E01), ("float8_e4m3fn", 0x7F), ("bfloat16", 0xFFC1)):
        s = spec(dtype=dtype, tp_size=1)
        width = {2: torch.int16, 1: torch.uint8}[s.element_size]
        src_t = [
            torch.full(sh, pattern, dtype=torch.int32).to(width).view(getattr(torch, dtype))
            for sh in s.rank_tensor_shapes()
        ]
        dst_t = tensors(s)
        moved = copy_request(rank_view(s, 0, src_t), rank_view(s, 0, dst_t), (0, 4), [0, 1], [3, 4], 6)
        assert moved == 3 * 2 * 6 * 4 * 2 * s.element_size
        got = dst_t[1].view(width)
        assert (got[:, 3] == torch.tensor(pattern).to(width)).all()
        assert (got[:, 4, :2] == torch.tensor(pattern).to(width)).all()
        assert (got[:, 4, 2:] == 0).all()  # slots past num_tokens in the last block stay untouched
        assert (got[:, :3] == 0).all()


def test_destination_can_be_a_mini_cache_too() -> None:
    s = spec(tp_size=1)
    small = dataclasses.replace(s, num_blocks=2, layout="packed", block_size=2)
    src_t, dst_t = tensors(s, 1.0), tensors(small, 0.0)
    moved = copy_request(rank_view(s, 0, src_t), rank_view(small, 0, dst_t), (0, 4), [4, 0], [1, 0], 8, 4)
    assert moved == 4 * 3 * 2 * 4 * 2 * 2
    assert all(bool((t == 1.0).all()) for t in dst_t)


def test_packed_nhd_holds_k_then_v_per_token_and_head() -> None:
    """vLLM's LBNHC, [N, B, H, 2D] with K in the first D: checked element by element, both ways."""
    packed, nhd = spec(tp_size=1, layout="packed_nhd"), spec(tp_size=1)  # nhd: [2, N, B, H, D]
    src_t = [
        (torch.arange(torch.Size(sh).numel(), dtype=torch.int16) + 400 * i).view(sh).view(torch.float16)
        for i, sh in enumerate(packed.rank_tensor_shapes())
    ]
    mid_t, back_t = tensors(nhd), tensors(packed)
    src_ids, mid_ids = [3, 1], [0, 4]
    moved = copy_request(rank_view(packed, 0, src_t), rank_view(nhd, 0, mid_t), (0, 4), src_ids, mid_ids, 6)
    assert moved == 6 * 3 * 2 * 4 * 2 * 2  # tokens x layers x K/V x heads x dim x bytes
    for layer, t, head, kv in itertools.product(range(3), range(6), range(4), range(2)):
        got = mid_t[layer].view(torch.int16)[kv, mid_ids[t // 4], t % 4, head]
        want = src_t[layer].view(torch.int16)[src_ids[t // 4], t % 4, head, 2 * kv : 2 * kv + 2]
        assert torch.equal(got, want), (layer, t, head, kv)
    for layer in range(3):  # everything else untouched: other blocks, slots 2-3 of block 4
        untouched = mid_t[layer].view(torch.int16).clone()
        untouched[:, 0] = 0
        untouched[:, 4, :2] = 0
        assert not untouched.any()
    copy_request(rank_view(nhd, 0, mid_t), rank_view(packed, 0, back_t), (0, 4), mid_ids, [2, 0], 6)
    for layer in range(3):
        got, want = back_t[layer].view(torch.int16), src_t[layer].view(torch.int16)
        assert torch.equal(got[2], want[3]) and torch.equal(got[0, :2], want[1, :2])
        assert not got[0, 2:].any() and not got[[1, 3, 4]].any()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a block of code runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_of(*args: Any) -> Counter[str]:
    """The aten ops of one copy_request(*args)."""
    with OpCounter() as counter:
        copy_request(*args)
    return counter.ops


def fused_rank(s: EngineSpec, fill: float = 0.0) -> Any:
    """A rank whose per-layer tensors lie back to back in one allocation: one fused view of all layers."""
    shape, layers = s.rank_tensor_shapes()[0], len(s.rank_tensor_shapes())
    size = torch.Size(shape).numel()
    big = torch.full((layers * size,), fill, dtype=getattr(torch, s.dtype))
    return rank_view(s, 0, [big[i * size : (i + 1) * size].view(shape) for i in range(layers)])


def test_blocks_that_follow_each_other_on_both_sides_move_as_one_strided_copy() -> None:
    """Per layer, a block's tokens follow the block before it in memory (a layer-major layout), so the
    blocks of a request allocated in a row are one run. (A cross-layer cache keeps every layer of a block
    together: there a run ends with each block.)"""
    s = spec(tp_size=1, num_blocks=40)
    src, dst = fused_rank(s, 1.0), fused_rank(s)
    for blocks in (1, 30):
        ops = ops_of(src, dst, (0, 4), list(range(blocks)), list(range(5, 5 + blocks)), blocks * 4)
        assert ops["copy_"] == 1 and ops["index_put_"] == 0  # no per-block work, no element-wise indexing
    got, want = dst.layers[0], src.layers[0]  # as same-width ints
    assert torch.equal(got[:, :, 5:35], want[:, :, :30])
    assert not got[:, :, :5].any() and not got[:, :, 35:].any()


def test_scattered_model_sized_blocks_move_a_strided_copy_each() -> None:
    """Blocks of a model's size (here 192 KiB) move faster as a copy each than element by element."""
    s = spec(tp_size=1, num_blocks=40, num_kv_heads=8, head_dim=128, block_size=16)
    src = fused_rank(s)
    for layer in src.layers[0]:
        layer.copy_(torch.randint(-(2**15), 2**15, layer.shape, dtype=torch.int16))
    dst, want = fused_rank(s), fused_rank(s)
    src_ids, dst_ids = list(range(0, 30, 3)), list(range(29, 9, -2))
    ops = ops_of(src, dst, (0, 8), src_ids, dst_ids, 10 * 16)
    assert ops["copy_"] == 10 and ops["index_put_"] == 0
    with mock.patch.object(host_executor, "_runs_pay", lambda *_: False):  # the indexed copy, as reference
        assert ops_of(src, want, (0, 8), src_ids, dst_ids, 10 * 16)["index_put_"] == 1
    assert torch.equal(dst.layers[0], want.layers[0])


@pytest.mark.parametrize("cross_layer", [False, True])
def test_many_short_runs_move_as_one_gather_and_one_index_put(cross_layer: bool) -> None:
    """Tiny blocks scattered: one call per run would cost more than the indexed copy, whose work does
    not grow with the block count."""
    s = spec(tp_size=1, num_blocks=40, cross_layer=cross_layer)
    src, dst = fused_rank(s), fused_rank(s)
    counts = []
    for blocks in (10, 30):
        ids = list(range(blocks))
        counts.append(ops_of(src, dst, (0, 4), ids, ids[::-1], blocks * 4))
    assert counts[0] == counts[1]
    assert counts[0]["index_put_"] == 1 and counts[0]["copy_"] == 0


def test_a_rank_copied_into_itself_reads_every_block_before_it_writes() -> None:
    """Blocks shifted by one within one rank: copied run by run, a block would be read after it was
    written; the one gather reads all first."""
    s = spec(tp_size=1, num_blocks=40, num_kv_heads=8, head_dim=128, block_size=16)
    rank = fused_rank(s)
    view = rank.layers[0]
    for b in range(5):
        view[:, :, b] = b + 1
    copy_request(rank, rank, (0, 8), [0, 1, 2, 3], [1, 2, 3, 4], 4 * 16)
    assert [int(view[0, 0, b, 0, 0, 0]) for b in range(5)] == [1, 1, 2, 3, 4]


def test_runs_break_where_either_side_stops_following_on() -> None:
    """Tokens 0-5: the source's kernel blocks 4, 5 (one axis, 2 slots each: rows 8-11) then 9; the
    destination's 0 and 1 apart (3 slots each, not one axis: no run crosses its block)."""
    s_rows = host_executor._rows((np.array([4, 4, 5, 5, 9, 9]), np.array([0, 1, 0, 1, 0, 1])), 2, True)
    d_rows = host_executor._rows((np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 2, 0, 1, 2])), 3, False)
    assert s_rows.tolist() == [8, 9, 10, 11, 18, 19]
    assert d_rows.tolist() == [0, 1, 2, 4, 5, 6]
    # Breaks: before token 3 (the destination changes block), before token 4 (the source jumps).
    assert host_executor._runs(s_rows, d_rows) == [(0, 3), (3, 1), (4, 2)]
