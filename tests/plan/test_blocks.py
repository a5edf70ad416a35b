"""Request-level checks: check_pull, check_copy, check_block_ids, needed_src_blocks, and published ranges."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sidecar.plan.blocks import (
    blocks_for,
    check_block_ids,
    check_copy,
    check_published,
    check_pull,
    needed_src_blocks,
    published_block_count,
    source_block_list,
)
from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec, Layout, PlanError
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2

HEAD_LAYOUTS = [layout.value for layout in Layout if layout is not Layout.MLA]


def pair(
    bp: int = 16, bd: int = 16, np_: int = 10, nd: int = 10, layouts: tuple[str, str] | None = None
) -> PairPlan:
    common: dict[str, Any] = {
        "tp_size": 1,
        "num_layers": 1,
        "num_kv_heads": 2,
        "head_dim": 4,
        "dtype": "float16",
    }
    lp, ld = layouts or ("flash_attn_nhd", "flash_attn_nhd")
    return plan_pair(
        EngineSpec(block_size=bp, num_blocks=np_, layout=lp, **common),
        EngineSpec(block_size=bd, num_blocks=nd, layout=ld, **common),
    )


def test_valid_pulls_pass() -> None:
    check_pull(pair(), [3, 1, 2], 40, [0, 9, 5])
    check_pull(pair(16, 32), [3, 1, 2], 40, [7, 8])
    check_pull(pair(32, 16), [3, 1], 40, [7, 8, 0])
    check_pull(pair(16, 16), [3, 1, 2], 40, [5], start_token=32)  # prefix hit: only the last block
    check_pull(pair(16, 8), [3, 1, 2], 40, [5, 6, 7], start_token=16)
    check_pull(pair(16, 16), [3, 1], 32, [], start_token=32)  # everything was a hit
    check_pull(pair(5, 3), [0, 1, 2], 11, [4, 5, 6, 7])  # no integer ratio: tokens are tokens
    check_pull(pair(), np.array([3, 1, 2]), 40, [np.int64(0), 9, 5])  # numpy ids are integers too


@pytest.mark.parametrize(
    ("plan", "src", "n", "dst", "start", "message"),
    [
        (
            pair(),
            [0, 1, 2],
            40,
            [0, 1, 2, 3],
            0,
            "local and remote block lists have different lengths (4 vs 3)",
        ),
        (
            pair(),
            [0, 1, 2, 3],
            40,
            [0, 1, 2],
            0,
            "local and remote block lists have different lengths (3 vs 4)",
        ),
        (
            pair(),
            [0, 1],
            40,
            [0, 1],
            0,
            "remote (prefill) block list has 2 ids but 40 tokens at block_size 16 need 3",
        ),
        (
            pair(16, 32),
            [0, 1, 2],
            40,
            [0],
            0,
            "local (decode) block list has 1 ids but 40 tokens at block_size 32 need 2",
        ),
        (
            pair(16, 32),
            [0, 1],
            40,
            [0, 1],
            0,
            "remote (prefill) block list has 2 ids but 40 tokens at block_size 16",
        ),
        (
            pair(),
            [0, 1, 2],
            40,
            [0],
            16,
            "local (decode) block list has 1 ids but tokens [16, 40) at block_size 16 need 2",
        ),
        (
            pair(),
            [0, 1, 2],
            40,
            [0],
            8,
            "start_token 8 is not a multiple of the local (decode) block_size 16",
        ),
        (pair(), [0, 1, 2], 40, [], 48, "start_token 48 is past num_tokens 40"),
        (pair(), [0, 1, 2], 40, [0], -16, "start_token must be a non-negative integer, got -16"),
        (pair(), [], 0, [], 0, "num_tokens must be a positive integer, got 0"),
        (pair(), [0], -3, [0], 0, "num_tokens must be a positive integer, got -3"),
        (
            pair(),
            [0, 10, 2],
            40,
            [0, 1, 2],
            0,
            "remote (prefill) block id 10 at position 1 is out of range [0, 10)",
        ),
        (
            pair(),
            [0, -1, 2],
            40,
            [0, 1, 2],
            0,
            "remote (prefill) block id -1 at position 1 is out of range [0, 10)",
        ),
        (
            pair(),
            [4, 1, 4],
            40,
            [0, 1, 2],
            0,
            "remote (prefill) block id 4 appears twice (positions 0 and 2)",
        ),
        (
            pair(nd=3),
            [0, 1, 2],
            40,
            [0, 1, 3],
            0,
            "local (decode) block id 3 at position 2 is out of range [0, 3)",
        ),
        (pair(), [0, 1, 2], 40, [7, 7, 2], 0, "local (decode) block id 7 appears twice (positions 0 and 1)"),
        (
            pair(),
            [0, 1.5, 2],
            40,
            [0, 1, 2],
            0,
            "remote (prefill) block id 1.5 at position 1 is out of range",
        ),
    ],
)
def test_check_pull_errors(plan: PairPlan, src: list, n: int, dst: list, start: int, message: str) -> None:
    with pytest.raises(PlanError) as info:
        check_pull(plan, src, n, dst, start)
    assert message in str(info.value)
    assert info.value.code == "INVALID_ARGUMENT"


def test_needed_src_blocks() -> None:
    assert needed_src_blocks(pair(), [5, 6, 7], 40) == [0, 1, 2]
    assert needed_src_blocks(pair(), [5, 6, 7], 40, start_token=32) == [2]
    assert needed_src_blocks(pair(16, 8), [5, 6, 7], 40, start_token=24) == [1, 2]  # token 24 sits in block 1
    assert needed_src_blocks(pair(64, 16), [5], 40, start_token=32) == [0]
    assert needed_src_blocks(pair(), [5, 6], 32, start_token=32) == []
    # A caller moving the request in rounds passes the whole list with a smaller num_tokens.
    assert needed_src_blocks(pair(16, 8), [5, 6, 7], 24, start_token=8) == [0, 1]
    with pytest.raises(PlanError, match="remote \\(prefill\\) block list has 2 ids but 40 tokens"):
        needed_src_blocks(pair(), [5, 6], 40)


@settings(max_examples=300, deadline=None)
@given(
    # Up to 64 ids the check runs on Python ints, past it on numpy: both paths run.
    ids=st.lists(st.one_of(st.integers(-3, 40), st.booleans(), st.just(2**70)), max_size=90),
    # Past 8x the ids the uniqueness check sorts instead of counting: both branches run.
    num_blocks=st.one_of(st.integers(1, 40), st.integers(241, 100_000)),
    unique=st.booleans(),
    form=st.sampled_from(["list", "array", "proto"]),
)
def test_check_block_ids_fast_path_agrees_with_the_loop(
    ids: list[Any], num_blocks: int, unique: bool, form: str
) -> None:
    """The vectorised accept path must accept exactly what the position-by-position check accepts,
    for a list, an array and a protobuf repeated field (how a request's ids arrive)."""

    def slow_ok() -> bool:
        seen: set[int] = set()
        for v in ids:
            if isinstance(v, bool) or not 0 <= v < num_blocks or (unique and v in seen):
                return False
            seen.add(v)
        return True

    low, high = {"list": (None, None), "array": (-(2**62), 2**62), "proto": (0, 2**32)}[form]
    if low is not None and any(isinstance(v, bool) or not low <= v < high for v in ids):
        return  # an int64 array, a uint32 field cannot hold these
    arg: Any = ids
    if form == "array":
        arg = np.asarray(ids, dtype=np.int64)
    elif form == "proto":
        arg = engine_pb2.PublishRequest(block_ids=ids).block_ids
    try:
        check_block_ids("x", arg, num_blocks, unique)
        ok = True
    except PlanError:
        ok = False
    assert ok == slow_ok()


def test_check_copy_forms_and_heads() -> None:
    p = pair(bp=16, bd=8)
    src, dst = p.prefill, p.decode
    # 40 tokens from 16: full form needs 3 source blocks, tail form 2 (blocks 1 and 2); dst needs 3.
    assert check_copy(src, 0, dst, 0, (0, 2), [5, 6, 7], [1, 2, 3], 40, 16).src_first == 0
    assert check_copy(src, 0, dst, 0, (0, 2), [6, 7], [1, 2, 3], 40, 16).src_first == 1
    # Longer than full (a whole request moved in rounds) is the full form; padding may repeat.
    assert check_copy(src, 0, dst, 0, (1, 2), [5, 6, 7, 7], [1, 2, 3], 40, 16).src_head0 == 1
    with pytest.raises(PlanError, match="source block list has 1 ids"):
        check_copy(src, 0, dst, 0, (0, 2), [5], [1, 2, 3], 40, 16)
    with pytest.raises(PlanError, match="destination block id 2 appears twice"):
        check_copy(src, 0, dst, 0, (0, 2), [5, 6, 7], [2, 2, 3], 40, 16)
    with pytest.raises(PlanError, match=r"heads \[1, 3\] are not all held by source rank 0"):
        check_copy(src, 0, dst, 0, (1, 3), [5, 6, 7], [1, 2, 3], 40, 16)
    with pytest.raises(PlanError, match="head_dim differs"):
        other = EngineSpec.from_dict(dst.to_dict() | {"head_dim": 8})
        check_copy(src, 0, other, 0, (0, 2), [5, 6, 7], [1, 2, 3], 40, 16)


@settings(max_examples=100, deadline=None)
@given(
    layouts=st.tuples(st.sampled_from(HEAD_LAYOUTS), st.sampled_from(HEAD_LAYOUTS)),
    bp=st.sampled_from([1, 3, 16, 32]),
    bd=st.sampled_from([1, 5, 16, 32]),
    num_tokens=st.integers(1, 60),
    hit_blocks=st.integers(0, 4),
)
def test_request_checks_do_not_depend_on_layout(
    layouts: tuple[str, str], bp: int, bd: int, num_tokens: int, hit_blocks: int
) -> None:
    """Block lists are about tokens and block sizes only: any layout pair accepts exactly the same ids."""
    plan, plain = pair(bp, bd, 64, 64, layouts), pair(bp, bd, 64, 64)
    start = min(hit_blocks * bd, num_tokens // bd * bd)
    src = list(range(-(-num_tokens // bp)))
    dst = list(range(-(-num_tokens // bd) - start // bd))
    check_pull(plan, src, num_tokens, dst, start)
    assert needed_src_blocks(plan, src, num_tokens, start) == needed_src_blocks(plain, src, num_tokens, start)
    with pytest.raises(PlanError) as one_too_many:
        check_pull(plan, src, num_tokens, [*dst, 63], start)
    with pytest.raises(PlanError) as plain_too_many:
        check_pull(plain, src, num_tokens, [*dst, 63], start)
    assert str(one_too_many.value) == str(plain_too_many.value)


# -- published ranges (a sliding-window request publishes only the blocks of its window) ------------


def test_published_ranges_that_pass() -> None:
    check_published("prefill", [3, 1, 2], 40, 0, 16, 10)  # the whole prompt
    check_published("prefill", [2], 40, 32, 16, 10)  # the window's blocks only: tokens [32, 40)
    check_published("prefill", [1, 2], 40, 16, 16, 10)
    check_published("prefill", [7], 1, 0, 16, 10)
    assert published_block_count(40, 32, 16) == 1 and published_block_count(48, 16, 16) == 2


@pytest.mark.parametrize(
    ("ids", "n", "first", "message"),
    [
        ([1, 2], 40, 8, "first_token 8 is not a multiple of the prefill block_size 16"),
        ([], 32, 32, "first_token 32 is not below num_tokens 32"),
        ([2], 40, 48, "first_token 48 is not below num_tokens 40"),
        ([1, 2, 3], 40, 16, "tokens [16, 40) at block size 16 need 2 blocks, got 3"),
        ([1, 2], 40, 0, "40 tokens at block size 16 need 3 blocks, got 2"),
        ([0, 0], 40, 16, "prefill block id 0 appears twice (positions 0 and 1)"),  # vLLM's null block
        ([4, 10], 40, 16, "prefill block id 10 at position 1 is out of range [0, 10)"),
        ([1], 0, 0, "num_tokens must be positive"),
        ([1], 40, -16, "first_token must be a non-negative integer"),
    ],
)
def test_published_range_refusals(ids: list[int], n: int, first: int, message: str) -> None:
    with pytest.raises(PlanError) as info:
        check_published("prefill", ids, n, first, 16, 10)
    assert message in str(info.value)
    assert info.value.code == "INVALID_ARGUMENT"


def test_source_block_list_puts_placeholders_before_the_range() -> None:
    assert source_block_list([5, 6], 0, 16) == [5, 6]
    assert source_block_list([5, 6], 32, 16) == [5, 5, 5, 6]  # positions 0, 1 hold nothing
    assert source_block_list(np.array([5, 6]), 16, 16) == [5, 5, 6]


def test_pull_from_a_published_range() -> None:
    # 100 tokens, window published from token 64 (prefill block 16: blocks 4..6 held, ids [7, 8, 9]).
    check_pull(pair(16, 16), [7, 8, 9], 100, [1, 2, 3], start_token=64, first_token=64)
    check_pull(pair(16, 32), [7, 8, 9], 100, [1, 2], start_token=64, first_token=64)
    check_pull(pair(16, 8), [7, 8, 9], 100, [1, 2, 3], start_token=80, first_token=64)  # later is fine
    check_pull(pair(32, 16), [7, 8, 9], 100, [1, 2, 3, 4, 5], start_token=32, first_token=32)


def test_pull_before_the_published_range_is_out_of_range() -> None:
    with pytest.raises(PlanError) as info:
        check_pull(pair(16, 32), [7, 8], 90, [1, 2, 3], start_token=0, first_token=64)
    assert info.value.code == "OUT_OF_RANGE"
    assert "start_token 0 is before the published range: the prefill holds tokens [64, 90)" in str(info.value)
    with pytest.raises(PlanError, match=r"start_token 32 is before .* tokens \[48, 90\)"):
        check_pull(pair(16, 16), [7, 8, 9], 90, [1, 2, 3, 4], start_token=32, first_token=48)


@pytest.mark.parametrize(
    ("src", "n", "first", "message"),
    [
        (
            [7, 8],
            100,
            64,
            "remote (prefill) block list has 2 ids but tokens [64, 100) at block_size 16 need 3",
        ),
        ([7, 8, 9], 100, 60, "the published range [60, 100) does not start on a block boundary"),
        ([7], 64, 64, "the published range [64, 64) does not start on a block boundary"),
    ],
)
def test_pull_with_a_bad_published_range(src: list[int], n: int, first: int, message: str) -> None:
    with pytest.raises(PlanError) as info:
        check_pull(pair(16, 16), src, n, [1, 2, 3], start_token=64, first_token=first)
    assert message in str(info.value)
    assert info.value.code == "INVALID_ARGUMENT"


@settings(max_examples=400, deadline=None)
@given(
    bp=st.sampled_from([1, 3, 16, 32]),
    bd=st.sampled_from([1, 5, 16, 32, 64]),
    num_tokens=st.integers(1, 300),
    window=st.integers(2, 200),
    data=st.data(),
)
def test_a_window_published_on_one_grid_is_pulled_on_another(
    bp: int, bd: int, num_tokens: int, window: int, data: st.DataObject
) -> None:
    """vLLM's prefill holds the blocks from the one of its window's start (the last token's window:
    tokens [num_tokens - window + 1, ...)); a decode that pulls from any point of its grid inside the
    published range passes, one point before the range is OUT_OF_RANGE, and the full-form source list
    puts every held block at its own position."""
    first = max(0, num_tokens - window + 1) // bp * bp
    first = min(first, (num_tokens - 1) // bp * bp)
    held = list(range(published_block_count(num_tokens, first, bp)))
    check_published("prefill", held, num_tokens, first, bp, 1000)
    full = source_block_list(held, first, bp)
    assert len(full) == blocks_for(num_tokens, bp) and full[first // bp :] == held
    starts = [s for s in range(0, num_tokens + 1, bd) if s >= first]
    if starts:
        start = data.draw(st.sampled_from(starts))
        dst = list(range(-(-num_tokens // bd) - start // bd))
        check_pull(pair(bp, bd, 1000, 1000), held, num_tokens, dst, start, first)
    below = [s for s in range(0, first, bd)]
    if below:
        start = data.draw(st.sampled_from(below))
        dst = list(range(-(-num_tokens // bd) - start // bd))
        with pytest.raises(PlanError) as info:
            check_pull(pair(bp, bd, 1000, 1000), held, num_tokens, dst, start, first)
        assert info.value.code == "OUT_OF_RANGE"
