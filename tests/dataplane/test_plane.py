"""The data plane alone, behind its door: two `DataPlane`s with real NIXL agents and real shared memory,
driven only with the plain-data jobs of dataplane/jobs.py (no gRPC, no control core). What one side
tells the other is what a Push carries: the reader's `ReceiveSlots` become the source's `Send`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kv_sidecar.config import Settings
from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.chunk_copies import HostCopies
from kv_sidecar.dataplane.jobs import (
    LocalCopy,
    RankKey,
    RankRead,
    Receive,
    Send,
    Sent,
    Tokens,
)
from kv_sidecar.dataplane.plane import DataPlane, copies_in_workers
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.execute.gpu import staging_bytes
from kv_sidecar.metrics import Metrics
from kv_sidecar.plan.pair import plan_pair
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.layout_io import changed_outside, check_request, fill_request, logical_kv
from kv_sidecar.server.engines import shm_tensors
from kv_sidecar.transport.nixl_driver import NixlDriver
from kv_sidecar_client.shm import ShmKVCache

SRC = EngineSpec(
    tp_size=1,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype="float16",
    block_size=16,
    num_blocks=32,
    layout="flash_attn_nhd",
)
# Another block size and layout: the chunks are gathered in the reader's layout.
DST = dataclasses.replace(SRC, block_size=32, num_blocks=16, layout="flash_attn_hnd")


class _Until:
    """A Halt: seconds left until a deadline, and an error past it."""

    def __init__(self, seconds: float) -> None:
        import time

        self._time = time
        self._deadline = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self._deadline - self._time.monotonic()
        if left <= 0:
            raise SidecarError(Code.DEADLINE_EXCEEDED, "the test's job timed out")
        return left


@pytest.fixture
def planes() -> Iterator[tuple[DataPlane, DataPlane]]:
    """A source and a reader plane, each with its own NIXL agent, small host rings."""
    with _two_planes(Settings(gpu_staging_bytes=2 * 4 * (64 << 10), gpu_staging_slots=4)) as made:
        yield made  # 4 slots of 64 KiB


@contextlib.contextmanager
def _two_planes(settings: Settings) -> Iterator[tuple[DataPlane, DataPlane]]:
    made = []
    for name in ("plane-src", "plane-dst"):
        nixl = NixlDriver(name)
        nixl.start()
        made.append((nixl, DataPlane(settings, nixl, Metrics())))
    (a_nixl, a), (b_nixl, b) = made
    a_nixl.load_remote(b_nixl.name, b_nixl.metadata())
    b_nixl.load_remote(a_nixl.name, a_nixl.metadata())
    try:
        yield a, b
    finally:
        for nixl, plane in made:
            nixl.stop()
            plane.close()


def test_a_staged_transfer_between_two_planes_moves_exactly_the_requested_blocks(
    planes: tuple[DataPlane, DataPlane],
) -> None:
    src_plane, dst_plane = planes
    num_tokens, start = 150, 32  # the reader holds the first 32 tokens already (a prefix hit)
    src_ids = list(range(3, 3 + 10))  # 10 source blocks of 16 tokens
    dst_ids = [9, 2, 14, 5]  # reader blocks for tokens [32, 150): 4 blocks of 32
    with (
        ShmKVCache(SRC.rank_tensor_shapes(), torch.float16) as src,
        ShmKVCache(DST.rank_tensor_shapes(), torch.float16) as dst,
    ):
        logical = logical_kv(SRC, num_tokens, seed=7)
        fill_request(SRC, 0, src.tensors, src_ids, logical)
        for t in dst.tensors:
            t.view(torch.uint8).fill_(0xA5)
        before = [t.clone() for t in dst.tensors]
        rx, job = _staged(src_plane, dst_plane, src, dst, src_ids, dst_ids, num_tokens, start)
        chunks = job.chunks
        assert chunks == tuple(
            sp.plan_chunks(start, num_tokens, DST.block_size, (64 << 10) // staging_bytes(DST, 1))
        )
        tx = src_plane.send(job)
        sent: list[Sent] = []
        source = threading.Thread(target=lambda: sent.append(tx.run(_Until(10))))
        source.start()
        rx.prepare()
        halt = _Until(10)
        while not rx.wait(min(0.05, halt.remaining())):
            pass
        rx.close(quiet=True)
        source.join(10)

        assert sent and sent[0].chunks == len(chunks) and tx.quiet
        assert rx.nbytes == sent[0].nbytes > 0
        assert check_request(DST, 0, dst.tensors, dst_ids, logical[:, :, :num_tokens], start) == []
        assert changed_outside(DST, before, dst.tensors, dst_ids) == []
        src_plane.detach(RankKey("prefill", 0))
        dst_plane.detach(RankKey("decode", 0))


@pytest.fixture(params=["waiting thread", "NIXL thread"])
def scatters_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where a reader scatters its chunks: host copies on the thread that waits, copies that only
    enqueue (GPU) on the NIXL thread. Host copies stand in for the latter here (no GPU on CI): the
    reader's bookkeeping is the same, only the copy's thread differs."""
    if request.param == "NIXL thread":
        monkeypatch.setattr(HostCopies, "enqueues", True)
    return str(request.param)


def _spy_copies(monkeypatch: pytest.MonkeyPatch, fail_gather: int = -1) -> list[tuple[bool, str]]:
    """Record each chunk copy (gather or not, the thread it ran on); the gather numbered `fail_gather`
    (from 0) raises instead of copying."""
    seen: list[tuple[bool, str]] = []
    launch = HostCopies.launch

    def spy(self: HostCopies, t0: int, t1: int, address: int) -> tuple[Any, int]:
        if self.into and sum(g for g, _ in seen) == fail_gather:
            raise RuntimeError(f"gather {fail_gather} broke")
        seen.append((self.into, threading.current_thread().name))
        return launch(self, t0, t1, address)

    monkeypatch.setattr(HostCopies, "launch", spy)
    return seen


# 4 slots of 16 KiB a ring: 2 blocks of DST a chunk.
SMALL_SLOTS = Settings(gpu_staging_bytes=2 * 4 * (16 << 10), gpu_staging_slots=4)


def _run_both(rx: Any, tx: Any, thread: str) -> list[Any]:
    """The source's `run` on a thread named `thread`, the reader's waits here; what `run` returned or
    raised."""
    out: list[Any] = []

    def source() -> None:
        try:
            out.append(tx.run(_Until(10)))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=source, name=thread)
    t.start()
    rx.prepare()
    halt = _Until(10)
    try:
        while not out and not rx.wait(min(0.05, halt.remaining())):
            pass
    finally:
        t.join(10)
    return out


@contextlib.contextmanager
def _small_rings() -> Iterator[tuple[DataPlane, DataPlane, ShmKVCache, ShmKVCache]]:
    """Two planes with rings of 4 slots of 2 blocks of DST, and a cache of each spec."""
    with (
        _two_planes(SMALL_SLOTS) as (src_plane, dst_plane),
        ShmKVCache(SRC.rank_tensor_shapes(), torch.float16) as src,
        ShmKVCache(DST.rank_tensor_shapes(), torch.float16) as dst,
    ):
        yield src_plane, dst_plane, src, dst


def _send_exact(
    ends: tuple[DataPlane, DataPlane, ShmKVCache, ShmKVCache],
    src_ids: list[int],
    dst_ids: list[int],
    seed: int,
) -> Sent:
    """A 500-token request (8 chunks) filled from `seed`, sent and received: every byte lands in
    `dst_ids`, nothing else changes, nothing is left in flight."""
    src_plane, dst_plane, src, dst = ends
    logical = logical_kv(SRC, 500, seed=seed)
    fill_request(SRC, 0, src.tensors, src_ids, logical)
    before = [t.clone() for t in dst.tensors]
    rx, job = _staged(src_plane, dst_plane, src, dst, src_ids, dst_ids, 500)
    assert len(job.chunks) == 8
    tx = src_plane.send(job)
    out = _run_both(rx, tx, "push")
    while not rx.wait(0.05):  # the source returned first: the reader's last scatters
        pass
    rx.close(quiet=True)
    assert len(out) == 1 and isinstance(out[0], Sent), out
    assert out[0].chunks == 8 and rx.nbytes == out[0].nbytes > 0 and tx.quiet
    assert check_request(DST, 0, dst.tensors, dst_ids, logical, 0) == []
    assert changed_outside(DST, before, dst.tensors, dst_ids) == []
    return out[0]


def test_more_chunks_than_slots_reuse_every_slot_whichever_thread_scatters(
    scatters_on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 chunks through 4 send and 4 receive slots: each gather goes into a send slot a WRITE freed,
    each WRITE into a slot the reader gave back, and every byte lands, nothing else. The source
    gathers on its push thread; the reader scatters where `scatters_on` says."""
    seen = _spy_copies(monkeypatch)
    dst_ids = [7, 3, 15, 0, 9, 12, 1, 4, 14, 2, 11, 6, 8, 13, 5, 10]
    with _small_rings() as ends:
        _send_exact(ends, list(range(32))[::-1], dst_ids, seed=11)
    gathers = [name for into, name in seen if into]
    scatters = {name for into, name in seen if not into}
    assert gathers == ["push"] * 8 and len(seen) == 16
    assert scatters == (
        {"nixl-plane-dst"} if scatters_on == "NIXL thread" else {threading.current_thread().name}
    )


def test_a_gather_that_fails_fails_its_transfer_and_leaves_the_ring_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The third gather raises: the source's `run` raises that error, nothing is left in flight, the
    send slots go back to the ring, and the next transfer through it moves every byte."""
    seen = _spy_copies(monkeypatch, fail_gather=2)
    src_ids, dst_ids = list(range(32)), list(range(16))
    with _small_rings() as ends:
        src_plane, dst_plane, src, dst = ends
        fill_request(SRC, 0, src.tensors, src_ids, logical_kv(SRC, 500, seed=5))
        rx, job = _staged(src_plane, dst_plane, src, dst, src_ids, dst_ids, 500)
        tx = src_plane.send(job)
        out = _run_both(rx, tx, "push")
        rx.close(quiet=True)
        assert len(out) == 1 and isinstance(out[0], RuntimeError) and str(out[0]) == "gather 2 broke"
        assert tx.quiet and sum(into for into, _ in seen) == 2
        src_plane.detach(RankKey("prefill", 0))
        dst_plane.detach(RankKey("decode", 0))

        monkeypatch.undo()  # the copies as they are
        seen = _spy_copies(monkeypatch)
        _send_exact(ends, src_ids, dst_ids, seed=6)
        assert sum(into for into, _ in seen) == 8


def _staged(
    src_plane: DataPlane,
    dst_plane: DataPlane,
    src: ShmKVCache,
    dst: ShmKVCache,
    src_ids: list[int],
    dst_ids: list[int],
    num_tokens: int,
    start: int = 0,
) -> tuple[Any, Send]:
    """A staged transfer of tokens [start, num_tokens) set up on both planes, nothing sent (the caller
    filled the source's blocks): the reader's Reception and the source's Send, in chunks as large as
    the reader's slots hold."""
    src_key, dst_key = RankKey("prefill", 0), RankKey("decode", 0)
    assert src_plane.attach_host(src_key, SRC, shm_tensors(src.handles())).kind == "DRAM"
    dst_plane.attach_host(dst_key, DST, shm_tensors(dst.handles()))
    heads = plan_pair(SRC, DST).decode_ranks[0].reads[0].heads
    tid = sp.new_transfer_id()
    tokens = Tokens(np.asarray(src_ids), np.asarray(dst_ids), num_tokens, start)
    rx = dst_plane.receive(Receive(dst_key, DST, heads, tokens, "plane-src", tid), _Until(10))
    assert rx is not None
    slots = rx.slots  # what the Push carries
    assert slots.memory_kind == "DRAM" and len(slots.addresses) >= 1
    per_chunk = src_plane.blocks_per_chunk(src_key, DST, [slots.slot_bytes] * len(slots.addresses))
    job = Send(
        src_key,
        DST,
        0,
        heads,
        ("prefill", "r1"),
        tuple(src_ids),
        num_tokens,
        start,
        tuple(sp.plan_chunks(start, num_tokens, DST.block_size, per_chunk)),
        tid,
        "plane-dst",
        slots.metadata,
        tuple((a, slots.slot_bytes) for a in slots.addresses),
        slots.device_id,
        deadline=_Until(10)._deadline,
    )
    return rx, job


@dataclasses.dataclass
class _OneChunk:
    """A one-chunk staged transfer of 64 tokens, set up and not sent: its Reception and Send, the
    reader's cache, what it held before, its blocks, and the logical KV the source holds."""

    rx: Any
    job: Send
    dst: ShmKVCache
    before: list[torch.Tensor]
    dst_ids: list[int]
    logical: Any

    def unchanged_outside(self, ids: list[int]) -> bool:
        return changed_outside(DST, self.before, self.dst.tensors, ids) == []


@contextlib.contextmanager
def _one_chunk(src_plane: DataPlane, dst_plane: DataPlane) -> Iterator[_OneChunk]:
    src_ids, dst_ids, num_tokens = [4, 5, 6, 7], [3, 11], 64
    with (
        ShmKVCache(SRC.rank_tensor_shapes(), torch.float16) as src,
        ShmKVCache(DST.rank_tensor_shapes(), torch.float16) as dst,
    ):
        before = [t.clone() for t in dst.tensors]
        logical = logical_kv(SRC, num_tokens, seed=3)
        fill_request(SRC, 0, src.tensors, src_ids, logical)
        rx, job = _staged(src_plane, dst_plane, src, dst, src_ids, dst_ids, num_tokens)
        assert len(job.chunks) == 1
        yield _OneChunk(rx, job, dst, before, dst_ids, logical)


def test_a_chunk_heard_before_the_reader_prepared_is_scattered_once_it_has(
    planes: tuple[DataPlane, DataPlane], scatters_on: str
) -> None:
    """A chunk heard while the reader still makes its copies waits for them; then a GPU reader's NIXL
    thread scatters it without `wait`, and a host reader's copy waits for `wait`, on its own thread."""
    with _one_chunk(*planes) as c:
        rx = c.rx
        sent = planes[0].send(c.job).run(_Until(10))  # the whole transfer, before the reader prepares
        assert sent.chunks == 1
        halt = _Until(10)
        while not rx._early:  # its notification, heard by the reader's NIXL thread
            halt.remaining()
            time.sleep(0.005)
        assert c.unchanged_outside([])  # nothing scattered yet
        rx.prepare()
        if scatters_on == "NIXL thread":
            while check_request(DST, 0, c.dst.tensors, c.dst_ids, c.logical, 0):
                halt.remaining()
                time.sleep(0.005)
        else:
            time.sleep(0.1)
            assert c.unchanged_outside([])
        while not rx.wait(min(0.05, halt.remaining())):
            pass
        rx.close(quiet=True)
        assert rx.nbytes == sent.nbytes
        assert check_request(DST, 0, c.dst.tensors, c.dst_ids, c.logical, 0) == []
        assert c.unchanged_outside(c.dst_ids)


def test_after_a_broken_notification_or_a_close_no_chunk_is_scattered(
    planes: tuple[DataPlane, DataPlane], scatters_on: str
) -> None:
    """A notification that breaks the protocol fails the transfer (its `wait` raises it) and stops the
    scatters: a good chunk heard after it, or after `close`, writes nothing."""
    with _one_chunk(*planes) as c:
        rx = c.rx
        rx.prepare()
        (t0, t1) = c.job.chunks[0]
        chunk = sp.chunk_notif(c.job.transfer_id, 0, 1, 0, t0, t1)
        rx._heard("another-agent", chunk)
        with pytest.raises(sp.ProtocolError, match=r"unexpected notification .* from another-agent"):
            rx.wait(1.0)
        rx._heard("plane-src", chunk)  # the right chunk from the right agent, too late
        assert not rx.wait(0.05)
        assert c.unchanged_outside([])
        rx.close(quiet=True)
        rx._heard("plane-src", chunk)
        assert c.unchanged_outside([])
        assert rx.nbytes == 0


def test_a_local_copy_and_its_refusals(planes: tuple[DataPlane, DataPlane]) -> None:
    """host-direct through the door; a rank detached meanwhile is named, not read."""
    plane = planes[0]
    plan = plan_pair(SRC, DST)
    num_tokens = 64
    src_ids, dst_ids = [4, 5, 6, 7], [1, 0]
    with (
        ShmKVCache(SRC.rank_tensor_shapes(), torch.float16) as src,
        ShmKVCache(DST.rank_tensor_shapes(), torch.float16) as dst,
    ):
        logical = logical_kv(SRC, num_tokens, seed=3)
        fill_request(SRC, 0, src.tensors, src_ids, logical)
        a, b = RankKey("p", 0), RankKey("d", 0)
        plane.attach_host(a, SRC, shm_tensors(src.handles()))
        plane.attach_host(b, DST, shm_tensors(dst.handles()))
        (read,) = plan.decode_ranks[0].reads
        job = LocalCopy(
            (RankRead(b, a, read.heads),),
            Tokens(np.asarray(src_ids), np.asarray(dst_ids), num_tokens, 0),
            whole_blocks=plan.is_identity(),
        )
        assert plane.copy_local(job, _Until(10)) > 0
        assert check_request(DST, 0, dst.tensors, dst_ids, logical) == []
        plane.detach(a)
        with pytest.raises(SidecarError) as info:
            plane.copy_local(job, _Until(10))
        assert info.value.code is Code.FAILED_PRECONDITION and "'p' rank 0" in info.value.message
        plane.detach(b)


def test_a_slot_too_small_for_one_block_is_refused_before_anything_is_taken(
    planes: tuple[DataPlane, DataPlane],
) -> None:
    plane = planes[1]
    big = dataclasses.replace(DST, head_dim=1024)  # one block: 2 x 32 x 2 x 1024 x 2 bytes x 2 layers
    with ShmKVCache(big.rank_tensor_shapes(), torch.float16) as dst:
        key = RankKey("big", 0)
        plane.attach_host(key, big, shm_tensors(dst.handles()))
        tokens = Tokens(np.asarray([0]), np.asarray([0]), 16, 0)
        with pytest.raises(SidecarError) as info:
            plane.receive(Receive(key, big, (0, 2), tokens, "plane-src", sp.new_transfer_id()), _Until(5))
        assert info.value.code is Code.RESOURCE_EXHAUSTED and "gpu_staging_bytes" in info.value.message
        ring = plane.device(-1).ring("recv")
        assert ring.pool.free == ring.slots  # nothing held
        plane.detach(key)


@pytest.mark.parametrize(
    ("setting", "gpus", "gpu", "host"),
    [
        ("auto", 0, False, False),
        ("auto", 2, False, False),
        ("auto", 3, False, False),
        ("auto", 4, True, False),  # two GPU pairs: GPU copies in workers, the host's stay here
        ("auto", 8, True, False),
        ("true", 0, True, True),
        (True, 2, True, True),  # a Settings made in code
        ("false", 8, False, False),
        (False, 8, False, False),
    ],
)
def test_device_workers_sends_which_copies_to_workers(
    setting: str | bool, gpus: int, gpu: bool, host: bool
) -> None:
    assert copies_in_workers(setting, lambda: gpus) == (gpu, host)
