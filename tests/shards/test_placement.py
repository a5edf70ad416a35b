"""Which shard serves an engine, and what each shard is told (pure parts of control shards)."""

from __future__ import annotations

import itertools
import re
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.config import ConfigError, load_settings
from kv_sidecar.shards.children import advertised_host, serve_argv, shard_settings
from kv_sidecar.shards.placement import EngineShards, Placement, gpu_groups

GPUS = tuple(f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(8))


@given(shards=st.integers(1, 8), gpus=st.integers(1, 8))
def test_gpus_split_into_contiguous_groups_one_per_shard(shards: int, gpus: int) -> None:
    p = Placement(shards, GPUS[:gpus])
    got = [p.shard_of("e", uuid) for uuid in GPUS[:gpus]]
    assert got == sorted(got), "contiguous: GPU k+1's shard is never below GPU k's"
    assert all(0 <= s < shards for s in got)
    if gpus >= shards:
        assert set(got) == set(range(shards)), "every shard gets GPUs"
        sizes = [got.count(s) for s in range(shards)]
        assert max(sizes) - min(sizes) <= 1, sizes


def test_the_two_gpu_pairs_of_four_gpus_get_a_shard_each() -> None:
    p = Placement(2, GPUS[:4])
    assert [p.shard_of("e", u) for u in GPUS[:4]] == [0, 0, 1, 1]


@given(engine=st.text(max_size=40), shards=st.integers(1, 8))
def test_a_host_engine_goes_by_its_id_alone(engine: str, shards: int) -> None:
    p, q = Placement(shards), Placement(shards, GPUS[:2])
    s = p.shard_of(engine)
    assert 0 <= s < shards
    assert q.shard_of(engine, "") == s, "a host engine ignores the GPUs"
    assert q.shard_of(engine, "GPU-not-visible-here") == s


@given(
    a=st.text(max_size=20),
    b=st.text(max_size=20),
    key=st.text(min_size=1, max_size=20),
    shards=st.integers(1, 8),
    rank=st.integers(0, 16),
)
def test_host_engines_that_name_one_placement_key_share_a_shard(
    a: str, b: str, key: str, shards: int, rank: int
) -> None:
    """A P/D pair of host engines names one key: both go to its shard, whatever their ids, and so do
    their spread ranks, rank by rank; GPU ranks still go by their GPU; no key: by engine id."""
    p = Placement(shards, GPUS[:2])
    assert p.shard_of(a, key=key) == p.shard_of(b, key=key) == p.shard_of(key)
    assert p.rank_shard(a, rank, key=key) == p.rank_shard(b, rank, key=key)
    assert p.shard_of(a, GPUS[1], key=key) == p.shard_of(b, GPUS[1])
    assert p.shard_of(a, key="") == p.shard_of(a)


def test_host_engines_spread_over_the_shards() -> None:
    p = Placement(4)
    counts = [0] * 4
    for i in range(400):
        counts[p.shard_of(f"engine-{i}")] += 1
    assert min(counts) > 60, counts


def test_an_engine_waits_for_its_rank_0s_route() -> None:
    shards = EngineShards()
    assert shards.wait("e", 0.05) is None
    threading.Timer(0.1, shards.set, args=("e", 3)).start()
    t0 = time.monotonic()
    assert shards.wait("e", 5) == 3
    assert time.monotonic() - t0 < 2


def test_engine_shards_forget_the_least_recently_routed() -> None:
    shards = EngineShards(capacity=2)
    shards.set("a", 0)
    shards.set("b", 1)
    assert shards.wait("a", 0) == 0  # "a" used: "b" is now the oldest
    shards.set("c", 1)
    assert shards.wait("b", 0) is None and shards.wait("a", 0) == 0 and shards.wait("c", 0) == 1


def test_a_shard_gets_its_own_socket_ports_and_id_and_everything_else_as_given() -> None:
    s = load_settings(
        {
            "engine_socket": "/run/kv/engine.sock",
            "peer_port": 50061,
            "metrics_port": 9464,
            "advertise_address": "10.0.0.7:50061",
            "sidecar_id": "node-a",
            "control_shards": 4,
            "staged_workers": True,
        },
        env={},
    )
    v = shard_settings(s, 2)
    assert v["engine_socket"] == "/run/kv/engine.sock.shard2"
    assert (v["peer_port"], v["metrics_port"], v["control_shards"]) == (50064, 0, 1)
    assert v["metrics_host"] == "127.0.0.1", "a shard's metrics are for its front door alone"
    assert (v["advertise_address"], v["sidecar_id"]) == ("10.0.0.7", "node-a-shard2")
    assert v["staged_workers"] is True and v["lease_ms"] == s.lease_ms
    argv = serve_argv(v)
    assert argv[argv.index("--staged-workers") + 1] == "true"
    assert argv[argv.index("--advertise-address") + 1] == "10.0.0.7"
    # Free ports stay free ports; no metrics stay none.
    free = shard_settings(load_settings({"peer_port": 0, "metrics_port": -1, "control_shards": 2}, env={}), 1)
    assert (free["peer_port"], free["metrics_port"], free["sidecar_id"]) == (0, -1, "")


def test_advertised_host() -> None:
    assert [advertised_host(a) for a in ("h", "h:1", "[::1]", "[::1]:5", "")] == [
        "h",
        "h",
        "[::1]",
        "[::1]",
        "",
    ]


@given(
    perm=st.permutations(range(8)),
    cuts=st.lists(st.integers(1, 7), min_size=0, max_size=7, unique=True),
)
def test_named_gpu_groups_put_each_gpus_engines_on_its_group_s_shard(
    perm: list[int], cuts: list[int]
) -> None:
    """Any partition of the GPUs into groups (control_shard_gpus): an engine goes to the shard of the group
    that holds its rank 0's GPU; a host engine still by its id."""
    bounds = [0, *sorted(cuts), 8]
    groups = tuple(tuple(perm[a:b]) for a, b in itertools.pairwise(bounds))
    text = ";".join(",".join(map(str, g)) for g in groups)
    assert gpu_groups(text, len(groups)) == groups
    p = Placement(len(groups), GPUS, groups)
    for k, group in enumerate(groups):
        assert all(p.shard_of("e", GPUS[g]) == k for g in group)
    assert p.shard_of("host-engine") == Placement(len(groups)).shard_of("host-engine")


def test_prefill_and_decode_gpus_apart_share_shards_when_grouped() -> None:
    """Prefill engines on GPUs 0-3 and decode engines on 4-7: contiguous groups would put every pair on
    two shards (staged between them); named pairs keep each on one."""
    paired = Placement(4, GPUS, gpu_groups("0,4;1,5;2,6;3,7", 4))
    assert [paired.shard_of("e", GPUS[g]) for g in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [Placement(4, GPUS).shard_of("e", GPUS[g]) for g in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    ("text", "shards", "message"),
    [
        ("0,1;2", 3, "names 2 groups of GPUs; control_shards is 3"),
        ("0,1;1,2", 2, "puts GPU 1 in more than one group"),
        ("0,a;1", 2, "'0,a' is not a list of GPU ordinals"),
        ("0;;1", 3, "'' is not a list of GPU ordinals"),
        ("0;-1", 2, "not negative"),
    ],
)
def test_gpu_groups_refuse_what_they_cannot_mean(text: str, shards: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        gpu_groups(text, shards)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings({"control_shards": shards, "control_shard_gpus": text}, env={})


def test_named_groups_must_cover_the_gpus_this_node_sees() -> None:
    with pytest.raises(ValueError, match="names GPU 4, but this node sees 4 GPU"):
        Placement(2, GPUS[:4], ((0, 1), (2, 4)))
    with pytest.raises(ValueError, match="leaves GPU 3 in no group"):
        Placement(2, GPUS[:4], ((0, 1), (2,)))


def test_a_shard_is_told_no_groups_of_its_own() -> None:
    s = load_settings({"control_shards": 2, "control_shard_gpus": "0,2;1,3"}, env={})
    v = shard_settings(s, 1)
    assert (v["control_shards"], v["control_shard_gpus"]) == (1, "")
    load_settings(v, env={})  # a shard's settings load as they are


@given(shards=st.integers(1, 8), gpus=st.integers(0, 8))
def test_gpus_of_a_shard_are_those_placed_on_it(shards: int, gpus: int) -> None:
    """What `kv-sidecar status` shows per shard (gpus_of) is where shard_of puts each GPU's engines."""
    for p in (
        Placement(shards, GPUS[:gpus]),
        *([Placement(1, GPUS[:gpus], (tuple(range(gpus)),))] if gpus else []),
    ):
        for k in range(p.shards):
            assert all(p.shard_of("e", GPUS[g]) == k for g in p.gpus_of(k))
        assert sorted(g for k in range(p.shards) for g in p.gpus_of(k)) == list(range(gpus))


@given(engine=st.text(max_size=20), shards=st.integers(1, 8), tp=st.integers(1, 16))
def test_spread_host_ranks_go_round_robin_from_rank_0s_shard(engine: str, shards: int, tp: int) -> None:
    p = Placement(shards, GPUS[:2])
    first = p.shard_of(engine)
    got = [p.rank_shard(engine, r) for r in range(tp)]
    assert got[0] == first and got == [(first + r) % shards for r in range(tp)]
    # A GPU rank goes by its GPU alone.
    assert [p.rank_shard(engine, 5, g) for g in GPUS[:2]] == [p.shard_of(engine, g) for g in GPUS[:2]]
