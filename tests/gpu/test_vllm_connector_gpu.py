"""The vLLM connector's worker side on GPUs, without vLLM (its wheel cannot travel to the GPU machine).

KV caches are allocated and viewed exactly as vLLM 0.32 does it (one int8
buffer, per-layer `[blocks, heads, tokens, K|V]` views strided by the
KVCacheLayout: tests/vllm/views.py, checked against vLLM's own code in
tests/vllm/test_kv_layout.py): LBNHC (FlashAttention, Triton, FlashInfer NHD)
and LBHNC (FlashInfer HND), with a kernel-block split and a cross-layer
BLNHC cache. The connector's own worker code describes them (kv_layout),
registers them over CUDA IPC and pulls with the orders the scheduler side
would send; every requested token must arrive bit for bit and no other byte
of the decode cache may change, on the same-node and the staged path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kv_sidecar.refengine.procs import SidecarProcess  # noqa: E402
from kv_sidecar_client import SidecarClient, params_to_json  # noqa: E402
from kv_sidecar_client.vllm.config import ConnectorConfig  # noqa: E402
from kv_sidecar_client.vllm.kv_layout import VllmKVInfo, describe  # noqa: E402
from kv_sidecar_client.vllm.worker import SidecarWorker  # noqa: E402
from tests.vllm.views import VllmCache, assert_pulled_exactly, pull_through_worker  # noqa: E402

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
# Prefill on one GPU, decode on another; a one-GPU machine runs both on it (every path but NVLink P2P).
GPU_A, GPU_B = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")

NUM_TOKENS = 300  # not a multiple of any block size
# name: (prefill (vLLM layout, block, kernel block), decode (...))
CASES = {
    "flash_attn_to_flashinfer_hnd": (("LBNHC", 16, None), ("LBHNC", 32, None)),
    "flashinfer_hnd_kernel_split_to_flash_attn": (("LBHNC", 64, 16), ("LBNHC", 16, None)),
    "flash_attn_identity": (("LBNHC", 16, None), ("LBNHC", 16, None)),
    "cross_layer_to_flash_attn": (("BLNHC", 16, None), ("LBNHC", 32, None)),
}


@pytest.fixture(scope="module")
def sidecars() -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    a, b = SidecarProcess("vllm-gpu-a"), SidecarProcess("vllm-gpu-b")
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


def registered(
    sidecar: SidecarProcess, engine_id: str, cache: VllmCache, layout: str, block: int
) -> SidecarWorker:
    w = SidecarWorker(
        ConnectorConfig(sidecar_socket=sidecar.socket, pull_timeout_s=60.0), engine_id, 0, on_cpu=False
    )
    w.register(describe(cache.views, VllmKVInfo("FLASH_ATTN", layout, block, 8, 128, 128, 1, False)))
    return w


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["gpu-direct", "gpu-staged"])
def test_vllm_shaped_caches_pull_bit_exact(
    case: str, path: str, sidecars: tuple[SidecarProcess, SidecarProcess]
) -> None:
    (p_layout, p_block, p_kernel), (d_layout, d_block, d_kernel) = CASES[case]
    a, b = sidecars
    prefill = VllmCache(GPU_A, p_layout, p_block, p_kernel, blocks=64)
    decode = VllmCache(GPU_B, d_layout, d_block, d_kernel, blocks=64)
    tag = f"{case}-{path}"
    pw = registered(a, f"p-{tag}", prefill, p_layout, p_block)
    dw = registered(a if path == "gpu-direct" else b, f"d-{tag}", decode, d_layout, d_block)
    try:
        p_blocks = list(range(63, 63 - -(-NUM_TOKENS // p_block), -1))  # scattered, descending
        d_blocks = [3 * i + 1 for i in range(-(-NUM_TOKENS // d_block))]
        before = decode.raw.clone()
        with SidecarClient(a.socket) as c:
            params = c.publish(f"p-{tag}", "req", p_blocks, NUM_TOKENS)
        result = pull_through_worker(dw, params_to_json(params), d_blocks)
        assert result.ok and result.path == path, result
        torch.cuda.synchronize()
        assert_pulled_exactly(prefill, decode, p_blocks, d_blocks, NUM_TOKENS, before)
    finally:
        dw.shutdown()
        pw.shutdown()
