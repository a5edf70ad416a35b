"""vLLM's KV cache layer views, rebuilt without vLLM (for the GPU machine, where vLLM cannot go).

vLLM 0.32 allocates one int8 buffer and views each layer as logical
`[blocks, heads, tokens, content]` with strides from its KVCacheLayout (a
permutation of `[L, B, H, N, C]`). tests/vllm/test_kv_layout.py checks that
`layer_views` gives exactly what vLLM's own `create_kv_cache_views` gives, so
that a GPU test built on it registers tensors shaped and strided as vLLM's
backends allocate them.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

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


class VllmCache:
    """One engine rank's KV cache allocated and viewed as vLLM does, with a reader and writer of tokens.

    `layers, heads, head` as a model with `heads` KV heads on this rank; the buffer is filled with
    random bytes. `allocation` is the context vLLM allocates in (the connector's shm pool on a CPU).
    """

    def __init__(
        self,
        device: str,
        layout: str,
        block: int,
        kernel: int | None,
        blocks: int,
        *,
        layers: int = 4,
        heads: int = 8,
        head: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        allocation: Any = None,
    ) -> None:
        esize = torch.empty((), dtype=dtype).element_size()
        content = 2 * head * esize  # K and V
        size = layers * blocks * heads * block * content
        with allocation or contextlib.nullcontext():
            self.raw = torch.zeros(size, dtype=torch.int8, device=device)
        self.raw.copy_(torch.randint(-128, 128, (size,), dtype=torch.int8))
        self.views = layer_views(
            self.raw,
            layout,
            num_layers=layers,
            num_blocks=blocks,
            heads=heads,
            block_size=block,
            content_bytes=content,
            dtype=dtype,
            kernel_block_size=kernel,
        )
        self.block = block
        self.int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[esize]

    def _by_block(self, view: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        v = view.view(self.int_type)
        ktok = v.shape[2]
        return v, self.block // ktok, ktok

    def tokens(self, block_ids: list[int], n: int) -> torch.Tensor:
        """[layers, tokens, heads, K|V] of the first n tokens held in block_ids (bit patterns as ints)."""
        out = []
        for view in self.views:
            v, ratio, _ = self._by_block(view)
            kblocks, heads, _, c = v.shape
            # Kernel blocks of one block are consecutive: regroup to [blocks, heads, block tokens, C].
            v = (
                v.unflatten(0, (kblocks // ratio, ratio))
                .permute(0, 2, 1, 3, 4)
                .reshape(-1, heads, self.block, c)
            )
            ids = torch.tensor(block_ids, device=v.device)
            out.append(v[ids].permute(0, 2, 1, 3).reshape(-1, heads, c)[:n])
        return torch.stack(out)

    def write_tokens(self, block_ids: list[int], n: int, values: torch.Tensor) -> None:
        for layer, view in enumerate(self.views):
            v, ratio, ktok = self._by_block(view)
            for t in range(n):
                b, s = block_ids[t // self.block], t % self.block
                v[b * ratio + s // ktok, :, s % ktok, :] = values[layer, t]


def pull_through_worker(worker: Any, params_json: str, block_ids: list[int], timeout_s: float = 60) -> Any:
    """Order one pull as the scheduler side would and poll the worker until it reports it; the PullResult."""
    from kv_sidecar_client.vllm.metadata import PullOrder, StepOrders

    worker.take_orders(StepOrders(pulls={"req": PullOrder(json.loads(params_json), block_ids, 0)}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, recving = worker.finished()
        if "req" in recving:
            return worker.pull_log[-1].result
        time.sleep(0.001)
    raise AssertionError("the pull did not finish")


def assert_pulled_exactly(
    prefill: VllmCache,
    decode: VllmCache,
    p_blocks: list[int],
    d_blocks: list[int],
    n: int,
    before: torch.Tensor,
) -> None:
    """Every requested token arrived bit for bit, and no byte outside the requested blocks changed
    (the unused tail of the last block may be written: a whole-block copy is allowed to)."""
    assert torch.equal(decode.tokens(d_blocks, n).cpu(), prefill.tokens(p_blocks, n).cpu()), "tokens differ"
    whole = len(d_blocks) * decode.block
    pulled = decode.raw.clone()
    decode.raw.copy_(before)
    old = decode.tokens(d_blocks, whole)
    decode.raw.copy_(pulled)
    decode.write_tokens(d_blocks, whole, old)  # put the blocks' old values back: all must be as before
    assert torch.equal(decode.raw, before), "bytes outside the requested blocks changed"
