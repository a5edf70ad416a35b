"""A hybrid model through two real vLLM engines and two real `kv-sidecar serve` processes (issue 33).

The Gemma-3-shaped model of tests/vllm/models.py (6 layers: sliding-window layers of 64 tokens next to
full-attention ones) runs with vLLM's hybrid KV cache manager on at both ends: three KV cache groups
(two of sliding-window layers, one of full-attention ones) drawing from one block pool, layer j of
every group a view of the same bytes. The prefill publishes each group as its own sidecar record (a
sliding-window group only its window); the decode engine pulls each into its own blocks of that
group. Greedy tokens and their log-probabilities must equal one engine's, for prompts shorter than,
equal to and many times longer than the window, between engines of equal and of different block
sizes; the decode engine keeps the KV capacity of an engine without a connector; and a long request
moves far fewer bytes than the same prompt through the same model with the hybrid manager off (every
layer's whole KV, as before this issue).

Engines: `h32` (hybrid, block 32, prefill node, window_alignment 64), `d32` and `d64` (hybrid, blocks
32 and 64, decode node), `ref` (hybrid, no connector), `off-p` / `off-d` (hybrid manager off, prefill
and decode node).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client.vllm.window import first_kept_token, prefill_tokens

from .failures import (
    a_failed_pull_of_one_group_is_computed,
    a_request_nobody_pulls_is_freed_at_lease_expiry,
    a_waiting_request_is_kept_alive_past_the_lease,
    abort_of_a_waiting_request_releases_every_group,
)
from .harness import EnginePair, VllmEngine, assert_same_output, metric, pulls_of
from .models import ARCHITECTURES, write_random_model

W = ARCHITECTURES["gemma3"]["sliding_window"]
LAYERS = ARCHITECTURES["gemma3"]["num_hidden_layers"]
# One layer's K and V per token: 2 KV heads x head_dim 64 x float32.
LAYER_TOKEN_BYTES = 2 * 2 * 64 * 4
REGIONS = 2  # layer positions per group (3 groups of 2 layers each): the registered regions
GROUPS = 3
LENGTHS = (20, 63, 64, 65, 96, 150, 400, 1000)
MAX_TOKENS = 10
LEASE_MS = 30000
ALIGNMENT = 64
KV_BYTES = 64 << 20  # tests/vllm/engine.py's default kv_cache_bytes


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


class Hybrid(EnginePair):
    max_tokens, lease_ms = MAX_TOKENS, LEASE_MS

    def __init__(self, tmp: str) -> None:
        model = write_random_model(f"{tmp}/model", "gemma3")
        self.sp, self.sd = SidecarProcess("hy-prefill-node"), SidecarProcess("hy-decode-node")
        conn = {"pull_timeout_s": 60.0, "lease_ms": LEASE_MS}
        base = {"model": model, "hybrid": True, "block_size": 32}

        def engine(name: str, sidecar: SidecarProcess | None, **over: Any) -> VllmEngine:
            extra = over.pop("connector", {})
            opts = base | over
            if sidecar is not None:
                opts["connector"] = conn | {"sidecar_socket": sidecar.socket, "engine_id": name} | extra
            return VllmEngine(f"hy-{name}", opts)

        self.h32 = engine("h32", self.sp, connector={"window_alignment": ALIGNMENT})
        self.d32 = engine("d32", self.sd)
        self.d64 = engine("d64", self.sd, block_size=64)
        self.ref = engine("ref", None)
        self.off_p = engine("off-p", self.sp, hybrid=False)
        self.off_d = engine("off-d", self.sd, hybrid=False)
        self.start(self.h32, self.d32, self.d64, self.ref, self.off_p, self.off_d)


@pytest.fixture(scope="module")
def hy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    fixture = Hybrid(str(tmp_path_factory.mktemp("vllm-hybrid")))
    yield fixture
    fixture.close()


def test_the_hybrid_manager_is_on_and_the_decode_keeps_its_capacity(hy: Hybrid) -> None:
    """vLLM keeps three groups with our connector loaded (it would turn the hybrid manager off for a
    connector without SupportsHMA), and the decode engine's blocks equal those of an engine without
    a connector; with the manager off the same memory holds a third as many blocks (every layer's)."""
    for e in (hy.h32, hy.d32, hy.d64, hy.ref):
        assert e.ready["kv_cache_groups"] == GROUPS, (e.name, e.ready)
    assert hy.free["hy-d32"] == hy.free["hy-ref"] == hy.free["hy-h32"]
    assert hy.off_d.ready["kv_cache_groups"] == 1
    # 64 MiB of blocks of 2 pages (one per layer position) with the manager on, of 6 (every layer)
    # with it off; block 0 is vLLM's null block.
    assert hy.free["hy-d32"] == KV_BYTES // (REGIONS * 32 * LAYER_TOKEN_BYTES) - 1 == 1023
    assert hy.free["hy-d64"] == KV_BYTES // (REGIONS * 64 * LAYER_TOKEN_BYTES) - 1
    assert hy.free["hy-off-d"] == KV_BYTES // (LAYERS * 32 * LAYER_TOKEN_BYTES) - 1 == 340


@pytest.mark.parametrize("decode", ["d32", "d64"])
def test_hybrid_requests_are_pulled_per_group_and_decode_as_one_engine(hy: Hybrid, decode: str) -> None:
    d_engine = getattr(hy, decode)
    bp, bd = 32, d_engine.opts["block_size"]
    prompts = [prompt(n, seed=100 * bd + n) for n in LENGTHS]
    want = hy.reference(prompts)
    ok_before = metric(hy.sd.metrics_port, "kvsidecar_pulls_total", outcome="ok")

    params = hy.prefill(hy.h32, prompts)
    for n, p in zip(LENGTHS, params, strict=True):
        groups = p["kv_sidecar_groups"]
        held = prefill_tokens(n, W, ALIGNMENT)
        assert [g["window"] for g in groups] == [W, W, None], groups
        for g in groups:
            kv = g["params"]
            first = first_kept_token(held, W, bp) if g["window"] else 0
            assert kv["num_tokens"] == held and kv.get("first_token", 0) == first, (n, kv)
            assert len(kv["block_ids"]) == -(-held // bp) - first // bp and 0 not in kv["block_ids"], (n, kv)
        # Each group's blocks are its own: no block id is published by two groups.
        every = [b for g in groups for b in g["params"]["block_ids"]]
        assert len(every) == len(set(every)), groups
    got, ids = hy.decode(d_engine, prompts, params)
    assert_same_output(got, want, LENGTHS)

    pulls = pulls_of(d_engine, ids)
    assert all(len(pulls[r]) == GROUPS and all(p["ok"] for p in pulls[r]) for r in ids), pulls
    assert metric(hy.sd.metrics_port, "kvsidecar_pulls_total", outcome="ok") == ok_before + GROUPS * len(ids)
    for n, rid in zip(LENGTHS, ids, strict=True):
        held = prefill_tokens(n, W, ALIGNMENT)
        start = first_kept_token(held, W, bd)
        whole = bp == bd  # equal blocks: whole blocks are READ; else the tokens themselves are converted
        full = -(-held // bd) * bd if whole else held
        window = (-(-held // bd) - start // bd) * bd if whole else held - start
        want_bytes = REGIONS * LAYER_TOKEN_BYTES * (full + 2 * window)
        assert sum(p["bytes"] for p in pulls[rid]) == want_bytes, (n, pulls[rid])
    hy.settled(hy.h32)


def test_a_long_hybrid_request_moves_fewer_bytes_than_with_the_hybrid_manager_off(hy: Hybrid) -> None:
    """The decode sidecar's byte counter, for one prompt of 1900 tokens (30 windows): with the manager
    on, the full-attention layers' whole prompt and the sliding-window layers' window; off, every
    layer's whole prompt."""
    n = 1900
    p = [prompt(n, seed=1900)]
    want = hy.reference(p)
    moved = {}
    for name, (pe, de) in {"on": (hy.h32, hy.d32), "off": (hy.off_p, hy.off_d)}.items():
        before = metric(hy.sd.metrics_port, "kvsidecar_pull_bytes_total")
        got, _ = hy.decode(de, p, hy.prefill(pe, p))
        assert_same_output(got, want, (n,))
        moved[name] = metric(hy.sd.metrics_port, "kvsidecar_pull_bytes_total") - before
    held = prefill_tokens(n, W, ALIGNMENT)
    window = -(-held // 32) * 32 - first_kept_token(held, W, 32)
    assert moved["on"] == REGIONS * LAYER_TOKEN_BYTES * (-(-held // 32) * 32 + 2 * window), moved
    # Off: one group of full attention, all 6 layers, the whole prompt but its last token.
    assert moved["off"] == LAYERS * LAYER_TOKEN_BYTES * -(-(n - 1) // 32) * 32, moved
    assert moved["on"] < moved["off"] / 2.5, moved
    hy.settled(hy.h32, hy.off_p)


def test_groups_that_do_not_correspond_are_computed_by_the_decode_engine(hy: Hybrid) -> None:
    """A hybrid prefill and a decode engine with the hybrid manager off (one group of every layer):
    the decode engine computes the request itself, saying why, and the prefill frees its blocks at
    once; the other way round too."""
    n = 300
    p = [prompt(n, seed=300)]
    want = hy.reference(p)
    for pe, de in ((hy.h32, hy.off_d), (hy.off_p, hy.d32)):
        got, ids = hy.decode(de, p, hy.prefill(pe, p))
        assert_same_output(got, want, (n,))
        assert not pulls_of(de, ids), f"{de.name} pulled from {pe.name}"
        hy.settled(pe)  # long before the lease: released by the decode engine
    for de in (hy.off_d, hy.d32):
        with open(de.log_path, errors="replace") as f:
            log = f.read()
        assert "KV cache groups of the two engines do not correspond" in log, de.name


def test_a_failed_pull_of_one_group_is_computed_from_the_start(hy: Hybrid) -> None:
    a_failed_pull_of_one_group_is_computed(hy, hy.h32, hy.d32, "d32", prompt(400, seed=4343), group=2)


def test_abort_of_a_waiting_hybrid_request_releases_every_group(hy: Hybrid) -> None:
    abort_of_a_waiting_request_releases_every_group(hy, hy.h32, hy.d32, prompt(300, seed=77))


def test_a_waiting_hybrid_request_is_kept_alive_past_the_lease(hy: Hybrid) -> None:
    """Queued, not stepped: only KeepAlive of every group's record holds the prefill's blocks."""
    a_waiting_request_is_kept_alive_past_the_lease(hy, hy.h32, hy.d32, prompt(200, seed=78), GROUPS)


def test_a_hybrid_request_nobody_pulls_is_freed_when_its_lease_expires(hy: Hybrid) -> None:
    a_request_nobody_pulls_is_freed_at_lease_expiry(hy, hy.h32, prompt(250, seed=79), GROUPS)
