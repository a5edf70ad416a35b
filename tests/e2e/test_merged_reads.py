"""host-nixl with `host_read_merge` on posts one descriptor per run of consecutive block ids, and with
it off (the default) one per block: real sidecars, every byte checked either way.

The engines are this process's clients (KV caches in shared memory), so that the test sees the whole
destination segment: the requested blocks must hold the source's bytes, and every other byte of the
segment (other blocks, padding between layer tensors) must be as it was. The decode sidecar's
`kvsidecar_nixl_descriptors_per_transfer` shows which way each READ went.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from kv_sidecar.plan.chunks import chunk_geometry
from kv_sidecar.plan.spec import EngineSpec, tensor_dims
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient
from kv_sidecar_client.shm import ShmKVCache

from .conftest import Spawn, metric, spec_dict

DESCS = "kvsidecar_nixl_descriptors_per_transfer"
MERGE = ["--host-read-merge", "true"]
_ids = itertools.count()


def whole_segment(cache: ShmKVCache) -> torch.Tensor:
    """Every byte of the cache's shared-memory object (its tensors are views into one segment)."""
    return torch.empty(0, dtype=torch.uint8).set_(cache.tensors[0].untyped_storage())


@pytest.fixture(scope="module")
def merging_pair() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    spawn = Spawn()
    try:
        a, b = spawn.together(
            lambda: SidecarProcess("merge-a", extra=MERGE), lambda: SidecarProcess("merge-b", extra=MERGE)
        )
        yield a, b
    finally:
        spawn.stop_all()


@pytest.mark.parametrize(
    ("layout", "merge"), [("flash_attn_nhd", True), ("flashinfer_hnd", True), ("flash_attn_nhd", False)]
)
def test_runs_and_gaps_move_exactly_the_requested_blocks(
    request: pytest.FixtureRequest, layout: str, merge: bool
) -> None:
    a, b = request.getfixturevalue("merging_pair" if merge else "sidecar_pair")
    spec = EngineSpec.from_dict(spec_dict(layout=layout, num_layers=3))
    geo = chunk_geometry(spec)
    axis = tensor_dims(spec).index("N")  # the block axis of each registered tensor
    n = next(_ids)
    src, dst = (ShmKVCache(spec.rank_tensor_shapes(), torch.float16) for _ in range(2))
    for cache in (src, dst):  # random bytes everywhere, so that a byte landing in the wrong place shows
        seg = whole_segment(cache)
        seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8))
    pulls = [
        # Runs of consecutive ids on both sides, a run broken on one side only, single blocks between.
        (
            [3, 4, 5, 6, 7, 8, 12, 20, 21, 22, 23, 24, 25, 40],
            [40, 41, 42, 43, 44, 45, 7, 50, 51, 52, 53, 9, 10, 11],
            5,  # runs: 5 * 2 <= 14 blocks, so they merge
        ),
        ([30, 31, 32, 33, 34, 35, 36, 37], [20, 21, 22, 23, 24, 25, 26, 27], 1),  # fully consecutive
        ([50, 49, 48, 47], [30, 31, 32, 33], 4),  # reversed on one side: nothing merges
        ([45, 44, 43, 42], [60, 59, 58, 57], 1),  # reversed on both sides: the same blocks forwards
        ([10, 11, 12, 13, 40, 41], [0, 1, 2, 3, 5, 6], 2),  # runs on both sides, a gap on both
        ([60], [63], 1),  # a single block
    ]
    try:
        with SidecarClient(a.socket) as pc, SidecarClient(b.socket) as dc:
            pc.register_rank(f"merge-p{n}", 0, spec.to_dict(), src.handles())
            dc.register_rank(f"merge-d{n}", 0, spec.to_dict(), dst.handles())
            for i, (src_ids, dst_ids, runs) in enumerate(pulls):
                want = whole_segment(dst).clone()
                for s_t, w_t in zip(src.tensors, dst.tensors, strict=True):
                    w_view = torch.empty(0, dtype=w_t.dtype).set_(
                        want.untyped_storage(), w_t.storage_offset(), w_t.shape, w_t.stride()
                    )
                    for s, d in zip(src_ids, dst_ids, strict=True):
                        w_view.select(axis, d).copy_(s_t.select(axis, s))
                before = (metric(b.metrics_port, DESCS + "_count"), metric(b.metrics_port, DESCS + "_sum"))
                params = pc.publish(f"merge-p{n}", f"m{i}", src_ids, len(src_ids) * spec.block_size)
                res = dc.pull(params, f"merge-d{n}", dst_ids)
                assert res.ok and res.path == "host-nixl", res
                assert res.bytes == len(src_ids) * geo.regions * geo.outer * geo.chunk
                got = whole_segment(dst)
                wrong = (got != want).nonzero().reshape(-1)
                assert wrong.numel() == 0, (
                    f"pull {i}: {wrong.numel()} bytes differ from the expected segment, first at offset "
                    f"{int(wrong[0])}"
                )
                after = (metric(b.metrics_port, DESCS + "_count"), metric(b.metrics_port, DESCS + "_sum"))
                # One READ; merging: one descriptor per (layer tensor, K/V plane, run), not per block.
                assert after[0] - before[0] == 1
                per = runs if merge else len(src_ids)
                assert after[1] - before[1] == geo.regions * geo.outer * per, (i, geo)
            pc.unregister_rank(f"merge-p{n}", 0)
            dc.unregister_rank(f"merge-d{n}", 0)
    finally:
        src.close()
        dst.close()
