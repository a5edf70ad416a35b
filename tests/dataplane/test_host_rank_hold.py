"""A host rank's memory outlives its registration while a copy holds it (MappedRanks, real shared memory).

The copies address engine memory by raw pointers, which keep no mapping alive: a prefill engine that
died while its sidecar gathered from its memory had that memory unmapped under the gather, and the
sidecar died of SIGSEGV (tests/e2e/test_staged_ring.py has that case end to end)."""

from __future__ import annotations

import os

import pytest
import torch

from kv_sidecar.dataplane.jobs import RankKey
from kv_sidecar.dataplane.ranks import MappedRanks
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.server.engines import shm_tensors
from kv_sidecar_client.shm import ShmKVCache

SPEC = EngineSpec.from_dict(
    {
        "tp_size": 1,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "dtype": "float16",
        "block_size": 16,
        "num_blocks": 8,
        "layout": "flash_attn_nhd",
    }
)


def _mappings(names: list[str]) -> int:
    """Mappings of these shared-memory objects in this process (the engine's own ones too: the test
    plays both)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if any(n in line for n in names))


def test_a_rank_unregistered_while_a_copy_holds_it_stays_mapped_until_the_copy_ends() -> None:
    ranks = MappedRanks(None)
    key = RankKey("engine", 0)
    with ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16) as cache:
        handles = shm_tensors(cache.handles())
        names = sorted({h.name for h in handles})
        engine_own = _mappings(names)
        ranks.attach_host(key, SPEC, handles)
        assert _mappings(names) > engine_own
        rank = ranks.host(key)
        with rank.in_use(), rank.in_use():  # two copies at once
            ranks.detach(key)
            with pytest.raises(SidecarError) as info:  # gone for new pulls at once
                ranks.host(key)
            assert info.value.code is Code.FAILED_PRECONDITION
            with pytest.raises(SidecarError), rank.in_use():  # and no new copy may hold it
                pass
            assert _mappings(names) > engine_own and rank.tensors  # the copies still read it
        assert _mappings(names) == engine_own and not rank.tensors  # the last one ended: unmapped


def test_a_rank_no_copy_holds_is_unmapped_when_it_is_unregistered() -> None:
    ranks = MappedRanks(None)
    key = RankKey("engine", 0)
    with ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16) as cache:
        handles = shm_tensors(cache.handles())
        names = [h.name for h in handles]
        engine_own = _mappings(names)
        ranks.attach_host(key, SPEC, handles)
        assert _mappings(names) > engine_own
        ranks.detach(key)
        assert _mappings(names) == engine_own


def test_a_rank_registered_again_under_its_old_names_maps_the_new_objects_while_the_old_are_held() -> None:
    """An engine that restarts may create its objects again under the names it had (vLLM's pool names
    them by pid, which a fresh container repeats). While a copy still holds the old rank, the new one
    must map the new objects: until 2026-11-30 the mapper shared mappings by name, and the new rank
    would have read and written the dead engine's pages."""
    ranks = MappedRanks(None)
    key = RankKey("engine", 0)
    name = f"kvs-test-renamed-{os.getpid()}"
    first = ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16, name=name)
    try:
        for t in first.tensors:
            t.fill_(1)
        ranks.attach_host(key, SPEC, shm_tensors(first.handles()))
        old = ranks.host(key)
        with old.in_use():
            ranks.detach(key)
            first.close()  # the engine is gone and its object with it (removed; still mapped here)
            with ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16, name=name) as second:
                for t in second.tensors:
                    t.fill_(2)
                ranks.attach_host(key, SPEC, shm_tensors(second.handles()))
                new = ranks.host(key)
                assert all(bool((t == 2).all()) for t in new.tensors), "the new rank maps the old object"
                assert all(bool((t == 1).all()) for t in old.tensors)  # the held copy still reads its own
                new.tensors[0].fill_(3)
                assert bool((second.tensors[0] == 3).all())  # and what the sidecar writes, the engine sees
                ranks.detach(key)
        assert not old.tensors
    finally:
        first.close()
