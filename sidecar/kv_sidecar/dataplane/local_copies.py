"""Copies between ranks mapped on this node: host-direct (the host executor, or one memmove per block
chunk where the plan is the identity) and gpu-direct (one Triton launch per (decode rank, source
rank) read on the decode GPU, reading the source over NVLink through mappings opened in that GPU's
context). A PullBatch's reads between the same two ranks go joined: one launch, one executor call,
or one run of memmoves. No NIXL: engine memory is never registered with it (DESIGN.md section 1).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kv_sidecar.dataplane.jobs import Halt, LocalCopy, RankKey, Tokens, join_tokens, joinable
from kv_sidecar.dataplane.ranks import HostRank, MappedRanks
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.execute import gpu
from kv_sidecar.execute.host import copy_request
from kv_sidecar.plan.blocks import check_block_ids, check_copy, check_copy_counts
from kv_sidecar.plan.chunks import descriptors
from kv_sidecar.plan.spec import PlanError


def copy_blocks(src: HostRank, dst: HostRank, src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """Copy whole blocks between two host ranks of the same geometry (an identity plan): one
    memmove per chunk, the runs NIXL's descriptor tables describe. Returns bytes copied.

    The ids were validated against both specs (check_pull); they are checked again here because
    memmove is not. Holding the tensors keeps their mappings alive should a rank unregister
    meanwhile (ShmMapper unmaps a segment only once no view of it is left).
    """
    src_t, dst_t = list(src.tensors), list(dst.tensors)
    sg, dg = src.geometry, dst.geometry
    if len(src_t) != sg.regions or len(dst_t) != dg.regions:
        raise SidecarError(Code.FAILED_PRECONDITION, "a rank of the pull was unregistered during it")
    if (sg.outer, sg.chunk, sg.regions) != (dg.outer, dg.chunk, dg.regions) or len(src_ids) != len(dst_ids):
        raise SidecarError(Code.INTERNAL, "block copy between ranks of different geometry")
    for ids, geo in ((src_ids, sg), (dst_ids, dg)):
        if len(ids) and not (int(np.min(ids)) >= 0 and int(np.max(ids)) < geo.num_blocks):
            raise SidecarError(Code.INTERNAL, f"block id out of range [0, {geo.num_blocks})")
    s_addr = descriptors(sg, [t.data_ptr() for t in src_t], src_ids)[:, 0].tolist()
    d_addr = descriptors(dg, [t.data_ptr() for t in dst_t], dst_ids)[:, 0].tolist()
    n = dg.chunk
    for d, s_ in zip(d_addr, s_addr, strict=True):
        ctypes.memmove(d, s_, n)
    return len(d_addr) * n


def copy_host(ranks: MappedRanks, job: LocalCopy, halt: Halt) -> int:
    t = job.tokens
    nbytes = 0
    for read in job.reads:
        halt.remaining()
        src, dst = ranks.host(read.src), ranks.host(read.dst)
        with src.in_use(), dst.in_use():  # the source's engine may die meanwhile
            if job.whole_blocks:  # whole blocks, as host-nixl moves them: no per-token indexing
                nbytes += copy_blocks(src, dst, _source_blocks(t, src.spec.block_size), t.dst_blocks)
                continue
            nbytes += copy_request(
                src.view, dst.view, read.heads, t.src_blocks, t.dst_blocks, t.num_tokens, t.start_token
            )
    return nbytes


def _source_blocks(t: Tokens, block_size: int) -> np.ndarray:
    """An identity plan's source blocks of the destination blocks of `t`, one for one."""
    first = t.start_token // block_size
    return t.src_blocks[first : first + len(t.dst_blocks)]


def copy_all(ranks: MappedRanks, jobs: Sequence[tuple[LocalCopy, Halt]]) -> list[int | BaseException]:
    """Several copies (a PullBatch's), each's bytes or what failed it: those into GPU ranks launched
    together with one wait per decode GPU (copy_gpu_all), the others one after another. In the
    sidecar, or in a device's worker process (dataplane/workers.py) for the copies into its device."""
    out: list[int | BaseException | None] = [None] * len(jobs)
    on_gpu = [i for i, (job, _) in enumerate(jobs) if job.reads and ranks.is_gpu(job.reads[0].dst)]
    if on_gpu:
        try:
            moved = copy_gpu_all(ranks, [jobs[i] for i in on_gpu])
        except Exception as e:  # the wait failed: no copy is known to have landed
            moved = [e] * len(on_gpu)
        for i, m in zip(on_gpu, moved, strict=True):
            out[i] = m
    on_host = [i for i in range(len(jobs)) if out[i] is None]
    if on_host:
        for i, m in zip(on_host, copy_host_all(ranks, [jobs[i] for i in on_host]), strict=True):
            out[i] = m
    return [m if m is not None else RuntimeError("a copy got no outcome") for m in out]


def copy_host_all(ranks: MappedRanks, jobs: Sequence[tuple[LocalCopy, Halt]]) -> list[int | BaseException]:
    """Several host copies (a PullBatch's), each's bytes or what failed it. The reads of several copies
    between the same two ranks go in one call where they may: whole blocks (an identity plan) as one
    run of memmoves, the others as one executor call over their joined tokens (`_launch_pair`); each
    executor call costs its own checks and index tables, whatever its size."""
    out: list[int | BaseException] = [0] * len(jobs)
    pairs: dict[tuple[object, ...], _Pair] = {}
    with contextlib.ExitStack() as stack:  # every rank's memory until the copies end
        hold = _Holds(stack)
        for k, (job, halt) in enumerate(jobs):
            try:  # a copy stopped, or whose ranks are gone, fails alone before any of it runs
                halt.remaining()
                reads = [(read, ranks.host(read.src), ranks.host(read.dst)) for read in job.reads]
                for read, src, dst in reads:
                    hold(read.src, src)
                    hold(read.dst, dst)
            except Exception as e:
                out[k] = e
                continue
            for read, src, dst in reads:
                key = (read.src, read.dst, read.heads, job.whole_blocks)
                if job.whole_blocks:
                    pair = _Pair(src, dst, read.heads, [])
                else:
                    pair = _Pair(src.view, dst.view, read.heads, [])
                pairs.setdefault(key, pair).copies.append(k)
        for (*_, whole_blocks), pair in pairs.items():
            tokens = [jobs[k][0].tokens for k in pair.copies]
            if whole_blocks:
                _copy_blocks_pair(pair, tokens, out)
            else:
                _launch_pair(pair, tokens, out, copy_request, None)
    return out


def _copy_blocks_pair(pair: _Pair, tokens: list[Tokens], out: list[int | BaseException]) -> None:
    """Whole blocks between two host ranks (identity plans): every copy's blocks in one run of memmoves,
    unless two write one block (then one run each, as before joins)."""
    src, dst = pair.src, pair.dst
    runs: list[tuple[int, np.ndarray, np.ndarray]] = []
    for k, t in zip(pair.copies, tokens, strict=True):
        if not isinstance(out[k], BaseException):
            runs.append((k, _source_blocks(t, src.spec.block_size), t.dst_blocks))
    dst_ids = np.concatenate([d for _, _, d in runs]) if runs else np.empty(0, dtype=np.int64)
    if len(runs) > 1 and len(dst_ids) and len(np.unique(dst_ids)) == len(dst_ids):
        try:
            nbytes = copy_blocks(src, dst, np.concatenate([s for _, s, _ in runs]), dst_ids)
        except Exception as e:
            for k, _, _ in runs:
                _add(out, k, e)
            return
        for k, _, d in runs:
            _add(out, k, nbytes // len(dst_ids) * len(d))  # every block moves the same bytes
        return
    for k, s, d in runs:
        try:
            moved: int | BaseException = copy_blocks(src, dst, s, d)
        except Exception as e:
            moved = e
        _add(out, k, moved)


def copy_gpu(ranks: MappedRanks, job: LocalCopy, halt: Halt) -> int:
    """Every read, one launch each on the decode GPU's current stream; the copy waits for them once,
    at the end, and the mappings stay held until then, even when a later launch fails. (A stream from
    torch's pool made current around them cost 0.07-0.15 ms more per pull, side by side on two H200s.)
    """
    (moved,) = copy_gpu_all(ranks, [(job, halt)])
    if isinstance(moved, BaseException):
        raise moved
    return moved


# The most bytes one joined launch moves. Members of 2 MiB joined 16 at a time ran 1.29-1.74x the pulls/s;
# 16 members of 64 MiB as one 1 GiB launch read over NVLink ran 0.63-0.80x (p50 1.07-1.31x slower), though
# the same join on one GPU takes 0.61x the GPU time of 16 launches (2x H200, docs/benchmarks.md): where
# a launch's own cost is small against its bytes, members go alone, as before joins.
JOIN_BYTES = 64 << 20


@dataclass
class _Pair:
    """The copies' reads between two ranks (one source rank, one decode rank, the same heads): the
    executor's views of both (GPU or host), or the host ranks themselves for whole-block copies."""

    src: Any
    dst: Any
    heads: tuple[int, int] | None
    copies: list[int]  # indexes of the copies with a read here


def copy_gpu_all(ranks: MappedRanks, jobs: Sequence[tuple[LocalCopy, Halt]]) -> list[int | BaseException]:
    """Several copies (a PullBatch's), then one wait per decode GPU for all. Each copy's bytes, or what
    failed it. The reads of several copies between the same two views go as one launch where they
    may (`_launch_pair`, up to JOIN_BYTES): a lone batch of 16 one-block gpu-direct pulls spent
    ~0.15 ms a member on its own id upload and launch, 2.9 of its 5.2 ms, on two H200s. A launch that
    fails fails the copies in it, whose other launches still complete before this returns; a failed
    wait fails every copy."""
    out: list[int | BaseException] = [0] * len(jobs)
    devices: set[int] = set()
    with contextlib.ExitStack() as stack:
        hold = _Holds(stack)
        try:
            pairs: dict[tuple[object, ...], _Pair] = {}
            for k, (job, halt) in enumerate(jobs):
                # A copy stopped, or whose ranks are gone (or will not map), fails alone, before any of
                # it launches.
                try:
                    halt.remaining()
                    views = []
                    for read in job.reads:
                        src, dst = ranks.gpu(read.src), ranks.gpu(read.dst)
                        hold(read.src, src)
                        hold(read.dst, dst)
                        views.append((read, dst.device, src.view(dst.device), dst.view(dst.device)))
                except Exception as e:
                    out[k] = e
                    continue
                for read, dev, src_view, dst_view in views:
                    devices.add(dev)
                    key = (read.src, read.dst, read.heads, dev)
                    pairs.setdefault(key, _Pair(src_view, dst_view, read.heads, [])).copies.append(k)
            for pair in pairs.values():
                tokens = [jobs[k][0].tokens for k in pair.copies]
                _launch_pair(pair, tokens, out, _launch_gpu, gpu.staging_bytes(pair.dst.spec, 1))
        finally:
            for dev in devices:  # no kernel of ours may write after the copies return
                torch.cuda.current_stream(dev).synchronize()
    return out


class _Holdable(Protocol):
    def in_use(self) -> contextlib.AbstractContextManager[None]: ...


class _Holds:
    """Holds each rank that several copies use once, until `stack` closes (not once per copy: a
    PullBatch of 16 reads the same two ranks 16 times)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._held: set[RankKey] = set()

    def __call__(self, key: RankKey, rank: _Holdable) -> None:
        if key not in self._held:
            self._stack.enter_context(rank.in_use())  # fails for a rank unregistered meanwhile
            self._held.add(key)


def _bounded(items: list[int], sizes: list[int]) -> list[list[int]]:
    """`items` in order, in runs of at most JOIN_BYTES (an item larger goes alone)."""
    runs: list[list[int]] = []
    size = 0
    for item, n in zip(items, sizes, strict=True):
        if not runs or size + n > JOIN_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += n
    return runs


def _add(out: list[int | BaseException], k: int, moved: int | BaseException) -> None:
    """A read's outcome into its copy's: bytes add up; the first failure stays."""
    done = out[k]
    if not isinstance(done, BaseException):
        out[k] = moved if isinstance(moved, BaseException) else done + moved


def _launch_gpu(
    src: Any, dst: Any, heads: Any, src_ids: Any, dst_ids: Any, num_tokens: int, start: int
) -> int:
    return gpu.copy_request(src, dst, heads, src_ids, dst_ids, num_tokens, start, synchronize=False)


def _launch_pair(
    pair: _Pair,
    tokens: list[Tokens],
    out: list[int | BaseException],
    copy: Callable[[Any, Any, Any, Any, Any, int, int], int],
    block_bytes: int | None,
) -> None:
    """One pair's reads: those that may be joined (jobs.joinable; no destination block twice) as one
    `copy` (a launch, or the host executor's call) over their joined tokens (jobs.join_tokens), up to
    JOIN_BYTES of `block_bytes` blocks a launch (None: no bound); the rest one `copy` each. A join that
    is refused (its checks run before anything moves) is taken apart (`_launch_joined`): a bad member
    fails alone with the words it gets alone, and the others join again."""
    bp, bd = pair.src.spec.block_size, pair.dst.spec.block_size
    joined: list[int] = []  # positions in pair.copies
    alone: list[int] = []
    for i, (k, t) in enumerate(zip(pair.copies, tokens, strict=True)):
        if isinstance(out[k], BaseException):
            continue  # another read of this copy failed to launch: launch nothing more of it
        too_large = block_bytes is not None and 2 * block_bytes * len(t.dst_blocks) > JOIN_BYTES
        if len(tokens) == 1 or too_large or not joinable(t, bp, bd):
            alone.append(i)  # alone, or too large to share a launch with another: as before joins
        else:
            joined.append(i)
    for group in _bounded(joined, [(block_bytes or 0) * len(tokens[i].dst_blocks) for i in joined]):
        dst_ids = np.concatenate([tokens[i].dst_blocks for i in group])
        if len(group) < 2 or len(np.unique(dst_ids)) < len(dst_ids):
            alone.extend(group)
        else:
            alone.extend(_launch_joined(pair, tokens, group, out, copy))
    for i in alone:
        t = tokens[i]
        try:
            moved: int | BaseException = copy(
                pair.src, pair.dst, pair.heads, t.src_blocks, t.dst_blocks, t.num_tokens, t.start_token
            )
        except Exception as e:
            moved = e
        _add(out, pair.copies[i], moved)


def _launch_joined(
    pair: _Pair,
    tokens: list[Tokens],
    group: list[int],
    out: list[int | BaseException],
    copy: Callable[[Any, Any, Any, Any, Any, int, int], int],
    checked: bool = False,
) -> list[int]:
    """`group`'s members as one `copy`; returns those to copy alone instead. The ids are checked once
    for the join: each member's counts alone (integer arithmetic), every member's source ids in one
    range check, and the joined copy's own check, which sees every member's destination ids (a join
    that passes these holds no member that alone would be refused). A full check per member cost
    ~10-20 us, 16 a batch, and the join's own check ran as well. Where any of these refuses, the
    members are checked alone (`checked` from then on): the bad ones fail with the words they get
    alone, and the others go joined again, or alone if the join itself is what is refused (too large
    for one launch). A join that fails once it runs fails its members."""
    src, dst, heads = pair.src, pair.dst, pair.heads
    members = [tokens[i] for i in group]
    try:
        if not checked:
            for t in members:
                check_copy_counts(
                    src.spec, dst.spec, len(t.src_blocks), len(t.dst_blocks), t.num_tokens, t.start_token
                )
            # Ids the join does not read must be in range too, as a member alone would have them.
            every_src = np.concatenate([t.src_blocks for t in members])
            check_block_ids("source", every_src, src.spec.num_blocks, unique=False)
        whole, _ = join_tokens(members, src.spec.block_size, dst.spec.block_size)
        nbytes = copy(src, dst, heads, whole.src_blocks, whole.dst_blocks, whole.num_tokens, 0)
    except PlanError:  # refused before anything moved
        if checked:
            return group
        good: list[int] = []
        for i, t in zip(group, members, strict=True):
            try:
                check_copy(
                    src.spec,
                    src.rank,
                    dst.spec,
                    dst.rank,
                    heads,
                    t.src_blocks,
                    t.dst_blocks,
                    t.num_tokens,
                    t.start_token,
                )
            except Exception as e:
                _add(out, pair.copies[i], e)
            else:
                good.append(i)
        return _launch_joined(pair, tokens, good, out, copy, checked=True) if len(good) > 1 else good
    except Exception as e:
        for i in group:
            _add(out, pair.copies[i], e)
        return []
    per_token = nbytes // whole.num_tokens
    for i, t in zip(group, members, strict=True):
        _add(out, pair.copies[i], (t.num_tokens - t.start_token) * per_token)
    return []
