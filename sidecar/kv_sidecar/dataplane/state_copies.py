"""Mamba state converted between engines (plan/state.py's byte runs) on host memory: copied between
ranks of this node (host-direct), or READ over NIXL from another sidecar's ranks straight into the
destination block (host-nixl-state), one descriptor per run and layer position. State groups need
layouts with blocks outermost (spec validation), so a block of a region is one page of `chunk` bytes.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from kv_sidecar.dataplane.jobs import Halt, StateBlock, StateCopy, StateRead
from kv_sidecar.dataplane.ranks import HostRank, MappedRanks
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.chunks import ChunkGeometry, chunk_geometry
from kv_sidecar.plan.state import StateMove


def _pages(geo: ChunkGeometry, bases: list[int], block: int, positions: int, side: str) -> list[int]:
    """The address of `block`'s page in each of the first `positions` regions."""
    if geo.outer != 1 or positions > geo.regions or not 0 <= block < geo.num_blocks:
        raise SidecarError(
            Code.INTERNAL,
            f"{side} state block {block} of {geo.num_blocks}, {positions} of {geo.regions} regions, "
            f"{geo.outer} chunks per block: not one page per region",
        )
    return [bases[j] + block * geo.chunk for j in range(positions)]


def _check_runs(moves: tuple[StateMove, ...], src_page: dict[int, int] | None, dst_page: int | None) -> None:
    """memmove and NIXL trust their addresses: every run inside its source page (`src_page`: bytes per
    source rank) and the destination page (the plan's runs, checked again here); None: not checked."""
    for m in moves:
        src_ok = src_page is None or (m.src_rank in src_page and m.src + m.nbytes <= src_page[m.src_rank])
        if not src_ok or (dst_page is not None and m.dst + m.nbytes > dst_page):
            raise SidecarError(Code.INTERNAL, f"state run {m} does not fit the pages")


def copy_state_local(ranks: MappedRanks, job: StateCopy, halt: Halt) -> int:
    """host-direct: the runs copied between ranks mapped here, in each layer position."""
    halt.remaining()
    b = job.block
    dst = ranks.host(job.dst)
    srcs: dict[int, HostRank] = {q: ranks.host(job.sources[q]) for q in {m.src_rank for m in b.moves}}
    with contextlib.ExitStack() as held:  # raw addresses keep no mapping alive: hold the ranks
        for r in (dst, *srcs.values()):
            held.enter_context(r.in_use())
        _check_runs(b.moves, {q: r.geometry.chunk for q, r in srcs.items()}, dst.geometry.chunk)
        d_pages = _pages(dst.geometry, dst.region_bases, b.dst_block, b.positions, "destination")
        s_pages = {
            q: _pages(r.geometry, r.region_bases, b.src_block, b.positions, "source") for q, r in srcs.items()
        }
        for j in range(b.positions):
            for m in b.moves:
                ctypes.memmove(d_pages[j] + m.dst, s_pages[m.src_rank][j] + m.src, m.nbytes)
    return b.nbytes


def state_descriptors(
    block: StateBlock, src_rank: int, src_pages: list[int], dst_pages: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) (M, 3) [address, length, device] descriptors of `src_rank`'s runs."""
    runs = [m for m in block.moves if m.src_rank == src_rank]
    local = np.empty((len(runs) * block.positions, 3), dtype=np.uint64)
    remote = np.empty_like(local)
    i = 0
    for j in range(block.positions):
        for m in runs:
            local[i] = (dst_pages[j] + m.dst, m.nbytes, 0)
            remote[i] = (src_pages[j] + m.src, m.nbytes, 0)
            i += 1
    return local, remote


def remote_pages(job: StateRead) -> dict[int, list[int]]:
    """Each source rank's page addresses (in its sidecar's address space) of the source block."""
    out = {}
    for src in job.sources:
        geo = chunk_geometry(src.spec)
        _check_runs(tuple(m for m in job.block.moves if m.src_rank == src.rank), {src.rank: geo.chunk}, None)
        out[src.rank] = _pages(
            geo, list(src.region_bases), job.block.src_block, job.block.positions, "source"
        )
    return out


def dst_pages(ranks: MappedRanks, job: StateRead) -> list[int]:
    """The destination rank's page addresses of the destination block."""
    dst = ranks.host(job.dst)
    _check_runs(job.block.moves, None, dst.geometry.chunk)
    return _pages(dst.geometry, dst.region_bases, job.block.dst_block, job.block.positions, "destination")
