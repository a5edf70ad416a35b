"""Which shard serves an engine, and what each shard is told (pure parts of control shards)."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.config import load_settings
from kv_sidecar.shards.children import advertised_host, serve_argv, shard_settings
from kv_sidecar.shards.placement import EngineShards, Placement

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
