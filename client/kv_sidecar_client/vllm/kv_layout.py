"""What vLLM's KV cache tensors are, in the sidecar's terms: an EngineSpec and the regions to register.

vLLM (0.32) hands a connector one view per attention layer, logically
`[blocks, heads, tokens_in_block, content]` where content is K then V
(`head_size + head_size_v` elements; MLA: the latent, one head). The physical
order follows vLLM's resolved `KVCacheLayout`, which the attention backends
choose among: LBHNC (head-major blocks), LBNHC (token-major blocks:
FlashAttention, Triton, FlashInfer NHD, the MLA backends' default), and their
block-outermost, cross-layer forms BLHNC/BLNHC.

The view is vLLM's claim; the attention kernels are the truth, and they need
not agree: the CPU backend takes an LBHNC page and reads each head's half as
the block's K rows and the other half as its V rows, not K|V per token
(kv-sidecar issue 30: a block-size conversion done from the view scrambled
every such cache, silently). So where the backend's own cache write is at
hand, `describe` runs it once on a scratch page and takes the layout whose
byte order matches what the kernel wrote, refusing if none does. Strides
decide how pages, blocks and layers interleave; a cache the sidecar cannot
address exactly (heads outermost, padded pages, quantisation scales inside a
page, K and V of different sizes, layers that overlap) is refused with a
message naming the layer, backend, layout, shape and strides.

Pure: torch tensors and callables in, plain data out; no vLLM import.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Our layout names (kv_sidecar.plan.spec.Layout values) for the page orders vLLM uses.
HEAD_MAJOR = "packed"  # page [heads, tokens, K|V]
TOKEN_MAJOR = "packed_nhd"  # page [tokens, heads, K|V]
KV_PLANES_HEAD_MAJOR = (
    "vllm_cpu"  # page [heads, K|V, ...]: each head's K as [dim, tokens], then V [tokens, dim]
)
MLA = "mla"  # page [tokens, latent]

# One page's dims, outermost first (K: the K/V plane, B: token, H: head, D: element), for every
# layout a dense page can be (kv_sidecar.plan.spec.LAYOUT_DIMS without the block dim N). The
# view's own order comes first among equals: with one head several orders are the same bytes.
# vllm_cpu's K plane holds each head's [B, D] tile transposed (kv_sidecar.plan.spec.K_TRANSPOSED).
PAGE_DIMS = {
    HEAD_MAJOR: "HBKD",
    TOKEN_MAJOR: "BHKD",
    KV_PLANES_HEAD_MAJOR: "HKBD",
    "flashinfer_hnd": "KHBD",
    "flashinfer_nhd": "KBHD",
}

# The backend's own cache write for one layer: (key, value, kv_cache, slot_mapping), key and value
# [tokens, heads, head_size] in the model's dtype, slot = kernel block * kernel block size + offset
# (vLLM's `AttentionImpl.do_kv_cache_update` with its layer bound).
KVWriter = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]


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
    model_dtype: Any = None  # torch dtype of the keys and values the kernels take (None: the cache's)


@dataclass(frozen=True)
class KVDescription:
    spec: dict[str, Any]  # kv_sidecar EngineSpec fields (the RegisterRank spec)
    regions: list[torch.Tensor]  # contiguous views to register, in order: per layer, or one cross-layer


def describe(
    layers: Sequence[torch.Tensor],
    info: VllmKVInfo,
    names: Sequence[str] | None = None,
    writers: Sequence[KVWriter | None] | None = None,
) -> KVDescription:
    """The spec and registration regions of one rank's KV cache, `layers` in model layer order.

    `writers[i]`, where given, is layer i's own cache write: the page order is then what it writes,
    checked on every such layer, not what the view claims.
    """
    import torch

    if not layers:
        raise UnsupportedKVCache("vLLM registered no KV cache tensors (an attention-free model?)")
    names = list(names) if names is not None else [f"layer {i}" for i in range(len(layers))]
    first = layers[0]

    def refuse(reason: str, layer: int = 0) -> UnsupportedKVCache:
        t = layers[layer]
        return UnsupportedKVCache(
            f"KVSidecarConnector cannot move the KV cache of attention backend {info.backend} "
            f"(vLLM KV cache layout {info.layout}): {names[layer]}: tensor shape {tuple(t.shape)}, strides "
            f"{tuple(t.stride())}, dtype {t.dtype}: {reason}"
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
                f"differs from {names[0]} (shape {tuple(first.shape)}, strides {tuple(first.stride())}, "
                f"{first.dtype}, {first.device}); all layers must share one geometry",
                i,
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
        _check_disjoint(layers, names, kblocks * page * esize, refuse)
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

    # -- what the kernels really write there ----------------------------------------------
    if not info.use_mla and writers is not None:
        found: tuple[str, int] | None = None  # (layout, the layer whose kernel wrote it)
        for i, write in enumerate(writers):
            if write is None:
                continue
            got = _probe_page_order(layers[i], write, info, layout, functools.partial(refuse, layer=i))
            if found is not None and got != found[0]:
                raise refuse(f"its kernel writes {got} pages, {names[found[1]]}'s kernel {found[0]}", i)
            found = found or (got, i)
        layout = found[0] if found else layout

    page_shape = _page_shape(layout, heads, tokens, content)
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


def transferred_layers(
    kv_caches: Mapping[str, torch.Tensor],
    sharing: Mapping[str, str | None],
    group_layers: Sequence[str],
    layer_index: Callable[[str], int],
) -> list[str]:
    """The layers whose caches the sidecar moves, in model order: every layer vLLM gave a cache,
    less those vLLM declares as reading another layer's cache (`kv_sharing_target_layer_name`),
    each checked to be exactly that layer's tensor. A layer of the KV cache groups that has no
    cache, or a cache nobody can explain, stops registration naming the layer."""
    missing = sorted(set(group_layers) - set(kv_caches))
    if missing:
        raise UnsupportedKVCache(
            f"KVSidecarConnector: vLLM's KV cache groups name layers {missing} but gave the connector no "
            "cache for them; the sidecar would move an incomplete cache"
        )
    names = []
    for name in sorted(kv_caches, key=layer_index):
        target = sharing.get(name)
        if target is None:
            names.append(name)
            continue
        mine, theirs = kv_caches[name], kv_caches.get(target)
        if theirs is None or (mine.data_ptr(), mine.shape, mine.stride()) != (
            theirs.data_ptr(),
            theirs.shape,
            theirs.stride(),
        ):
            raise UnsupportedKVCache(
                f"KVSidecarConnector: {name} is declared to share {target}'s KV cache, but its tensor is not "
                f"{target}'s (shape {tuple(mine.shape)}, strides {tuple(mine.stride())}, at {mine.data_ptr():#x})"
            )
    return names


def check_covers_allocation(desc: KVDescription, allocated: Sequence[int]) -> None:
    """The regions registered must be every byte vLLM allocated for the KV cache, no more and no less."""
    registered = sum(r.numel() * r.element_size() for r in desc.regions)
    if registered != sum(allocated):
        raise UnsupportedKVCache(
            f"KVSidecarConnector: vLLM allocated {sum(allocated)} bytes of KV cache ({len(allocated)} "
            f"tensor(s)), but the spec derived from its layers ({desc.spec}) accounts for {registered}: "
            "some layer's bytes would not be moved, or be moved as another's"
        )


def _page_shape(layout: str, heads: int, tokens: int, content: int) -> tuple[int, ...]:
    if layout == MLA:
        return (tokens, content)
    sizes = {"K": 2, "B": tokens, "H": heads, "D": content // 2}
    dims = PAGE_DIMS[layout]
    if dims.endswith("KD"):  # K and V side by side in the last dim
        return (*(sizes[d] for d in dims[:-2]), content)
    return tuple(sizes[d] for d in dims)


def _pages(layout: str, logical: torch.Tensor) -> torch.Tensor:
    """[N, page elements] holding `logical` ([N, K, B, H, D]) in `layout`'s page order."""
    import torch

    n = logical.shape[0]
    if layout == KV_PLANES_HEAD_MAJOR:
        k = logical[:, 0].permute(0, 2, 3, 1).reshape(n, logical.shape[3], -1)  # [N, H, D*B]
        v = logical[:, 1].permute(0, 2, 1, 3).reshape(n, logical.shape[3], -1)  # [N, H, B*D]
        return torch.cat([k, v], dim=2).reshape(n, -1)
    dims = PAGE_DIMS[layout]
    return logical.permute(0, *(1 + "KBHD".index(c) for c in dims)).reshape(n, -1)


def _check_disjoint(
    layers: Sequence[torch.Tensor],
    names: Sequence[str],
    nbytes: int,
    refuse: Callable[[str, int], UnsupportedKVCache],
) -> None:
    """Per-layer caches must not share bytes: the sidecar would move one layer's data as another's."""
    spans = sorted((t.data_ptr(), i) for i, t in enumerate(layers))
    for (start, i), (next_start, j) in itertools.pairwise(spans):
        if start + nbytes > next_start:
            raise refuse(
                f"its {nbytes} bytes overlap {names[j]}'s (a layer that shares another's cache "
                "must be left out of the registration, and only a layer vLLM declares as sharing may be)",
                i,
            )


def _probe_page_order(
    view: torch.Tensor,
    write: KVWriter,
    info: VllmKVInfo,
    natural: str,
    refuse: Callable[[str], UnsupportedKVCache],
) -> str:
    """Run the backend's cache write on a scratch copy of two pages; the layout whose order it matches.

    Where each logical element (block, K/V, token, head, dim) lands is read off in binary: pass j
    writes 1 to the elements whose number has bit j set and 0 to the rest, so every page element
    collects the number of the logical element the kernel put there. Only zero and non-zero are
    read, so a kernel that converts on the way in (fp8 quantisation, a scale) is probed as well.
    """
    import torch

    _, heads, tokens, content = view.shape
    d = content // 2
    nblocks = min(2, view.shape[0])
    s_block = view.stride(0)
    page = heads * tokens * content
    span = (nblocks - 1) * s_block + page
    scratch_flat = torch.zeros(span, dtype=view.dtype, device=view.device)
    scratch = torch.as_strided(scratch_flat, (nblocks, *view.shape[1:]), view.stride(), 0)
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[view.element_size()]
    n = nblocks * tokens
    # [K, tokens (both blocks), H, D] in the order the kernel takes keys and values.
    numbers = torch.arange(2 * n * heads * d, dtype=torch.int64).view(2, n, heads, d)
    slots = torch.arange(n, dtype=torch.int64, device=view.device)
    model_dtype = info.model_dtype or (view.dtype if view.dtype.is_floating_point else torch.float32)

    def written(values: torch.Tensor) -> torch.Tensor:
        """[N, page] booleans: which page elements the kernel left non-zero for these 0/1 inputs."""
        scratch_flat.zero_()
        kv = values.to(device=view.device, dtype=model_dtype)
        try:
            write(kv[0], kv[1], scratch, slots)
        except Exception as e:  # not verifiable: do not register on a guess
            raise refuse(
                f"running the backend's own KV cache write on a scratch page (to check where it puts "
                f"K and V) failed: {type(e).__name__}: {e}"
            ) from e
        flat = scratch_flat.view(width) != 0
        return torch.stack([flat[b * s_block : b * s_block + page] for b in range(nblocks)]).cpu()

    if not bool(written(torch.ones(numbers.shape)).all()):
        raise refuse(
            "the backend's own KV cache write of K and V for every token leaves part of a page unwritten"
        )
    found = torch.zeros(nblocks, page, dtype=torch.int64)
    for bit in range(max(1, int(numbers.max()).bit_length())):
        found |= written(((numbers >> bit) & 1).float()).long() << bit
    # The same numbers as [N, K, B, H, D], the order _pages takes.
    logical = numbers.view(2, nblocks, tokens, heads, d).permute(1, 0, 2, 3, 4)
    for name in [natural] + [name for name in PAGE_DIMS if name != natural]:
        if torch.equal(found, _pages(name, logical)):
            return name
    raise refuse(
        "the backend's own KV cache write puts K and V where none of the sidecar's page orders "
        f"({', '.join(f'{k} {v}' for k, v in PAGE_DIMS.items())}) would"
    )


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))
