"""Real vLLM engine processes (tests/vllm/engine.py) and the sidecars they talk to."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kv_sidecar.refengine import scrape
from kv_sidecar.refengine.procs import ProcessError, SidecarProcess, _Proc

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600  # several engines start at once on 2 cores


def _pythonpath() -> str:
    """The repository (for `tests.vllm.engine`), then whatever the test run was given: a PYTHONPATH that
    points at a checkout's sidecar/ and client/ must reach the engines too, or they would import the
    installed packages instead."""
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(ROOT), *([inherited] if inherited else [])])


class VllmEngine(_Proc):
    """tests/vllm/engine.py in its own process. Start several with `start_all` (they boot in parallel)."""

    def __init__(self, name: str, opts: dict[str, Any], env: dict[str, str] | None = None) -> None:
        super().__init__(
            [sys.executable, "-m", "tests.vllm.engine", json.dumps(opts)],
            name,
            env={"PYTHONPATH": _pythonpath(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
        )
        self.opts = opts
        self.ready: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> VllmEngine:
        try:
            self.ready = json.loads(self.readline(timeout_s))
        except BaseException:
            self.kill()
            raise
        if not self.ready.get("ok"):
            self.kill()
            raise ProcessError(f"{self.name} failed to start: {self.ready.get('error')}")
        return self

    def send(self, cmd: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.readline(timeout_s))

    def call(self, cmd: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        """send(), failing the test with the engine's answer if it is not ok."""
        answer = self.send(cmd, timeout_s)
        assert answer.get("ok"), f"{self.name}: {cmd['cmd']} failed: {answer}"
        return answer

    def generate(
        self,
        prompts: dict[str, list[int]],
        max_tokens: int,
        params: dict[str, Any] | None = None,
        logprobs: int | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Add every prompt (with kv_transfer_params params[id], if given) and run them to completion;
        `logprobs`: also return each sampled token's log-probability."""
        for rid, prompt in prompts.items():
            kvp = (params or {}).get(rid)
            self.call(
                {
                    "cmd": "add",
                    "id": rid,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "kv_transfer_params": kvp,
                    "logprobs": logprobs,
                }
            )
        return self.call({"cmd": "run", "ids": list(prompts)})["outputs"]

    def state(self) -> dict[str, Any]:
        return self.call({"cmd": "state"})

    def settle(self, timeout_s: float = 60) -> dict[str, Any]:
        return self.send({"cmd": "settle", "timeout_s": timeout_s}, timeout_s + 30)

    def stop(self) -> None:
        if self.alive:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(30)
            except Exception:
                self.kill()


def start_all(*engines: VllmEngine) -> None:
    """Wait for engines that were started together; stop them all if one fails."""
    try:
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.kill()
        raise


class EnginePair:
    """A test module's vLLM engines around two sidecars (`sp` the prefill's, `sd` the decode's), and what
    its tests do with them: a one-engine reference, a prefill that publishes, a decode that pulls, and
    the check that every block a prefill held for a reader is back. A subclass starts its sidecars,
    builds its engines (`ref` runs without a connector) and calls `start`."""

    sp: SidecarProcess
    sd: SidecarProcess
    ref: VllmEngine
    max_tokens: int  # a decode's tokens (and the reference's)
    lease_ms: int  # the connectors' lease: settled() waits a third of it
    params_key = "kv_sidecar"  # what a prefill's kv_transfer_params must hold

    def start(self, *engines: VllmEngine) -> None:
        self.engines = engines
        start_all(*engines)
        self.free = {e.name: e.ready["free_blocks"] for e in engines}
        self._n = 0

    def ids(self, tag: str, count: int) -> list[str]:
        self._n += 1
        return [f"{tag}{self._n}-{i}" for i in range(count)]

    def reference(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        ids = self.ids("r", len(prompts))
        outs = self.ref.generate(dict(zip(ids, prompts, strict=True)), self.max_tokens, logprobs=0)
        return [outs[i] for i in ids]

    def prefill(self, engine: VllmEngine, prompts: list[list[int]]) -> list[dict[str, Any]]:
        ids = self.ids(f"p-{engine.name}-", len(prompts))
        outs = engine.generate(
            dict(zip(ids, prompts, strict=True)), 1, {i: {"do_remote_decode": True} for i in ids}
        )
        params = [outs[i]["kv_transfer_params"] for i in ids]
        assert all(p and self.params_key in p for p in params), params
        return params

    def decode(
        self, engine: VllmEngine, prompts: list[list[int]], params: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[str]]:
        ids = self.ids(f"d-{engine.name}-", len(prompts))
        outs = engine.generate(
            dict(zip(ids, prompts, strict=True)),
            self.max_tokens,
            dict(zip(ids, params, strict=True)),
            logprobs=0,
        )
        return [outs[i] for i in ids], ids

    def settled(self, *engines: VllmEngine) -> None:
        """Every block a prefill held for a reader is back (consumed or released, not left to its lease)."""
        for e in engines:
            state = e.settle(self.lease_ms / 1000 / 3)
            assert state["ok"] and state["free_blocks"] == self.free[e.name], state

    def close(self) -> None:
        for e in self.engines:
            e.stop()
        codes = self.sp.stop(), self.sd.stop()
        assert codes == (0, 0), f"sidecars exited with {codes}"


LOGPROB_TOLERANCE = 1e-4  # the same computation in another batch: float noise, not a wrong KV


def assert_same_output(
    got: list[dict[str, Any]], want: list[dict[str, Any]], lengths: tuple[int, ...]
) -> None:
    for n, g, w in zip(lengths, got, want, strict=True):
        assert g["tokens"] == w["tokens"], f"{n} tokens"
        worst = max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True))
        assert worst < LOGPROB_TOLERANCE, f"{n} tokens: log-probabilities differ by {worst}"


def pulls_of(engine: VllmEngine, request_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The decode engine's pull records (one per KV cache group) of these requests."""
    out: dict[str, list[dict[str, Any]]] = {}
    for p in engine.state()["pulls"]:
        for r in request_ids:
            if p["request_id"] == r or p["request_id"].startswith(f"{r}-"):
                out.setdefault(r, []).append(p)
    return out


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric over its label sets (those with these label values), read from a
    sidecar's (or a vLLM server's) /metrics."""
    return scrape.value(port, name, **labels)


def prefill_then_decode(
    P: VllmEngine, D: VllmEngine, prompts: dict[str, list[int]], max_tokens: int
) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Each prompt prefilled on P for a remote decode, then decoded on D from P's kv_transfer_params:
    D's tokens and P's params (None where P published nothing), by prompt id."""
    outs = P.generate(
        {f"p{r}": p for r, p in prompts.items()}, 1, {f"p{r}": {"do_remote_decode": True} for r in prompts}
    )
    params = {r: outs[f"p{r}"]["kv_transfer_params"] for r in prompts}
    assert all(params.values()), f"P published no params for some prompts: {outs}"
    got = D.generate(
        {f"d{r}": p for r, p in prompts.items()}, max_tokens, {f"d{r}": params[r] for r in prompts}
    )
    return {r: got[f"d{r}"]["tokens"] for r in prompts}, params


def wait_until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
