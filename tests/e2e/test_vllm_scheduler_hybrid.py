"""The connector's hybrid-model paths (groups.py) without vLLM, against real sidecars: a prefill that
publishes one sidecar record per KV cache group, a decode that orders one pull per group or computes
a request whose groups do not correspond, and a worker that frees a request only when every group's
record is released. (Real engines: tests/vllm/test_hybrid.py.)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient, params_from_json, params_to_json
from kv_sidecar_client.shm import ShmKVCache
from kv_sidecar_client.vllm.config import ConnectorConfig
from kv_sidecar_client.vllm.groups import KVGroup
from kv_sidecar_client.vllm.scheduler import SidecarScheduler
from kv_sidecar_client.vllm.window import prefill_tokens

from .conftest import spec_dict
from .test_vllm_scheduler_window import vllm_request
from .test_vllm_worker_host import worker

W = 64
BLOCK = 32
# Gemma-3's pattern in three groups of two layers: two of sliding-window layers, one of full ones.
GROUPS = [
    KVGroup(("l.0", "l.3"), W),
    KVGroup(("l.1", "l.4"), W),
    KVGroup(("l.2", "l.5"), None),
]


@pytest.fixture
def prefill(sidecar_pair: tuple[SidecarProcess, SidecarProcess]) -> Iterator[tuple[SidecarScheduler, Any]]:
    """A prefill engine's worker (registered, block 32) and its hybrid scheduler-side connector."""
    a = sidecar_pair[0]
    w, _cache = worker(a, "hy-p", ("LBHNC", BLOCK, None))
    sched = SidecarScheduler(ConnectorConfig(sidecar_socket=a.socket), "hy-p", BLOCK, groups=GROUPS)
    try:
        yield sched, w
    finally:
        sched.shutdown()
        w.shutdown()


def _finish(sched: SidecarScheduler, rid: str, prompt: int, tables: list[list[int]]) -> Any:
    req = vllm_request(rid, prompt, {"do_remote_decode": True})
    kept = sched.prefill_length(req)
    assert kept == prefill_tokens(prompt, W, BLOCK)
    req.num_prompt_tokens = req.num_computed_tokens = kept
    req.status = "FINISHED_LENGTH_CAPPED"
    return sched.request_finished_groups(req, tables)


def _published(sidecar: SidecarProcess) -> int:
    with SidecarClient(sidecar.socket) as c:
        return c.status().published_requests


def _until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# 200 tokens: the prefill computes 191 (window start 128, aligned to 32): tokens [0, 191) in 6 blocks,
# the window from block 4 on.
TABLES = [[0, 0, 0, 0, 5, 6], [0, 0, 0, 0, 7, 8], [9, 10, 11, 12, 13, 14]]


def test_each_group_is_published_as_its_own_record_and_freed_when_all_are_released(
    prefill: tuple[SidecarScheduler, Any], sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    sched, w = prefill
    a, _ = sidecar_pair
    before = _published(a)
    delay, out = _finish(sched, "h1", 200, TABLES)
    assert delay and out is not None
    groups = out["kv_sidecar_groups"]
    assert [g["window"] for g in groups] == [W, W, None]
    assert [g["layers"] for g in groups] == [list(g.layers) for g in GROUPS]
    got = [
        (g["params"]["request_id"], g["params"].get("first_token", 0), g["params"]["block_ids"])
        for g in groups
    ]
    assert got == [("h1#g0", 128, [5, 6]), ("h1#g1", 128, [7, 8]), ("h1#g2", 0, [9, 10, 11, 12, 13, 14])]
    assert out["kv_sidecar"] == groups[0]["params"]
    assert _published(a) == before + 3

    w.take_orders(sched.take_orders())
    with SidecarClient(sidecar_pair[1].socket) as c:  # each record given up by its reader
        for i, g in enumerate(groups):
            assert w.finished()[0] == set(), f"freed after {i} of 3 records were released"
            assert c.abort("hy-d", g["params"]["request_id"], params_from_json(g["params"]))
            _until(lambda n=i: _published(a) == before + 2 - n, "the record to be released")
    sending: set[str] = set()
    _until(lambda: bool(sending.update(w.finished()[0]) or sending), "the request to be freed")
    assert sending == {"h1"}


def test_a_null_block_in_any_group_publishes_nothing(
    prefill: tuple[SidecarScheduler, Any], sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    sched, _ = prefill
    before, unpublished = _published(sidecar_pair[0]), sched.unpublished
    for tables in (
        [TABLES[0], [0, 0, 0, 0, 7, 0], TABLES[2]],  # inside a window
        [TABLES[0], TABLES[1], [9, 10, 0, 12, 13, 14]],  # a full-attention group never has one
    ):
        assert _finish(sched, "h2", 200, tables) == (False, None)
    assert sched.unpublished == unpublished + 2 and _published(sidecar_pair[0]) == before


def _decode(
    sidecar: SidecarProcess, groups: list[KVGroup] | None, window: int | None = None
) -> SidecarScheduler:
    return SidecarScheduler(
        ConnectorConfig(sidecar_socket=sidecar.socket), "hy-d", BLOCK, window, groups=groups
    )


def test_the_decode_orders_one_pull_per_group_into_that_groups_blocks(
    prefill: tuple[SidecarScheduler, Any], sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    sched, _ = prefill
    _, out = _finish(sched, "h3", 200, TABLES)
    decode = _decode(sidecar_pair[1], GROUPS)
    try:
        req = vllm_request("d3", 200, out)
        assert decode.matched_tokens(req, 0) == (191, True)
        # vLLM's tables: null blocks before each sliding window, then new blocks.
        decode.after_alloc_groups(
            req, [([0] * 4 + [31, 32], 0, 4), ([0] * 4 + [33, 34], 0, 4), (list(range(40, 46)), 0, 0)], 191
        )
        orders = decode.take_orders()
        assert not orders.pulls
        parts = orders.group_pulls["d3"]
        assert [(o.params["request_id"], o.start_token, o.block_ids) for o in parts] == [
            ("h3#g0", 128, [31, 32]),
            ("h3#g1", 128, [33, 34]),
            ("h3#g2", 0, [40, 41, 42, 43, 44, 45]),
        ]
        assert all(o.restart_on_failure and not o.error for o in parts)
    finally:
        decode.shutdown()
    for g in out["kv_sidecar_groups"]:  # nobody pulls them here
        with SidecarClient(sidecar_pair[1].socket) as c:
            c.abort("hy-d", g["params"]["request_id"], params_from_json(g["params"]))


@pytest.mark.parametrize(
    "groups",
    [
        None,  # the decode engine runs with the hybrid manager off: one group
        [GROUPS[0], GROUPS[1], KVGroup(("l.2", "l.5"), W)],  # another kind
        [GROUPS[1], GROUPS[0], GROUPS[2]],  # another order
    ],
    ids=["one-group", "other-window", "other-order"],
)
def test_groups_that_do_not_correspond_are_computed_here_and_released_at_once(
    prefill: tuple[SidecarScheduler, Any],
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
    groups: list[KVGroup] | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched, _ = prefill
    a, b = sidecar_pair
    before = _published(a)
    _, out = _finish(sched, "h4", 200, TABLES)
    assert _published(a) == before + 3
    decode = _decode(b, groups)
    try:
        with caplog.at_level("WARNING"):
            assert decode.matched_tokens(vllm_request("d4", 200, out), 0) == (0, False)
        assert "do not correspond" in caplog.text and "l." in caplog.text, caplog.text
        _until(lambda: _published(a) == before, "every group's record to be released")
    finally:
        decode.shutdown()


def test_the_sidecars_refuse_a_pull_between_engines_whose_groups_differ(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """Whoever the client: ranks registered with KV cache groups that do not correspond are not paired;
    the pull fails with the planner's message naming the group and layer, and nothing is written."""
    a, b = sidecar_pair
    mine = [{"layers": ["l.0", "l.3"], "sliding_window": W}, {"layers": ["l.2", "l.5"]}]
    theirs = [
        {"layers": ["l.0", "l.3"], "sliding_window": W},
        {"layers": ["l.2", "l.5"], "sliding_window": W},
    ]
    specs = {
        name: EngineSpec.from_dict(spec_dict(groups=groups)) for name, groups in (("p", mine), ("d", theirs))
    }
    caches = {name: ShmKVCache(s.rank_tensor_shapes(), torch.float16) for name, s in specs.items()}
    try:
        with SidecarClient(a.socket) as pc, SidecarClient(b.socket) as dc:
            pc.register_rank("grp-p", 0, specs["p"].to_dict(), caches["p"].handles())
            dc.register_rank("grp-d", 0, specs["d"].to_dict(), caches["d"].handles())
            params = pc.publish("grp-p", "g#g1", [3, 4], 20)
            before = caches["d"].tensors[0].clone()
            result = dc.pull(params, "grp-d", [5, 6])
            assert not result.ok and result.error_code == "FAILED_PRECONDITION", result
            assert (
                "KV cache group 1 (layer l.2) differs: prefill full attention, decode sliding window 64"
                in (result.error)
            ), result
            assert torch.equal(caches["d"].tensors[0], before)
            pc.unregister_rank("grp-p", 0)
            dc.unregister_rank("grp-d", 0)
    finally:
        for c in caches.values():
            c.close()


# A Mamba group next to an attention group (tests/vllm/test_hybrid_ssm.py's kind, smaller): each layer
# position's block of 16 tokens (4 KV heads of 16, float16: 4096 bytes) holds a Mamba layer's conv and SSM
# state when the Mamba group owns the block.
MAMBA = [
    {
        "layers": ["m.0", "m.2"],
        "state": [
            {"name": "conv", "shape": [3, 40], "dtype": "float32", "offset": 0},
            {"name": "ssm", "shape": [2, 8, 16], "dtype": "float32", "offset": 480},
        ],
    },
    {"layers": ["a.1", "a.3"]},
]


@pytest.mark.parametrize(
    "decode_over",
    [{}, {"block_size": 32}, {"layout": "packed_nhd"}],
    ids=["same-geometry", "other-block-size", "other-layout"],
)
def test_a_state_block_moves_whole_between_equal_engines_and_as_its_arrays_otherwise(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], decode_over: dict[str, Any]
) -> None:
    """Two real sidecars: a Mamba group's record (one block) is copied whole into the decode's block of
    every layer position between engines of one geometry; between engines of another page geometry
    only its state arrays' bytes move (to the same offsets), and only for a pull that names its group
    (a state block moved as tokens would land as attention bytes). Nothing else is written."""
    a, b = sidecar_pair
    base = {"layout": "packed", "groups": MAMBA}
    specs = {
        "p": EngineSpec.from_dict(spec_dict(**base)),
        "d": EngineSpec.from_dict(spec_dict(**base | decode_over)),
    }
    caches = {name: ShmKVCache(s.rank_tensor_shapes(), torch.float16) for name, s in specs.items()}
    state = 3 * 40 * 4 + 2 * 8 * 16 * 4  # conv and SSM state, float32: 1504 of a page's 4096 bytes
    try:
        for t in caches["p"].tensors:
            t.copy_(torch.randn(t.shape))
        with SidecarClient(a.socket) as pc, SidecarClient(b.socket) as dc:
            pc.register_rank("ssm-p", 0, specs["p"].to_dict(), caches["p"].handles())
            dc.register_rank("ssm-d", 0, specs["d"].to_dict(), caches["d"].handles())
            params = pc.publish("ssm-p", "s#g0", [3], 16)  # one state block, as its 16 tokens
            before = [t.clone() for t in caches["d"].tensors]
            if decode_over:
                refused = dc.pull(params, "ssm-d", [5])
                assert not refused.ok and refused.error_code == "FAILED_PRECONDITION", refused
                assert "KV cache group 0 (layer m.0): a pull between them must name its KV cache group" in (
                    refused.error
                ), refused
                assert all(torch.equal(t, o) for t, o in zip(caches["d"].tensors, before, strict=True))
            result = dc.pull(params, "ssm-d", [5], group=0)
            assert result.ok and result.bytes == 2 * (state if decode_over else 4096), result
            for want, got, old in zip(caches["p"].tensors, caches["d"].tensors, before, strict=True):
                w, g, o = (x.view(torch.uint8).reshape(x.shape[0], -1) for x in (want, got, old))
                if decode_over:  # the arrays at their offsets; the page's padding as it was
                    assert torch.equal(g[5, :state], w[3, :state]) and torch.equal(g[5, state:], o[5, state:])
                else:  # the whole page: conv, SSM state, padding
                    assert torch.equal(g[5], w[3])
                rest = [i for i in range(g.shape[0]) if i != 5]
                assert torch.equal(g[rest], o[rest])
            pc.unregister_rank("ssm-p", 0)
            dc.unregister_rank("ssm-d", 0)
    finally:
        for c in caches.values():
            c.close()


def test_a_mamba_hybrid_publishes_its_state_block_and_the_decode_pulls_it_whole(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """The scheduler side of a Mamba hybrid against real sidecars: the prefill computes all but the last
    prompt token, publishes the state group's one block as that block's tokens and the attention group's
    blocks of N - 1 tokens; the decode engine loads N - 1 tokens and orders the state block into its
    request's one state block, whole. A state block list that is not one block publishes nothing."""
    from kv_sidecar_client.vllm.mamba_state import state_arrays

    a, b = sidecar_pair
    groups = [
        KVGroup(("m.0", "m.2"), None, state_arrays("m.0", [(3, 40), (2, 8, 16)], ["float32", "float32"])),
        KVGroup(("a.1", "a.3"), None),
    ]
    w, _cache = worker(a, "ssm-p", ("LBHNC", BLOCK, None))
    sched = SidecarScheduler(ConnectorConfig(sidecar_socket=a.socket), "ssm-p", BLOCK, groups=groups)
    decode = _decode(b, groups)
    try:
        req = vllm_request("s1", 100, {"do_remote_decode": True})
        assert sched.prefill_length(req) == 99
        req.num_prompt_tokens = req.num_computed_tokens = 99
        req.status = "FINISHED_LENGTH_CAPPED"
        unpublished = sched.unpublished
        assert sched.request_finished_groups(req, [[7, 8], [1, 2, 3, 4]]) == (False, None)  # two state blocks
        assert sched.unpublished == unpublished + 1
        delay, out = sched.request_finished_groups(req, [[7], [1, 2, 3, 4]])
        assert delay and out is not None
        state, attention = out["kv_sidecar_groups"]
        assert (state["params"]["block_ids"], state["params"]["num_tokens"]) == ([7], BLOCK)
        assert (attention["params"]["block_ids"], attention["params"]["num_tokens"]) == ([1, 2, 3, 4], 99)
        assert out["kv_sidecar"] == attention["params"] and state["state"][1]["offset"] == 480

        d = vllm_request("d1", 100, out)
        assert decode.matched_tokens(d, 0) == (99, True)
        decode.after_alloc_groups(d, [([21], 0, 0), ([30, 31, 32, 33], 0, 0)], 99)
        parts = decode.take_orders().group_pulls["d1"]
        assert [(o.params["request_id"], o.start_token, o.block_ids, o.error) for o in parts] == [
            ("s1#g0", 0, [21], ""),
            ("s1#g1", 0, [30, 31, 32, 33], ""),
        ]
        assert all(o.restart_on_failure for o in parts)
        # The whole prompt's state (params of the 99-token prefix, for a 99-token prompt): computed here.
        assert decode.matched_tokens(vllm_request("d2", 99, out), 0) == (0, False)
        for g in out["kv_sidecar_groups"]:  # nobody pulls them here
            with SidecarClient(b.socket) as c:
                c.abort("hy-d", g["params"]["request_id"], params_from_json(g["params"]))
    finally:
        decode.shutdown()
        sched.shutdown()
        w.shutdown()


# Other blocks than TABLES (of the prefill worker's 24): the prefill sidecar holds two requests at once.
TABLES_B = [[0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 3, 4], [15, 16, 17, 18, 19, 20]]


def _loading(decode: SidecarScheduler, rid: str, out: dict[str, Any]) -> None:
    """A decode request of the prefill's `out` whose three pulls are ordered, as vLLM drives it."""
    req = vllm_request(rid, 200, out)
    assert decode.matched_tokens(req, 0) == (191, True)
    decode.after_alloc_groups(
        req, [([0] * 4 + [31, 32], 0, 4), ([0] * 4 + [33, 34], 0, 4), (list(range(40, 46)), 0, 0)], 191
    )
    assert len(decode.take_orders().group_pulls[rid]) == 3


def _release_all(sidecar: SidecarProcess, out: dict[str, Any]) -> None:
    with SidecarClient(sidecar.socket) as c:
        for g in out["kv_sidecar_groups"]:
            c.abort("hy-d", g["params"]["request_id"], params_from_json(g["params"]))


def test_a_failed_load_releases_every_groups_record_at_once(
    prefill: tuple[SidecarScheduler, Any], sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """vLLM computes a request whose load failed (failed_recving) and never reads its records: the
    prefill's sidecar releases them now, not when their lease ends. A load that finished well releases
    nothing here (its reads consumed the records)."""
    sched, _ = prefill
    a, b = sidecar_pair
    before = _published(a)
    _, good = _finish(sched, "h7", 200, TABLES)
    _, bad = _finish(sched, "h8", 200, TABLES_B)
    assert _published(a) == before + 6
    decode = _decode(b, GROUPS)
    try:
        _loading(decode, "d7", good)
        _loading(decode, "d8", bad)
        decode.finished_loading(["d7", "d8"], failed={"d8"})
        _until(lambda: _published(a) == before + 3, "the failed load's three records to be released")
        time.sleep(0.5)
        assert _published(a) == before + 3
    finally:
        decode.shutdown()
        _release_all(b, good)


def test_a_partly_failed_load_of_one_group_releases_its_record(
    prefill: tuple[SidecarScheduler, Any], sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """A model of one group: vLLM recomputes the blocks a pull left unfilled (invalid_block_ids); a request
    with such a block releases its record, one whose blocks all loaded does not. (`prefill`: its worker
    registers engine hy-p, which publishes these.)"""
    a, b = sidecar_pair
    before = _published(a)
    with SidecarClient(a.socket) as c:
        published = {
            rid: c.publish("hy-p", rid, blocks, 64) for rid, blocks in (("x1", [3, 4]), ("x2", [5, 6]))
        }
    decode = _decode(b, None)
    try:
        for rid, params in published.items():
            req = vllm_request(
                f"d-{rid}", 100, {"do_remote_prefill": True, "kv_sidecar": json.loads(params_to_json(params))}
            )
            assert decode.matched_tokens(req, 0) == (64, True)
            decode.after_alloc(req, [50, 51] if rid == "x1" else [60, 61], 0, 64)
        decode.take_orders()
        # With TP, one rank's unfilled block may be reported steps before every rank has finished.
        decode.finished_loading([], invalid_blocks={51, 99})
        time.sleep(0.3)
        assert _published(a) == before + 2
        decode.finished_loading(["d-x1", "d-x2"])
        _until(lambda: _published(a) == before + 1, "x1's record to be released")
        time.sleep(0.5)
        assert _published(a) == before + 1
    finally:
        decode.shutdown()
        with SidecarClient(b.socket) as c:
            c.abort("hy-d", "x2", published["x2"])


def test_a_release_the_decode_sidecar_cannot_take_goes_through_once_it_is_back(
    prefill: tuple[SidecarScheduler, Any], sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """The decode engine's sidecar died with the pull (its engine computes the request): the release is
    tried again each keep-alive interval, and the prefill's records go once a sidecar answers on the socket
    again, not at the end of their lease."""
    sched, _ = prefill
    a, _ = sidecar_pair
    c = SidecarProcess("dying-decode-node")
    before = _published(a)
    _, out = _finish(sched, "h9", 200, TABLES_B)
    decode = SidecarScheduler(
        ConnectorConfig(sidecar_socket=c.socket, keepalive_interval_s=0.2), "hy-d", BLOCK, groups=GROUPS
    )
    try:
        _loading(decode, "d9", out)
        c.kill()
        decode.finished_loading(["d9"], failed={"d9"})
        time.sleep(1.5)  # several tries while no sidecar answers: the records stay
        assert _published(a) == before + 3
        c = SidecarProcess(c.name, workdir=c.workdir)
        _until(lambda: _published(a) == before, "the release to go through the restarted sidecar")
    finally:
        decode.shutdown()
        c.stop()
        _release_all(a, out)
