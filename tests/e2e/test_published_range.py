"""A published range (issue 34): an engine that holds only part of a request (a sliding-window request:
the blocks of its window) publishes those blocks with `first_token`, and every pull path moves exactly
tokens [start_token, num_tokens) from them, byte for byte, touching nothing else; a bad range, and a pull
from before it, are refused with a message naming the range."""

from __future__ import annotations

import itertools

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client.shm import ShmKVCache

from .conftest import Spawn, metric, spec_dict

_ids = itertools.count()
TOKENS = 200  # a long prompt
FIRST = 144  # its window's blocks start here (block 9 of 16 tokens): 4 blocks, 56 tokens
RING = ["--host-transfer", "ring", "--gpu-staging-bytes", str(6 << 16), "--gpu-staging-slots", "3"]


def _token_bytes(spec: EngineSpec) -> int:
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.element_size


def _windowed(prefill: EngineProcess, held: list[int], tokens: int = TOKENS, first: int = FIRST) -> dict:
    rid = f"window-{next(_ids)}"
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": rid,
            "block_ids": held,
            "num_tokens": tokens,
            "seed": 5,
            "first_token": first,
        }
    )
    assert pub["ok"], pub
    assert pub["params"]["first_token"] == first and pub["params"]["block_ids"] == held, pub
    return pub["params"]


def _pull_window(
    prefill: EngineProcess, decode: EngineProcess, held: list[int], dst: list[int], start: int, path: str
) -> None:
    params = _windowed(prefill, held)
    res = decode.send({"cmd": "pull", "params": params, "block_ids": dst, "seed": 5, "start_token": start})
    assert res["ok"] and res["verified"], res
    assert res["path"] == path, res
    # Only the window moves: its tokens (whole blocks where blocks are READ as they are).
    bd = decode.spec.block_size
    tokens = (
        len(dst) * bd
        if path in ("host-nixl", "host-direct") and bd == prefill.spec.block_size
        else TOKENS - start
    )
    assert res["bytes"] == tokens * _token_bytes(decode.spec), res
    ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
    assert (ev["kind"], ev["request_id"]) == ("consumed", params["request_id"]), ev


# (decode block size, on the prefill's sidecar, path)
CASES = {
    "nixl-identity": (16, False, "host-nixl"),
    "nixl-staged-smaller-blocks": (8, False, "host-nixl-staged"),
    "nixl-staged-larger-blocks": (48, False, "host-nixl-staged"),
    "direct-identity": (16, True, "host-direct"),
    "direct-converted": (8, True, "host-direct"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_window_is_pulled_byte_for_byte_on_every_host_path(
    case: str, sidecar_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    bd, same, path = CASES[case]
    a, b = sidecar_pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, f"wp-{case}", EngineSpec.from_dict(spec_dict())),
        lambda: EngineProcess(
            (a if same else b).socket,
            f"wd-{case}",
            EngineSpec.from_dict(spec_dict(block_size=bd, num_blocks=40)),
        ),
    )
    held = [30, 4, 17, 9]  # tokens [144, 200): blocks 9..12 of the prompt; blocks 0..8 are not held
    start = -(-FIRST // bd) * bd  # the decode's first block boundary inside the range
    dst = list(range(3, 3 + -(-TOKENS // bd) - start // bd))
    _pull_window(prefill, decode, held, dst, start, path)
    # Twice: the second pull of the pair finds the handshake made (the early READ path, host-nixl).
    _pull_window(prefill, decode, held, [d + 20 for d in dst], start, path)


def test_a_window_over_the_staged_ring(spawn: Spawn) -> None:
    a, b = spawn.together(
        lambda: SidecarProcess("ring-p", extra=RING), lambda: SidecarProcess("ring-d", extra=RING)
    )
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "ring-wp", EngineSpec.from_dict(spec_dict())),
        lambda: EngineProcess(b.socket, "ring-wd", EngineSpec.from_dict(spec_dict(block_size=8))),
    )
    _pull_window(prefill, decode, [30, 4, 17, 9], list(range(7)), 144, "host-ring")


def test_a_pull_from_before_the_range_is_out_of_range_and_touches_nothing(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], spawn: Spawn
) -> None:
    a, b = sidecar_pair
    prefill, remote, local = spawn.together(
        lambda: EngineProcess(a.socket, "oor-p", EngineSpec.from_dict(spec_dict())),
        lambda: EngineProcess(b.socket, "oor-d", EngineSpec.from_dict(spec_dict())),
        lambda: EngineProcess(a.socket, "oor-l", EngineSpec.from_dict(spec_dict())),
    )
    failures = metric(b.metrics_port, "kvsidecar_failures_total", '{reason="pull_out_of_range"}')
    for decode in (remote, local):
        params = _windowed(prefill, [30, 4, 17, 9])
        # The decode engine asks for the whole prompt, and for one block before the window.
        for start, dst in ((0, list(range(13))), (128, list(range(5)))):
            res = decode.send(
                {"cmd": "pull", "params": params, "block_ids": dst, "seed": 5, "start_token": start}
            )
            assert not res["ok"] and res["error_code"] == "OUT_OF_RANGE", res
            assert f"start_token {start} is before the published range" in res["error"], res
            assert f"holds tokens [{FIRST}, {TOKENS})" in res["error"], res
            assert res["untouched"] and res["verified"], res
    assert metric(b.metrics_port, "kvsidecar_failures_total", '{reason="pull_out_of_range"}') == failures + 2
    # The request is still there for a reader that asks for the window.
    res = remote.send(
        {"cmd": "pull", "params": params, "block_ids": [1, 2, 3, 4], "seed": 5, "start_token": 144}
    )
    assert res["ok"] and res["verified"], res


@pytest.mark.parametrize(
    ("held", "tokens", "first", "message"),
    [
        ([4, 5, 6, 7], 200, 136, "first_token 136 is not a multiple of the prefill block_size 16"),
        ([4, 5, 6], 200, 144, "tokens [144, 200) at block size 16 need 4 blocks, got 3"),
        ([], 144, 144, "first_token 144 is not below num_tokens 144"),
        ([0, 0, 5, 6], 200, 144, "prefill block id 0 appears twice (positions 0 and 1)"),
        ([4, 5, 6, 64], 200, 144, "prefill block id 64 at position 3 is out of range [0, 64)"),
    ],
)
def test_bad_published_ranges_are_refused_and_counted(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
    held: list[int],
    tokens: int,
    first: int,
    message: str,
) -> None:
    sc = sidecar_pair[0]
    spec = EngineSpec.from_dict(spec_dict())
    refused = metric(sc.metrics_port, "kvsidecar_publishes_refused_total", '{reason="invalid_argument"}')
    cache = ShmKVCache(spec.rank_tensor_shapes(), torch.float16)
    with SidecarClient(sc.socket) as client:
        client.register_rank("range-p", 0, spec.to_dict(), cache.handles())
        try:
            published = client.status().published_requests
            with pytest.raises(KVSidecarError) as info:
                client.publish("range-p", "r", held, tokens, first_token=first)
            assert client.status().published_requests == published
        finally:
            client.unregister_rank("range-p", 0)
            cache.close()
    assert info.value.code == "INVALID_ARGUMENT" and message in info.value.message, info.value
    assert (
        metric(sc.metrics_port, "kvsidecar_publishes_refused_total", '{reason="invalid_argument"}')
        == refused + 1
    )
