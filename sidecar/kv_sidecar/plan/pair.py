"""TP mapping between a prefill and a decode engine: who reads which heads from whom.

`plan_pair` is computed once per (prefill engine, decode engine) pair at
handshake. It works on *global* KV head indices: every decode rank needs the
heads it holds, every prefill rank offers the heads it holds, and a read is
the intersection of the two. Ranks that hold replicated heads (tp > heads)
or an MLA latent (replicated everywhere) are read from by exactly one decode
rank per head; the other holders are only told "consumed" (`notify_only`), so
every prefill rank learns when it may free its blocks. A Mamba group's state
(plan/state.py) may lie on prefill ranks whose heads a decode rank does not
read (fewer KV heads than ranks): those ranks are in its `notify_only` too, so
they keep their blocks until it is done.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kv_sidecar.plan.spec import MUST_MATCH, EngineSpec, PlanError, rank_block_bytes, token_bytes_per_head
from kv_sidecar.plan.state import StateMove, check_state_pair, state_moves, state_sources

PRECONDITION = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class Read:
    """One decode rank reads global heads [start, stop) from one prefill rank (None: MLA latent)."""

    prefill_rank: int
    heads: tuple[int, int] | None

    def to_json(self) -> dict[str, Any]:
        return {"prefill_rank": self.prefill_rank, "heads": None if self.heads is None else list(self.heads)}


@dataclass(frozen=True)
class DecodeRankPlan:
    rank: int
    reads: tuple[Read, ...]
    notify_only: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "reads": [read.to_json() for read in self.reads],
            "notify_only": list(self.notify_only),
        }


@dataclass(frozen=True)
class PairPlan:
    prefill: EngineSpec
    decode: EngineSpec
    decode_ranks: tuple[DecodeRankPlan, ...]
    # Per KV cache group (empty: no groups), for a Mamba group the byte runs of each decode rank's state
    # block (plan/state.py), else None. Derived from the two specs, so the hash need not cover it.
    state: tuple[tuple[tuple[StateMove, ...], ...] | None, ...] = ()

    def mapping_json(self) -> list[dict[str, Any]]:
        return [rank_plan.to_json() for rank_plan in self.decode_ranks]

    def hash(self) -> str:
        return self._hash

    @cached_property
    def _hash(self) -> str:  # a plan is immutable: hashed once (every OpenRead names it)
        # Canonical JSON (sorted keys, no whitespace) so both sidecars, whatever
        # their Python version, hash the same bytes for the same plan.
        body = {
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "decode_ranks": self.mapping_json(),
        }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "hash": self.hash(),
            "identity": self.is_identity(),
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "bytes_per_block": {
                "prefill_rank": rank_block_bytes(self.prefill),
                "decode_rank": rank_block_bytes(self.decode),
            },
            "decode_ranks": [
                {**rank_plan.to_json(), "bytes_per_token": self.read_bytes_per_token(rank_plan)}
                for rank_plan in self.decode_ranks
            ],
            **(
                {
                    "state_moves": {
                        str(g): [[m.to_json() for m in rank] for rank in moves]
                        for g, moves in enumerate(self.state)
                        if moves is not None
                    }
                }
                if any(m is not None for m in self.state)
                else {}
            ),
        }

    def state_moves(self, group: int) -> tuple[tuple[StateMove, ...], ...]:
        """Each decode rank's byte runs of Mamba group `group`'s state block; INVALID_ARGUMENT if the
        group is not one."""
        moves = self.state[group] if 0 <= group < len(self.state) else None
        if moves is None:
            raise PlanError(f"KV cache group {group} is not a Mamba state group of the decode engine")
        return moves

    def read_bytes_per_token(self, rank_plan: DecodeRankPlan) -> list[int]:
        """Bytes one token moves for each of `rank_plan.reads` (all layers, K and V)."""
        per_head = token_bytes_per_head(self.decode)
        return [per_head * (1 if r.heads is None else r.heads[1] - r.heads[0]) for r in rank_plan.reads]

    @cached_property
    def _consumers(self) -> dict[int, frozenset[int]]:
        found: dict[int, set[int]] = {p: set() for p in range(self.prefill.tp_size)}
        for rank_plan in self.decode_ranks:
            for read in rank_plan.reads:
                found[read.prefill_rank].add(rank_plan.rank)
            for p in rank_plan.notify_only:
                found[p].add(rank_plan.rank)
        return {p: frozenset(ranks) for p, ranks in found.items()}

    def consumers_of(self, prefill_rank: int) -> frozenset[int]:
        if prefill_rank not in self._consumers:
            raise PlanError(f"prefill rank {prefill_rank} out of range for tp_size {self.prefill.tp_size}")
        return self._consumers[prefill_rank]

    def is_identity(self) -> bool:
        return self._identity

    @cached_property
    def _identity(self) -> bool:
        same_geometry = _without_num_blocks(self.prefill) == _without_num_blocks(self.decode)
        return same_geometry and all(
            rank_plan.notify_only == ()
            and rank_plan.reads == (Read(rank_plan.rank, _heads_of(self.decode, rank_plan.rank)),)
            for rank_plan in self.decode_ranks
        )


def _without_num_blocks(spec: EngineSpec) -> dict[str, Any]:
    d = spec.to_dict()
    del d["num_blocks"]
    return d


def _heads_of(spec: EngineSpec, rank: int) -> tuple[int, int] | None:
    return None if spec.is_mla else spec.rank_heads(rank)


def check_compatible(prefill: EngineSpec, decode: EngineSpec) -> None:
    """Raise FAILED_PRECONDITION naming the first field on which the engines cannot pair."""
    for side, spec in (("prefill", prefill), ("decode", decode)):
        # Specs validate on construction; this catches ones built around that.
        try:
            spec.validate()
        except PlanError as exc:
            raise PlanError(f"{side} engine: {exc}", PRECONDITION) from None
    if prefill.is_mla != decode.is_mla:
        raise PlanError(
            f"layout differs: prefill {prefill.layout.value}, decode {decode.layout.value}; "
            "an mla cache pairs only with another mla cache",
            PRECONDITION,
        )
    _check_groups(prefill, decode)
    for name in (*MUST_MATCH, "num_kv_heads"):
        p, d = getattr(prefill, name), getattr(decode, name)
        if p != d:
            raise PlanError(f"{name} differs: prefill {p}, decode {d}", PRECONDITION)


def _check_groups(prefill: EngineSpec, decode: EngineSpec) -> None:
    """A hybrid model's KV cache groups must correspond: each group of the prefill engine is read into
    the same group of the decode engine, tensor j into tensor j; refused naming the first layer that
    does not correspond."""
    if not prefill.groups and not decode.groups:
        return
    counts = len(prefill.groups) or 1, len(decode.groups) or 1
    if counts[0] != counts[1]:
        raise PlanError(
            f"KV cache groups differ: prefill {counts[0]}, decode {counts[1]} (a hybrid model with the hybrid "
            "KV cache manager on at one end only?)",
            PRECONDITION,
        )
    for i, (p, d) in enumerate(zip(prefill.groups, decode.groups, strict=True)):
        for j in range(max(len(p.layers), len(d.layers))):
            a = p.layers[j] if j < len(p.layers) else None
            b = d.layers[j] if j < len(d.layers) else None
            if a != b:
                raise PlanError(
                    f"KV cache group {i} differs at layer position {j}: prefill layer {a}, decode layer {b}",
                    PRECONDITION,
                )
        if p.sliding_window != d.sliding_window or bool(p.state) != bool(d.state):
            raise PlanError(
                f"KV cache group {i} (layer {p.layers[0]}) differs: prefill {p.kind}, decode {d.kind}",
                PRECONDITION,
            )
        if p.state:
            # Its state moves as byte runs inside the blocks (plan/state.py), whatever the page geometry.
            check_state_pair(i, prefill, decode, p, d)


def _state_plans(
    prefill: EngineSpec, decode: EngineSpec
) -> tuple[tuple[tuple[StateMove, ...], ...] | None, ...]:
    """Each Mamba group's state moves (None for the other groups)."""
    return tuple(
        state_moves(prefill, decode, p, d) if p.state else None
        for p, d in zip(prefill.groups, decode.groups, strict=True)
    )


def _state_dependencies(
    state: tuple[tuple[tuple[StateMove, ...], ...] | None, ...],
    reads: list[list[Read]],
    notify: list[set[int]],
) -> None:
    """Add to a decode rank's `notify` the prefill ranks its state runs read but its attention reads do
    not, so that they count it among their consumers and keep the request's blocks until it is done."""
    for moves in state:
        for d, rank_moves in enumerate(moves or ()):
            notify[d] |= state_sources(rank_moves) - {r.prefill_rank for r in reads[d]}


def plan_pair(prefill: EngineSpec, decode: EngineSpec) -> PairPlan:
    check_compatible(prefill, decode)
    if prefill.is_mla:
        # The latent is replicated on every rank: each decode rank reads one
        # prefill rank, round robin so the prefill ranks share the load.
        reads = [[Read(d % prefill.tp_size, None)] for d in range(decode.tp_size)]
    else:
        reads = [_merge_reads(_head_sources(prefill, decode, d)) for d in range(decode.tp_size)]
    notify = _notify_only(prefill, decode, reads)
    state = _state_plans(prefill, decode)
    _state_dependencies(state, reads, notify)
    ranks = tuple(
        DecodeRankPlan(rank=d, reads=tuple(reads[d]), notify_only=tuple(sorted(notify[d])))
        for d in range(decode.tp_size)
    )
    return PairPlan(prefill=prefill, decode=decode, decode_ranks=ranks, state=state)


def _holders(spec: EngineSpec, head: int) -> list[int]:
    """Ranks of `spec` that hold global head `head` (several when heads are replicated)."""
    return [r for r in range(spec.tp_size) if spec.rank_heads(r)[0] <= head < spec.rank_heads(r)[1]]


def _head_sources(prefill: EngineSpec, decode: EngineSpec, d: int) -> list[tuple[int, int]]:
    """(global head, prefill rank to read it from) for each head decode rank `d` holds.

    When several prefill ranks hold a head, the decode ranks that hold it take
    turns over them (i-th holder on decode reads from the i-th holder on
    prefill, modulo), which keeps equal replicated layouts an identity and
    spreads the load; the holders left over are notified, not read.
    """
    start, stop = decode.rank_heads(d)
    out: list[tuple[int, int]] = []
    for head in range(start, stop):
        p_holders = _holders(prefill, head)
        d_index = _holders(decode, head).index(d)
        out.append((head, p_holders[d_index % len(p_holders)]))
    return out


def _merge_reads(sources: list[tuple[int, int]]) -> list[Read]:
    """Collapse consecutive heads read from the same prefill rank into one Read."""
    reads: list[Read] = []
    for head, p in sources:
        last = reads[-1] if reads else None
        if last is not None and last.prefill_rank == p and last.heads is not None and last.heads[1] == head:
            reads[-1] = Read(p, (last.heads[0], head + 1))
        else:
            reads.append(Read(p, (head, head + 1)))
    return reads


def _notify_only(prefill: EngineSpec, decode: EngineSpec, reads: list[list[Read]]) -> list[set[int]]:
    """Give every prefill rank nobody reads to one decode rank to notify.

    The candidates are the decode ranks that need what that prefill rank
    holds (for MLA: all of them); picking by rank modulo spreads the work.
    """
    notify: list[set[int]] = [set() for _ in range(decode.tp_size)]
    read_ranks = {read.prefill_rank for rank_reads in reads for read in rank_reads}
    for p in range(prefill.tp_size):
        if p in read_ranks:
            continue
        if prefill.is_mla:
            candidates = list(range(decode.tp_size))
        else:
            p_start, p_stop = prefill.rank_heads(p)
            candidates = [
                d
                for d in range(decode.tp_size)
                if decode.rank_heads(d)[0] < p_stop and p_start < decode.rank_heads(d)[1]
            ]
        notify[candidates[p % len(candidates)]].add(p)
    return notify
