"""Several requests' copies between the same two ranks joined into one (dataplane/jobs.join_tokens), the
way a PullBatch's gpu-direct members go as one launch: run through the CPU executor, the join puts
every member's tokens where its own copy would, and writes nothing outside the members' blocks but
the padding of each member's own last block.

Against the logical-KV oracle of test_copy_properties: random layouts, TP pairings, kernel blocks and
storage, prefill blocks into decode blocks of the same size or a multiple.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_sidecar.dataplane.jobs import Tokens, join_tokens, joinable
from kv_sidecar.execute.host import copy_request, rank_view
from kv_sidecar.plan.blocks import blocks_for, dst_block_count
from kv_sidecar.plan.pair import plan_pair
from tests.plan.plan_oracle import allocate, logical_kv, write_tokens
from tests.plan.test_copy_properties import HEAD_LAYOUTS, STORAGES, engine


@st.composite
def joined_case(draw: st.DrawFn) -> dict:
    mla = draw(st.integers(0, 5)) == 0
    common = {
        "num_layers": draw(st.integers(1, 2)),
        "head_dim": draw(st.integers(2, 6)),
        "dtype": draw(st.sampled_from(["float16", "float32", "bfloat16"])),
    }
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    prefill = draw(engine(common, heads, mla, HEAD_LAYOUTS))
    decode = draw(engine(common, heads, mla, HEAD_LAYOUTS))
    bd = prefill.block_size * draw(st.integers(1, 3))  # joinable: a decode block holds whole prefill blocks
    kernel = (
        decode.kernel_block_size if decode.kernel_block_size and bd % decode.kernel_block_size == 0 else None
    )
    decode = dataclasses.replace(decode, block_size=bd, kernel_block_size=kernel)
    members = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 3 * bd))
        members.append((n, bd * draw(st.integers(0, (n - 1) // bd))))
    n_src = sum(blocks_for(n, prefill.block_size) for n, _ in members)
    n_dst = sum(dst_block_count(bd, n, s) for n, s in members)
    # Room for every member's own blocks, and spares the join must leave alone.
    prefill = dataclasses.replace(prefill, num_blocks=n_src + 2)
    decode = dataclasses.replace(decode, num_blocks=n_dst + 3)
    return {
        "prefill": prefill,
        "decode": decode,
        "members": members,
        "src_order": draw(st.permutations(range(prefill.num_blocks))),
        "dst_order": draw(st.permutations(range(decode.num_blocks))),
        "storage": (draw(st.sampled_from(STORAGES)), draw(st.sampled_from(STORAGES))),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(joined_case())
def test_a_join_lands_every_member_as_its_own_copy_would(case: dict) -> None:
    prefill, decode = case["prefill"], case["decode"]
    bp, bd = prefill.block_size, decode.block_size
    rng = np.random.default_rng(case["seed"])
    plan = plan_pair(prefill, decode)
    tokens, logicals = [], []
    src_at = dst_at = 0
    for n, start in case["members"]:
        src = case["src_order"][src_at : src_at + blocks_for(n, bp)]
        dst = case["dst_order"][dst_at : dst_at + dst_block_count(bd, n, start)]
        src_at, dst_at = src_at + len(src), dst_at + len(dst)
        tokens.append(Tokens(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), n, start))
        logicals.append(logical_kv(prefill, n, rng))
        assert joinable(tokens[-1], bp, bd)
    whole, spans = join_tokens(tokens, bp, bd)
    assert [moved for _, moved in spans][:-1] == [
        -(-(t.num_tokens - t.start_token) // bd) * bd for t in tokens
    ][:-1]
    sources = []
    for rank in range(prefill.tp_size):
        cache = allocate(prefill, case["storage"][0], rng)
        for t, logical in zip(tokens, logicals, strict=True):
            write_tokens(
                prefill, rank, cache.arrays(), logical, t.src_blocks.tolist(), 0, range(t.num_tokens)
            )
        sources.append(cache)
    for rank_plan in plan.decode_ranks:
        dst_cache = allocate(decode, case["storage"][1], rng)
        expected = dst_cache.snapshot()
        for t, logical in zip(tokens, logicals, strict=True):
            ids = t.dst_blocks.tolist()
            write_tokens(
                decode,
                rank_plan.rank,
                expected,
                logical,
                ids,
                t.start_token // bd,
                range(t.start_token, t.num_tokens),
            )
        dst = rank_view(decode, rank_plan.rank, dst_cache.as_spec_dtype(decode))
        for read in rank_plan.reads:
            src = rank_view(prefill, read.prefill_rank, sources[read.prefill_rank].as_spec_dtype(prefill))
            copy_request(
                src, dst, read.heads, whole.src_blocks, whole.dst_blocks, whole.num_tokens, whole.start_token
            )
        # Padding (the rest of a member's last block, but the last member's) holds whatever the join
        # put there: the same zeros on both sides, and every other byte must match.
        got = dst_cache.arrays()
        for t, (_, moved) in zip(tokens, spans, strict=True):
            end = t.start_token + moved
            if end > t.num_tokens:
                pad = np.zeros((*logicals[0].shape[:2], end, *logicals[0].shape[3:]), dtype=logicals[0].dtype)
                for arrays in (got, expected):
                    ids = t.dst_blocks.tolist()
                    write_tokens(
                        decode,
                        rank_plan.rank,
                        arrays,
                        pad,
                        ids,
                        t.start_token // bd,
                        range(t.num_tokens, end),
                    )
        for g, w in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, w)


def test_what_may_be_joined() -> None:
    assert joinable(Tokens(np.arange(3), np.arange(2), 40, 0), 16, 32)
    assert joinable(Tokens(np.arange(3), np.arange(1), 40, 32), 16, 32)
    assert not joinable(Tokens(np.arange(3), np.arange(2), 40, 16), 16, 32)  # not on a decode block boundary
    assert not joinable(Tokens(np.arange(3), np.arange(3), 40, 0), 32, 16)  # a decode block holds half of one
    assert not joinable(Tokens(np.arange(3), np.arange(0), 32, 32), 16, 32)  # moves nothing


def test_a_join_takes_each_members_blocks_in_turn() -> None:
    """Prefill blocks of 16 into decode blocks of 32: a 40-token request padded to 64 (its last prefill
    block again for the padding), then one past a 32-token prefix, the last of the join, unpadded."""
    a = Tokens(np.array([10, 11, 12]), np.array([20, 21]), 40, 0)
    b = Tokens(np.array([30, 31, 32, 33, 34]), np.array([40, 41]), 70, 32)
    whole, spans = join_tokens([a, b], 16, 32)
    assert spans == [(0, 64), (64, 38)]
    assert whole.src_blocks.tolist() == [10, 11, 12, 12, 32, 33, 34]
    assert whole.dst_blocks.tolist() == [20, 21, 40, 41]
    assert (whole.num_tokens, whole.start_token) == (102, 0)
    with pytest.raises(ValueError):
        join_tokens([Tokens(np.arange(3), np.arange(1), 40, 40)], 16, 32)
