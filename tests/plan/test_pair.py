"""TP mapping tables, rejections, hash and identity of `plan_pair`."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kv_sidecar.plan.pair import DecodeRankPlan, PairPlan, Read, plan_pair
from kv_sidecar.plan.spec import EngineSpec, Layout, PlanError


def spec(tp: int, heads: int = 8, **over: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "tp_size": tp,
        "num_layers": 2,
        "num_kv_heads": heads,
        "head_dim": 4,
        "dtype": "float16",
        "block_size": 16,
        "num_blocks": 10,
        "layout": "flash_attn_nhd",
    }
    if over.get("layout") == "mla":
        base["num_kv_heads"] = 1
    return EngineSpec(**{**base, **over})


def table(plan: PairPlan) -> list[tuple[list[tuple[int, Any]], list[int]]]:
    """Each decode rank as ([(prefill rank, heads), ...], notify_only)."""
    return [
        ([(r.prefill_rank, r.heads) for r in rank.reads], list(rank.notify_only))
        for rank in plan.decode_ranks
    ]


@pytest.mark.parametrize(
    ("p", "d", "heads", "expected"),
    [
        (1, 2, 8, [([(0, (0, 4))], []), ([(0, (4, 8))], [])]),
        (2, 1, 8, [([(0, (0, 4)), (1, (4, 8))], [])]),
        (2, 4, 8, [([(0, (0, 2))], []), ([(0, (2, 4))], []), ([(1, (4, 6))], []), ([(1, (6, 8))], [])]),
        (4, 2, 8, [([(0, (0, 2)), (1, (2, 4))], []), ([(2, (4, 6)), (3, (6, 8))], [])]),
        (
            3,
            6,
            6,
            [
                ([(0, (0, 1))], []),
                ([(0, (1, 2))], []),
                ([(1, (2, 3))], []),
                ([(1, (3, 4))], []),
                ([(2, (4, 5))], []),
                ([(2, (5, 6))], []),
            ],
        ),
        (
            6,
            3,
            6,
            [
                ([(0, (0, 1)), (1, (1, 2))], []),
                ([(2, (2, 3)), (3, (3, 4))], []),
                ([(4, (4, 5)), (5, (5, 6))], []),
            ],
        ),
        # TP ratio 2:3, heads split evenly on both sides: decode rank 1 straddles two prefill ranks.
        (2, 3, 6, [([(0, (0, 2))], []), ([(0, (2, 3)), (1, (3, 4))], []), ([(1, (4, 6))], [])]),
        # kv heads 2 < prefill TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1; read one, notify the other.
        (4, 2, 2, [([(0, (0, 1))], [1]), ([(2, (1, 2))], [3])]),
        (4, 1, 2, [([(0, (0, 1)), (2, (1, 2))], [1, 3])]),
        # kv heads 2 < decode TP 4: two decode ranks hold each head and both read it.
        (2, 4, 2, [([(0, (0, 1))], []), ([(0, (0, 1))], []), ([(1, (1, 2))], []), ([(1, (1, 2))], [])]),
        # Replicated on both sides: the i-th decode holder reads the i-th prefill holder (an identity).
        (4, 4, 2, [([(0, (0, 1))], []), ([(1, (0, 1))], []), ([(2, (1, 2))], []), ([(3, (1, 2))], [])]),
        (8, 4, 2, [([(0, (0, 1))], [2]), ([(1, (0, 1))], [3]), ([(4, (1, 2))], [6]), ([(5, (1, 2))], [7])]),
    ],
)
def test_head_mapping(p: int, d: int, heads: int, expected: list) -> None:
    assert table(plan_pair(spec(p, heads), spec(d, heads))) == expected


@pytest.mark.parametrize(
    ("p", "d", "expected"),
    [
        (2, 1, [([(0, None)], [1])]),
        (1, 2, [([(0, None)], []), ([(0, None)], [])]),
        (4, 2, [([(0, None)], [2]), ([(1, None)], [3])]),
        (2, 4, [([(0, None)], []), ([(1, None)], []), ([(0, None)], []), ([(1, None)], [])]),
        (3, 1, [([(0, None)], [1, 2])]),
    ],
)
def test_mla_mapping(p: int, d: int, expected: list) -> None:
    plan = plan_pair(spec(p, layout="mla"), spec(d, layout="mla"))
    assert table(plan) == expected
    assert all(plan.consumers_of(rank) for rank in range(p))


def test_consumers_of() -> None:
    plan = plan_pair(spec(4, 2), spec(2, 2))
    assert [plan.consumers_of(p) for p in range(4)] == [frozenset({0})] * 2 + [frozenset({1})] * 2
    plan = plan_pair(spec(2, 2), spec(4, 2))
    assert plan.consumers_of(0) == frozenset({0, 1})
    with pytest.raises(PlanError, match="prefill rank 2 out of range"):
        plan.consumers_of(2)


@pytest.mark.parametrize("layout", [layout.value for layout in Layout if layout is not Layout.MLA])
def test_layouts_and_block_sizes_do_not_change_the_mapping(layout: str) -> None:
    plain = plan_pair(spec(2), spec(4))
    other = plan_pair(
        spec(2, layout=layout, block_size=16, kernel_block_size=4),
        spec(4, layout="flashinfer_hnd", block_size=48, cross_layer=True),
    )
    assert plain.decode_ranks == other.decode_ranks
    swapped = plan_pair(spec(2, layout="packed", cross_layer=True), spec(4, layout=layout, block_size=8))
    assert plain.decode_ranks == swapped.decode_ranks


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        (spec(2, layout="mla"), spec(2), "layout differs: prefill mla, decode flash_attn_nhd"),
        (spec(2), spec(2, layout="mla"), "layout differs: prefill flash_attn_nhd, decode mla"),
        (
            spec(2, layout="packed_nhd"),
            spec(2, layout="mla"),
            "layout differs: prefill packed_nhd, decode mla",
        ),
        (spec(2, 8), spec(2, 4), "num_kv_heads differs: prefill 8, decode 4"),
        (spec(2), spec(2, head_dim=8), "head_dim differs: prefill 4, decode 8"),
        (spec(2), spec(2, num_layers=3), "num_layers differs: prefill 2, decode 3"),
        (spec(2), spec(2, dtype="bfloat16"), "dtype differs: prefill float16, decode bfloat16"),
    ],
)
def test_rejections(prefill: EngineSpec, decode: EngineSpec, message: str) -> None:
    with pytest.raises(PlanError) as info:
        plan_pair(prefill, decode)
    assert message in str(info.value)
    assert info.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize(("heads", "tp"), [(6, 4), (8, 3), (3, 2)])
def test_heads_tp_not_divisible(heads: int, tp: int) -> None:
    with pytest.raises(PlanError, match=f"num_kv_heads {heads} and tp_size {tp}: one must divide the other"):
        spec(tp, heads)


def test_invalid_spec_smuggled_past_construction_is_failed_precondition() -> None:
    bad = spec(2, 6)
    object.__setattr__(bad, "tp_size", 4)
    with pytest.raises(PlanError, match="prefill engine: num_kv_heads 6 and tp_size 4") as info:
        plan_pair(bad, spec(2, 6))
    assert info.value.code == "FAILED_PRECONDITION"


def test_hash_is_stable_and_pinned() -> None:
    a = plan_pair(spec(2), spec(4, layout="flash_attn_hnd", block_size=32))
    b = plan_pair(spec(2), spec(4, layout="flash_attn_hnd", block_size=32))
    assert a.hash() == b.hash()
    # Pinned: both sidecars compare this digest, so it must not drift between versions unnoticed.
    assert a.hash() == "8cbd40e62011eac3f23cac34d0b24d79d668448eb70caddf05d314bbe1cd6722"


@pytest.mark.parametrize(
    "change",
    [
        {"num_blocks": 11},
        {"layout": "flashinfer_nhd"},
        {"layout": "packed_nhd"},
        {"block_size": 32},
        {"kernel_block_size": 8},
        {"cross_layer": True},
        {"tp_size": 1},
    ],
)
def test_hash_changes_with_either_spec(change: dict[str, Any]) -> None:
    base = plan_pair(spec(2), spec(2))
    changed = dataclasses.replace(base.prefill, **change)
    assert plan_pair(changed, base.decode).hash() != base.hash()
    assert plan_pair(base.prefill, changed).hash() != base.hash()
    assert plan_pair(base.decode, changed).hash() != plan_pair(changed, base.decode).hash()


def test_hash_covers_the_mapping() -> None:
    plan = plan_pair(spec(2), spec(2))
    swapped = PairPlan(
        plan.prefill,
        plan.decode,
        (DecodeRankPlan(0, (Read(1, (4, 8)),), ()), DecodeRankPlan(1, (Read(0, (0, 4)),), ())),
    )
    assert swapped.hash() != plan.hash()


def test_is_identity() -> None:
    assert plan_pair(spec(2), spec(2, num_blocks=99)).is_identity()
    assert plan_pair(spec(1, layout="mla"), spec(1, layout="mla")).is_identity()
    assert plan_pair(spec(4, 2), spec(4, 2)).is_identity()
    assert not plan_pair(spec(2), spec(2, block_size=32)).is_identity()
    assert not plan_pair(spec(2), spec(2, layout="flash_attn_hnd")).is_identity()
    assert plan_pair(spec(2, layout="packed_nhd"), spec(2, layout="packed_nhd")).is_identity()
    assert not plan_pair(spec(2, layout="packed_nhd"), spec(2, layout="packed")).is_identity()
    packed_nhd_x = spec(2, layout="packed_nhd", cross_layer=True)
    assert plan_pair(packed_nhd_x, packed_nhd_x).is_identity()
    assert not plan_pair(packed_nhd_x, spec(2, layout="packed_nhd")).is_identity()
    assert not plan_pair(spec(2), spec(2, kernel_block_size=8)).is_identity()
    assert not plan_pair(spec(2), spec(2, cross_layer=True)).is_identity()
    assert not plan_pair(spec(2), spec(4)).is_identity()
    assert not plan_pair(spec(2, layout="mla"), spec(1, layout="mla")).is_identity()


def test_to_json() -> None:
    plan = plan_pair(spec(4, 2), spec(2, 2))
    out = plan.to_json()
    assert out["decode_ranks"][0]["rank"] == 0
    assert out["decode_ranks"][0]["reads"] == [{"prefill_rank": 0, "heads": [0, 1]}]
    assert out["decode_ranks"][0]["notify_only"] == [1]
    assert out["hash"] == plan.hash()
    assert out["prefill"] == plan.prefill.to_dict()
    # one head x 4 dims x K,V x 2 layers x 2 bytes, per token; x16 tokens per block
    assert out["decode_ranks"][0]["bytes_per_token"] == [32]
    assert out["bytes_per_block"] == {"prefill_rank": 512, "decode_rank": 512}
    mla = plan_pair(spec(1, layout="mla"), spec(2, layout="mla")).to_json()
    assert mla["decode_ranks"][1]["reads"] == [{"prefill_rank": 0, "heads": None}]


# A hybrid model (vLLM's hybrid KV cache manager): 3 KV cache groups of 2 layer positions each.
HYBRID = (
    {"layers": ("l0", "l3"), "sliding_window": 64},
    {"layers": ("l1", "l4"), "sliding_window": 64},
    {"layers": ("l2", "l5")},
)


def test_hybrid_groups_that_correspond_pair_across_tp_and_block_sizes() -> None:
    plan = plan_pair(spec(1, groups=HYBRID), spec(2, groups=HYBRID, block_size=32))
    assert table(plan) == table(plan_pair(spec(1), spec(2, block_size=32)))
    assert plan.hash() != plan_pair(spec(1), spec(2, block_size=32)).hash()
    assert EngineSpec.from_dict(spec(1, groups=HYBRID).to_dict()) == spec(1, groups=HYBRID)
    assert "groups" not in spec(1).to_dict()  # one group: the spec (and plan hashes) as before


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        (HYBRID, (), "KV cache groups differ: prefill 3, decode 1"),
        (HYBRID, HYBRID[:2], "KV cache groups differ: prefill 3, decode 2"),
        (
            HYBRID,
            (HYBRID[1], HYBRID[0], HYBRID[2]),
            "KV cache group 0 differs at layer position 0: prefill layer l0, decode layer l1",
        ),
        (
            HYBRID,
            (*HYBRID[:2], {"layers": ("l2", "l5"), "sliding_window": 128}),
            "KV cache group 2 (layer l2) differs: prefill full attention, decode sliding window 128",
        ),
    ],
)
def test_hybrid_groups_that_do_not_correspond_are_refused_naming_the_layer(
    prefill: tuple[dict[str, Any], ...], decode: tuple[dict[str, Any], ...], message: str
) -> None:
    with pytest.raises(PlanError) as info:
        plan_pair(spec(1, groups=prefill), spec(1, groups=decode))
    assert message in str(info.value)
    assert info.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            ({"layers": ("l0",)},),
            "the KV cache groups have 1 layer positions but the engine registers num_layers 2",
        ),
        (({"layers": ("l0", "l1")}, {"layers": ("l1", "l2")}), "layer l1 is in more than one place"),
        (({"layers": ("l0", "l0")},), "layer l0 is in more than one place"),
        (({"layers": ()},), "KV cache group 0 names no layer"),
        (({"layers": ("a", "b"), "sliding_window": -1},), "sliding_window must be >= 0"),
    ],
)
def test_malformed_groups_are_refused(groups: tuple[dict[str, Any], ...], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        spec(1, groups=groups)
