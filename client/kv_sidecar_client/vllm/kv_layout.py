"""What vLLM's KV cache tensors are, in the sidecar's terms: an EngineSpec and the regions to register.

vLLM (0.32) hands a connector one view per attention layer, logically
`[blocks, heads, tokens_in_block, content]` where content is K then V
(`head_size + head_size_v` elements; MLA: the latent, one head). The physical
order follows vLLM's resolved `KVCacheLayout`, which the attention backends
choose among: LBHNC (head-major blocks: the CPU backend, FlashInfer HND),
LBNHC (token-major blocks: FlashAttention, Triton, FlashInfer NHD, the MLA
backends' default), and their block-outermost, cross-layer forms BLHNC/BLNHC.

The mapping is read off the tensors' shapes and strides, not taken on trust
from a backend name: whatever a backend declares, the bytes are where the
strides say. A cache the sidecar cannot address exactly (heads outermost,
padded pages, quantisation scales inside a page, K and V of different sizes)
is refused with a message naming the backend, layout, shape and strides.

Pure: torch tensors in, plain data out; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Our layout names (kv_sidecar.plan.spec.Layout values) for the page orders vLLM uses.
HEAD_MAJOR = "packed"  # page [heads, tokens, K|V]
TOKEN_MAJOR = "packed_nhd"  # page [tokens, heads, K|V]
MLA = "mla"  # page [tokens, latent]


class UnsupportedKVCache(ValueError):
    """vLLM's KV cache has a shape or layout the sidecar cannot move exactly."""


@dataclass(frozen=True)
class VllmKVInfo:
    """What the worker knows about its KV cache besides the tensors."""

    backend: str  # attention backend name, for messages
    layout: str  # vLLM's resolved KVCacheLayout name (e.g. "LBHNC"), for messages
    block_size: int  # the scheduler's block size (block ids are in these units)
    num_kv_heads: int  # KV heads of the whole model (all TP ranks)
    head_size: int
    head_size_v: int  # 0 for MLA
    tp_size: int
    use_mla: bool


@dataclass(frozen=True)
class KVDescription:
    spec: dict[str, Any]  # kv_sidecar EngineSpec fields (the RegisterRank spec)
    regions: list[torch.Tensor]  # contiguous views to register, in order: per layer, or one cross-layer


def describe(layers: Sequence[torch.Tensor], info: VllmKVInfo) -> KVDescription:
    """The spec and registration regions of one rank's KV cache, `layers` in model layer order."""
    import torch

    if not layers:
        raise UnsupportedKVCache("vLLM registered no KV cache tensors (an attention-free model?)")
    first = layers[0]

    def refuse(reason: str) -> UnsupportedKVCache:
        return UnsupportedKVCache(
            f"KVSidecarConnector cannot move the KV cache of attention backend {info.backend} "
            f"(vLLM KV cache layout {info.layout}): layer tensor shape {tuple(first.shape)}, strides "
            f"{tuple(first.stride())}, dtype {first.dtype}: {reason}"
        )

    if first.dim() != 4:
        raise refuse("expected vLLM's 4-D [blocks, heads, tokens, content] layer views")
    for i, t in enumerate(layers[1:], 1):
        if (t.shape, t.stride(), t.dtype, t.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise refuse(
                f"layer {i} differs (shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype}, "
                f"{t.device}); all layers must share one geometry"
            )
    kblocks, heads, tokens, content = first.shape
    s_block, s_head, s_token, s_content = first.stride()

    # -- what one page (a kernel block of one layer) holds ----------------------------
    if info.use_mla:
        if heads != 1 or content != info.head_size:
            raise refuse(f"an MLA cache should be 1 head of {info.head_size} latent elements per token")
        want_heads = 1
    else:
        if info.head_size_v != info.head_size:
            raise refuse(f"K and V heads differ in size ({info.head_size} vs {info.head_size_v})")
        if content != 2 * info.head_size:
            raise refuse(
                f"content is {content} elements, not K and V of {info.head_size} each "
                "(a quantised cache with scales inside the page?)"
            )
        want_heads = max(1, info.num_kv_heads // info.tp_size)
    if heads != want_heads:
        raise refuse(
            f"{heads} head slots per rank, expected {want_heads} "
            f"({info.num_kv_heads} KV heads over TP {info.tp_size})"
        )
    if info.block_size % tokens:
        raise refuse(f"kernel blocks of {tokens} tokens do not divide the block size {info.block_size}")
    ratio = info.block_size // tokens
    if kblocks % ratio:
        raise refuse(f"{kblocks} kernel blocks are not whole blocks of {ratio}")

    if s_content != 1:
        raise refuse("the content (K|V) dim must be innermost and dense")
    # A dim of size 1 may carry any stride (torch does not normalise them): one head is both orders.
    if s_token == content and (heads == 1 or s_head == tokens * content):
        layout = MLA if info.use_mla else HEAD_MAJOR
    elif s_head == content and s_token == heads * content:
        layout = MLA if info.use_mla else TOKEN_MAJOR
    else:
        raise refuse("a page is not one dense [heads, tokens, content] or [tokens, heads, content] run")
    page = heads * tokens * content  # elements of one kernel block of one layer

    # -- how layers and blocks interleave -----------------------------------------------
    nlayers = len(layers)
    esize = first.element_size()
    ptrs = [t.data_ptr() for t in layers]
    if s_block == page:
        cross_layer = False  # every layer a dense run of pages
    elif (
        nlayers > 1
        and ratio == 1
        and s_block == nlayers * page
        and all(p == ptrs[0] + i * page * esize for i, p in enumerate(ptrs))
    ):
        cross_layer = True  # blocks outermost, the layers of a block side by side
    else:
        raise refuse(
            f"pages are {s_block} elements apart, not {page} (one layer's blocks back to back) "
            f"or {nlayers * page} (every layer of a block together): padded pages or another "
            "cache group's data sit between blocks"
        )

    page_shape = {
        HEAD_MAJOR: (heads, tokens, content),
        TOKEN_MAJOR: (tokens, heads, content),
        MLA: (tokens, content),
    }[layout]
    shape = (kblocks, nlayers, *page_shape) if cross_layer else (kblocks, *page_shape)
    strides = _contiguous(shape)
    bases = layers[:1] if cross_layer else layers
    regions = [torch.as_strided(t, shape, strides, t.storage_offset()) for t in bases]
    spec: dict[str, Any] = {
        "tp_size": info.tp_size,
        "num_layers": nlayers,
        "num_kv_heads": 1 if info.use_mla else info.num_kv_heads,
        "head_dim": info.head_size,
        "dtype": str(first.dtype).removeprefix("torch."),
        "block_size": info.block_size,
        "num_blocks": kblocks // ratio,
        "layout": layout,
        "kernel_block_size": tokens if ratio > 1 else None,
        "cross_layer": cross_layer,
    }
    return KVDescription(spec, regions)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))
