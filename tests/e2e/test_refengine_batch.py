"""The reference engine's batch commands, which bench/node_scaling.py drives: N requests published, pulled
by C threads of a separate engine process, every byte checked afterwards, and exactly N "consumed"
events; a pull that lands on wrong bytes is caught by the check."""

from __future__ import annotations

import json

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess

from .conftest import Spawn, spec_dict

SPEC = EngineSpec.from_dict(spec_dict())


def _setup(
    spawn: Spawn, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> tuple[EngineProcess, EngineProcess]:
    a, b = sidecar_pair
    prefill, decode = spawn.together(
        lambda: EngineProcess(a.socket, "batch-p", SPEC), lambda: EngineProcess(b.socket, "batch-d", SPEC)
    )
    for block in range(4):
        got = prefill.send(
            {"cmd": "prefill", "block_ids": [block], "num_tokens": 16, "seed": block, "publish": False}
        )
        assert got["ok"], got
    return prefill, decode


def _publish(prefill: EngineProcess, n: int, prefix: str) -> list[dict[str, object]]:
    got = prefill.send(
        {"cmd": "publish_batch", "prefix": prefix, "block_ids": [[i % 4] for i in range(n)], "num_tokens": 16}
    )
    assert got["ok"], got
    return [{"params": p, "block_ids": [10 + i], "seed": i % 4} for i, p in enumerate(got["params"])]


def test_a_batch_is_pulled_checked_and_consumed(
    spawn: Spawn, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    prefill, decode = _setup(spawn, sidecar_pair)
    items = _publish(prefill, 12, "ok-")
    got = decode.send({"cmd": "pull_batch", "items": items, "concurrency": 3, "num_tokens": 16})
    assert got["ok"] and got["paths"] == {"host-nixl": 12} and len(got["lat"]) == 12, got
    checked = decode.send({"cmd": "verify_batch"})
    assert checked == {"ok": True, "checked": 12, "errors": [], "bad_untouched": True}
    assert prefill.send({"cmd": "count_events", "kind": "consumed", "expect": 12})["count"] == 12


def test_the_check_catches_bytes_that_are_not_the_seeds(
    spawn: Spawn, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    prefill, decode = _setup(spawn, sidecar_pair)
    items = _publish(prefill, 2, "bad-")
    items[1]["seed"] = 3  # it was published from block 1, filled from seed 1
    assert decode.send({"cmd": "pull_batch", "items": items, "concurrency": 2, "num_tokens": 16})["ok"]
    checked = decode.send({"cmd": "verify_batch"})
    assert not checked["ok"] and checked["checked"] == 2 and checked["errors"]


def test_a_batch_past_a_prefix_is_checked_from_its_start(
    spawn: Spawn, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """--prefix-blocks: requests of two blocks, the decode engine pulling only the second (start_token 16);
    the check compares those tokens, and catches a pull that lands the wrong ones."""
    prefill, decode = _setup(spawn, sidecar_pair)
    for seed, ids in ((50, [0, 1]), (51, [2, 3])):  # two 32-token requests' KV, of two seeds
        got = prefill.send(
            {"cmd": "prefill", "block_ids": ids, "num_tokens": 32, "seed": seed, "publish": False}
        )
        assert got["ok"], got
    got = prefill.send(
        {"cmd": "publish_batch", "prefix": "pre-", "block_ids": [[0, 1], [2, 3]] * 2, "num_tokens": 32}
    )
    assert got["ok"], got
    items = [
        {"params": p, "block_ids": [20 + i], "seed": 50 + i % 2, "start_token": 16}
        for i, p in enumerate(got["params"])
    ]
    right, swapped = items[:2], items[2:]
    swapped[0]["seed"], swapped[1]["seed"] = 51, 50  # each names the other's tokens
    for batch, ok in ((right, True), (swapped, False)):
        cmd = {"cmd": "pull_batch", "items": batch, "concurrency": 2, "num_tokens": 32, "start_token": 16}
        assert decode.send(cmd)["ok"]
        checked = decode.send({"cmd": "verify_batch"})
        assert checked["ok"] is ok and checked["checked"] == 2 and bool(checked["errors"]) is not ok, checked


def test_pulls_meant_to_fail_fail_alone_and_are_counted_apart(
    spawn: Spawn, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """--bad-every: items that name a request the source does not hold must fail (their status counted),
    the others arrive and are checked and consumed; latencies are the others'. One meant to fail that
    arrives is an error."""
    prefill, decode = _setup(spawn, sidecar_pair)
    for per_call in (1, 4):  # Pull calls, PullBatch calls
        items = _publish(prefill, 8, f"mixed{per_call}-")
        for k in (2, 5):
            items[k]["params"] = dict(items[k]["params"], request_id=f"not-published-{k}")
            items[k]["expect_error"] = True
        cmd = {"cmd": "pull_batch", "items": items, "concurrency": 2, "num_tokens": 16, "per_call": per_call}
        got = decode.send(cmd)
        assert got["ok"] and len(got["lat"]) == 6, got
        assert got["bad"] == {"count": 2, "codes": {"NOT_FOUND": 2}}, got
        assert got["cpu_s"] > 0, got
        # host-nixl READs ahead of the source's answer: a refused pull may have written its own blocks
        # (named unfilled), so that is reported, not asserted.
        checked = decode.send({"cmd": "verify_batch"})
        assert checked == {"ok": True, "checked": 6, "errors": [], "bad_untouched": checked["bad_untouched"]}
        assert prefill.send({"cmd": "count_events", "kind": "consumed", "expect": 6})["count"] == 6
    # A pull meant to fail that arrives fails the batch.
    fresh = _publish(prefill, 2, "wrong-")
    fresh[0]["expect_error"] = True
    got = decode.send({"cmd": "pull_batch", "items": fresh, "concurrency": 1, "num_tokens": 16})
    assert not got["ok"] and any("meant to fail" in e for e in got["errors"]), got


def test_workers_of_one_engine_pull_their_own_ranks(
    spawn: Spawn, sidecar_pair: tuple[SidecarProcess, SidecarProcess]
) -> None:
    """`own_ranks` (bench/spread_ranks.py): a TP 2 decode engine as two processes on one sidecar, one per
    rank, as vLLM's workers are; each pulls only its rank, so both pull every request without meeting."""
    a, b = sidecar_pair
    tp2 = EngineSpec.from_dict(spec_dict(tp_size=2))
    prefill = spawn(EngineProcess(a.socket, "own-p", tp2))
    workers = spawn.together(*[lambda r=r: EngineProcess(b.socket, "own-d", tp2, ranks=[r]) for r in (0, 1)])
    assert prefill.send({"cmd": "prefill", "block_ids": [0], "num_tokens": 16, "seed": 7, "publish": False})[
        "ok"
    ]
    got = prefill.send({"cmd": "publish_batch", "prefix": "own-", "block_ids": [[0]] * 6, "num_tokens": 16})
    items = [{"params": p, "block_ids": [10 + i], "seed": 7} for i, p in enumerate(got["params"])]
    for w in workers:
        w.post({"cmd": "pull_batch", "items": items, "concurrency": 2, "num_tokens": 16, "own_ranks": True})
    for w in workers:
        res = json.loads(w.readline(60))
        assert res["ok"] and res["paths"] == {"host-nixl": 6}, res
        checked = w.send({"cmd": "verify_batch"})
        assert checked["ok"] and checked["checked"] == 6, checked
    assert prefill.send({"cmd": "count_events", "kind": "consumed", "expect": 12})["count"] == 12
