"""A hybrid model (tests/vllm/test_hybrid.py's) from a TP1 prefill engine to a TP2 decode engine, the
hybrid KV cache manager on at both ends: each decode rank pulls its own KV head of every group's record
(three groups, two ranks: six pulls per request), and the output equals the decode engine's alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import SidecarProcess

from .harness import VllmEngine, metric, prefill_then_decode, start_all
from .models import write_random_model
from .test_hybrid import ALIGNMENT, GROUPS, prompt


@pytest.fixture(scope="module")
def tp_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmEngine, VllmEngine, SidecarProcess]]:
    model = write_random_model(str(tmp_path_factory.mktemp("vllm-hybrid-tp") / "model"), "gemma3")
    sp, sd = SidecarProcess("hy-tp-prefill-node"), SidecarProcess("hy-tp-decode-node")
    P = VllmEngine(
        "hy-prefill-tp1",
        {
            "model": model,
            "hybrid": True,
            "connector": {"sidecar_socket": sp.socket, "engine_id": "hp1", "window_alignment": ALIGNMENT},
        },
    )
    D = VllmEngine(
        "hy-decode-tp2",
        {
            "model": model,
            "hybrid": True,
            "tensor_parallel_size": 2,
            "prefix_caching": False,  # so that its own run of a prompt is a clean reference
            "connector": {"sidecar_socket": sd.socket, "engine_id": "hd2"},
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


def test_hybrid_tp1_prefill_to_tp2_decode_equals_the_decode_engine_alone(
    tp_pair: tuple[VllmEngine, VllmEngine, SidecarProcess],
) -> None:
    P, D, sd = tp_pair
    assert P.ready["kv_cache_groups"] == D.ready["kv_cache_groups"] == GROUPS
    prompts = {f"r{n}": prompt(n, seed=60 + n) for n in (20, 64, 400)}
    want = {rid: out["tokens"] for rid, out in D.generate(prompts, 10).items()}
    pulls = metric(sd.metrics_port, "kvsidecar_pulls_total", outcome="ok")
    assert prefill_then_decode(P, D, prompts, 10)[0] == want
    # One pull per decode rank, group and request, each of the rank's own head.
    assert metric(sd.metrics_port, "kvsidecar_pulls_total", outcome="ok") - pulls == 2 * GROUPS * len(prompts)
    assert metric(sd.metrics_port, "kvsidecar_failures_total") == 0
    settled = P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == P.ready["free_blocks"], settled
