"""Where each block's bytes sit in a rank's tensors: NIXL descriptor tables.

In every supported layout a logical block is a contiguous run of bytes for each
index of the dims *before* the block dim (K/V for kv-first layouts, nothing for
blocks-first and cross-layer ones). One such run is a "chunk"; a rank has
regions x outer x num_blocks chunks. Pure numpy, no I/O.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from kv_sidecar.plan.spec import EngineSpec, tensor_dims


@dataclass(frozen=True)
class ChunkGeometry:
    regions: int  # tensors per rank
    outer: int  # chunks per block per region
    outer_stride: int  # bytes between consecutive outer indices
    chunk: int  # bytes of one block's run (all kernel blocks of a logical block)
    num_blocks: int
    region_bytes: int

    @property
    def chunks_per_rank(self) -> int:
        return self.regions * self.outer * self.num_blocks


@functools.lru_cache(maxsize=256)  # specs are frozen; pull paths ask per READ
def chunk_geometry(spec: EngineSpec) -> ChunkGeometry:
    shapes = spec.rank_tensor_shapes()
    shape = shapes[0]
    # Only dims after N are ever merged (a packed K/V last dim), so the letter's
    # position is the axis in the registered shape.
    block_dim = tensor_dims(spec).index("N")
    per_kernel_block = math.prod(shape[block_dim + 1 :]) * spec.element_size
    return ChunkGeometry(
        regions=len(shapes),
        outer=math.prod(shape[:block_dim]),
        outer_stride=shape[block_dim] * per_kernel_block,
        chunk=per_kernel_block * spec.kernel_blocks_per_block,
        num_blocks=spec.num_blocks,
        region_bytes=math.prod(shape) * spec.element_size,
    )


def chunk_indices(geo: ChunkGeometry, block_ids: np.ndarray) -> np.ndarray:
    """Indices into `descriptor_table` for these blocks, ordered region, outer, block."""
    base = np.arange(geo.regions * geo.outer, dtype=np.int64) * geo.num_blocks
    return (base[:, None] + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1)


def descriptors(
    geo: ChunkGeometry, region_bases: list[int], block_ids: np.ndarray, device: int = 0
) -> np.ndarray:
    """(M, 3) uint64 [address, length, device] for these blocks, same order as chunk_indices."""
    if len(region_bases) != geo.regions:
        raise ValueError(f"expected {geo.regions} region addresses, got {len(region_bases)}")
    bases = (
        np.asarray(region_bases, dtype=np.uint64)[:, None]
        + (np.arange(geo.outer, dtype=np.uint64) * np.uint64(geo.outer_stride))[None, :]
    )
    addrs = bases.reshape(-1)[:, None] + np.asarray(block_ids, dtype=np.uint64)[None, :] * np.uint64(
        geo.chunk
    )
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs.reshape(-1)
    out[:, 1] = geo.chunk
    out[:, 2] = device
    return out


def descriptor_table(geo: ChunkGeometry, region_bases: list[int], device: int = 0) -> np.ndarray:
    """Every chunk of a rank, to prepare once as a NIXL dlist."""
    return descriptors(geo, region_bases, np.arange(geo.num_blocks), device)


def by_destination(dst_ids: np.ndarray, src_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (destination, source) block pairs ordered by destination id. Which block goes where is
    unchanged; a table that runs backwards on both sides (vLLM frees a request's blocks last first, so
    its next requests often get descending ids) then runs forwards, and its blocks are neighbours in
    the descriptor list too."""
    dst = np.asarray(dst_ids, dtype=np.int64)
    src = np.asarray(src_ids, dtype=np.int64)
    if dst.shape != src.shape or dst.ndim != 1:
        raise ValueError(f"block id lists differ in shape: {dst.shape} and {src.shape}")
    if dst.size > 1 and not (np.diff(dst) > 0).all():
        order = np.argsort(dst, kind="stable")
        dst, src = dst[order], src[order]
    return dst, src


def block_runs(dst_ids: np.ndarray, src_ids: np.ndarray) -> np.ndarray:
    """(R, 3) int64 [dst start, src start, count]: the pairs ordered by destination id, cut into maximal
    runs where both the destination and the source block ids go up by one. A run's blocks sit back to
    back on both sides."""
    dst, src = by_destination(dst_ids, src_ids)
    if dst.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [dst.size])))
    return np.stack([dst[starts], src[starts], counts], axis=1)


def merged_segments(
    local: ChunkGeometry, remote: ChunkGeometry, dst_ids: np.ndarray, src_ids: np.ndarray
) -> np.ndarray:
    """(M, 4) int64 [region, local offset, remote offset, length]: the bytes an identity READ of
    src_ids into dst_ids moves, one segment per (region, outer index, run of `block_runs`), ordered
    region, outer, run (runs by destination id). Offsets are from the region's start; the two sides may
    hold different numbers of blocks (so different outer strides) but must agree on everything else."""
    if (local.regions, local.outer, local.chunk) != (remote.regions, remote.outer, remote.chunk):
        raise ValueError(f"chunk geometries differ beyond their block counts: {local} and {remote}")
    runs = block_runs(dst_ids, src_ids)
    outer = np.arange(local.outer, dtype=np.int64)
    # (outer, run) grid, then repeated per region.
    loc = (outer * local.outer_stride)[:, None] + (runs[:, 0] * local.chunk)[None, :]
    rem = (outer * remote.outer_stride)[:, None] + (runs[:, 1] * remote.chunk)[None, :]
    length = np.broadcast_to((runs[:, 2] * local.chunk)[None, :], loc.shape)
    per_region = loc.size
    out = np.empty((local.regions * per_region, 4), dtype=np.int64)
    out[:, 0] = np.repeat(np.arange(local.regions, dtype=np.int64), per_region)
    out[:, 1] = np.tile(loc.reshape(-1), local.regions)
    out[:, 2] = np.tile(rem.reshape(-1), local.regions)
    out[:, 3] = np.tile(length.reshape(-1), local.regions)
    return out


def segment_descriptors(
    segments: np.ndarray, local_bases: list[int], remote_bases: list[int], device: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) (M, 3) uint64 [address, length, device] lists of `merged_segments`."""
    regions = segments[:, 0]
    out = []
    for bases, col in ((local_bases, 1), (remote_bases, 2)):
        d = np.empty((len(segments), 3), dtype=np.uint64)
        d[:, 0] = np.asarray(bases, dtype=np.uint64)[regions] + segments[:, col].astype(np.uint64)
        d[:, 1] = segments[:, 3]
        d[:, 2] = device
        out.append(d)
    return out[0], out[1]
