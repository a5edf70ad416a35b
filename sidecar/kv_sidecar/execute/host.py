"""CPU executor: carry out one decode rank's read of a request with torch host ops.

Every rank's tensors are seen through one canonical strided view
`[layer, kv, kernel_block, token_in_kernel_block, local_head, dim]` (kv and
head have size 1 for MLA), built from the layout table in the spec. A copy is
then token-level: tokens [start_token, num_tokens) are mapped to
(kernel block, slot) on each side by vectorised index arithmetic, gathered
from the source with one advanced index, and written into the destination
with one index_put. Layout, block size (any ratio), kernel block size,
cross-layer and head slicing all reduce to that index arithmetic and strides,
and nothing outside the addressed token slots and heads is ever written.

Tensors are viewed as same-width integers: the copy is bitwise (NaN payloads
survive) and works for dtypes CPU indexing lacks kernels for (float8).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_sidecar.plan.blocks import check_copy
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


def _slots(
    block_ids: Sequence[int], first_pos: int, spec: EngineSpec, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel block, slot in kernel block) of each token; block_ids[0] holds block number first_pos."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=tokens.device)
    in_block = tokens % spec.block_size
    logical = ids[tokens // spec.block_size - first_pos]
    kernel_block = logical * spec.kernel_blocks_per_block + in_block // spec.physical_block_size
    return kernel_block, in_block % spec.physical_block_size


def copy_request(
    src: RankView,
    dst: RankView,
    heads: tuple[int, int] | None,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
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
    bd = dst.spec.block_size
    src_first = shape.src_first
    src_tokens = torch.arange(start_token, num_tokens, device=src.device)
    dst_tokens = torch.arange(start_token, num_tokens, device=dst.device)
    s_block, s_slot = _slots(src_block_ids, src_first, src.spec, src_tokens)
    d_block, d_slot = _slots(dst_block_ids, start_token // bd, dst.spec, dst_tokens)

    written = 0
    for s_view, d_view in _layer_pairs(src, dst):
        # [L, K, T, H, D]: the two advanced indices are adjacent, so T lands in their place.
        data = s_view[:, :, s_block, s_slot, src_heads]
        d_view[:, :, d_block, d_slot, dst_heads] = data.to(d_view.device)
        written += data.numel() * dst.spec.element_size
    return written


def _layer_pairs(src: RankView, dst: RankView) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching (src, dst) canonical views: one pair if both are single views, else one per layer;
    one per plane too where either side keeps its planes apart."""
    layers: list[int | None] = (
        [None] if src.is_single_view and dst.is_single_view else list(range(src.spec.num_layers))
    )
    planes: list[int | None] = [0, 1] if src.split_planes or dst.split_planes else [None]
    return [(src.part(i, p), dst.part(i, p)) for i in layers for p in planes]
