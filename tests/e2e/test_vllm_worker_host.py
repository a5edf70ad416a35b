"""The vLLM connector's worker side on host memory, without vLLM: caches allocated and viewed as vLLM does
(tests/vllm/views.py) inside the connector's shared-memory pool, described, registered and pulled by the
connector's own worker code through real sidecars; bit-exact, nothing else touched. (The GPU twin is
tests/gpu/test_vllm_connector_gpu.py; real vLLM engines: tests/vllm.)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import torch

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient, params_to_json
from kv_sidecar_client.vllm import worker as worker_module
from kv_sidecar_client.vllm.config import ConnectorConfig
from kv_sidecar_client.vllm.kv_layout import VllmKVInfo, describe
from kv_sidecar_client.vllm.metadata import PullOrder, StepOrders
from kv_sidecar_client.vllm.worker import SidecarWorker
from tests.vllm.views import VllmCache, assert_pulled_exactly, pull_through_worker

from .conftest import metric

NUM_TOKENS = 150
CASES = {
    # name: (prefill (vLLM layout, block, kernel block), decode (...), path across sidecars)
    "cpu_backend_identity": (("LBHNC", 32, None), ("LBHNC", 32, None), "host-nixl"),
    "flash_attn_to_cpu_backend": (("LBNHC", 16, None), ("LBHNC", 32, None), "host-nixl-staged"),
    "kernel_split_to_cross_layer": (("LBHNC", 64, 16), ("BLNHC", 16, None), "host-nixl-staged"),
}


def worker(
    sidecar: SidecarProcess,
    engine_id: str,
    spec: tuple[str, int, int | None],
    pull_batch: bool = True,
    pull_batch_max: int = 64,
) -> tuple[SidecarWorker, VllmCache]:
    layout, block, kernel = spec
    config = ConnectorConfig(
        sidecar_socket=sidecar.socket,
        pull_timeout_s=30.0,
        pull_batch=pull_batch,
        pull_batch_max=pull_batch_max,
    )
    w = SidecarWorker(config, engine_id, 0, on_cpu=True)
    assert w.pool is not None
    cache = VllmCache(
        "cpu", layout, block, kernel, blocks=24, layers=2, heads=2, head=32, allocation=w.pool.allocation()
    )
    w.register(describe(cache.views, VllmKVInfo("TEST", layout, block, 2, 32, 32, 1, False)))
    return w, cache


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("same_sidecar", [False, True], ids=["two-sidecars", "one-sidecar"])
def test_vllm_shaped_host_caches_pull_bit_exact(
    case: str, same_sidecar: bool, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    p_spec, d_spec, remote_path = CASES[case]
    a, b = sidecar_pair
    tag = f"{case}-{same_sidecar}"
    pw, prefill = worker(a, f"vp-{tag}", p_spec)
    dw, decode = worker(a if same_sidecar else b, f"vd-{tag}", d_spec)
    try:
        p_blocks = list(range(23, 23 - -(-NUM_TOKENS // p_spec[1]), -1))
        d_blocks = [2 * i + 1 for i in range(-(-NUM_TOKENS // d_spec[1]))]
        before = decode.raw.clone()
        with SidecarClient(a.socket) as c:
            params = c.publish(f"vp-{tag}", "req", p_blocks, NUM_TOKENS)
        result = pull_through_worker(dw, params_to_json(params), d_blocks)
        assert result.ok and result.path == ("host-direct" if same_sidecar else remote_path), result
        assert_pulled_exactly(prefill, decode, p_blocks, d_blocks, NUM_TOKENS, before)
    finally:
        dw.shutdown()
        pw.shutdown()


def test_with_pull_batch_a_steps_pulls_go_in_one_call_and_a_bad_one_fails_alone(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """pull_batch: the step's three pulls go in PullBatch calls of at most two (pull_batch_max): two
    arrive bit-exact, the third (a block id past the cache) fails alone, naming its blocks, and vLLM is
    told which to recompute."""
    a, b = sidecar_pair
    spec = ("LBHNC", 32, None)
    pw, prefill = worker(a, "vb-p", spec)
    dw, decode = worker(b, "vb-d", spec, pull_batch=True, pull_batch_max=2)
    try:
        n_blocks = -(-NUM_TOKENS // 32)
        before = decode.raw.clone()
        orders, wanted = {}, {}
        with SidecarClient(a.socket) as c:
            for i in range(3):
                p_blocks = [i * n_blocks + k for k in range(n_blocks)]
                d_blocks = (
                    [i * n_blocks + k for k in range(n_blocks)] if i < 2 else [20, 21, 22, 24, 99][:n_blocks]
                )
                params = c.publish("vb-p", f"r{i}", p_blocks, NUM_TOKENS)
                orders[f"r{i}"] = PullOrder(json.loads(params_to_json(params)), d_blocks, 0)
                wanted[f"r{i}"] = (p_blocks, d_blocks)
        batches = metric(b.metrics_port, "kvsidecar_pull_batch_pulls_sum")
        calls = metric(b.metrics_port, "kvsidecar_pull_batch_pulls_count")
        dw.take_orders(StepOrders(pulls=orders))
        done: set[str] = set()
        deadline = time.monotonic() + 60
        while done != set(orders) and time.monotonic() < deadline:
            done |= dw.finished()[1]
            time.sleep(0.001)
        assert done == set(orders), done
        results = {rec.request_id: rec.result for rec in dw.pull_log[-3:]}
        assert results["r0"].ok and results["r1"].ok, results
        assert (
            results["r2"].error_code == "INVALID_ARGUMENT"
            and results["r2"].unfilled_blocks == wanted["r2"][1]
        )
        assert dw.load_errors() == set(wanted["r2"][1])
        assert metric(b.metrics_port, "kvsidecar_pull_batch_pulls_sum") - batches == 3
        assert metric(b.metrics_port, "kvsidecar_pull_batch_pulls_count") - calls == 2  # 2 + 1
        # Both good requests bit-exact (whole blocks: the plan is the identity), nothing else changed.
        good = sorted(set(wanted["r0"][1]) | set(wanted["r1"][1]))
        assert_pulled_exactly(
            prefill, decode, wanted["r0"][0] + wanted["r1"][0], good, len(good) * 32, before
        )
    finally:
        dw.shutdown()
        pw.shutdown()


def test_cpu_cache_outside_the_pool_is_refused_by_name(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    w = SidecarWorker(ConnectorConfig(sidecar_socket=sidecar_pair[0].socket), "vx", 0, on_cpu=True)
    try:
        cache = VllmCache(
            "cpu", "LBHNC", 32, None, blocks=4, layers=2, heads=2, head=32
        )  # plain torch memory
        with pytest.raises(ValueError, match="not in the shared memory this connector allocated"):
            w.register(describe(cache.views, VllmKVInfo("TEST", "LBHNC", 32, 2, 32, 32, 1, False)))
    finally:
        w.shutdown()
    assert torch.is_tensor(cache.raw)


def test_a_release_no_order_claims_is_dropped_after_a_while(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Publish the scheduler gave up (it timed out there) but the sidecar carried out ends by its lease;
    no step's orders ever claim its release. The worker keeps such a release only for a while, and one
    that its orders do claim in that while still frees the request's blocks."""
    monkeypatch.setattr(worker_module, "RELEASED_EARLY_TTL_S", 0.5)
    a, _ = sidecar_pair
    w, _cache = worker(a, "v-early", ("LBHNC", 32, None))
    try:
        with SidecarClient(a.socket) as c:
            c.publish("v-early", "lost", [0], 32, lease_ms=100)  # never in any step's orders
            _wait_until(lambda: "lost" in w._released_early)
            time.sleep(0.6)
            c.publish("v-early", "ordered-late", [1], 32, lease_ms=100)
            _wait_until(lambda: "ordered-late" in w._released_early)
        assert "lost" not in w._released_early
        w.take_orders(StepOrders(published=["ordered-late"]))
        sending, _ = w.finished()
        assert sending == {"ordered-late"} and not w._released_early
    finally:
        w.shutdown()


def _wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
