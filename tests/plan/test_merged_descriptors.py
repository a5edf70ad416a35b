"""Property tests: host-nixl's merged descriptors move exactly the bytes of the per-block ones.

`merged_segments` posts one descriptor per run of consecutive block ids (on both sides) instead of one per
block. Expanded to single bytes, both plans must pair the same destination bytes with the same source
bytes, each destination byte once, for every layout and for any block id lists.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sidecar.plan.chunks import (
    ChunkGeometry,
    block_runs,
    chunk_geometry,
    descriptors,
    merged_segments,
    segment_descriptors,
)
from kv_sidecar.plan.spec import EngineSpec, Layout

ORDERS = ["random", "consecutive", "reversed", "runs"]


@st.composite
def spec_pair(draw: st.DrawFn) -> tuple[EngineSpec, EngineSpec]:
    """The same engine on both sides (host-nixl's identity plan), each side with its own cache size."""
    layout = draw(st.sampled_from(list(Layout)))
    block_size = draw(st.sampled_from([2, 4]))
    spec = EngineSpec.from_dict(
        {
            "tp_size": 1,
            "num_layers": draw(st.integers(1, 3)),
            "num_kv_heads": 1 if layout is Layout.MLA else draw(st.integers(1, 2)),
            "head_dim": draw(st.sampled_from([1, 2])),
            "dtype": "float16",
            "block_size": block_size,
            "num_blocks": draw(st.integers(1, 24)),
            "layout": layout.value,
            "kernel_block_size": draw(st.sampled_from([None, block_size // 2])),
            "cross_layer": draw(st.booleans()),
        }
    )
    return spec, dataclasses.replace(spec, num_blocks=draw(st.integers(1, 24)))


@st.composite
def block_ids(draw: st.DrawFn, num_blocks: int, n: int) -> list[int]:
    """n distinct ids below num_blocks, in one of the orders a block table can take."""
    order = draw(st.sampled_from(ORDERS))
    if order == "random":
        return draw(st.permutations(range(num_blocks)))[:n]
    start = draw(st.integers(0, num_blocks - n))
    ids = list(range(start, start + n))
    if order == "reversed":
        return ids[::-1]
    if order == "runs":  # consecutive runs in a shuffled order: runs and gaps mixed
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=n)))
        pieces = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True) if ids[a:b]]
        return [i for p in draw(st.permutations(pieces)) for i in p]
    return ids


def byte_pairs(local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """(bytes, 2) [local address, remote address] of every byte the descriptor lists move, sorted."""
    assert (local[:, 1] == remote[:, 1]).all(), "a descriptor's two sides differ in length"
    pairs = [
        np.stack([np.arange(lo, lo + n), np.arange(re, re + n)], axis=1)
        for (lo, n, _), (re, _, _) in zip(local.astype(np.int64), remote.astype(np.int64), strict=True)
    ]
    out = np.concatenate(pairs) if pairs else np.empty((0, 2), dtype=np.int64)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def bases(geo: ChunkGeometry, start: int) -> list[int]:
    # Regions with gaps between them, so that an offset taken from the wrong region moves other bytes.
    return [start + i * (geo.region_bytes + 37) for i in range(geo.regions)]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), specs=spec_pair())
def test_merged_segments_move_the_same_bytes_as_per_block_descriptors(
    data: st.DataObject, specs: tuple[EngineSpec, EngineSpec]
) -> None:
    dspec, sspec = specs
    local, remote = chunk_geometry(dspec), chunk_geometry(sspec)
    n = data.draw(st.integers(1, min(dspec.num_blocks, sspec.num_blocks)), label="blocks")
    dst = np.asarray(data.draw(block_ids(dspec.num_blocks, n), label="dst"), dtype=np.int64)
    src = np.asarray(data.draw(block_ids(sspec.num_blocks, n), label="src"), dtype=np.int64)
    lb, rb = bases(local, 4096), bases(remote, 1 << 20)

    per_block = byte_pairs(descriptors(local, lb, dst), descriptors(remote, rb, src))
    segments = merged_segments(local, remote, dst, src)
    merged_local, merged_remote = segment_descriptors(segments, lb, rb)
    merged = byte_pairs(merged_local, merged_remote)

    np.testing.assert_array_equal(merged, per_block)
    # Each destination byte is written once, and only bytes of the requested blocks are.
    assert len(np.unique(merged[:, 0])) == len(merged) == n * local.regions * local.outer * local.chunk
    # One descriptor per (region, outer index, run), runs maximal: never more than per block.
    runs = block_runs(dst, src)
    assert len(segments) == local.regions * local.outer * len(runs) <= local.regions * local.outer * n
    assert (np.diff(runs[:, 0]) > 0).all(), "runs go by destination id"
    if len(runs) > 1:  # neighbouring runs could not have been one
        joined = (runs[:-1, 0] + runs[:-1, 2] == runs[1:, 0]) & (runs[:-1, 1] + runs[:-1, 2] == runs[1:, 1])
        assert not joined.any()


@pytest.mark.parametrize(
    ("dst", "src", "runs"),
    [
        ([5], [9], [[5, 9, 1]]),
        ([0, 1, 2, 3], [10, 11, 12, 13], [[0, 10, 4]]),
        # Backwards on both sides: the same blocks forwards, one run.
        ([3, 2, 1, 0], [13, 12, 11, 10], [[0, 10, 4]]),
        # Backwards on one side only: nothing merges.
        ([3, 2, 1, 0], [0, 1, 2, 3], [[0, 3, 1], [1, 2, 1], [2, 1, 1], [3, 0, 1]]),
        # Consecutive on one side only: no merge there.
        ([0, 1, 2], [4, 6, 7], [[0, 4, 1], [1, 6, 2]]),
        ([7, 8, 1, 2, 3, 20], [0, 1, 2, 3, 4, 5], [[1, 2, 3], [7, 0, 2], [20, 5, 1]]),
    ],
)
def test_block_runs(dst: list[int], src: list[int], runs: list[list[int]]) -> None:
    assert block_runs(np.asarray(dst), np.asarray(src)).tolist() == runs


def test_a_fully_consecutive_pull_is_one_descriptor_per_region_and_outer_index() -> None:
    spec = EngineSpec.from_dict(
        {
            "tp_size": 1,
            "num_layers": 4,
            "num_kv_heads": 8,
            "head_dim": 128,
            "dtype": "bfloat16",
            "block_size": 16,
            "num_blocks": 512,
            "layout": "flash_attn_nhd",
        }
    )
    geo = chunk_geometry(spec)
    seg = merged_segments(geo, geo, np.arange(100, 228), np.arange(0, 128))
    assert len(seg) == 4 * 2  # layers x K/V
    assert (seg[:, 3] == 128 * geo.chunk).all()
    assert seg[:2, 1:3].tolist() == [
        [100 * geo.chunk, 0],
        [geo.outer_stride + 100 * geo.chunk, geo.outer_stride],
    ]


def test_geometries_that_differ_beyond_block_counts_are_refused() -> None:
    geo = ChunkGeometry(regions=2, outer=2, outer_stride=64, chunk=16, num_blocks=4, region_bytes=128)
    with pytest.raises(ValueError, match="differ"):
        merged_segments(geo, dataclasses.replace(geo, chunk=8), np.arange(2), np.arange(2))
    with pytest.raises(ValueError, match="shape"):
        block_runs(np.arange(2), np.arange(3))
