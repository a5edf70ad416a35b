"""EngineSpec geometry: tensor shapes per layout, per layer and cross-layer, and the layout table."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from kv_sidecar.plan.chunks import chunk_geometry, descriptors
from kv_sidecar.plan.spec import LAYOUT_DIMS, EngineSpec, Layout, kv_in_last_dim, kv_planes, tensor_dims
from tests.plan.plan_oracle import head_vector, head_vector_index

# Every dim has its own size: K/V 2, H=3 local heads, B=4 slots (kernel blocks of a
# block of 8), D=5, N=6 kernel blocks (3 logical blocks), L=7 layers. Written out by
# hand from each layout's documented dim order, not from LAYOUT_DIMS.
PER_LAYER: dict[Layout, tuple[int, ...]] = {
    Layout.FLASH_ATTN_NHD: (2, 6, 4, 3, 5),
    Layout.FLASH_ATTN_HND: (2, 6, 3, 4, 5),
    Layout.FLASHINFER_NHD: (6, 2, 4, 3, 5),
    Layout.FLASHINFER_HND: (6, 2, 3, 4, 5),
    Layout.PACKED: (6, 3, 4, 10),
    Layout.PACKED_NHD: (6, 4, 3, 10),
    Layout.VLLM_CPU: (6, 3, 2, 4, 5),
    Layout.MLA: (6, 4, 5),
}
CROSS_LAYER: dict[Layout, tuple[int, ...]] = {
    Layout.FLASH_ATTN_NHD: (6, 7, 2, 4, 3, 5),
    Layout.FLASH_ATTN_HND: (6, 7, 2, 3, 4, 5),
    Layout.FLASHINFER_NHD: (6, 7, 2, 4, 3, 5),
    Layout.FLASHINFER_HND: (6, 7, 2, 3, 4, 5),
    Layout.PACKED: (6, 7, 3, 4, 10),
    Layout.PACKED_NHD: (6, 7, 4, 3, 10),
    Layout.VLLM_CPU: (6, 7, 3, 2, 4, 5),
    Layout.MLA: (6, 7, 4, 5),
}


def spec(layout: Layout, **over: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "tp_size": 2,
        "num_layers": 7,
        "num_kv_heads": 1 if layout is Layout.MLA else 6,
        "head_dim": 5,
        "dtype": "bfloat16",
        "block_size": 8,
        "kernel_block_size": 4,
        "num_blocks": 3,
        "layout": layout,
    }
    return EngineSpec(**(base | over))


@pytest.mark.parametrize("layout", list(PER_LAYER))
def test_tensor_shapes(layout: Layout) -> None:
    per_layer = spec(layout)
    assert per_layer.layer_tensor_shape() == PER_LAYER[layout]
    assert per_layer.rank_tensor_shapes() == [PER_LAYER[layout]] * 7
    assert spec(layout, cross_layer=True).rank_tensor_shapes() == [CROSS_LAYER[layout]]


def test_cross_layer_blocks_outermost_when_sizes_coincide() -> None:
    # Two blocks of one kernel block: N has the size of the K/V dim before it; N is found by position.
    s = spec(Layout.FLASH_ATTN_HND, num_blocks=2, kernel_block_size=None, cross_layer=True)
    assert s.rank_tensor_shapes() == [(2, 7, 2, 3, 8, 5)]  # [N, L, 2, H, B, D]
    assert chunk_geometry(s).outer == 1
    assert chunk_geometry(s).chunk == 7 * 2 * 3 * 8 * 5 * 2


def test_every_layout_has_a_dim_order() -> None:
    assert set(PER_LAYER) == set(CROSS_LAYER) == set(Layout), "write the new layout's shapes above"
    for layout in Layout:
        dims = LAYOUT_DIMS[layout]
        assert dims.endswith("D") and "N" in dims and "B" in dims, layout
        assert len(set(dims)) == len(dims) and set(dims) <= set("NKBHD"), layout
        if kv_in_last_dim(layout):
            assert dims.index("N") < dims.index("K"), "N's position must stay its axis"
    assert tensor_dims(spec(Layout.PACKED, cross_layer=True)) == "NLHBKD"
    assert tensor_dims(spec(Layout.PACKED_NHD, cross_layer=True)) == "NLBHKD"  # vLLM BLNHC
    assert [layout for layout in Layout if kv_in_last_dim(layout)] == [Layout.PACKED, Layout.PACKED_NHD]


@pytest.mark.parametrize("layout", list(PER_LAYER))
@pytest.mark.parametrize("cross_layer", [False, True])
def test_chunk_is_one_block_of_one_region(layout: Layout, cross_layer: bool) -> None:
    s = spec(layout, cross_layer=cross_layer)
    geo = chunk_geometry(s)
    block = 8 * s.heads_per_rank * (1 if s.is_mla else 2) * 5 * 2  # tokens x heads x K/V x D x bf16
    per_region = block * (7 if cross_layer else 1)
    assert geo.outer * geo.chunk == per_region
    assert geo.regions * geo.region_bytes == s.rank_bytes() == per_region * 3 * geo.regions
    assert geo.outer == (2 if layout.value.startswith("flash_attn") and not cross_layer else 1)


@pytest.mark.parametrize("layout", list(PER_LAYER))
@pytest.mark.parametrize("cross_layer", [False, True])
def test_descriptors_cover_exactly_the_blocks_bytes(layout: Layout, cross_layer: bool) -> None:
    """NIXL descriptors of some blocks = the bytes the oracle's per-layout indexing puts in those blocks."""
    s = spec(layout, cross_layer=cross_layer, num_layers=2, head_dim=3)
    geo = chunk_geometry(s)
    bases = [1000 + i * (geo.region_bytes + 64) for i in range(geo.regions)]
    blocks = [2, 0]
    descs = descriptors(geo, bases, np.asarray(blocks))
    got = {int(a) + k for a, n, _ in descs for k in range(int(n))}
    # Element numbers of each region, indexed the oracle's way (explicit per layout).
    regions = [np.arange(math.prod(shape)).reshape(shape) for shape in s.rank_tensor_shapes()]
    want: set[int] = set()
    r, es = s.kernel_blocks_per_block, s.element_size
    for block, layer, plane, k, slot, head in itertools.product(
        blocks, range(2), range(kv_planes(s)), range(r), range(4), range(s.heads_per_rank)
    ):
        region, _ = head_vector_index(s, layer, plane, block * r + k, slot, head)
        for e in np.ravel(head_vector(s, regions, layer, plane, block * r + k, slot, head)):
            want.update(range(bases[region] + int(e) * es, bases[region] + int(e) * es + es))
    assert got == want
    assert len(descs) == geo.regions * geo.outer * len(blocks)
