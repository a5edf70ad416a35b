"""Copy cases shared by the GPU executor tests: specs, random caches, block ids and the host reference.

The reference is the CPU executor (`kv_sidecar.execute.host.copy_request`)
run on CPU copies of the same bytes: the GPU executor must produce exactly
what it produces, bit for bit, and leave every other byte alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kv_sidecar.execute import host
from kv_sidecar.plan.blocks import blocks_for, dst_block_count
from kv_sidecar.plan.spec import EngineSpec, Layout

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def spec(**kw: object) -> EngineSpec:
    base: dict[str, object] = {
        "tp_size": 1,
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 128,
        "dtype": "bfloat16",
        "block_size": 16,
        "num_blocks": 24,
        "layout": Layout.FLASH_ATTN_NHD,
    }
    base.update(kw)
    return EngineSpec(**base)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Read:
    src_rank: int
    heads: tuple[int, int] | None


@dataclass(frozen=True)
class Case:
    name: str
    src: EngineSpec
    dst: EngineSpec
    dst_rank: int
    reads: tuple[Read, ...]
    num_tokens: int
    start_token: int = 0
    tail_src_ids: bool = False  # src ids only from the start token's block on

    def src_ranks(self) -> list[int]:
        return sorted({r.src_rank for r in self.reads})


MLA = {"layout": Layout.MLA, "num_kv_heads": 1, "head_dim": 576}

CASES: tuple[Case, ...] = (
    Case("homogeneous", spec(), spec(), 0, (Read(0, (0, 4)),), 70),
    Case("split_1to2", spec(), spec(tp_size=2), 1, (Read(0, (2, 4)),), 45),
    Case("gather_2to1", spec(tp_size=2), spec(), 0, (Read(0, (0, 2)), Read(1, (2, 4))), 50),
    Case("nhd_to_hnd", spec(), spec(layout=Layout.FLASH_ATTN_HND), 0, (Read(0, (0, 4)),), 64),
    Case("block_16_to_32", spec(), spec(block_size=32, num_blocks=12), 0, (Read(0, (0, 4)),), 77),
    Case("mla", spec(**MLA), spec(**MLA, block_size=64, num_blocks=6), 0, (Read(0, None),), 100),
    Case(
        "flashinfer_hnd_to_packed_kernel_blocks",
        spec(layout=Layout.FLASHINFER_HND, tp_size=2),
        spec(layout=Layout.PACKED, block_size=32, kernel_block_size=16, num_blocks=12),
        0,
        (Read(1, (2, 4)),),
        90,
    ),
    Case(
        "cross_layer_prefix",
        spec(cross_layer=True),
        spec(layout=Layout.FLASHINFER_NHD, block_size=8, num_blocks=48),
        0,
        (Read(0, (0, 4)),),
        60,
        start_token=24,
        tail_src_ids=True,
    ),
    Case(
        "fp8_d64_prefix_to_cross_layer",
        spec(dtype="float8_e4m3fn", head_dim=64, num_kv_heads=2, block_size=32, num_blocks=8),
        spec(
            dtype="float8_e4m3fn",
            head_dim=64,
            num_kv_heads=2,
            tp_size=2,
            cross_layer=True,
            layout=Layout.FLASH_ATTN_HND,
        ),
        1,
        (Read(0, (1, 2)),),
        81,
        start_token=32,
    ),
    # vLLM's default GPU layout (LBNHC, [N, B, H, 2D]): per-layer and cross-layer, both directions.
    Case(
        "packed_nhd_to_hnd_tp_split",
        spec(layout=Layout.PACKED_NHD),
        spec(layout=Layout.FLASH_ATTN_HND, tp_size=2),
        1,
        (Read(0, (2, 4)),),
        53,
    ),
    Case(
        "packed_nhd_to_packed_block_32_kernel_16_prefix",
        spec(layout=Layout.PACKED_NHD),
        spec(layout=Layout.PACKED, block_size=32, kernel_block_size=16, num_blocks=12),
        0,
        (Read(0, (0, 4)),),
        77,
        start_token=32,
    ),
    Case(
        "packed_nhd_cross_layer_to_packed_nhd_block_8",
        spec(layout=Layout.PACKED_NHD, cross_layer=True),
        spec(layout=Layout.PACKED_NHD, block_size=8, num_blocks=48),
        0,
        (Read(0, (0, 4)),),
        60,
    ),
    Case(
        "gather_tp2_to_packed_nhd_cross_layer_kernel_blocks",
        spec(tp_size=2, block_size=32, num_blocks=12),
        spec(layout=Layout.PACKED_NHD, cross_layer=True, kernel_block_size=4),
        0,
        (Read(0, (0, 2)), Read(1, (2, 4))),
        70,
        start_token=16,
    ),
    Case(
        # 40-byte rows: V starts 40 bytes into each packed row, so only 8-byte vectors are legal.
        "packed_nhd_d20_to_flashinfer_nhd",
        spec(layout=Layout.PACKED_NHD, head_dim=20),
        spec(layout=Layout.FLASHINFER_NHD, head_dim=20, block_size=8, num_blocks=48),
        0,
        (Read(0, (0, 4)),),
        45,
    ),
    Case(
        "replicated_heads_tp4",
        spec(num_kv_heads=2, tp_size=4),
        spec(num_kv_heads=2, tp_size=2, layout=Layout.FLASH_ATTN_HND, block_size=64, num_blocks=6),
        1,
        (Read(3, (1, 2)),),
        128,
    ),
)


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def random_tensors(s: EngineSpec, seed: int) -> list[torch.Tensor]:
    """CPU tensors of the spec's shapes and dtype holding random bytes (NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in s.rank_tensor_shapes():
        raw = torch.randint(
            -(2**31),
            2**31 - 1,
            (int(np.prod(shape)) * s.element_size // 4 + 1,),
            generator=g,
            dtype=torch.int32,
        )
        t = raw.view(torch.uint8)[: int(np.prod(shape)) * s.element_size].view(_INT[s.element_size])
        out.append(t.view(shape).view(getattr(torch, s.dtype)).clone())
    return out


def block_ids(c: Case, seed: int) -> tuple[list[int], list[int]]:
    """(src ids, dst ids) in random order, src either all blocks or the tail, dst from start_token."""
    rng = np.random.default_rng(seed)
    n_src = blocks_for(c.num_tokens, c.src.block_size)
    if c.tail_src_ids:
        n_src -= c.start_token // c.src.block_size
    n_dst = dst_block_count(c.dst.block_size, c.num_tokens, c.start_token)
    src_ids = rng.permutation(c.src.num_blocks)[:n_src].tolist()
    dst_ids = rng.permutation(c.dst.num_blocks)[:n_dst].tolist()
    return src_ids, dst_ids


def run_ids(c: Case, seed: int, runs: str) -> tuple[list[int], list[int]]:
    """Block ids of which the sides named in `runs` ("src", "dst", "both") are one ascending run, as
    blocks allocated in a row are, the others random: seed 0, runs that end at the last block; other
    seeds, runs from a random start."""
    rng = np.random.default_rng(seed)
    src_ids, dst_ids = block_ids(c, seed)

    def run(num_blocks: int, n: int) -> list[int]:
        first = num_blocks - n if seed == 0 else int(rng.integers(0, num_blocks - n + 1))
        return list(range(first, first + n))

    if runs in ("src", "both"):
        src_ids = run(c.src.num_blocks, len(src_ids))
    if runs in ("dst", "both"):
        dst_ids = run(c.dst.num_blocks, len(dst_ids))
    return src_ids, dst_ids


def reference(
    c: Case,
    srcs: dict[int, list[torch.Tensor]],
    dst: list[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> tuple[list[torch.Tensor], int]:
    """What the destination must hold after all reads (host executor on CPU copies), and bytes written."""
    out = [t.clone() for t in dst]
    dview = host.rank_view(c.dst, c.dst_rank, out)
    written = 0
    for r in c.reads:
        sview = host.rank_view(c.src, r.src_rank, srcs[r.src_rank])
        written += host.copy_request(sview, dview, r.heads, src_ids, dst_ids, c.num_tokens, c.start_token)
    return out, written


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def with_blocks(s: EngineSpec, num_blocks: int) -> EngineSpec:
    return replace(s, num_blocks=num_blocks)
