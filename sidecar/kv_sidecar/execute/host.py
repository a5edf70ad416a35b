"""CPU executor: carry out one decode rank's read of a request with torch host ops.

Every rank's tensors are seen through one canonical strided view
`[layer, kv, kernel_block, token_in_kernel_block, local_head, dim]` (kv and
head have size 1 for MLA), built from the layout table in the spec. A copy is
then token-level: tokens [start_token, num_tokens) are mapped to
(kernel block, slot) on each side by vectorised index arithmetic. Layout,
block size (any ratio), kernel block size, cross-layer and head slicing all
reduce to that index arithmetic and strides, and nothing outside the
addressed token slots and heads is ever written.

The tokens then move as *runs*: tokens that follow each other in memory on
both sides (a kernel block's slots; consecutive kernel blocks too where a
side's view lets its blocks and slots be one axis) go as one strided
`copy_`. Torch's CPU advanced indexing moves an element at a time (~2 GB/s
here against ~20 GB/s for a strided copy, bench/host_copy.py), so runs are
taken unless there are so many short ones that the calls cost more: then one
advanced-index gather and index_put move them all.

Tensors are viewed as same-width integers: the copy is bitwise (NaN payloads
survive) and works for dtypes CPU indexing lacks kernels for (float8).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_sidecar.plan.blocks import BlockIds, check_copy
from kv_sidecar.plan.spec import K_TRANSPOSED, EngineSpec, PlanError, kv_in_last_dim, tensor_dims

CANONICAL = "LKNBHD"  # layer, K/V, kernel block, token in kernel block, local head, dim

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RankView:
    """A rank's registered tensors seen through its spec.

    `layers` is one canonical view `[L, K, N, B, H, D]` when all layers can be
    addressed as one strided tensor (cross-layer, or per-layer tensors equally
    spaced in one storage); otherwise one `[1, K, N, B, H, D]` view per layer.
    A layout whose K plane is transposed (`K_TRANSPOSED`) has no single strided
    view of both planes: `layers` then holds the K plane's views and `v_layers`
    the V plane's, the same way, each with a K dim of size 1.
    """

    spec: EngineSpec
    rank: int
    layers: tuple[torch.Tensor, ...]
    v_layers: tuple[torch.Tensor, ...] = ()

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def is_single_view(self) -> bool:
        return len(self.layers) == 1

    @property
    def split_planes(self) -> bool:
        return bool(self.v_layers)

    def part(self, layer: int | None, plane: int | None) -> torch.Tensor:
        """`[l, k, N, B, H, D]` over every layer (None; single views only) or one, every plane (None) or one."""
        views = self.layers
        if self.v_layers:
            if plane is None:
                raise ValueError("a split-plane view has no view of both planes")
            views, plane = (self.layers, self.v_layers)[plane], None
        if layer is None or len(views) == 1:
            view = views[0] if layer is None else views[0][layer : layer + 1]
        else:
            view = views[layer]
        return view if plane is None else view[:, plane : plane + 1]


def rank_view(spec: EngineSpec, rank: int, tensors: Sequence[torch.Tensor]) -> RankView:
    """Validate `tensors` against `spec.rank_tensor_shapes()` and build the canonical view(s)."""
    if not 0 <= rank < spec.tp_size:
        raise PlanError(f"rank {rank} out of range for tp_size {spec.tp_size}")
    shapes = spec.rank_tensor_shapes()
    if len(tensors) != len(shapes):
        raise PlanError(f"rank {rank}: expected {len(shapes)} KV tensors, got {len(tensors)}")
    want_dtype = getattr(torch, spec.dtype)
    for i, (tensor, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if tuple(tensor.shape) != shape:
            raise PlanError(
                f"rank {rank} tensor {i}: shape {tuple(tensor.shape)} does not match spec {shape}"
            )
        if tensor.dtype != want_dtype:
            raise PlanError(f"rank {rank} tensor {i}: dtype {tensor.dtype} does not match spec {spec.dtype}")
        if not tensor.is_contiguous():
            raise PlanError(f"rank {rank} tensor {i}: must be contiguous (strides {tensor.stride()})")
        if tensor.device != tensors[0].device:
            raise PlanError(f"rank {rank} tensor {i}: on {tensor.device}, tensor 0 on {tensors[0].device}")
    as_ints = [t.view(_INT_OF_WIDTH[spec.element_size]) for t in tensors]
    canon = [_canonical(spec, t) for t in as_ints]
    if spec.layout not in K_TRANSPOSED:
        return RankView(spec, rank, _layer_views(spec, canon))
    kdim = 1 if spec.cross_layer else 0
    k_plane = [_transpose_tiles(c.narrow(kdim, 0, 1)) for c in canon]
    v_plane = [c.narrow(kdim, 1, 1) for c in canon]
    return RankView(spec, rank, _layer_views(spec, k_plane), _layer_views(spec, v_plane))


def _layer_views(spec: EngineSpec, canon: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if spec.cross_layer:
        return (canon[0],)
    stacked = _stack_equally_spaced(canon)
    if stacked is not None:
        return (stacked,)
    # Layers in separate allocations (or unevenly spaced) cannot be one view:
    # the copy then loops over layers, one gather + index_put each.
    return tuple(c.unsqueeze(0) for c in canon)


def _transpose_tiles(view: torch.Tensor) -> torch.Tensor:
    """A canonical view (last dims B, H, D) of a plane stored [D, B] per head: B steps by 1, D by B."""
    strides = list(view.stride())
    strides[-3], strides[-1] = 1, view.shape[-3]
    return view.as_strided(view.shape, strides, view.storage_offset())


def _canonical(spec: EngineSpec, tensor: torch.Tensor) -> torch.Tensor:
    """View one registered tensor in canonical dim order (with L only if cross-layer)."""
    dims = tensor_dims(spec)
    if kv_in_last_dim(spec.layout):
        # Last dim is 2*D with K in the first half: split it into (K, D).
        tensor = tensor.unflatten(-1, (2, spec.head_dim))
    for letter in "KH":  # MLA has no K/V split and no head dim: add them with size 1
        if letter not in dims:
            tensor = tensor.unsqueeze(-1)
            dims += letter
    wanted = CANONICAL if spec.cross_layer else CANONICAL[1:]
    return tensor.permute([dims.index(letter) for letter in wanted])


def _stack_equally_spaced(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One [L, ...] view over per-layer views that share a storage at a constant, non-overlapping stride."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != storage for v in views):
        return None
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0]
    if any(b - a != step for a, b in itertools.pairwise(offsets)):
        return None
    if step < first.numel():  # overlapping or reversed layers: not a sane cache, do not fuse
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


def copy_request(
    src: RankView,
    dst: RankView,
    heads: tuple[int, int] | None,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    num_tokens: int,
    start_token: int = 0,
) -> int:
    """Copy tokens [start_token, num_tokens) of global heads `heads` from src into dst; return bytes written.

    Block id conventions and every check: `kv_sidecar.plan.blocks.check_copy`.
    """
    shape = check_copy(
        src.spec, src.rank, dst.spec, dst.rank, heads, src_block_ids, dst_block_ids, num_tokens, start_token
    )
    if start_token == num_tokens:
        return 0
    src_heads = slice(shape.src_head0, shape.src_head0 + shape.num_heads)
    dst_heads = slice(shape.dst_head0, shape.dst_head0 + shape.num_heads)
    tokens = np.arange(start_token, num_tokens, dtype=np.int64)
    s_at = _slots(src_block_ids, shape.src_first, src.spec, tokens)
    d_at = _slots(dst_block_ids, start_token // dst.spec.block_size, dst.spec, tokens)
    pairs = _layer_pairs(src, dst)
    if any(s.untyped_storage().data_ptr() == d.untyped_storage().data_ptr() for s, d in pairs):
        # One storage on both sides (a rank copied into itself): runs written in turn could read what an
        # earlier run wrote, where a gather reads everything first.
        return _copy_indexed(pairs, (*s_at, src_heads), (*d_at, dst_heads), dst.spec.element_size)
    s_axes = [_token_axis(v) for v, _ in pairs]
    d_axes = [_token_axis(v) for _, v in pairs]
    runs = _runs(
        _rows(s_at, src.spec.physical_block_size, all(a is not None for a in s_axes)),
        _rows(d_at, dst.spec.physical_block_size, all(a is not None for a in d_axes)),
    )
    token_bytes = sum(d.shape[0] * d.shape[1] * d.shape[-1] for _, d in pairs) * shape.num_heads
    if not _runs_pay(len(runs), len(pairs), len(tokens) * token_bytes * dst.spec.element_size):
        return _copy_indexed(pairs, (*s_at, src_heads), (*d_at, dst_heads), dst.spec.element_size)
    written = 0
    for (s_view, d_view), s_axis, d_axis in zip(pairs, s_axes, d_axes, strict=True):
        for i, n in runs:
            data = _run(s_view, s_axis, int(s_at[0][i]), int(s_at[1][i]), n, src_heads)
            _run(d_view, d_axis, int(d_at[0][i]), int(d_at[1][i]), n, dst_heads).copy_(data)
            written += data.numel()
    return written * dst.spec.element_size


# What a strided copy_ call and an advanced-index copy cost on the host (bench/host_copy.py): a run costs
# a call, the indexed copy a few calls and its bytes at element-at-a-time speed.
_RUN_CALL_S = 6e-6
_INDEXED_CALL_S = 20e-6
_INDEXED_BYTES_PER_S = 2e9


def _runs_pay(runs: int, pairs: int, nbytes: int) -> bool:
    """Whether `runs` strided copies per (layer, plane) pair beat one advanced-index copy per pair."""
    return runs * pairs * _RUN_CALL_S <= pairs * _INDEXED_CALL_S + nbytes / _INDEXED_BYTES_PER_S


def _slots(
    block_ids: BlockIds, first_pos: int, spec: EngineSpec, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(kernel block, slot in kernel block) of each token; block_ids[0] holds block number first_pos."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    in_block = tokens % spec.block_size
    logical = ids[tokens // spec.block_size - first_pos]
    kernel_block = logical * spec.kernel_blocks_per_block + in_block // spec.physical_block_size
    return kernel_block, in_block % spec.physical_block_size


def _token_axis(view: torch.Tensor) -> torch.Tensor | None:
    """A canonical view `[L, K, N, B, H, D]` as `[L, K, N*B, H, D]` where its kernel blocks follow each
    other in memory (N's stride is B slots), so that a run may cross from one kernel block into the
    next; None where they do not (heads between the slots, a transposed plane)."""
    if view.shape[2] > 1 and view.stride(2) != view.shape[3] * view.stride(3):
        return None
    shape = (*view.shape[:2], view.shape[2] * view.shape[3], *view.shape[4:])
    strides = (*view.stride()[:2], *view.stride()[3:])
    return view.as_strided(shape, strides, view.storage_offset())


def _rows(at: tuple[np.ndarray, np.ndarray], kernel_block_size: int, joined: bool) -> np.ndarray:
    """Each token's row on one side: consecutive rows are consecutive in memory. Where the kernel blocks
    are not one axis (`joined` False), a block's rows are spaced one apart from the next block's, so that
    no run crosses a kernel block."""
    block, slot = at
    return block * (kernel_block_size + (0 if joined else 1)) + slot


def _runs(s_rows: np.ndarray, d_rows: np.ndarray) -> list[tuple[int, int]]:
    """(first token index, length) of each run of tokens that follow each other on both sides."""
    breaks = np.flatnonzero((np.diff(s_rows) != 1) | (np.diff(d_rows) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(s_rows)]))
    return list(zip(starts.tolist(), (ends - starts).tolist(), strict=True))


def _run(
    view: torch.Tensor, axis: torch.Tensor | None, block: int, slot: int, n: int, heads: slice
) -> torch.Tensor:
    """`[L, K, n, H, D]`: n tokens from (kernel block, slot) on, through the joined axis if there is one."""
    if axis is not None:
        row = block * view.shape[3] + slot
        return axis[:, :, row : row + n, heads]
    return view[:, :, block, slot : slot + n, heads]


def _copy_indexed(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    src_at: tuple[np.ndarray, np.ndarray, slice],
    dst_at: tuple[np.ndarray, np.ndarray, slice],
    element_size: int,
) -> int:
    """Every token at once: one advanced-index gather and one index_put per (layer, plane) pair."""
    s_dev, d_dev = pairs[0][0].device, pairs[0][1].device  # each side's views share one device
    s_block, s_slot = (torch.from_numpy(a).to(s_dev) for a in src_at[:2])
    d_block, d_slot = (torch.from_numpy(a).to(d_dev) for a in dst_at[:2])
    written = 0
    for s_view, d_view in pairs:
        # [L, K, T, H, D]: the two advanced indices are adjacent, so T lands in their place.
        data = s_view[:, :, s_block, s_slot, src_at[2]]
        d_view[:, :, d_block, d_slot, dst_at[2]] = data.to(d_dev)
        written += data.numel()
    return written * element_size


def _layer_pairs(src: RankView, dst: RankView) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching (src, dst) canonical views: one pair if both are single views, else one per layer;
    one per plane too where either side keeps its planes apart."""
    layers: list[int | None] = (
        [None] if src.is_single_view and dst.is_single_view else list(range(src.spec.num_layers))
    )
    planes: list[int | None] = [0, 1] if src.split_planes or dst.split_planes else [None]
    return [(src.part(i, p), dst.part(i, p)) for i in layers for p in planes]
