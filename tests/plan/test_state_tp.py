"""Mamba/SSM state between engines of different TP sizes (plan/state.py): each decode rank's state block
must hold exactly what an engine of its TP size computes, i.e. the model's state sharded the way vLLM
shards it. The planned byte runs are checked against the reference in state_oracle.py, which shards a
model-wide state as vLLM's Mamba-2 weight loader does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import DTYPE_SIZES, EngineSpec, PlanError, rank_block_bytes
from kv_sidecar.plan.state import StateMove

from .state_oracle import mamba2_state, model_state, shard

TPS = (1, 2, 4)
LAYERS = ("model.layers.0.mixer",)


def granite_state(tp: int) -> list[dict[str, Any]]:
    """The Granite-4-shaped test model's Mamba-2 state at `tp`: 8 heads of 64, state size 16."""
    return mamba2_state(tp, heads=8, head_dim=64, d_state=16)


def engine(tp: int, state: list[dict[str, Any]], **over: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "tp_size": tp,
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 64,
        "dtype": "float32",
        "block_size": 128,
        "num_blocks": 8,
        "layout": "vllm_cpu",
        "groups": (
            {"layers": ("model.layers.0.mixer", "model.layers.2.mixer"), "state": state},
            {"layers": ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")},
        ),
    }
    return EngineSpec(**{**base, **over})


# -- the reference (state_oracle.py) applied: the moves' result -----------------------------------


def apply(
    moves: tuple[StateMove, ...], sources: list[np.ndarray], page: int
) -> tuple[np.ndarray, np.ndarray]:
    """(the destination block the moves fill from zero, how often each of its bytes was written)."""
    out, hits = np.zeros(page, dtype=np.uint8), np.zeros(page, dtype=np.int64)
    for m in moves:
        assert m.nbytes > 0 and m.src >= 0 and m.src + m.nbytes <= len(sources[m.src_rank]), m
        out[m.dst : m.dst + m.nbytes] = sources[m.src_rank][m.src : m.src + m.nbytes]
        hits[m.dst : m.dst + m.nbytes] += 1
    return out, hits


def state_mask(arrays: list[dict[str, Any]], page: int) -> np.ndarray:
    mask = np.zeros(page, dtype=bool)
    for a in arrays:
        n = int(np.prod(a["shape"])) * DTYPE_SIZES[a["dtype"]]
        mask[a["offset"] : a["offset"] + n] = True
    return mask


# -- generated state descriptions ---------------------------------------------------------------------

described = st.lists(
    st.fixed_dictionaries(
        {
            "dims": st.lists(st.integers(1, 3), min_size=1, max_size=3),
            "tp_dim": st.integers(0, 2),
            "segments": st.lists(
                st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=3
            ),  # (size in units of 4, replicated: only meaningful as vLLM's one group)
            "dtype": st.sampled_from(["float32", "bfloat16", "uint8"]),
        }
    ),
    min_size=1,
    max_size=3,
)


def arrays_at(desc: list[dict[str, Any]], tp: int, max_tp: int) -> list[dict[str, Any]]:
    """The generated arrays as an engine of `tp` ranks describes them. A replicated segment is vLLM's one
    group: replicated only where tp > 1 (at tp 1 it is split in one), and its size does not scale."""
    out, offset = [], 0
    for i, d in enumerate(desc):
        k = d["tp_dim"] % len(d["dims"])
        segs = [
            {"size": 4 * u if rep else 4 * u * max_tp, "replicated": rep and tp > 1}
            for u, rep in d["segments"]
        ]
        shape = list(d["dims"])
        shape[k] = sum(s["size"] if s["replicated"] else s["size"] // tp for s in segs)
        out.append(
            {
                "name": f"s{i}",
                "shape": tuple(shape),
                "dtype": d["dtype"],
                "offset": offset,
                "tp_dim": k,
                "segments": segs,
            }
        )
        offset += int(np.prod(shape)) * DTYPE_SIZES[d["dtype"]]
    return out


def _page(spec: EngineSpec) -> int:
    return rank_block_bytes(spec) // spec.num_layers


@settings(max_examples=150, deadline=None)
@given(
    desc=described,
    ts=st.sampled_from(TPS),
    td=st.sampled_from(TPS),
    kv=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_every_decode_state_byte_comes_from_exactly_one_source_byte_as_vllm_shards_it(
    desc: list[dict[str, Any]], ts: int, td: int, kv: int, seed: int
) -> None:
    """Each decode rank's arrays are written byte for byte exactly once, nothing else in its block is,
    every byte read lies in a source rank's arrays, and the result is the model's state sharded for the
    decode TP size: what that engine would have computed. Every prefill rank a decode rank reads state
    from counts it among its consumers (whatever the KV heads' plan)."""
    max_tp = max(TPS)
    sa, da = arrays_at(desc, ts, max_tp), arrays_at(desc, td, max_tp)
    src, dst = engine(ts, sa, num_kv_heads=kv), engine(td, da, num_kv_heads=kv)
    plan = plan_pair(src, dst)
    for r, moves in enumerate(plan.state_moves(0)):
        assert all(r in plan.consumers_of(m.src_rank) for m in moves)
    model = model_state(sa, seed)
    sp, dp = _page(src), _page(dst)
    sources = [shard(sa, model, ts, q, sp) for q in range(ts)]
    src_mask = state_mask(sa, sp)
    for r, moves in enumerate(plan.state_moves(0)):
        got, hits = apply(moves, sources, dp)
        assert (hits == state_mask(da, dp)).all(), (r, moves)  # each state byte once, padding never
        for m in moves:
            assert src_mask[m.src : m.src + m.nbytes].all(), m  # only state bytes are read
        assert (got == shard(da, model, td, r, dp)).all(), (r, moves)
    assert plan.state[1] is None  # the attention group has no state moves


@settings(max_examples=100, deadline=None)
@given(desc=described, ts=st.sampled_from(TPS), td=st.sampled_from(TPS), seed=st.integers(0, 2**16))
def test_tp_a_to_b_then_b_to_a_is_the_identity(
    desc: list[dict[str, Any]], ts: int, td: int, seed: int
) -> None:
    max_tp = max(TPS)
    sa, da = arrays_at(desc, ts, max_tp), arrays_at(desc, td, max_tp)
    src, dst = engine(ts, sa), engine(td, da)
    sp, dp = _page(src), _page(dst)
    rng = np.random.default_rng(seed)
    # Any source state whose replicas agree (an engine's replicated runs are equal on every rank).
    sources = [shard(sa, model_state(sa, seed), ts, q, sp) for q in range(ts)]
    mask = state_mask(sa, sp)
    for s in sources:
        s[~mask] = rng.integers(0, 256, size=int((~mask).sum()), dtype=np.uint8)  # padding: not state
    there = [apply(m, sources, dp)[0] for m in plan_pair(src, dst).state_moves(0)]
    back = [apply(m, there, sp)[0] for m in plan_pair(dst, src).state_moves(0)]
    for s, b in zip(sources, back, strict=True):
        assert (s[mask] == b[mask]).all()


def test_granite_tp1_to_tp2_and_back_moves_x_halves_whole_groups_and_ssm_heads() -> None:
    """The test model's numbers, by hand: a TP 1 conv row is 544 channels (2176 bytes: x 512, B 16, C
    16), a TP 2 rank's 288 (1152 bytes: its 256 of x, then the one group's B and C whole); the SSM state
    follows the conv state (byte 6528, and 3456 on TP 2), 4096 bytes per head, 4 heads per TP 2 rank."""
    one, two = engine(1, granite_state(1)), engine(2, granite_state(2))
    down = plan_pair(one, two).state_moves(0)
    assert down[0] == (
        StateMove(0, 0, 0, 1024),  # row 0: x[0:256]
        StateMove(0, 2048, 1024, 1152),  # row 0: B and C, then row 1: x[0:256] (adjacent on both sides)
        StateMove(0, 4224, 2176, 1152),  # row 1: B and C, row 2: x[0:256]
        StateMove(0, 6400, 3328, 16512),  # row 2: B and C, then heads 0-3
    )
    assert down[1] == (
        StateMove(0, 1024, 0, 1152),  # row 0: x[256:512], B, C
        StateMove(0, 3200, 1152, 1152),
        StateMove(0, 5376, 2304, 1152),
        StateMove(0, 6528 + 4 * 4096, 3456, 4 * 4096),  # heads 4-7
    )
    (up,) = plan_pair(two, one).state_moves(0)
    assert sum(m.nbytes for m in up) == 3 * 2176 + 8 * 4096
    assert up[:3] == (StateMove(0, 0, 0, 1024), StateMove(1, 0, 1024, 1024), StateMove(0, 1024, 2048, 1152))
    # row 2: B and C then heads 0-3 from rank 0 (adjacent on both sides), heads 4-7 from rank 1
    assert up[-2:] == (
        StateMove(0, 3328, 6400, 128 + 4 * 4096),
        StateMove(1, 3456, 6528 + 4 * 4096, 4 * 4096),
    )
    # B and C (channels 512-543 of each row) come from rank 0 only: one copy of a replicated run.
    assert all(m.src_rank == 0 for m in up if m.dst < 6528 and m.dst % 2176 + m.nbytes > 2048)


def test_the_same_undescribed_state_still_pairs_only_at_the_same_tp_size() -> None:
    plain = [{k: v for k, v in a.items() if k not in ("tp_dim", "segments")} for a in granite_state(1)]
    plan = plan_pair(engine(1, plain), engine(1, plain, num_blocks=3))
    assert plan.is_identity() and plan.state_moves(0) == ((StateMove(0, 0, 0, 3 * 544 * 4 + 8 * 4096),),)
    # Another page geometry at the same TP size: the arrays' bytes still move as they are.
    other = plan_pair(engine(1, plain), engine(1, plain, block_size=256))
    assert not other.is_identity() and other.state_moves(0) == plan.state_moves(0)
    with pytest.raises(PlanError) as info:
        plan_pair(engine(1, plain), engine(2, granite_state(2)))
    assert info.value.code == "FAILED_PRECONDITION"
    assert str(info.value).startswith(
        "KV cache group 0 (layer model.layers.0.mixer) holds Mamba state, which cannot be converted exactly "
        "between these engines: the prefill engine (tp_size 1) does not describe how TP shards its conv state"
    )


def _with(arrays: list[dict[str, Any]], i: int, **over: Any) -> list[dict[str, Any]]:
    out = [dict(a) for a in arrays]
    out[i] |= over
    return out


@pytest.mark.parametrize(
    ("decode_state", "why"),
    [
        (
            _with(granite_state(2), 1, shape=(4, 32, 16), segments=[{"size": 8}]),
            "ssm has shape (8, 64, 16) at prefill tp_size 1 and (4, 32, 16) at decode tp_size 2: they differ "
            "beyond dim 0, the one TP shards",
        ),
        (
            _with(
                granite_state(2),
                0,
                shape=(3, 280),
                segments=[{"size": 496}, {"size": 16, "replicated": True}, {"size": 16, "replicated": True}],
            ),
            "conv is sharded as prefill dim 1 = [512, 16, 16], decode dim 1 = [496, 16 replicated, 16 replicated]",
        ),
        (
            _with(granite_state(2), 1, dtype="bfloat16"),
            "prefill ssm (8, 64, 16) float32 at byte 6528, decode ssm (4, 64, 16) bfloat16 at byte 3456",
        ),
        (granite_state(2)[:1], "prefill 2 state arrays, decode 1"),
    ],
)
def test_state_that_does_not_correspond_is_refused_naming_the_layer_and_why(
    decode_state: list[dict[str, Any]], why: str
) -> None:
    for p, d in ((engine(1, granite_state(1)), engine(2, decode_state)),):
        with pytest.raises(PlanError) as info:
            plan_pair(p, d)
        assert info.value.code == "FAILED_PRECONDITION"
        assert str(info.value) == (
            "KV cache group 0 (layer model.layers.0.mixer) holds Mamba state, which cannot be converted exactly "
            f"between these engines: {why}"
        )


def test_a_segment_that_does_not_split_evenly_is_refused() -> None:
    """TP 4 cannot split 8 SSM heads... it can; 6 it cannot: vLLM refuses such an engine, and so does the
    spec (and the planner, as FAILED_PRECONDITION, for a spec built around validation)."""
    bad = _with(granite_state(4), 1, shape=(1, 64, 16), segments=[{"size": 6}])
    with pytest.raises(PlanError, match=r"ssm's segment of 6 does not split evenly over tp_size 4"):
        engine(4, bad)
    with pytest.raises(
        PlanError,
        match=r"conv dim 1 = \[512, 16, 16\] holds 544 per rank at tp_size 1, its shape \(3, 288\) 288",
    ):
        engine(1, _with(granite_state(1), 0, shape=(3, 288)))
    with pytest.raises(PlanError, match=r"has no dim 3 to shard"):
        engine(1, _with(granite_state(1), 0, tp_dim=3))


def test_a_prefill_rank_holding_state_but_no_head_a_decode_rank_reads_waits_for_it() -> None:
    """One KV head over TP 4 -> 2: decode rank 0 reads the head from prefill rank 0 and is told of rank 2,
    but its state (heads 0-3, x channels 0-255) is prefill ranks 0 and 1's: rank 1 joins its notify_only,
    so that rank 1 keeps the request's blocks until rank 0 is done (consumers_of)."""
    plan = plan_pair(engine(4, granite_state(4), num_kv_heads=1), engine(2, granite_state(2), num_kv_heads=1))
    d0, d1 = plan.decode_ranks
    assert [r.prefill_rank for r in d0.reads] == [0] and d0.notify_only == (1, 2)
    assert [r.prefill_rank for r in d1.reads] == [1] and d1.notify_only == (2, 3)
    assert plan.consumers_of(1) == {0, 1} and plan.consumers_of(3) == {1}
    assert {m.src_rank for m in plan.state_moves(0)[0]} == {0, 1}
    # Without a state group the heads' plan is as before (rank 1 is read by decode rank 1 only).
    bare = plan_pair(
        engine(4, granite_state(4), num_kv_heads=1, groups=()), engine(2, [], num_kv_heads=1, groups=())
    )
    assert bare.decode_ranks[0].notify_only == (2,)


def test_the_plan_command_shows_the_state_moves() -> None:
    body = plan_pair(engine(2, granite_state(2)), engine(1, granite_state(1))).to_json()
    assert body["state_moves"]["0"][0][0] == [0, 0, 0, 1024]
    same = plan_pair(engine(1, granite_state(1)), engine(1, granite_state(1))).to_json()
    assert same["identity"] and same["state_moves"] == {"0": [[[0, 0, 0, 3 * 2176 + 8 * 4096]]]}


def test_a_described_state_round_trips_through_dict_and_proto() -> None:
    from kv_sidecar.server.engines import spec_from_proto, spec_to_proto

    s = engine(2, granite_state(2))
    assert spec_from_proto(spec_to_proto(s)) == s == EngineSpec.from_dict(s.to_dict())
    conv = s.to_dict()["groups"][0]["state"][0]
    assert conv["tp_dim"] == 1 and conv["segments"][1] == {"size": 16, "replicated": True}
    assert s.groups[0].state[0].sharding() == "dim 1 = [512, 16 replicated, 16 replicated]"
