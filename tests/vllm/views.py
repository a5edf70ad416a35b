"""vLLM's KV cache layer views, rebuilt without vLLM (for the GPU machine, where vLLM cannot go).

vLLM 0.32 allocates one int8 buffer and views each layer as logical
`[blocks, heads, tokens, content]` with strides from its KVCacheLayout (a
permutation of `[L, B, H, N, C]`). tests/vllm/test_kv_layout.py checks that
`layer_views` gives exactly what vLLM's own `create_kv_cache_views` gives, so
that a GPU test built on it registers tensors shaped and strided as vLLM's
backends allocate them.
"""

from __future__ import annotations

import torch

# vLLM's KVCacheLayout names spell the physical order of the logical dims L, B, H, N, C.
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def buffer_bytes(num_layers: int, num_blocks: int, heads: int, block_size: int, content_bytes: int) -> int:
    return num_layers * num_blocks * heads * block_size * content_bytes


def layer_views(
    raw: torch.Tensor,
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    heads: int,
    block_size: int,
    content_bytes: int,
    dtype: torch.dtype,
    kernel_block_size: int | None = None,
) -> list[torch.Tensor]:
    """One `[blocks, heads, tokens, content]` view per layer of a flat int8 buffer, as vLLM makes them."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vLLM KV cache layout {layout!r}")
    order = layout
    sizes = {"L": num_layers, "B": num_blocks, "H": heads, "N": block_size, "C": content_bytes}
    if kernel_block_size is not None and kernel_block_size != block_size:
        # A block becomes block_size / kernel_block_size kernel blocks, each a dense page of its own;
        # only possible when a block is one dense page (nothing else nested inside the block dim).
        if set(order[order.index("B") + 1 :]) != set("HNC"):
            raise ValueError(f"{layout}: blocks are not dense pages, they cannot be split into kernel blocks")
        sizes["B"] *= block_size // kernel_block_size
        sizes["N"] = kernel_block_size
    strides: dict[str, int] = {}
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    shape = [sizes[d] for d in "BHNC"]
    stride = [strides[d] for d in "BHNC"]
    if step > raw.numel():
        raise ValueError(f"buffer of {raw.numel()} bytes is smaller than the {step} the cache needs")
    views = []
    for layer in range(num_layers):
        v = torch.as_strided(raw, shape, stride, raw.storage_offset() + layer * strides["L"])
        views.append(v.view(dtype))
    return views
