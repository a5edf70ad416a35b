"""Reference model for the planner tests: a logical KV and a loop-based materialiser.

Deliberately independent of the executor: no strided views, no layout
tables, just one explicit index tuple per layout, written into numpy arrays
one head vector at a time. Sizes in the tests are small, so loops are fine.
Values are integers of the dtype's width, so comparisons are bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_sidecar.plan.spec import EngineSpec

INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def logical_kv(spec: EngineSpec, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """[layers, planes, tokens, heads, dim] of distinct non-zero values (MLA: planes = heads = 1)."""
    planes, heads = (1, 1) if spec.is_mla else (2, spec.num_kv_heads)
    shape = (spec.num_layers, planes, num_tokens, heads, spec.head_dim)
    count = int(np.prod(shape))
    assert count < 2 ** (8 * spec.element_size - 1), "too many values to keep them distinct"
    values = rng.permutation(count) + 1
    return values.reshape(shape).astype(_np_int(spec))


def _np_int(spec: EngineSpec) -> type[np.integer]:
    return {1: np.int8, 2: np.int16, 4: np.int32}[spec.element_size]


@dataclass
class RankCache:
    """One rank's tensors as torch (for the executor) and numpy (for the oracle) over the same memory."""

    tensors: list[torch.Tensor]  # integer dtype of the spec's width

    def as_spec_dtype(self, spec: EngineSpec) -> list[torch.Tensor]:
        return [t.view(getattr(torch, spec.dtype)) for t in self.tensors]

    def arrays(self) -> list[np.ndarray]:
        return [t.numpy() for t in self.tensors]

    def snapshot(self) -> list[np.ndarray]:
        return [a.copy() for a in self.arrays()]


def allocate(spec: EngineSpec, storage: str, rng: np.random.Generator) -> RankCache:
    """Random-filled tensors of spec.rank_tensor_shapes().

    storage: "separate" (one allocation per tensor), "packed" (per-layer
    tensors back to back in one allocation), "gapped" (one allocation, equal
    gaps between layers), "uneven" (one allocation, unequal gaps).
    """
    dtype = INT_OF_WIDTH[spec.element_size]
    shapes = spec.rank_tensor_shapes()
    sizes = [int(np.prod(s)) for s in shapes]
    info = np.iinfo(_np_int(spec))

    def random_fill(t: torch.Tensor) -> None:
        t.numpy()[:] = rng.integers(info.min, info.max, size=t.numel(), endpoint=True, dtype=_np_int(spec))

    if storage == "separate" or len(shapes) == 1:
        flat = [torch.empty(n, dtype=dtype) for n in sizes]
        for t in flat:
            random_fill(t)
    else:
        step = {"packed": 0, "gapped": 5, "uneven": 3}[storage]
        gaps = [step * i if storage == "uneven" else step for i in range(len(sizes))]
        big = torch.empty(sum(sizes) + sum(gaps) + 7, dtype=dtype)
        random_fill(big)  # gaps too: the executor must not touch them
        flat, at = [], 7
        for n, g in zip(sizes, gaps, strict=True):
            flat.append(big[at : at + n])
            at += n + g
    return RankCache([t.view(s) for t, s in zip(flat, shapes, strict=True)])


def head_vector_index(spec: EngineSpec, layer: int, plane: int, kblock: int, slot: int, head: int) -> tuple:
    """(tensor number, numpy index) of one head vector (head_dim elements) on one rank."""
    d = spec.head_dim
    layout = spec.layout.value
    # Index per layout as written in the layout's docs: [dims...] with N = kblock.
    if layout == "flash_attn_nhd":  # [2, N, B, H, D]
        idx, n_pos = [plane, kblock, slot, head, slice(None)], 1
    elif layout == "flash_attn_hnd":  # [2, N, H, B, D]
        idx, n_pos = [plane, kblock, head, slot, slice(None)], 1
    elif layout == "flashinfer_nhd":  # [N, 2, B, H, D]
        idx, n_pos = [kblock, plane, slot, head, slice(None)], 0
    elif layout == "flashinfer_hnd":  # [N, 2, H, B, D]
        idx, n_pos = [kblock, plane, head, slot, slice(None)], 0
    elif layout == "packed":  # [N, H, B, 2D], K then V in the last dim
        idx, n_pos = [kblock, head, slot, slice(plane * d, plane * d + d)], 0
    elif layout == "packed_nhd":  # [N, B, H, 2D], K then V in the last dim
        idx, n_pos = [kblock, slot, head, slice(plane * d, plane * d + d)], 0
    elif layout == "vllm_cpu":  # [N, H, 2, B, D]; the K plane's [B, D] tile is stored [D, B]
        idx, n_pos = (
            [kblock, head, plane] + ([slice(None), slice(None)] if plane == 0 else [slot, slice(None)]),
            0,
        )
    elif layout == "mla":  # [N, B, L]
        assert plane == 0 and head == 0
        idx, n_pos = [kblock, slot, slice(None)], 0
    else:
        raise AssertionError(layout)
    if spec.cross_layer:  # [N, layers, <rest without N>]
        rest = idx[:n_pos] + idx[n_pos + 1 :]
        return 0, tuple([kblock, layer, *rest])
    return layer, tuple(idx)


def head_vector(
    spec: EngineSpec, arrays: Sequence[np.ndarray], layer: int, plane: int, kblock: int, slot: int, head: int
) -> np.ndarray:
    """A writable view of one head vector (head_dim elements) in `arrays`, the rank's tensors."""
    tensor, idx = head_vector_index(spec, layer, plane, kblock, slot, head)
    view = arrays[tensor][idx]
    if spec.layout.value == "vllm_cpu" and plane == 0:  # idx named the whole tile: [D, B], column `slot`
        view = view.reshape(spec.head_dim, -1)[:, slot]
    return view


def write_tokens(
    spec: EngineSpec,
    rank: int,
    arrays: list[np.ndarray],
    logical: np.ndarray,
    block_ids: Sequence[int],
    first_block: int,
    tokens: range,
) -> None:
    """Write `tokens` of all heads `rank` holds from `logical` into `arrays`.

    block_ids[i] is the physical block holding logical block number first_block + i.
    """
    layers, planes, _, _, _ = logical.shape
    r = spec.block_size // (spec.kernel_block_size or spec.block_size)
    kbs = spec.kernel_block_size or spec.block_size
    if spec.is_mla:
        heads = [(0, 0)]
    else:
        start, stop = spec.rank_heads(rank)
        heads = [(g, g - start) for g in range(start, stop)]
    for t in tokens:
        block = block_ids[t // spec.block_size - first_block]
        offset = t % spec.block_size
        kblock, slot = block * r + offset // kbs, offset % kbs
        for layer in range(layers):
            for plane in range(planes):
                for global_head, local_head in heads:
                    view = head_vector(spec, arrays, layer, plane, kblock, slot, local_head)
                    view[...] = logical[layer, plane, t, global_head]


def kernel_block_axis(spec: EngineSpec) -> int:
    """Axis of the (kernel) block dim in each registered tensor."""
    if spec.cross_layer:
        return 0
    return 1 if spec.layout.value.startswith("flash_attn") else 0
