"""A host rank's memory outlives its registration while a copy holds it (MappedRanks, real shared memory).

The copies address engine memory by raw pointers, which keep no mapping alive: a prefill engine that
died while its sidecar gathered from its memory had that memory unmapped under the gather, and the
sidecar died of SIGSEGV (tests/e2e/test_staged_ring.py has that case end to end)."""

from __future__ import annotations

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
