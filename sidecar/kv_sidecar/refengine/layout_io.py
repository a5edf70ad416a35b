"""Write and read one logical block of a rank's cache, layout by layout.

Deliberately plain (one block at a time, explicit per-layout indexing) and
independent of the executors, so it can serve as the reference they are
checked against.
"""

from __future__ import annotations

import torch

from kv_sidecar.plan.spec import EngineSpec, Layout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def logical_kv(spec: EngineSpec, num_tokens: int, seed: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] (MLA: [layers, 1, tokens, 1, latent]) of seeded random bits.

    Random bit patterns, not random numbers: every byte value occurs (NaNs
    too), which is what a byte-exact mover must carry, and it is fast.
    """
    g = torch.Generator().manual_seed(seed)
    kv = 1 if spec.is_mla else 2
    heads = 1 if spec.is_mla else spec.num_kv_heads
    bits = torch.empty(
        spec.num_layers, kv, num_tokens, heads, spec.head_dim, dtype=_INT_OF_SIZE[spec.element_size]
    )
    return bits.random_(generator=g).view(getattr(torch, spec.dtype))


def _block_slot(spec: EngineSpec, tensors: list[torch.Tensor], layer: int, block: int) -> torch.Tensor:
    """A view [kv, r*kb tokens..., heads, dim]-ish of one logical block in one layer, in physical dim order."""
    r = spec.kernel_blocks_per_block
    if spec.cross_layer:
        return tensors[0][block * r : (block + 1) * r, layer]  # [r, <layer shape without N>]
    t = tensors[layer]
    if spec.layout in (Layout.FLASH_ATTN_NHD, Layout.FLASH_ATTN_HND):
        return t[:, block * r : (block + 1) * r].transpose(0, 1)  # [r, 2, ...]
    return t[block * r : (block + 1) * r]


def _to_physical(spec: EngineSpec, x: torch.Tensor) -> torch.Tensor:
    """x: [kv, tokens(block_size), heads, dim] -> [r, <per-kernel-block physical dims>]."""
    r, kb = spec.kernel_blocks_per_block, spec.physical_block_size
    kv, _, h, d = x.shape
    x = x.reshape(kv, r, kb, h, d).permute(1, 0, 2, 3, 4)  # [r, kv, kb, h, d]
    lay = spec.layout
    if lay in (Layout.FLASH_ATTN_NHD, Layout.FLASHINFER_NHD):
        return x
    if lay in (Layout.FLASH_ATTN_HND, Layout.FLASHINFER_HND):
        return x.permute(0, 1, 3, 2, 4)
    if lay is Layout.PACKED:
        return torch.cat([x[:, 0], x[:, 1]], dim=-1).permute(0, 2, 1, 3)  # [r, h, kb, 2d]
    if lay is Layout.PACKED_NHD:
        return torch.cat([x[:, 0], x[:, 1]], dim=-1)  # [r, kb, h, 2d]
    if lay is Layout.VLLM_CPU:  # [r, h, kv, kb, d] in shape; the K tile holds [d, kb]
        k = x[:, 0].permute(0, 2, 3, 1).reshape(r, h, 1, kb, d)  # [r, h, d, kb], read as [kb, d]
        return torch.cat([k, x[:, 1].permute(0, 2, 1, 3)[:, :, None]], dim=2)
    if lay is Layout.MLA:
        return x[:, 0, :, 0, :]  # [r, kb, latent]
    raise AssertionError(f"no reference writer for layout {lay.value}")


def _from_physical(spec: EngineSpec, y: torch.Tensor) -> torch.Tensor:
    _r, _kb = spec.kernel_blocks_per_block, spec.physical_block_size
    lay = spec.layout
    if lay in (Layout.FLASH_ATTN_NHD, Layout.FLASHINFER_NHD):
        x = y
    elif lay in (Layout.FLASH_ATTN_HND, Layout.FLASHINFER_HND):
        x = y.permute(0, 1, 3, 2, 4)
    elif lay is Layout.PACKED:
        d = y.shape[-1] // 2
        z = y.permute(0, 2, 1, 3)  # [r, kb, h, 2d]
        x = torch.stack([z[..., :d], z[..., d:]], dim=1)
    elif lay is Layout.PACKED_NHD:
        d = y.shape[-1] // 2  # y: [r, kb, h, 2d], K in the first half
        x = torch.stack([y[..., :d], y[..., d:]], dim=1)
    elif lay is Layout.VLLM_CPU:  # y: [r, h, kv, kb, d], the K tile holding [d, kb]
        r, h, _, kb, d = y.shape
        k = y[:, :, 0].reshape(r, h, d, kb).permute(0, 3, 1, 2)  # [r, kb, h, d]
        x = torch.stack([k, y[:, :, 1].permute(0, 2, 1, 3)], dim=1)
    elif lay is Layout.MLA:
        x = y[:, None, :, None, :]
    else:
        raise AssertionError(f"no reference reader for layout {lay.value}")
    kv, h, d = x.shape[1], x.shape[3], x.shape[4]
    return x.permute(1, 0, 2, 3, 4).reshape(kv, -1, h, d)  # [kv, kernel blocks * kb, h, d]


def write_block(
    spec: EngineSpec, tensors: list[torch.Tensor], layer: int, block: int, x: torch.Tensor
) -> None:
    """x: [kv, block_size, heads_local, dim]."""
    _block_slot(spec, tensors, layer, block).copy_(_to_physical(spec, x))


def read_block(spec: EngineSpec, tensors: list[torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return _from_physical(spec, _block_slot(spec, tensors, layer, block))


def fill_request(
    spec: EngineSpec,
    rank: int,
    tensors: list[torch.Tensor],
    block_ids: list[int],
    logical: torch.Tensor,
    first_token: int = 0,
) -> None:
    """Write the rank's shard of `logical` into `block_ids`: tokens [first_token, all) from the block of
    first_token (a block boundary) on, as a sliding-window engine holds only its window's blocks."""
    h0, h1 = spec.rank_heads(rank)
    bs, tokens = spec.block_size, logical.shape[2]
    for j, b in enumerate(block_ids, start=first_token // bs):
        t0, t1 = j * bs, min(tokens, (j + 1) * bs)
        for layer in range(spec.num_layers):
            # On `logical`'s device: from a GPU, every write is a kernel the host does not wait for.
            x = torch.zeros(
                logical.shape[1], bs, h1 - h0, spec.head_dim, dtype=logical.dtype, device=logical.device
            )
            x[:, : t1 - t0] = logical[layer, :, t0:t1, h0:h1]
            write_block(spec, tensors, layer, b, x)


def gather_blocks(
    spec: EngineSpec, tensors: list[torch.Tensor], layer: int, block_ids: list[int]
) -> torch.Tensor:
    """Copy of logical blocks in one layer as [n, kv, block_size, heads_local, dim] (one gather, no loop)."""
    r = spec.kernel_blocks_per_block
    idx = (torch.tensor(block_ids, dtype=torch.int64)[:, None] * r + torch.arange(r)[None, :]).flatten()
    idx = idx.to(tensors[0].device)
    if spec.cross_layer:
        y = tensors[0][:, layer].index_select(0, idx)
    elif block_dim(spec) == 1:
        y = tensors[layer].index_select(1, idx).transpose(0, 1)
    else:
        y = tensors[layer].index_select(0, idx)
    y = y.reshape(len(block_ids), r, *y.shape[1:])
    flat = _from_physical(spec, y.reshape(len(block_ids) * r, *y.shape[2:]))  # [kv, n*block_size, h, d]
    kv, _, h, d = flat.shape
    return flat.reshape(kv, len(block_ids), spec.block_size, h, d).transpose(0, 1)


def check_request(
    spec: EngineSpec,
    rank: int,
    tensors: list[torch.Tensor],
    block_ids: list[int],
    logical: torch.Tensor,
    start_token: int = 0,
) -> list[str]:
    """Compare tokens [start_token, tokens) in `block_ids` with `logical`; returns mismatches."""
    h0, h1 = spec.rank_heads(rank)
    tokens = logical.shape[2]
    n = tokens - start_token
    errors: list[str] = []
    for layer in range(spec.num_layers):
        got = gather_blocks(spec, tensors, layer, block_ids)  # [nb, kv, B, h, d]
        got = got.transpose(0, 1).reshape(got.shape[1], -1, *got.shape[3:])[:, :n]
        want = logical[layer, :, start_token:, h0:h1].to(got.device)
        if not torch.equal(_bits(got), _bits(want)):
            bad = (_bits(got) != _bits(want)).reshape(got.shape[0], n, -1).any(-1).any(0).nonzero().flatten()
            first = int(bad[0]) // spec.block_size
            errors.append(
                f"rank {rank} layer {layer}: {len(bad)} tokens differ, first in block "
                f"{block_ids[first]} (token {start_token + int(bad[0])})"
            )
    return errors


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare raw bytes: NaN != NaN and -0.0 == 0.0 must not hide a difference."""
    return t.contiguous().view(torch.uint8)


def block_dim(spec: EngineSpec) -> int:
    return 1 if spec.layout in (Layout.FLASH_ATTN_NHD, Layout.FLASH_ATTN_HND) and not spec.cross_layer else 0


def changed_outside(
    spec: EngineSpec, before: list[torch.Tensor], after: list[torch.Tensor], block_ids: list[int]
) -> list[str]:
    """Tensors whose bytes changed outside `block_ids` (kernel blocks expanded)."""
    r, dim = spec.kernel_blocks_per_block, block_dim(spec)
    keep = torch.ones(spec.num_blocks * r, dtype=torch.bool)
    for b in block_ids:
        keep[b * r : (b + 1) * r] = False
    idx = keep.nonzero().flatten()
    return [
        f"tensor {i} changed outside the requested blocks"
        for i, (x, y) in enumerate(zip(before, after, strict=True))
        if not torch.equal(
            _bits(x.index_select(dim, idx.to(x.device))), _bits(y.index_select(dim, idx.to(y.device)))
        )
    ]
