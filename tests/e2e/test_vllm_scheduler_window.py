"""The connector's scheduler side for sliding-window requests, without vLLM: requests duck-typed as vLLM
hands them (its null block, 0, where blocks left the window), against a real sidecar. (Real engines:
tests/vllm/test_sliding_window.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient
from kv_sidecar_client.shm import ShmKVCache
from kv_sidecar_client.vllm.config import ConnectorConfig
from kv_sidecar_client.vllm.scheduler import SidecarScheduler
from kv_sidecar_client.vllm.window import prefill_tokens

from .conftest import spec_dict

W = 64
SPEC = EngineSpec.from_dict(spec_dict(block_size=16))


@pytest.fixture
def prefill(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> Iterator[SidecarScheduler]:
    """A registered prefill engine (block 16, window 64) and its scheduler-side connector."""
    sc = sidecar_pair[0]
    cache = ShmKVCache(SPEC.rank_tensor_shapes(), torch.float16)
    with SidecarClient(sc.socket) as client:
        client.register_rank("win-p", 0, SPEC.to_dict(), cache.handles())
        sched = SidecarScheduler(ConnectorConfig(sidecar_socket=sc.socket), "win-p", 16, window=W)
        try:
            yield sched
        finally:
            sched.shutdown()
            client.unregister_rank("win-p", 0)
            cache.close()


def vllm_request(rid: str, prompt: int, kvp: dict[str, Any], **over: Any) -> SimpleNamespace:
    """What the scheduler-side connector reads of a vLLM Request, waiting with nothing computed."""
    fields = {
        "request_id": rid,
        "kv_transfer_params": kvp,
        "prompt_token_ids": list(range(prompt)),
        "num_prompt_tokens": prompt,
        "num_computed_tokens": 0,
        "status": "WAITING",
    }
    return SimpleNamespace(**(fields | over))


def _finished_prefill(sched: SidecarScheduler, rid: str, prompt: int, blocks: list[int]) -> Any:
    """A prefill request that computed its shortened prompt and finished: what request_finished returns."""
    req = vllm_request(rid, prompt, {"do_remote_decode": True})
    kept = sched.prefill_length(req)
    assert kept == prefill_tokens(prompt, W, 16)
    req.num_prompt_tokens = req.num_computed_tokens = kept
    req.status = "FINISHED_LENGTH_CAPPED"
    return sched.request_finished(req, blocks)


def test_the_prefill_publishes_the_blocks_after_the_null_ones(prefill: SidecarScheduler) -> None:
    # 200 tokens: the prefill computes 191, whose window starts at token 128: 8 null blocks, then 4.
    delay, out = _finished_prefill(prefill, "w1", 200, [0] * 8 + [5, 6, 7, 8])
    assert delay and out is not None
    params = out["kv_sidecar"]
    assert (params["num_tokens"], params["first_token"], params["block_ids"]) == (191, 128, [5, 6, 7, 8])
    # A prompt whose window never moved publishes every block from token 0 (first_token is 0, not sent).
    delay, out = _finished_prefill(prefill, "w2", 40, [9, 10, 11])
    assert delay and out is not None and "first_token" not in out["kv_sidecar"]


def test_a_null_block_inside_the_window_is_never_published(prefill: SidecarScheduler) -> None:
    before = prefill.unpublished
    assert _finished_prefill(prefill, "w3", 200, [0] * 8 + [5, 0, 7, 8]) == (False, None)
    assert _finished_prefill(prefill, "w4", 200, [0] * 12) == (False, None)
    assert prefill.unpublished == before + 2


def _published(sidecar: SidecarProcess) -> int:
    with SidecarClient(sidecar.socket) as c:
        return c.status().published_requests


def _decode_request(rid: str, prompt: int, params: dict[str, Any]) -> SimpleNamespace:
    return vllm_request(rid, prompt, {"do_remote_prefill": True, "kv_sidecar": params})


@pytest.mark.parametrize(
    ("decode_block", "window", "pulled"), [(16, W, True), (64, W, False), (16, None, False)]
)
def test_a_decode_engine_takes_a_window_only_where_its_blocks_fit_it(
    prefill: SidecarScheduler,
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
    decode_block: int,
    window: int | None,
    pulled: bool,
) -> None:
    """208 tokens: the prefill keeps tokens from 144 on. A decode engine of block 16 starts its window
    there too and pulls; one of block 64 would start at 128 (not published): it computes the request and
    frees the prefill's blocks at once, as does one whose model has no window."""
    a, b = sidecar_pair
    _, out = _finished_prefill(prefill, f"w5-{decode_block}-{window}", 208, [0] * 9 + [3, 4, 5, 6])
    assert out is not None and out["kv_sidecar"]["first_token"] == 144
    held = _published(a)
    decode = SidecarScheduler(ConnectorConfig(sidecar_socket=b.socket), "win-d", decode_block, window=window)
    try:
        req = _decode_request("d5", 208, out["kv_sidecar"])
        count, load = decode.matched_tokens(req, 0)
        if pulled:
            assert (count, load) == (207, True)
            return
        assert (count, load) == (0, False)
        deadline = time.monotonic() + 10
        while _published(a) == held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _published(a) == held - 1, "the prefill's blocks must be released at once"
    finally:
        decode.shutdown()


def test_the_decode_pulls_into_the_blocks_after_its_null_ones(
    prefill: SidecarScheduler, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    _, out = _finished_prefill(prefill, "w6", 208, [0] * 9 + [3, 4, 5, 6])
    assert out is not None
    decode = SidecarScheduler(ConnectorConfig(sidecar_socket=sidecar_pair[1].socket), "win-d", 16, window=W)
    try:
        req = _decode_request("d6", 208, out["kv_sidecar"])
        assert decode.matched_tokens(req, 0) == (207, True)
        # vLLM's table: null blocks up to the window's block (144 / 16 = 9), then new blocks.
        decode.after_alloc(req, [0] * 9 + [21, 22, 23, 24], 0, 207, num_null_blocks=9)
        (order,) = decode.take_orders().pulls.values()
        assert (order.start_token, order.block_ids, order.restart_on_failure, order.error) == (
            144,
            [21, 22, 23, 24],
            True,
            "",
        )
        # A null block where data is to go is never a pull's destination: the load fails, vLLM restarts.
        req = _decode_request("d7", 208, out["kv_sidecar"])
        decode.after_alloc(req, [0] * 9 + [21, 0, 23, 24], 0, 207, num_null_blocks=9)
        (order,) = decode.take_orders().pulls.values()
        assert order.error and order.restart_on_failure
    finally:
        decode.shutdown()


def test_a_local_prefix_hit_past_the_window_start_lets_any_block_size_pull(
    prefill: SidecarScheduler, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """A block-64 engine whose own cache holds tokens up to 192 pulls from there: every block it fills
    starts inside the published range [144, 207), though its first in-window block (128) does not."""
    _, out = _finished_prefill(prefill, "w8", 208, [0] * 9 + [3, 4, 5, 6])
    assert out is not None
    decode = SidecarScheduler(ConnectorConfig(sidecar_socket=sidecar_pair[1].socket), "win-d", 64, window=W)
    try:
        req = _decode_request("d8", 208, out["kv_sidecar"])
        assert decode.matched_tokens(req, 192) == (15, True)
        decode.after_alloc(req, [0, 0, 40, 41], 1, 15, num_null_blocks=2)
        (order,) = decode.take_orders().pulls.values()
        assert (order.start_token, order.block_ids) == (192, [41])
    finally:
        decode.shutdown()
