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
offsets carry a `multiple_of` hint, meant to let it emit 16-byte vector loads
and stores; the compiler drops it, and the tile moves 4 bytes a thread at a time
(bench/kernel_codegen.py; docs/gpu.md, "Addresses").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from typing import Any

import triton
import triton.language as tl

log = logging.getLogger(__name__)


# The kernel's int parameters. Triton is told not to specialise on their values (being 1, divisibility
# by 16), only on their width: a pull's length, prefix start and first blocks would otherwise each
# compile a kernel for every class they fall in (6 among 18 pulls of a serving mix, 150-600 ms each),
# and the copy is as fast without (bench/kernel_compiles.py; the row mask below is why).
_INTS = (
    "n_chunks", "start_token", "src_first", "dst_first", "src_h0", "dst_h0",
    "s_kv", "s_n", "s_b", "s_h", "d_kv", "d_n", "d_b", "d_h",
)  # fmt: skip
# Nor on the id lists' alignment: a member's ids can be a view into a batch's upload at any offset, and
# the kernel reads one id per row, never as vectors. (Where this Triton lacks the option, they are.)
_IDS = ("src_ids", "dst_ids")
_IDS_ANY_ALIGNMENT = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
_SPECIALISE = {"do_not_specialize": _INTS} | (
    {"do_not_specialize_on_alignment": _IDS} if _IDS_ANY_ALIGNMENT else {}
)


@triton.jit(**_SPECIALISE)
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
    chunk = r % NC
    th = r // NC
    head = th % NH
    tok = start_token + th // NH
    # Rows go token by token (NH * NC a token): a row is live while its token is. Said of the token, the
    # mask is visibly constant over each token's rows, so that a token's id loads are one, whatever
    # n_chunks is; said of the row (r < n_chunks), only where n_chunks is a multiple of 16, and the
    # copy ran at half its bandwidth otherwise (bench/kernel_compiles.py).
    live = tok < start_token + n_chunks // (NH * NC)

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


# Triton releases whose compiled-kernel launcher `Launcher` calls directly: its arguments are internal
# to Triton (3.6: grid, stream, function, packed metadata, launch metadata, two hooks, then every
# parameter in order, constexprs included, pointers as tensors or plain addresses).
DIRECT_TRITON = ("3.6.",)
_MAX_COMPILED = 1024  # specialisations kept (Triton keeps its compiled kernels itself)
_N_POINTERS = 5  # anchor, the two layer tables, the two id lists: then the ints, then the constexprs
_CONSTEXPRS = ("NKV", "NH", "NC", "CHUNK", "ROWS", "ALIGN", "S_BS", "S_KBS", "D_BS", "D_KBS")


def specialization_key(
    pointers: tuple[Any, ...], ints: tuple[int, ...], constexprs: dict[str, int], num_warps: int
) -> tuple[Any, ...]:
    """Everything Triton specialises a launch of kv_copy_kernel on: each pointer's dtype and 16-byte
    alignment (not the id lists', see _IDS); each int's width (i32, i64, u64), not its value (_INTS);
    the constexprs; num_warps. Two launches with one key run one compiled kernel."""
    return (
        tuple(
            (p.dtype, True if i >= _N_POINTERS - len(_IDS) and _IDS_ANY_ALIGNMENT else p.data_ptr() % 16 == 0)
            for i, p in enumerate(pointers)
        ),
        tuple(0 if -(2**31) <= v < 2**31 else 2 if v >= 2**63 else 1 for v in ints),
        tuple(constexprs[n] for n in _CONSTEXPRS),
        num_warps,
    )


class Launcher:
    """kv_copy_kernel launches that skip Triton's per-launch Python once it has compiled them.

    `kernel[grid](...)`, inside `torch.cuda.stream(s)`, binds and specialises every argument, looks
    the compiled kernel up, asks torch for the device and stream, checks each pointer with the
    driver, and only then launches: most of a launch's host time inside a sidecar (bench/
    trace_pull.py). Here the first launch of each `specialization_key` goes through Triton (compiling
    if need be) and its compiled kernel is kept; later ones call that kernel's launcher with the
    stream's handle and the pointers as addresses. A Triton release not in DIRECT_TRITON, or a launch
    hook (a profiler's), always goes through Triton.
    """

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], Any] = {}
        # Held while Triton compiles a kernel this launcher keeps (a first launch, a warm-up): one
        # compile per kernel, not one per thread that met it first. Launches through Triton on every
        # call (another release, a hook) go without it, so that a warm-up holds none of them up.
        self._compiling = threading.Lock()
        self.direct_launches = 0  # launches that skipped Triton's Python (metrics, tests, benchmarks)
        self.triton_launches = 0  # launches through `kernel[grid]`: first ones, hooks, other releases
        self.warmed = 0  # kernels compiled ahead of their first launch (warm)
        names = tuple(getattr(kv_copy_kernel, "arg_names", ()))
        self._n_ints = len(names) - _N_POINTERS - len(_CONSTEXPRS)
        # The launcher takes the parameters by position: only for the signature this was written for.
        self._direct = (
            triton.__version__.startswith(DIRECT_TRITON) and names[-len(_CONSTEXPRS) :] == _CONSTEXPRS
        )
        self._warned = False

    def counts(self) -> dict[str, int]:
        return {"direct": self.direct_launches, "triton": self.triton_launches}

    def __call__(
        self,
        grid: tuple[int, int],
        stream: Any,
        pointers: tuple[Any, ...],
        ints: tuple[int, ...],
        constexprs: dict[str, int],
        num_warps: int,
    ) -> None:
        """Launch on `stream` (a torch.cuda.Stream), with its device current."""
        if len(pointers) != _N_POINTERS or len(ints) != self._n_ints:
            raise ValueError(
                f"kv_copy_kernel takes {_N_POINTERS} pointers and {self._n_ints} ints, "
                f"got {len(pointers)} and {len(ints)}"
            )
        if not (self._direct and _no_launch_hooks()):
            self._through_triton(None, grid, stream, pointers, ints, constexprs, num_warps)
            return
        key = (stream.device_index, specialization_key(pointers, ints, constexprs, num_warps))
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._compiling:
                compiled = self._compiled.get(key)
                if compiled is None:
                    self._through_triton(key, grid, stream, pointers, ints, constexprs, num_warps)
                    return
        self.direct_launches += 1
        compiled.run(
            grid[0],
            grid[1],
            1,
            stream.cuda_stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *(p.data_ptr() for p in pointers),
            *ints,
            *(constexprs[n] for n in _CONSTEXPRS),
        )

    def _through_triton(
        self,
        key: tuple[Any, ...] | None,
        grid: tuple[int, int],
        stream: Any,
        pointers: tuple[Any, ...],
        ints: tuple[int, ...],
        constexprs: dict[str, int],
        num_warps: int,
    ) -> None:
        """A launch through `kernel[grid]` (compiling if need be), its compiled kernel kept under `key`
        (None: not kept, every launch goes this way)."""
        import torch

        self.triton_launches += 1
        if not self._direct and not self._warned:
            self._warned = True  # a newer Triton in the image would otherwise cost every launch silently
            log.warning(
                "Triton %s: GPU copies launch through Triton's Python launcher, ~0.1 ms slower per "
                'launch than the direct launch kept for Triton %s (docs/gpu.md, "The kernel"); '
                'kvsidecar_gpu_launches_total{by="triton"} counts them',
                triton.__version__,
                " or ".join(v.rstrip(".") for v in DIRECT_TRITON),
            )
        # Through Triton, which launches on the current stream: make `stream` current if it is not.
        current = torch.cuda.current_stream(stream.device) == stream
        with contextlib.nullcontext() if current else torch.cuda.stream(stream):
            compiled = kv_copy_kernel[grid](*pointers, *ints, **constexprs, num_warps=num_warps)
        if key is not None and compiled is not None:
            self._keep(key, compiled)

    def _keep(self, key: tuple[Any, ...], compiled: Any) -> None:
        if len(self._compiled) >= _MAX_COMPILED:  # many geometries over time: stay bounded
            self._compiled.clear()
        self._compiled[key] = compiled

    def warm(
        self,
        device: int,
        pointers: tuple[Any, ...],
        ints: tuple[int, ...],
        constexprs: dict[str, int],
        num_warps: int,
    ) -> bool:
        """Compile the kernel a launch with these arguments would run, without launching it, so that
        the first launch does not wait for the compiler (0.5-0.6 s with Triton's disk cache filled,
        1.4-2.1 s without, on one H200: bench/kernel_compiles.py). True if it was not compiled yet."""
        import torch

        key = (device, specialization_key(pointers, ints, constexprs, num_warps))
        with self._compiling:
            if key in self._compiled:
                return False
            with torch.cuda.device(device):
                compiled = kv_copy_kernel.warmup(
                    *pointers, *ints, **constexprs, grid=(1, 1), num_warps=num_warps
                )
                load = getattr(compiled, "_init_handles", None)
                if load is not None:  # its module into this device's context now, not at the first launch
                    load()
            self.warmed += 1
            if compiled is not None:  # kept even where launches go through Triton: warmed once
                self._keep(key, compiled)
            return True


def _no_launch_hooks() -> bool:
    """No launch hook is set: none at all, or (3.6) empty HookChains."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True
    hooks = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    return all(h is None or (isinstance(getattr(h, "calls", None), list) and not h.calls) for h in hooks)


launch = Launcher()
