"""Real vLLM engines on one node sidecar run as control shards (`control_shards: 2`).

Both engines name the node sidecar's one socket; the connector's clients ask its front door which
shard serves their engine (the scheduler's Publish, each worker's registration and polled pulls).
The engine ids are picked so that the TP 1 prefill engine and the TP 2 decode engine land on different
shards: every pull goes between the two shard processes (host-nixl-staged: each decode rank reads its
half of the heads). The decode engine's output must
equal what it computes alone. Then a TP 2 decode engine whose ranks the node sidecar spreads over its
shards (`control_shard_ranks: spread`), fed from a sidecar of its own: each rank pulls on its shard;
and fed from a TP 2 prefill engine spread over the same shards, each decode rank beside the prefill rank
it reads: each shard copies its own rank (host-direct). A TP 1 decode engine on the prefill engine's
leader shard reads both of its ranks: the one there as a copy, the other from the other shard.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar.shards.placement import Placement

from .engine import write_model
from .harness import VllmEngine, metric, prefill_then_decode, start_all
from .test_pd import BLOCK, prompt

PLACEMENT = Placement(2)
PREFILL_ID = next(f"shard-p{i}" for i in range(100) if PLACEMENT.shard_of(f"shard-p{i}") == 0)
DECODE_ID = next(f"shard-d{i}" for i in range(100) if PLACEMENT.shard_of(f"shard-d{i}") == 1)
# Host ranks spread round robin from rank 0's shard, which goes by engine id: rank r of both on one shard.
SPREAD_P_ID = next(f"spread-p{i}" for i in range(100) if PLACEMENT.shard_of(f"spread-p{i}") == 0)
SPREAD_D_ID = next(f"spread-d{i}" for i in range(100) if PLACEMENT.shard_of(f"spread-d{i}") == 0)
# An id that would go to shard 1, and a placement key (the connector's shard_placement) that puts it on 0.
MIXED_D_ID = next(f"mixed-d{i}" for i in range(100) if PLACEMENT.shard_of(f"mixed-d{i}") == 1)
MIXED_KEY = next(f"node-pair-{i}" for i in range(100) if PLACEMENT.shard_of(f"node-pair-{i}") == 0)


@pytest.fixture(scope="module")
def on_shards(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmEngine, VllmEngine, SidecarProcess]]:
    model = write_model(str(tmp_path_factory.mktemp("vllm-shards") / "model"))
    node = SidecarProcess("shards-node", extra=["--control-shards", "2"])
    P = VllmEngine(
        "prefill-shard0",
        {
            "model": model,
            "block_size": BLOCK,
            "connector": {"sidecar_socket": node.socket, "engine_id": PREFILL_ID},
        },
    )
    D = VllmEngine(
        "decode-shard1",
        {
            "model": model,
            "block_size": BLOCK,
            "tensor_parallel_size": 2,
            "prefix_caching": False,  # so that its own run of a prompt is a clean reference
            "connector": {"sidecar_socket": node.socket, "engine_id": DECODE_ID},
        },
    )
    try:
        start_all(P, D)
        yield P, D, node
    finally:
        P.stop()
        D.stop()
        assert node.stop() == 0, "\n".join(node.stderr_tail)


def test_pd_through_a_node_sidecar_of_control_shards_equals_the_decode_engine_alone(
    on_shards: tuple[VllmEngine, VllmEngine, SidecarProcess],
) -> None:
    P, D, node = on_shards
    prompts = {f"r{n}": prompt(n, seed=80 + n) for n in (9, 64, 200)}
    want = {rid: out["tokens"] for rid, out in D.generate(prompts, 10).items()}
    staged = {"outcome": "ok", "shard": "1", "path": "host-nixl-staged"}
    before = metric(node.metrics_port, "kvsidecar_pulls_total", **staged)
    assert prefill_then_decode(P, D, prompts, 10)[0] == want
    # One pull per decode rank per request, each by the decode engine's shard from the prefill
    # engine's (the decode rank's half of the heads: host-nixl-staged), none failed: equal output
    # alone would not show it, vLLM computes what a failed pull did not fill.
    pulls = metric(
        node.metrics_port, "kvsidecar_pulls_total", outcome="ok", shard="1", path="host-nixl-staged"
    )
    assert pulls - before == 2 * len(prompts)
    assert metric(node.metrics_port, "kvsidecar_failures_total") == 0
    settled = P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == P.ready["free_blocks"], settled


Spread = tuple[VllmEngine, VllmEngine, VllmEngine, VllmEngine, SidecarProcess]


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spread]:
    """A TP 2 decode engine on a node sidecar that spreads an engine's ranks over its 2 shards
    (`control_shard_ranks: spread`), fed by a TP 1 prefill engine on a sidecar of its own (another
    node) and by a TP 2 prefill engine spread over the same shards: each worker registers its rank on
    its own shard, rank 1 led by rank 0's shard."""
    model = write_model(str(tmp_path_factory.mktemp("vllm-spread") / "model"))
    node = SidecarProcess("spread-node", extra=["--control-shards", "2", "--control-shard-ranks", "spread"])
    other = SidecarProcess("prefill-node")
    P = VllmEngine(
        "prefill-other-node",
        {"model": model, "block_size": BLOCK, "connector": {"sidecar_socket": other.socket}},
    )
    near = VllmEngine(
        "prefill-spread",
        {
            "model": model,
            "block_size": BLOCK,
            "tensor_parallel_size": 2,
            "connector": {"sidecar_socket": node.socket, "engine_id": SPREAD_P_ID},
        },
    )
    D = VllmEngine(
        "decode-spread",
        {
            "model": model,
            "block_size": BLOCK,
            "tensor_parallel_size": 2,
            "prefix_caching": False,
            "connector": {"sidecar_socket": node.socket, "engine_id": SPREAD_D_ID},
        },
    )
    D1 = VllmEngine(
        "decode-tp1-on-the-leader-shard",
        {
            "model": model,
            "block_size": BLOCK,
            "prefix_caching": False,
            "connector": {
                "sidecar_socket": node.socket,
                "engine_id": MIXED_D_ID,
                "shard_placement": MIXED_KEY,
            },
        },
    )
    try:
        start_all(P, near, D, D1)
        yield P, near, D, D1, node
    finally:
        for engine in (P, near, D, D1):
            engine.stop()
        assert node.stop() == 0, "\n".join(node.stderr_tail)
        assert other.stop() == 0, "\n".join(other.stderr_tail)


def _pd_with_a_pull_per_shard(
    P: VllmEngine, D: VllmEngine, node: SidecarProcess, prefix: str, seed: int, path: str
) -> None:
    """P/D equals D alone, each request one `path` pull on each of the two shards (one per decode rank),
    none failed, and P's blocks all freed."""
    prompts = {f"{prefix}{n}": prompt(n, seed=seed + n) for n in (9, 64, 200)}
    want = {rid: out["tokens"] for rid, out in D.generate(prompts, 10).items()}
    ok = {"outcome": "ok", "path": path}
    before = [metric(node.metrics_port, "kvsidecar_pulls_total", shard=str(k), **ok) for k in (0, 1)]
    assert prefill_then_decode(P, D, prompts, 10)[0] == want
    after = [metric(node.metrics_port, "kvsidecar_pulls_total", shard=str(k), **ok) for k in (0, 1)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [len(prompts)] * 2, (before, after)
    assert metric(node.metrics_port, "kvsidecar_failures_total") == 0
    settled = P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == P.ready["free_blocks"], settled


def test_pd_into_a_tp_engine_spread_over_shards_equals_the_decode_engine_alone(spread: Spread) -> None:
    """Each decode rank pulls its half of the heads on its own shard."""
    P, _, D, _, node = spread
    _pd_with_a_pull_per_shard(P, D, node, "s", 90, "host-nixl-staged")


def test_pd_between_two_tp_engines_spread_over_the_same_shards_copies_on_each(spread: Spread) -> None:
    """Both engines spread over the node sidecar's shards, rank r of each on shard r: each decode rank's
    pull is a copy on its own shard from the prefill rank beside it, the request held there for that
    rank (its leader shard forwarded the publish), and "consumed" frees the prefill engine's blocks."""
    _, P, D, _, node = spread
    _pd_with_a_pull_per_shard(P, D, node, "n", 95, "host-direct")


def test_pd_from_a_spread_engine_into_one_on_its_leader_shard_reads_both_shards(spread: Spread) -> None:
    """A TP 1 decode engine on the shard that leads the TP 2 prefill engine (placed there by the
    connector's `shard_placement`, against its engine id): each pull reads prefill rank 0 there as a
    copy and rank 1 from the other shard (host-nixl-staged, through the leader shard's handshake with
    itself); the output equals the decode engine's alone."""
    _, P, _, D, node = spread
    prompts = {f"m{n}": prompt(n, seed=70 + n) for n in (9, 64, 200)}
    want = {rid: out["tokens"] for rid, out in D.generate(prompts, 10).items()}
    ok = {"outcome": "ok", "shard": "0", "path": "host-nixl-staged"}
    before = metric(node.metrics_port, "kvsidecar_pulls_total", **ok)
    assert prefill_then_decode(P, D, prompts, 10)[0] == want
    assert metric(node.metrics_port, "kvsidecar_pulls_total", **ok) - before == len(prompts)
    assert metric(node.metrics_port, "kvsidecar_failures_total") == 0
    settled = P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == P.ready["free_blocks"], settled
