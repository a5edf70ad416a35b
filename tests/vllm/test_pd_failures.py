"""Failures around real vLLM engines: no sidecar at start, either sidecar killed mid-pull and restarted
(tests/vllm/failures.py, shared with the hybrid models), a Publish while the prefill sidecar is down, a
silent prefill sidecar."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import ProcessError, SidecarProcess

from .engine import write_model
from .failures import FailurePair, published, registered_ranks, sidecar_killed_mid_pull_then_restarted
from .harness import VllmEngine, wait_until
from .test_pd import BLOCK, prompt

PULL_TIMEOUT_S = 8.0
PUBLISH_TIMEOUT_S = 2.0  # the connector's default


class Pair(FailurePair):
    max_tokens, lease_ms = 8, 30000
    groups, pull_timeout_s = 1, PULL_TIMEOUT_S

    def __init__(self, tmp: str) -> None:
        self.model = write_model(f"{tmp}/model")
        self.sp, self.sd = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
        conn = {"keepalive_interval_s": 1.0, "pull_timeout_s": PULL_TIMEOUT_S, "lease_ms": 30000}
        self.P = VllmEngine(
            "prefill",
            {
                "model": self.model,
                "block_size": BLOCK,
                "connector": conn | {"sidecar_socket": self.sp.socket, "engine_id": "prefill"},
            },
        )
        self.D = VllmEngine(
            "decode",
            {
                "model": self.model,
                "block_size": BLOCK,
                "connector": conn | {"sidecar_socket": self.sd.socket, "engine_id": "decode"},
            },
        )
        self.ref = VllmEngine("reference", {"model": self.model, "block_size": BLOCK})
        self.start(self.P, self.D, self.ref)
        self.p_free = self.free[self.P.name]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    fixture = Pair(str(tmp_path_factory.mktemp("vllm-fail")))
    yield fixture
    fixture.close()


def test_engine_start_fails_naming_the_socket_when_no_sidecar_listens(pair: Pair, tmp_path: object) -> None:
    missing = f"{tmp_path}/nobody.sock"
    engine = VllmEngine(
        "orphan", {"model": pair.model, "connector": {"sidecar_socket": missing, "connect_timeout_s": 1.0}}
    )
    with pytest.raises(ProcessError, match=f"no kv-sidecar answers on '{missing}'"):
        engine.wait_ready()


def test_engine_start_fails_naming_an_unknown_config_key(pair: Pair) -> None:
    engine = VllmEngine(
        "typo", {"model": pair.model, "connector": {"sidecar_socket": pair.sd.socket, "pull_timeout": 5}}
    )
    with pytest.raises(ProcessError, match=r"unknown key\(s\) \['pull_timeout'\]"):
        engine.wait_ready()


def _pd_matches(pair: Pair, n: int, tokens: int, seed: int) -> None:
    """A request prefilled by P through its sidecar and pulled by D gives the tokens the reference computes alone."""
    q, p, d, r = prompt(tokens, seed=seed), f"p{n}", f"d{n}", f"r{n}"
    params = pair.P.generate({p: q}, 1, {p: {"do_remote_decode": True}})[p]["kv_transfer_params"]
    assert params is not None and params["kv_sidecar"]["sidecar_address"] == pair.sp.peer_address, params
    assert pair.D.generate({d: q}, 6, {d: params})[d]["tokens"] == pair.ref.generate({r: q}, 6)[r]["tokens"]
    assert pair.D.state()["pulls"][-1]["ok"]


def test_prefill_sidecar_killed_mid_pull_then_restarted(pair: Pair) -> None:
    (pull,) = sidecar_killed_mid_pull_then_restarted(
        pair, "prefill", prompt(600, seed=21), prompt(140, seed=22)
    )
    assert not pull["ok"] and pull["unfilled"], pull  # vLLM recomputes exactly the blocks not filled


def test_decode_sidecar_killed_mid_pull_then_restarted(pair: Pair) -> None:
    (pull,) = sidecar_killed_mid_pull_then_restarted(
        pair, "decode", prompt(500, seed=31), prompt(90, seed=32)
    )
    assert not pull["ok"], pull


def test_publish_fails_while_the_prefill_sidecar_is_gone(pair: Pair) -> None:
    """A prefill request finishing while its sidecar is down cannot be published: it ends without
    transfer params and frees its blocks at once (the decode engine computes it), the engine's step
    does not stall waiting for the sidecar, and publishing works again once the sidecar is back."""
    p = prompt(300, seed=41)
    pair.sp.kill()
    t0 = time.monotonic()
    out = pair.P.generate({"p5": p}, 1, {"p5": {"do_remote_decode": True}})["p5"]
    took = time.monotonic() - t0
    assert out["kv_transfer_params"] is None, out
    assert pair.P.state()["free_blocks"] == pair.p_free  # nothing held for a reader
    assert took < 5, f"the prefill request took {took:.1f} s with its sidecar gone"
    # The decode engine, sent the request without params (as a router does then), computes it itself.
    assert pair.D.generate({"d5": p}, 6)["d5"]["tokens"] == pair.ref.generate({"r5": p}, 6)["r5"]["tokens"]
    assert not any(pull["request_id"].startswith("d5") for pull in pair.D.state()["pulls"])

    # Back on the same socket: once the engine has registered again (its backoff), it publishes.
    pair.restart("prefill")
    wait_until(lambda: registered_ranks(pair.sp) == 1, 30, "the prefill engine to register again")
    _pd_matches(pair, 6, 120, seed=42)
    assert pair.P.settle(30)["free_blocks"] == pair.p_free


def test_a_silent_prefill_sidecar_does_not_stall_the_prefill_engine(pair: Pair) -> None:
    """A prefill sidecar that stops answering (here SIGSTOP; a hung process looks the same) costs vLLM's
    scheduler one publish_timeout_s, not the client's 30 s per finishing request: later requests skip
    the Publish at once until the sidecar answers a probe, then publishing resumes."""
    prompts = {f"s{i}": prompt(100 + 20 * i, seed=50 + i) for i in range(3)}
    # A request through the pair first: the prefill engine's next Publish goes over the engine lane
    # connection this one leaves open, so the stopped sidecar reads it, and carries it out, on waking.
    _pd_matches(pair, 8, 70, seed=49)
    assert pair.P.settle(30)["free_blocks"] == pair.p_free
    os.kill(pair.sp.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        first = pair.P.generate({"s0": prompts["s0"]}, 1, {"s0": {"do_remote_decode": True}})["s0"]
        rest = pair.P.generate(
            {k: prompts[k] for k in ("s1", "s2")}, 1, {k: {"do_remote_decode": True} for k in ("s1", "s2")}
        )
        took = time.monotonic() - t0
        state = pair.P.state()
    finally:
        os.kill(pair.sp.proc.pid, signal.SIGCONT)
    assert first["kv_transfer_params"] is None and all(r["kv_transfer_params"] is None for r in rest.values())
    # One Publish waited its timeout (2 s by default); the two after it did not wait at all.
    assert took < PUBLISH_TIMEOUT_S + 3, f"three prefill requests took {took:.1f} s with the sidecar silent"
    assert state["publishing_paused"] and state["free_blocks"] == pair.p_free, state
    unpublished = state["unpublished"]
    # Awake again: the probe hears it and first withdraws the Publish that timed out, which the woken
    # sidecar carried out (it would hold it for its 30 s lease); then the next request is published.
    wait_until(lambda: not pair.P.state()["publishing_paused"], 30, "publishing to resume")
    assert published(pair.sp) == 0
    _pd_matches(pair, 7, 130, seed=59)
    assert pair.P.state()["unpublished"] == unpublished
    assert pair.P.settle(30)["free_blocks"] == pair.p_free
