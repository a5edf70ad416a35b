"""Property tests: plan + CPU executor against the logical-KV oracle.

For random valid (prefill, decode) pairs, materialise every prefill rank's
cache from a logical KV, poison every decode rank's cache, run each decode
rank's reads through copy_request, and require that each decode rank holds
exactly the logical KV of the requested tokens for its heads, with every
other byte (other blocks, later token slots, gaps between layer tensors)
unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_sidecar.execute import host as host_executor
from kv_sidecar.execute.host import RankView, copy_request, rank_view
from kv_sidecar.plan.blocks import (
    blocks_for,
    check_pull,
    dst_block_count,
    needed_src_blocks,
    source_block_list,
)
from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec, Layout
from tests.plan.plan_oracle import allocate, kernel_block_axis, logical_kv, write_tokens

HEAD_LAYOUTS = [layout for layout in Layout if layout is not Layout.MLA]
STORAGES = ["separate", "packed", "gapped", "uneven"]


@st.composite
def engine(draw: st.DrawFn, common: dict, heads: int, mla: bool, layouts: list[Layout]) -> EngineSpec:
    if mla:
        tp = draw(st.integers(1, 8))
        layout = Layout.MLA
    else:
        tp = draw(st.sampled_from([t for t in range(1, 9) if heads % t == 0 or t % heads == 0]))
        layout = draw(st.sampled_from(layouts))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 16]))
    kernel = draw(st.sampled_from([None, *[k for k in range(1, block_size + 1) if block_size % k == 0]]))
    return EngineSpec(
        tp_size=tp,
        num_kv_heads=heads,
        layout=layout,
        block_size=block_size,
        kernel_block_size=kernel,
        num_blocks=draw(st.integers(1, 12)),
        cross_layer=draw(st.booleans()),
        **common,
    )


@st.composite
def pull_case(draw: st.DrawFn, pinned: Layout | None = None) -> dict:
    """A random valid pull; with `pinned`, one side (either) has that layout and neither is MLA."""
    mla = pinned is None and draw(st.integers(0, 5)) == 0
    common = {
        "num_layers": draw(st.integers(1, 3)),
        "head_dim": draw(st.integers(2, 8)),
        "dtype": draw(st.sampled_from(["float16", "float32", "bfloat16"])),
    }
    heads = 1 if mla else draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    sides = [HEAD_LAYOUTS, HEAD_LAYOUTS]
    if pinned is not None:
        sides[draw(st.integers(0, 1))] = [pinned]
    prefill = draw(engine(common, heads, mla, sides[0]))
    decode = draw(engine(common, heads, mla, sides[1]))
    capacity = min(prefill.num_blocks * prefill.block_size, decode.num_blocks * decode.block_size, 48)
    num_tokens = draw(st.integers(1, capacity))
    start_token = decode.block_size * draw(st.integers(0, num_tokens // decode.block_size))
    n_src = blocks_for(num_tokens, prefill.block_size)
    n_dst = dst_block_count(decode.block_size, num_tokens, start_token)
    src_ids = draw(block_ids(prefill.num_blocks, n_src))
    dst_ids = draw(block_ids(decode.num_blocks, n_dst))
    return {
        "prefill": prefill,
        "decode": decode,
        "num_tokens": num_tokens,
        "start_token": start_token,
        "src_ids": src_ids,
        "dst_ids": dst_ids,
        "storage": (draw(st.sampled_from(STORAGES)), draw(st.sampled_from(STORAGES))),
        "staging": draw(st.sampled_from([None, "tail", "padded"])),
        # Move the request in rounds of this many tokens (a multiple of the decode block size), or at once.
        "round": decode.block_size * draw(st.integers(1, 4)) if draw(st.booleans()) else None,
        "seed": draw(st.integers(0, 2**32 - 1)),
        # The executor's choice between strided runs and one indexed copy (None: its own), forced either way.
        "runs": draw(st.sampled_from([None, True, False])),
    }


@st.composite
def block_ids(draw: st.DrawFn, num_blocks: int, n: int) -> list[int]:
    """n distinct block ids: scattered, or consecutive (as an allocator often hands them out), so that
    runs of tokens cross from one block into the next."""
    if n and draw(st.booleans()):
        first = draw(st.integers(0, num_blocks - n))
        return list(range(first, first + n))
    return draw(st.permutations(range(num_blocks)))[:n]


def copy_strategy(runs: bool | None) -> contextlib.AbstractContextManager[object]:
    """The executor left to choose (None), or made to copy by runs (True) or by one indexed copy (False)."""
    if runs is None:
        return contextlib.nullcontext()
    return mock.patch.object(host_executor, "_runs_pay", lambda *_: runs)


def check_plan_shape(plan: PairPlan) -> None:
    """Each decode rank reads each of its heads exactly once; every prefill rank is consumed."""
    p, d = plan.prefill, plan.decode
    for rank_plan in plan.decode_ranks:
        readers = {read.prefill_rank for read in rank_plan.reads}
        assert readers.isdisjoint(rank_plan.notify_only)
        if p.is_mla:
            assert len(rank_plan.reads) == 1 and rank_plan.reads[0].heads is None
            continue
        covered = []
        for read in rank_plan.reads:
            assert read.heads is not None
            start, stop = p.rank_heads(read.prefill_rank)
            assert start <= read.heads[0] < read.heads[1] <= stop
            covered.extend(range(*read.heads))
        assert covered == list(range(*d.rank_heads(rank_plan.rank)))
    for prefill_rank in range(p.tp_size):
        assert plan.consumers_of(prefill_rank), f"prefill rank {prefill_rank} is never consumed"


def staged(
    prefill: EngineSpec,
    rank: int,
    tensors: list[torch.Tensor],
    src_ids: list[int],
    needed: list[int],
    form: str,
) -> tuple[RankView, list[int]]:
    """A mini-cache of just the needed source blocks, copied byte for byte (what the NIXL path stages).

    Its ids are either just the staged blocks ("tail") or padded with block 0
    in front so that position i is still source block i ("padded").
    """
    spec = dataclasses.replace(prefill, num_blocks=max(1, len(needed)))
    r = prefill.kernel_blocks_per_block
    kblocks = [src_ids[pos] * r + k for pos in needed for k in range(r)]
    axis = kernel_block_axis(prefill)
    out = [t.index_select(axis, torch.tensor(kblocks, dtype=torch.int64)).contiguous() for t in tensors]
    if not needed:  # a full prefix hit moves nothing; keep one dummy block so the shape is valid
        out = [torch.zeros(s, dtype=tensors[0].dtype) for s in spec.rank_tensor_shapes()]
    ids = list(range(len(needed)))
    if form == "padded" and needed:
        ids = [0] * needed[0] + ids
    return rank_view(spec, rank, out), ids


def rounds(start: int, num_tokens: int, size: int | None) -> list[tuple[int, int]]:
    if size is None or start == num_tokens:
        return [(start, num_tokens)]
    return [(t0, min(num_tokens, t0 + size)) for t0 in range(start, num_tokens, size)]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pull_case())
def test_pull_matches_logical_kv(case: dict) -> None:
    check_pull_case(case)


# Every layout is in the general test; this keeps the newest (vLLM's default GPU layout, LBNHC)
# on one side of every example, against every other layout, TP pairing and block geometry.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pull_case(pinned=Layout.PACKED_NHD))
def test_packed_nhd_pull_matches_logical_kv(case: dict) -> None:
    check_pull_case(case)


# vLLM's CPU backend (what its kernels store under LBHNC: K rows, then V rows, per head) against every
# other layout: the only layout a CPU vLLM engine registers.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pull_case(pinned=Layout.VLLM_CPU))
def test_vllm_cpu_pull_matches_logical_kv(case: dict) -> None:
    check_pull_case(case)


def check_pull_case(case: dict) -> None:
    prefill, decode = case["prefill"], case["decode"]
    n, start = case["num_tokens"], case["start_token"]
    src_ids, dst_ids = case["src_ids"], case["dst_ids"]
    rng = np.random.default_rng(case["seed"])
    plan = plan_pair(prefill, decode)
    check_plan_shape(plan)
    check_pull(plan, src_ids, n, dst_ids, start)

    logical = logical_kv(prefill, n, rng)
    sources = []
    for rank in range(prefill.tp_size):
        cache = allocate(prefill, case["storage"][0], rng)
        write_tokens(prefill, rank, cache.arrays(), logical, src_ids, 0, range(n))
        sources.append(cache)

    bd = decode.block_size
    for rank_plan in plan.decode_ranks:
        dst_cache = allocate(decode, case["storage"][1], rng)
        expected = dst_cache.snapshot()
        write_tokens(decode, rank_plan.rank, expected, logical, dst_ids, start // bd, range(start, n))
        dst = rank_view(decode, rank_plan.rank, dst_cache.as_spec_dtype(decode))
        moved = 0
        for read in rank_plan.reads:
            src_tensors = sources[read.prefill_rank].as_spec_dtype(prefill)
            for t0, t1 in rounds(start, n, case["round"]):
                round_dst = dst_ids[(t0 - start) // bd : -(-(t1 - start) // bd)]
                if case["staging"]:
                    needed = needed_src_blocks(plan, src_ids, t1, t0)
                    form = case["staging"]
                    src, ids = staged(prefill, read.prefill_rank, src_tensors, src_ids, needed, form)
                else:  # the whole request's ids, even when this round needs fewer
                    src, ids = rank_view(prefill, read.prefill_rank, src_tensors), src_ids
                with copy_strategy(case["runs"]):
                    moved += copy_request(src, dst, read.heads, ids, round_dst, t1, t0)
        for got, want in zip(dst_cache.arrays(), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        per_token = decode.num_layers * (1 if decode.is_mla else 2) * decode.heads_per_rank * decode.head_dim
        assert moved == (n - start) * per_token * decode.element_size


@st.composite
def windowed_case(draw: st.DrawFn) -> dict:
    """A random pull from a published range [first_token, num_tokens) (a sliding-window request): the
    prefill holds only the blocks from first_token's on, and the decode pulls from a start at or past it."""
    case = draw(pull_case())
    prefill, decode, n = case["prefill"], case["decode"], case["num_tokens"]
    bp, bd = prefill.block_size, decode.block_size
    first = bp * draw(st.integers(0, (n - 1) // bp))
    # The decode pulls from a point of its own grid at or past the range's start (its window's start).
    starts = [s for s in range(0, n + 1, bd) if s >= first]
    if not starts:
        first, starts = 0, [0]
    start = draw(st.sampled_from(starts))
    return case | {
        "first_token": first,
        "start_token": start,
        "held": case["src_ids"][first // bp :],
        "dst_ids": draw(block_ids(decode.num_blocks, dst_block_count(bd, n, start))),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windowed_case())
def test_windowed_pull_reads_only_the_published_range(case: dict) -> None:
    """The source cache holds the request's KV only in its published blocks; every other block is
    random. The pull's full-form source list (placeholders before first_token) must give the decode
    exactly tokens [start_token, num_tokens): a read of a placeholder position would copy wrong bytes."""
    prefill, decode = case["prefill"], case["decode"]
    n, start, first = case["num_tokens"], case["start_token"], case["first_token"]
    held, dst_ids = case["held"], case["dst_ids"]
    rng = np.random.default_rng(case["seed"])
    plan = plan_pair(prefill, decode)
    check_pull(plan, held, n, dst_ids, start, first)
    src_ids = source_block_list(held, first, prefill.block_size)
    assert len(src_ids) == blocks_for(n, prefill.block_size)

    logical = logical_kv(prefill, n, rng)
    sources = []
    for rank in range(prefill.tp_size):
        cache = allocate(prefill, case["storage"][0], rng)
        write_tokens(
            prefill, rank, cache.arrays(), logical, held, first // prefill.block_size, range(first, n)
        )
        sources.append(cache)

    bd = decode.block_size
    for rank_plan in plan.decode_ranks:
        dst_cache = allocate(decode, case["storage"][1], rng)
        expected = dst_cache.snapshot()
        write_tokens(decode, rank_plan.rank, expected, logical, dst_ids, start // bd, range(start, n))
        dst = rank_view(decode, rank_plan.rank, dst_cache.as_spec_dtype(decode))
        for read in rank_plan.reads:
            src = rank_view(prefill, read.prefill_rank, sources[read.prefill_rank].as_spec_dtype(prefill))
            with copy_strategy(case["runs"]):
                copy_request(src, dst, read.heads, src_ids, dst_ids, n, start)
        for got, want in zip(dst_cache.arrays(), expected, strict=True):
            np.testing.assert_array_equal(got, want)
