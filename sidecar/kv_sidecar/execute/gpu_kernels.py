"""The Triton kernel behind the GPU executor: one launch moves a whole (request, source rank) read.

Work unit: a *row chunk*, CHUNK consecutive words of one (layer, K/V, token,
head) row (a row is head_dim elements, contiguous in every layout). Program
(i, j) copies ROWS row chunks of layer/plane j: it maps each to its token and
local head, looks up the token's logical block id on each side, expands it to
(kernel block, slot), forms both addresses from the sides' strides and moves
a [ROWS, CHUNK] tile with one load and one store. Layout conversion, block
size and kernel block size conversion, head slicing and the prefix start are
therefore all just index arithmetic; nothing outside the addressed rows is
ever written.

Addresses: both sides' memory is imported IPC memory the kernel cannot take as
typed arguments, so every address is an int64 word offset from one small
*anchor* tensor the sidecar owns on the copying GPU. The anchor's alignment is
known to the compiler (Triton specialises 16-byte-aligned pointers) and the
offsets carry a `multiple_of` hint, which is what lets it emit 16-byte vector
loads and stores.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


@triton.jit
def kv_copy_kernel(
    anchor,  # *word: origin of every address below
    src_layers,  # *i64 [layers]: word offset of each source layer's element 0
    dst_layers,  # *i64 [layers]
    src_ids,  # *i32: source logical block ids
    dst_ids,  # *i32: destination logical block ids
    n_chunks,  # row chunks per (layer, plane): tokens * NH * NC
    start_token,
    src_first,  # logical block number of src_ids[0]
    dst_first,
    src_h0,  # local head (source side) of the first global head copied
    dst_h0,
    s_kv,  # source word strides
    s_n,
    s_b,
    s_h,
    d_kv,  # destination word strides
    d_n,
    d_b,
    d_h,
    NKV: tl.constexpr,  # K/V planes: 2, or 1 for MLA
    NH: tl.constexpr,  # heads copied
    NC: tl.constexpr,  # chunks per row
    CHUNK: tl.constexpr,  # words per chunk (a power of two)
    ROWS: tl.constexpr,  # row chunks per program
    ALIGN: tl.constexpr,  # every chunk start is a multiple of ALIGN words
    S_BS: tl.constexpr,  # source logical / kernel block size (tokens)
    S_KBS: tl.constexpr,
    D_BS: tl.constexpr,
    D_KBS: tl.constexpr,
):
    pid = tl.program_id(0)
    plane = tl.program_id(1)
    layer = plane // NKV
    kv = (plane % NKV).to(tl.int64)  # int64 before any stride product: caches exceed 2**31 words

    r = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < n_chunks
    chunk = r % NC
    th = r // NC
    head = th % NH
    tok = start_token + th // NH

    # (kernel block, slot) of each token on each side; ids[0] is logical block number `first`.
    # Written out twice rather than as a helper so the CPU interpreter runs it too.
    s_in = tok % S_BS
    s_logical = tl.load(src_ids + (tok // S_BS - src_first), mask=live, other=0).to(tl.int64)
    s_blk = s_logical * (S_BS // S_KBS) + s_in // S_KBS
    s_slot = s_in % S_KBS
    d_in = tok % D_BS
    d_logical = tl.load(dst_ids + (tok // D_BS - dst_first), mask=live, other=0).to(tl.int64)
    d_blk = d_logical * (D_BS // D_KBS) + d_in // D_KBS
    d_slot = d_in % D_KBS

    src_row = (
        tl.load(src_layers + layer)
        + kv * s_kv
        + s_blk * s_n
        + s_slot * s_b
        + (src_h0 + head) * s_h
        + chunk * CHUNK
    )
    dst_row = (
        tl.load(dst_layers + layer)
        + kv * d_kv
        + d_blk * d_n
        + d_slot * d_b
        + (dst_h0 + head) * d_h
        + chunk * CHUNK
    )
    src_row = tl.multiple_of(src_row, ALIGN)
    dst_row = tl.multiple_of(dst_row, ALIGN)

    cols = tl.arange(0, CHUNK)
    mask = live[:, None]
    vals = tl.load(anchor + src_row[:, None] + cols[None, :], mask=mask, eviction_policy="evict_first")
    tl.store(anchor + dst_row[:, None] + cols[None, :], vals, mask=mask)


def interpreted(kernel: Any) -> Any:
    """The same kernel run by Triton's CPU interpreter (tests on machines without a GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)
