"""Request-level block checks: do these block id lists fit this plan and token count?

A pull moves tokens [start_token, num_tokens). The prefill side names the
blocks holding tokens [first_token, num_tokens) at its block size: all of them
(first_token 0), or, for a sliding-window request, those from the block of
its window's start on (the engine freed the ones before; `check_published`).
The decode side names only the blocks it wants filled, covering [start_token,
num_tokens) at its block size (a prefix hit, or the part before a window: the
first start_token tokens are not pulled), and start_token is not below
first_token. Block sizes may differ by any ratio, or none: the executors work
token by token, so only these counts matter.

The data plane indexes source blocks by position from token 0 (the "full
form" of `check_copy`); `source_block_list` makes that form of a published
range, with placeholders where nothing is held, which no pull from
first_token on reads.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.plan.spec import MUST_MATCH, EngineSpec, PlanError

# Block ids as the checks and executors take them: a list, or an int array (how a pull carries them,
# server/pull_job.ids_array: every check then takes the vectorised path).
BlockIds = Sequence[int] | np.ndarray


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


def published_block_count(num_tokens: int, first_token: int, block_size: int) -> int:
    """Blocks of `block_size` holding tokens [first_token, num_tokens); first_token is block aligned."""
    return blocks_for(num_tokens, block_size) - first_token // block_size


def check_published(
    what: str, block_ids: BlockIds, num_tokens: int, first_token: int, block_size: int, num_blocks: int
) -> None:
    """A published range: `block_ids` hold tokens [first_token, num_tokens) at `block_size`, each once.

    first_token starts a block (the engine holds whole blocks) and lies below num_tokens (a request
    publishes at least one token)."""
    for name, value in (("num_tokens", num_tokens), ("first_token", first_token)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"{name} must be a non-negative integer, got {value!r}")
    if num_tokens <= 0:
        raise PlanError("num_tokens must be positive")
    if first_token % block_size:
        raise PlanError(
            f"first_token {first_token} is not a multiple of the {what} block_size {block_size}: "
            "a published range starts on a block boundary"
        )
    if first_token >= num_tokens:
        raise PlanError(
            f"first_token {first_token} is not below num_tokens {num_tokens}: a request publishes at "
            "least its last token"
        )
    need = published_block_count(num_tokens, first_token, block_size)
    if len(block_ids) != need:
        held = f"tokens [{first_token}, {num_tokens})" if first_token else f"{num_tokens} tokens"
        raise PlanError(f"{held} at block size {block_size} need {need} blocks, got {len(block_ids)}")
    check_block_ids(what, block_ids, num_blocks)


def source_block_list(block_ids: BlockIds, first_token: int, block_size: int) -> list[int]:
    """The full form (one id per block position from token 0) of blocks holding [first_token, ...).

    The positions before first_token get the first held id as a placeholder: a valid id, so that
    the executors' range checks pass, and never read, because every pull starts at first_token or
    later (`check_pull`, and the source's own check before it sends)."""
    skipped = first_token // block_size
    if not skipped:
        return list(block_ids)
    return [int(block_ids[0])] * skipped + [int(b) for b in block_ids]


def check_start(start_token: int, first_token: int, num_tokens: int) -> None:
    """OUT_OF_RANGE unless a read from start_token stays inside the published [first_token, num_tokens)."""
    if start_token < first_token:
        raise PlanError(
            f"start_token {start_token} is before the published range: the prefill holds tokens "
            f"[{first_token}, {num_tokens}) of this request (a sliding-window request: the blocks "
            f"before its window are freed); pull from token {first_token} or later",
            code="OUT_OF_RANGE",
        )


def check_block_ids(what: str, ids: BlockIds, num_blocks: int, unique: bool = True) -> None:
    """Every id in [0, num_blocks) and, if `unique`, none repeated (a repeat would be written twice)."""
    if _ids_ok(ids, num_blocks, unique):
        return
    seen: dict[int, int] = {}
    for pos, raw in enumerate(ids):
        block = _as_int(raw)
        if block is None or not 0 <= block < num_blocks:
            shown = repr(raw) if block is None else block  # np.int64(7) reads as 7
            raise PlanError(f"{what} block id {shown} at position {pos} is out of range [0, {num_blocks})")
        if not unique:
            continue
        if block in seen:
            raise PlanError(f"{what} block id {block} appears twice (positions {seen[block]} and {pos})")
        seen[block] = pos


# Up to this many ids a check runs on Python ints (a decode step's 1-block pulls), beyond on numpy.
_FEW_IDS = 64


def _ids_ok(ids: BlockIds, num_blocks: int, unique: bool) -> bool:
    """Vectorised fast path: a request has thousands of ids; the loop above only finds the culprit.
    Its cost must follow the request, not the cache: engines have 10^5 blocks and more."""
    if isinstance(ids, np.ndarray):
        arr = ids.reshape(-1)
    else:
        try:
            if isinstance(ids, (list, tuple)):
                # A bool is an int to numpy, and fromiter would cut 1.5 to 1: a list is checked whole.
                if bool in set(map(type, ids)):
                    return False
                arr = np.asarray(ids)
            else:  # a protobuf repeated integer field (a request's ids): ints only, read ~2x faster
                arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
        except (TypeError, ValueError, OverflowError):
            return False
    n = arr.size
    if n == 0:
        return True
    if arr.dtype.kind not in "iu":
        return False
    if n <= _FEW_IDS:  # each numpy reduction costs ~3 us whatever its size; Python's take less here
        values = arr.tolist()
        return min(values) >= 0 and max(values) < num_blocks and (not unique or len(set(values)) == n)
    if arr.min() < 0 or arr.max() >= num_blocks:
        return False
    if not unique or n == 1:
        return True
    if num_blocks <= 8 * n:  # O(n + num_blocks), the fastest where the cache is not much larger
        return int(np.bincount(arr, minlength=num_blocks).max()) <= 1
    ordered = np.sort(arr)
    return bool((ordered[1:] != ordered[:-1]).all())


def _as_int(value: object) -> int | None:
    """`value` as an int if it is an integer of any kind (numpy, protobuf), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
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


def check_copy_pair(src: EngineSpec, dst: EngineSpec) -> None:
    """The fields an executor cannot convert between."""
    for name in (*MUST_MATCH, "num_kv_heads", "is_mla"):  # the planner's list, so the two cannot drift
        if getattr(src, name) != getattr(dst, name):
            raise PlanError(f"{name} differs: source {getattr(src, name)}, destination {getattr(dst, name)}")


def local_heads(spec: EngineSpec, rank: int, heads: tuple[int, int] | None, side: str) -> tuple[int, int]:
    """(first local head, count) of global heads `heads` on `rank` of `spec`; MLA has one latent "head"."""
    if spec.is_mla:
        if heads is not None:
            raise PlanError(f"heads must be None for an mla cache, got {heads}")
        return 0, 1
    if heads is None:
        raise PlanError("heads must be a [start, stop) range for a non-mla cache, got None")
    start, stop = spec.rank_heads(rank)
    if not start <= heads[0] < heads[1] <= stop:
        raise PlanError(
            f"heads {list(heads)} are not all held by {side} rank {rank} (it holds [{start}, {stop}))"
        )
    return heads[0] - start, heads[1] - heads[0]


@dataclass(frozen=True)
class CopyShape:
    """A validated copy request: which source block position `src_block_ids[0]` holds, and the heads."""

    src_first: int
    src_head0: int
    dst_head0: int
    num_heads: int


def check_copy(
    src: EngineSpec,
    src_rank: int,
    dst: EngineSpec,
    dst_rank: int,
    heads: tuple[int, int] | None,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    num_tokens: int,
    start_token: int = 0,
) -> CopyShape:
    """The executors' one contract for a copy of tokens [start_token, num_tokens); raises PlanError.

    `dst_block_ids` covers exactly tokens [start_token, num_tokens) at dst's
    block size. `src_block_ids` is, at src's block size, either
    - the "full" form: at least the blocks of tokens [0, num_tokens) (more is
      fine, e.g. the whole request when it is moved in rounds of tokens), or
    - the "tail" form: exactly the blocks from the one holding start_token on
      (a staging mini-cache holding only the needed blocks).
    The two forms have different lengths whenever the distinction matters, so
    the length says which. Source ids may repeat (positions that hold no
    requested token are never read, so callers may pad with any valid id);
    destination ids may not (a block would be written twice).
    """
    check_copy_pair(src, dst)
    check_copy_counts(src, dst, len(src_block_ids), len(dst_block_ids), num_tokens, start_token)
    check_block_ids("source", src_block_ids, src.num_blocks, unique=False)
    check_block_ids("destination", dst_block_ids, dst.num_blocks)
    s_h0, nh = local_heads(src, src_rank, heads, "source")
    d_h0, _ = local_heads(dst, dst_rank, heads, "destination")
    src_first = (
        0 if len(src_block_ids) >= blocks_for(num_tokens, src.block_size) else start_token // src.block_size
    )
    return CopyShape(src_first, s_h0, d_h0, nh)


def check_copy_counts(
    src: EngineSpec, dst: EngineSpec, n_src: int, n_dst: int, num_tokens: int, start_token: int
) -> None:
    """check_copy's checks of the tokens and of how many ids each side has (not of the ids): integer
    arithmetic only, cheap enough to run per member where a join checks the ids once for all."""
    check_tokens(num_tokens, start_token, dst.block_size)
    bs, bd = src.block_size, dst.block_size
    full, tail = blocks_for(num_tokens, bs), len(src_block_range(bs, num_tokens, start_token))
    if n_src < full and n_src != tail:
        raise PlanError(
            f"source block list has {n_src} ids; {num_tokens} tokens from {start_token} "
            f"at block_size {bs} need {full} (from token 0) or {tail} (from the start token's block)"
        )
    want_dst = dst_block_count(bd, num_tokens, start_token)
    if n_dst != want_dst:
        raise PlanError(
            f"destination block list has {n_dst} ids; tokens [{start_token}, {num_tokens}) "
            f"at block_size {bd} need {want_dst}"
        )


def check_pull(
    plan: PairPlan,
    src_block_ids: BlockIds,
    num_tokens: int,
    dst_block_ids: BlockIds,
    start_token: int = 0,
    first_token: int = 0,
) -> None:
    """Raise PlanError unless this pull fits the plan: INVALID_ARGUMENT, or OUT_OF_RANGE for a pull
    from before the published range. `src_block_ids` hold tokens [first_token, num_tokens)."""
    bp, bd = plan.prefill.block_size, plan.decode.block_size
    check_tokens(num_tokens, start_token, bd)
    if isinstance(first_token, bool) or not isinstance(first_token, int) or first_token < 0:
        raise PlanError(f"first_token must be a non-negative integer, got {first_token!r}")
    if first_token % bp or (first_token and first_token >= num_tokens):
        raise PlanError(
            f"the published range [{first_token}, {num_tokens}) does not start on a block boundary of the "
            f"prefill block_size {bp} below num_tokens"
        )
    check_start(start_token, first_token, num_tokens)
    want_src = published_block_count(num_tokens, first_token, bp)
    want_dst = dst_block_count(bd, num_tokens, start_token)
    n_src, n_dst = len(src_block_ids), len(dst_block_ids)
    if bp == bd and start_token == 0 and n_src != n_dst:
        raise PlanError(f"local and remote block lists have different lengths ({n_dst} vs {n_src})")
    if n_src != want_src:
        held = f"tokens [{first_token}, {num_tokens})" if first_token else f"{num_tokens} tokens"
        raise PlanError(
            f"remote (prefill) block list has {n_src} ids but {held} at block_size {bp} need {want_src}"
        )
    if n_dst != want_dst:
        covered = f"tokens [{start_token}, {num_tokens})" if start_token else f"{num_tokens} tokens"
        raise PlanError(
            f"local (decode) block list has {n_dst} ids but {covered} at block_size {bd} need {want_dst}"
        )
    check_block_ids("remote (prefill)", src_block_ids, plan.prefill.num_blocks)
    check_block_ids("local (decode)", dst_block_ids, plan.decode.num_blocks)


def needed_src_blocks(
    plan: PairPlan, src_block_ids: BlockIds, num_tokens: int, start_token: int = 0
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
