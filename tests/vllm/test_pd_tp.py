"""Prefill and decode engines of different tensor parallelism: a TP1 prefill engine, a TP2 decode engine.

Each TP2 worker process registers its rank with the decode node's sidecar and
pulls its own rank (its half of the KV heads) concurrently; the sidecars plan
which prefill heads each decode rank reads. The decode engine's output must
equal what it computes itself without a prefill engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import SidecarProcess

from .engine import write_model
from .harness import VllmEngine, metric, prefill_then_decode, start_all
from .test_pd import BLOCK, prompt


@pytest.fixture(scope="module")
def tp_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmEngine, VllmEngine, SidecarProcess]]:
    model = write_model(str(tmp_path_factory.mktemp("vllm-tp") / "model"))
    sp, sd = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
    P = VllmEngine(
        "prefill-tp1",
        {"model": model, "block_size": BLOCK, "connector": {"sidecar_socket": sp.socket, "engine_id": "p1"}},
    )
    D = VllmEngine(
        "decode-tp2",
        {
            "model": model,
            "block_size": BLOCK,
            "tensor_parallel_size": 2,
            "prefix_caching": False,  # so that its own run of a prompt is a clean reference
            "connector": {"sidecar_socket": sd.socket, "engine_id": "d2"},
        },
    )
    try:
        start_all(P, D)
        yield P, D, sd
    finally:
        P.stop()
        D.stop()
        sp.stop()
        sd.stop()


def test_tp1_prefill_to_tp2_decode_equals_the_decode_engine_alone(
    tp_pair: tuple[VllmEngine, VllmEngine, SidecarProcess],
) -> None:
    P, D, sd = tp_pair
    prompts = {f"r{n}": prompt(n, seed=60 + n) for n in (9, 64, 200)}
    want = {rid: out["tokens"] for rid, out in D.generate(prompts, 10).items()}
    pulls = metric(sd.metrics_port, "kvsidecar_pulls_total")
    assert prefill_then_decode(P, D, prompts, 10)[0] == want
    # One pull per decode rank per request, each of the rank's own heads.
    assert metric(sd.metrics_port, "kvsidecar_pulls_total") - pulls == 2 * len(prompts)
    assert metric(sd.metrics_port, "kvsidecar_failures_total") == 0
    settled = P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == P.ready["free_blocks"], settled
