"""Request-level block checks: do these block id lists fit this plan and token count?

A pull moves tokens [start_token, num_tokens). The prefill side names the
blocks holding all of tokens [0, num_tokens) at its block size; the decode
side names only the blocks it wants filled, covering [start_token,
num_tokens) at its block size (a prefix hit: the first start_token tokens are
already there). Block sizes may differ by any ratio, or none: the executors
work token by token, so only these counts matter.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import PlanError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def dst_block_count(block_size: int, num_tokens: int, start_token: int) -> int:
    """Destination blocks covering tokens [start_token, num_tokens); start_token is block aligned."""
    return blocks_for(num_tokens, block_size) - start_token // block_size


def src_block_range(block_size: int, num_tokens: int, start_token: int) -> range:
    """Positions of the source blocks holding tokens [start_token, num_tokens) (empty if none)."""
    if start_token >= num_tokens:
        return range(0)
    return range(start_token // block_size, blocks_for(num_tokens, block_size))


def check_block_ids(what: str, ids: Sequence[int], num_blocks: int, unique: bool = True) -> None:
    """Every id in [0, num_blocks) and, if `unique`, none repeated (a repeat would be written twice)."""
    seen: dict[int, int] = {}
    for pos, raw in enumerate(ids):
        block = _as_int(raw)
        if block is None or not 0 <= block < num_blocks:
            raise PlanError(f"{what} block id {raw!r} at position {pos} is out of range [0, {num_blocks})")
        if not unique:
            continue
        if block in seen:
            raise PlanError(f"{what} block id {block} appears twice (positions {seen[block]} and {pos})")
        seen[block] = pos


def _as_int(value: object) -> int | None:
    """`value` as an int if it is an integer of any kind (numpy, protobuf), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        return None


def check_tokens(num_tokens: int, start_token: int, dst_block_size: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise PlanError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if isinstance(start_token, bool) or not isinstance(start_token, int) or start_token < 0:
        raise PlanError(f"start_token must be a non-negative integer, got {start_token!r}")
    if start_token > num_tokens:
        raise PlanError(f"start_token {start_token} is past num_tokens {num_tokens}")
    if start_token % dst_block_size:
        raise PlanError(
            f"start_token {start_token} is not a multiple of the local (decode) block_size {dst_block_size}: "
            "a prefix hit must end on a block boundary"
        )


def check_pull(
    plan: PairPlan,
    src_block_ids: Sequence[int],
    num_tokens: int,
    dst_block_ids: Sequence[int],
    start_token: int = 0,
) -> None:
    """Raise PlanError (INVALID_ARGUMENT) unless this pull fits the plan."""
    bp, bd = plan.prefill.block_size, plan.decode.block_size
    check_tokens(num_tokens, start_token, bd)
    want_src = blocks_for(num_tokens, bp)
    want_dst = dst_block_count(bd, num_tokens, start_token)
    n_src, n_dst = len(src_block_ids), len(dst_block_ids)
    if bp == bd and start_token == 0 and n_src != n_dst:
        raise PlanError(f"local and remote block lists have different lengths ({n_dst} vs {n_src})")
    if n_src != want_src:
        raise PlanError(
            f"remote (prefill) block list has {n_src} ids but {num_tokens} tokens at block_size {bp} "
            f"need {want_src}"
        )
    if n_dst != want_dst:
        covered = f"tokens [{start_token}, {num_tokens})" if start_token else f"{num_tokens} tokens"
        raise PlanError(
            f"local (decode) block list has {n_dst} ids but {covered} at block_size {bd} need {want_dst}"
        )
    check_block_ids("remote (prefill)", src_block_ids, plan.prefill.num_blocks)
    check_block_ids("local (decode)", dst_block_ids, plan.decode.num_blocks)


def needed_src_blocks(
    plan: PairPlan, src_block_ids: Sequence[int], num_tokens: int, start_token: int = 0
) -> list[int]:
    """Positions in `src_block_ids` of the blocks holding tokens [start_token, num_tokens).

    `src_block_ids` may cover more than `num_tokens` (the whole request, when
    a caller moves it in rounds of tokens); ids past num_tokens are ignored.
    """
    bp = plan.prefill.block_size
    check_tokens(num_tokens, start_token, plan.decode.block_size)
    want = blocks_for(num_tokens, bp)
    if len(src_block_ids) < want:
        raise PlanError(
            f"remote (prefill) block list has {len(src_block_ids)} ids but {num_tokens} tokens "
            f"at block_size {bp} need {want}"
        )
    return list(src_block_range(bp, num_tokens, start_token))
