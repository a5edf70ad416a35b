"""The vLLM connector's worker side on host memory, without vLLM: caches allocated and viewed as vLLM does
(tests/vllm/views.py) inside the connector's shared-memory pool, described, registered and pulled by the
connector's own worker code through real sidecars; bit-exact, nothing else touched. (The GPU twin is
tests/gpu/test_vllm_connector_gpu.py; real vLLM engines: tests/vllm.)"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient, params_to_json
from kv_sidecar_client.vllm import worker as worker_module
from kv_sidecar_client.vllm.config import ConnectorConfig
from kv_sidecar_client.vllm.kv_layout import VllmKVInfo, describe
from kv_sidecar_client.vllm.metadata import StepOrders
from kv_sidecar_client.vllm.worker import SidecarWorker
from tests.vllm.views import VllmCache, assert_pulled_exactly, pull_through_worker

NUM_TOKENS = 150
CASES = {
    # name: (prefill (vLLM layout, block, kernel block), decode (...), path across sidecars)
    "cpu_backend_identity": (("LBHNC", 32, None), ("LBHNC", 32, None), "host-nixl"),
    "flash_attn_to_cpu_backend": (("LBNHC", 16, None), ("LBHNC", 32, None), "host-nixl-staged"),
    "kernel_split_to_cross_layer": (("LBHNC", 64, 16), ("BLNHC", 16, None), "host-nixl-staged"),
}


def worker(
    sidecar: SidecarProcess, engine_id: str, spec: tuple[str, int, int | None]
) -> tuple[SidecarWorker, VllmCache]:
    layout, block, kernel = spec
    w = SidecarWorker(
        ConnectorConfig(sidecar_socket=sidecar.socket, pull_timeout_s=30.0), engine_id, 0, on_cpu=True
    )
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
