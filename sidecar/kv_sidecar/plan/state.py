"""Mamba/SSM state between engines of different TP sizes: which bytes of which source rank's state
block go where in each destination rank's.

A Mamba group's block holds one request's state arrays at fixed byte offsets (`StateArray`). TP shards
each array along one dim (`tp_dim`), segment by segment (`StateSegment`: vLLM splits Mamba-2's conv
channels as x, B and C separately, and keeps one group of B and C whole on every rank when there are
fewer groups than ranks); every other dim is the model's. So a destination rank's array is, row by
row of the dims before `tp_dim`, its model range of each segment, which lies in one or more source
ranks (or in every one, replicated: then one is chosen). `state_moves` lists those byte runs, relative
to the start of a block, for every destination rank; the executors copy them block by block.

Pure: plain values, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from kv_sidecar.plan.spec import DTYPE_SIZES, EngineSpec, KVGroupSpec, PlanError, StateArray

PRECONDITION = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class StateMove:
    """`nbytes` bytes at byte `src` of source rank `src_rank`'s state block to byte `dst` of the
    destination rank's (both from the start of the block)."""

    src_rank: int
    src: int
    dst: int
    nbytes: int

    def to_json(self) -> list[int]:
        return [self.src_rank, self.src, self.dst, self.nbytes]


def check_state_pair(group: int, src: EngineSpec, dst: EngineSpec, sg: KVGroupSpec, dg: KVGroupSpec) -> None:
    """FAILED_PRECONDITION naming the group's first layer and why, unless `state_moves` can build each
    destination rank's state exactly from the source's: the same arrays, or arrays that both engines
    describe the sharding of and that agree in everything but their ranks' share of `tp_dim`."""
    if sg.state == dg.state and src.tp_size == dst.tp_size:
        return  # the same arrays on the same ranks: copied as they are
    where = f"KV cache group {group} (layer {sg.layers[0]}) holds Mamba state"

    def refuse(why: str) -> PlanError:
        return PlanError(
            f"{where}, which cannot be converted exactly between these engines: {why}", PRECONDITION
        )

    for side, spec, g in (("prefill", src, sg), ("decode", dst, dg)):
        undescribed = [a.name for a in g.state if not a.segments]
        if undescribed:
            raise refuse(
                f"the {side} engine (tp_size {spec.tp_size}) does not describe how TP shards its "
                f"{undescribed[0]} state, so it moves only between engines of the same TP size and state arrays "
                f"(prefill {sg.kind}, decode {dg.kind})"
            )
    if len(sg.state) != len(dg.state):
        raise refuse(f"prefill {len(sg.state)} state arrays, decode {len(dg.state)}")
    for a, b in zip(sg.state, dg.state, strict=True):
        if a.name != b.name or a.dtype != b.dtype:
            raise refuse(f"prefill {a.describe()}, decode {b.describe()}")
        if a.tp_dim != b.tp_dim or [s.size for s in a.segments] != [s.size for s in b.segments]:
            raise refuse(f"{a.name} is sharded as prefill {a.sharding()}, decode {b.sharding()}")
        other = [i for i in range(len(a.shape)) if i != a.tp_dim]
        if len(a.shape) != len(b.shape) or [a.shape[i] for i in other] != [b.shape[i] for i in other]:
            raise refuse(
                f"{a.name} has shape {a.shape} at prefill tp_size {src.tp_size} and {b.shape} at decode "
                f"tp_size {dst.tp_size}: they differ beyond dim {a.tp_dim}, the one TP shards"
            )


def state_moves(
    src: EngineSpec, dst: EngineSpec, sg: KVGroupSpec, dg: KVGroupSpec
) -> tuple[tuple[StateMove, ...], ...]:
    """For each destination rank, the byte runs that fill its state arrays (every byte once), sorted by
    destination byte, adjacent runs merged. The pair must pass `check_state_pair`."""
    if sg.state == dg.state and src.tp_size == dst.tp_size and not all(a.segments for a in sg.state):
        # Undescribed but identical: each rank's arrays from the same rank, byte for byte.
        return tuple(
            _merged([StateMove(r, a.offset, a.offset, a.nbytes) for a in sg.state])
            for r in range(dst.tp_size)
        )
    return tuple(
        _merged(
            [
                m
                for a, b in zip(sg.state, dg.state, strict=True)
                for m in _array_moves(a, src.tp_size, b, dst.tp_size, r)
            ]
        )
        for r in range(dst.tp_size)
    )


def state_sources(moves: tuple[StateMove, ...]) -> frozenset[int]:
    """The source ranks a destination rank's moves read."""
    return frozenset(m.src_rank for m in moves)


def _array_moves(a: StateArray, ts: int, b: StateArray, td: int, rank: int) -> list[StateMove]:
    """Destination rank `rank`'s array `b` from source arrays `a` (on every source rank)."""
    k = a.tp_dim
    inner = prod(a.shape[k + 1 :]) * DTYPE_SIZES[a.dtype]  # bytes of one index of the sharded dim
    rows = prod(a.shape[:k])
    # The source rank a replicated run is read from: the one that holds the proportional share of the
    # split runs, so that a destination rank reads as few source ranks as it can.
    home = rank * ts // td
    out: list[StateMove] = []
    s_base = d_base = 0  # where the segment starts in the sharded dim, on a source / this rank
    for ss, ds in zip(a.segments, b.segments, strict=True):
        g0, g1 = ds.held(td, rank)
        for q in [home] if ss.replicated else range(ts):
            h0, h1 = ss.held(ts, q)
            lo, hi = max(g0, h0), min(g1, h1)
            if lo >= hi:
                continue
            s_idx, d_idx = s_base + lo - h0, d_base + lo - g0
            for row in range(rows):
                out.append(
                    StateMove(
                        q,
                        a.offset + (row * a.shape[k] + s_idx) * inner,
                        b.offset + (row * b.shape[k] + d_idx) * inner,
                        (hi - lo) * inner,
                    )
                )
        s_base += ss.local(ts)
        d_base += ds.local(td)
    return out


def _merged(moves: list[StateMove]) -> tuple[StateMove, ...]:
    out: list[StateMove] = []
    for m in sorted(moves, key=lambda m: m.dst):
        last = out[-1] if out else None
        if (
            last
            and last.src_rank == m.src_rank
            and last.dst + last.nbytes == m.dst
            and last.src + last.nbytes == m.src
        ):
            out[-1] = StateMove(m.src_rank, last.src, last.dst, last.nbytes + m.nbytes)
        else:
            out.append(m)
    return tuple(out)


def check_state_pull(
    plan_prefill: EngineSpec,
    plan_decode: EngineSpec,
    group: int,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    start_token: int,
) -> None:
    """A pull of a Mamba group's record whose state is converted: one published state block into one
    block here, all of it (a state has no token prefix). INVALID_ARGUMENT otherwise."""
    what = f"a pull of KV cache group {group}'s Mamba state"
    if start_token:
        raise PlanError(f"{what} moves the whole state: start_token must be 0, got {start_token}")
    for side, ids, spec in (
        ("remote (prefill)", src_block_ids, plan_prefill),
        ("local (decode)", dst_block_ids, plan_decode),
    ):
        if len(ids) != 1:
            raise PlanError(f"{what} moves one state block; the {side} block list has {len(ids)}")
        block = int(ids[0])
        if not 0 <= block < spec.num_blocks:
            raise PlanError(f"{what}: {side} block id {block} is out of range [0, {spec.num_blocks})")
