"""Two real vLLM engines (prefill, decode) through two real `kv-sidecar serve` processes.

The decode engine's greedy tokens must equal those of one vLLM engine that ran
the whole request itself (the "reference": no connector, same weights).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess

from .engine import write_model
from .harness import VllmEngine, metric, start_all

LEASE_MS = 6000
KEEPALIVE_S = 1.0
BLOCK = 32
# 2 layers x K,V x 2 KV heads x head_dim 64 x float32, per token
TOKEN_BYTES = 2 * 2 * 2 * 64 * 4
LENGTHS = (5, 31, 32, 33, 100, 300, 1000)  # shorter than a block, around block edges, many blocks


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 1000 for i in range(n)]


class PD:
    """The fixture: sidecars, engines, and the P -> D round trip."""

    def __init__(self, tmp: str) -> None:
        model = write_model(f"{tmp}/model")
        self.sp, self.sd = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
        conn = {"keepalive_interval_s": KEEPALIVE_S, "pull_timeout_s": 20.0}
        self.P = VllmEngine(
            "prefill",
            {
                "model": model,
                "block_size": BLOCK,
                "connector": conn
                | {"sidecar_socket": self.sp.socket, "engine_id": "prefill", "lease_ms": LEASE_MS},
            },
        )
        self.D = VllmEngine(
            "decode",
            {
                "model": model,
                "block_size": BLOCK,
                "connector": conn | {"sidecar_socket": self.sd.socket, "engine_id": "decode"},
            },
        )
        self.D64 = VllmEngine(
            "decode64",
            {
                "model": model,
                "block_size": 64,
                # A step's pulls in one PullBatch call: the other decode engine sends one Pull each.
                "connector": conn
                | {"sidecar_socket": self.sd.socket, "engine_id": "decode64", "pull_batch": True},
            },
        )
        self.R = VllmEngine("reference", {"model": model, "block_size": BLOCK})
        self.engines = (self.P, self.D, self.D64, self.R)
        start_all(*self.engines)
        self.p_free = self.P.ready["free_blocks"]
        self._n = 0

    def ids(self, tag: str, count: int) -> list[str]:
        self._n += 1
        return [f"{tag}{self._n}-{i}" for i in range(count)]

    def prefill(self, prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
        """kv_transfer_params of each request after a max_tokens=1 prefill, keyed like `prompts`."""
        outs = self.P.generate(prompts, 1, {rid: {"do_remote_decode": True} for rid in prompts})
        params = {rid: out["kv_transfer_params"] for rid, out in outs.items()}
        assert all(p and p.get("do_remote_prefill") and "kv_sidecar" in p for p in params.values()), params
        return params

    def reference(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = self.ids("r", len(prompts))
        outs = self.R.generate(dict(zip(ids, prompts, strict=True)), max_tokens)
        return [outs[i]["tokens"] for i in ids]

    def disaggregated(
        self, prompts: list[list[int]], max_tokens: int, decode: VllmEngine | None = None
    ) -> list[list[int]]:
        decode = decode or self.D
        pids, dids = self.ids("p", len(prompts)), self.ids("d", len(prompts))
        params = self.prefill(dict(zip(pids, prompts, strict=True)))
        outs = decode.generate(
            dict(zip(dids, prompts, strict=True)),
            max_tokens,
            {d: params[p] for p, d in zip(pids, dids, strict=True)},
        )
        return [outs[i]["tokens"] for i in dids]

    def close(self) -> None:
        for e in self.engines:
            e.stop()
        codes = self.sp.stop(), self.sd.stop()
        assert codes == (0, 0), f"sidecars exited with {codes}"


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    fixture = PD(str(tmp_path_factory.mktemp("vllm-pd")))
    yield fixture
    fixture.close()


def last_pulls(engine: VllmEngine, n: int) -> list[dict[str, Any]]:
    return engine.state()["pulls"][-n:]


def test_disaggregated_output_equals_aggregated(pd: PD) -> None:
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    want = pd.reference(prompts, 16)
    got = pd.disaggregated(prompts, 16)
    assert got == want
    pulls = last_pulls(pd.D, len(prompts))
    assert all(p["ok"] and p["path"] == "host-nixl" for p in pulls), pulls
    # Every prompt token's KV came over the wire: whole blocks of each prompt.
    assert sorted(p["bytes"] for p in pulls) == sorted(-(-n // BLOCK) * BLOCK * TOKEN_BYTES for n in LENGTHS)
    # The prefill engine gets every block back once the decode side consumed them.
    settled = pd.P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == pd.p_free, settled


def test_different_block_sizes_give_identical_output(pd: PD) -> None:
    prompts = [prompt(n, seed=100 + n) for n in (7, 64, 65, 250)]
    batched = metric(pd.sd.metrics_port, "kvsidecar_pull_batch_pulls_sum")
    assert pd.disaggregated(prompts, 12, decode=pd.D64) == pd.reference(prompts, 12)
    pulls = last_pulls(pd.D64, len(prompts))
    assert all(p["ok"] and p["path"] == "host-nixl-staged" for p in pulls), pulls
    # D64 sends a step's pulls in PullBatch calls (pull_batch): every one of these went in one.
    assert metric(pd.sd.metrics_port, "kvsidecar_pull_batch_pulls_sum") - batched == len(prompts)
    assert pd.P.settle(30)["free_blocks"] == pd.p_free


def test_decode_prefix_cache_hit_pulls_only_the_missing_blocks(pd: PD) -> None:
    first = prompt(200, seed=7)
    assert pd.disaggregated([first], 4) == pd.reference([first], 4)
    # Same first 4 blocks (128 tokens), a different tail: the decode engine holds those 4 blocks.
    second = first[:128] + prompt(100, seed=8)
    before = metric(pd.sd.metrics_port, "kvsidecar_pull_bytes_total")
    assert pd.disaggregated([second], 6) == pd.reference([second], 6)
    moved = metric(pd.sd.metrics_port, "kvsidecar_pull_bytes_total") - before
    missing_blocks = -(-228 // BLOCK) - 4
    assert moved == missing_blocks * BLOCK * TOKEN_BYTES
    (pull,) = last_pulls(pd.D, 1)
    assert pull["ok"] and pull["bytes"] == moved
    assert pd.P.settle(30)["free_blocks"] == pd.p_free


def test_blocks_are_freed_on_lease_expiry_when_no_decode_pulls(pd: PD) -> None:
    pd.prefill({rid: prompt(90, seed=11) for rid in pd.ids("orphan", 1)})
    held = pd.P.state()
    assert held["free_blocks"] < pd.p_free, "published blocks must be held until released"
    time.sleep(LEASE_MS / 1000 / 2)
    assert pd.P.state()["free_blocks"] < pd.p_free, "blocks must stay held for the lease"
    settled = pd.P.settle(LEASE_MS / 1000 + 10)
    assert settled["ok"] and settled["free_blocks"] == pd.p_free, settled
    assert metric(pd.sp.metrics_port, "kvsidecar_lease_expiries_total") >= 1


def test_waiting_decode_request_is_kept_alive_past_the_lease(pd: PD) -> None:
    p = prompt(150, seed=12)
    (pid,), (did,) = pd.ids("p", 1), pd.ids("d", 1)
    params = pd.prefill({pid: p})[pid]
    pd.D.call({"cmd": "add", "id": did, "prompt": p, "max_tokens": 5, "kv_transfer_params": params})
    time.sleep(LEASE_MS / 1000 + 2)  # queued, not stepped: only KeepAlive holds the prefill blocks
    out = pd.D.call({"cmd": "run", "ids": [did]})["outputs"][did]
    assert out["tokens"] == pd.reference([p], 5)[0]
    (pull,) = last_pulls(pd.D, 1)
    assert pull["ok"], pull
    assert pd.P.settle(30)["free_blocks"] == pd.p_free


def test_abort_of_a_waiting_decode_request_releases_the_prefill_blocks(pd: PD) -> None:
    p = prompt(120, seed=13)
    (pid,), (did,) = pd.ids("p", 1), pd.ids("d", 1)
    params = pd.prefill({pid: p})[pid]
    released_before = metric(pd.sp.metrics_port, "kvsidecar_lease_expiries_total")
    pd.D.call({"cmd": "add", "id": did, "prompt": p, "max_tokens": 5, "kv_transfer_params": params})
    pd.D.call({"cmd": "abort", "ids": [did]})
    t0 = time.monotonic()
    settled = pd.P.settle(LEASE_MS / 1000 / 2)  # well before the lease would free them
    assert settled["ok"] and settled["free_blocks"] == pd.p_free, settled
    assert time.monotonic() - t0 < LEASE_MS / 1000 / 2
    assert metric(pd.sp.metrics_port, "kvsidecar_lease_expiries_total") == released_before


@pytest.mark.parametrize(
    "bad",
    [
        {"do_remote_prefill": True},
        {"do_remote_prefill": True, "kv_sidecar": "not json"},
        {"do_remote_prefill": True, "kv_sidecar": {"engine_id": "prefill"}},
        {"do_remote_prefill": True, "kv_sidecar": {"no_such_field": 1}},
    ],
    ids=["missing", "unparsable", "incomplete", "unknown-field"],
)
def test_malformed_transfer_params_are_computed_locally(pd: PD, bad: dict[str, Any]) -> None:
    p = prompt(70, seed=14)
    (did,) = pd.ids("d", 1)
    pulls_before = pd.D.state()["pull_count"]
    out = pd.D.generate({did: p}, 5, {did: bad})[did]
    assert out["tokens"] == pd.reference([p], 5)[0]
    assert pd.D.state()["pull_count"] == pulls_before, "nothing may be pulled for malformed params"
