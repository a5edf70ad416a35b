"""P/D == one engine, over architectures as vLLM builds them, with real (random) weights.

For each architecture of tests/vllm/models.py, two real `kv-sidecar serve` processes and three
vLLM engines (`kv_both`, prefix caching off so an engine's own run of a prompt is a clean
reference): block 32 on the prefill node, block 64 and a TP2 engine of block 32 on the decode node.
The same engines serve every pairing: 32 -> 64, 64 -> 32, and TP1 -> TP2 at 32 -> 32. Each pull must
succeed and the decode engine's greedy tokens must equal its own computation of the whole prompt.

First, per architecture, the tier proves it can see a wrong KV cache at all: decoding a prompt from
another prompt's KV must change the tokens (with vLLM's dummy weights it did not: issue 30).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess

from .harness import VllmEngine, metric, start_all
from .models import ARCHITECTURES, write_random_model
from .test_pd import prompt

# Shorter than a block, one block of 64 (Gemma's window), many blocks and windows.
LENGTHS = (20, 64, 150)
MAX_TOKENS = 8


@dataclass
class Matrix:
    arch: str
    e32: VllmEngine  # block 32, prefill node
    e64: VllmEngine  # block 64, decode node
    tp2: VllmEngine  # block 32, TP 2, decode node
    sp: SidecarProcess
    sd: SidecarProcess

    def alone(self, engine: VllmEngine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        outs = engine.generate({f"a-{engine.name}-{r}": p for r, p in prompts.items()}, MAX_TOKENS)
        return {r: outs[f"a-{engine.name}-{r}"]["tokens"] for r in prompts}

    def prefill(self, engine: VllmEngine, prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
        ids = {r: f"p-{engine.name}-{r}" for r in prompts}
        outs = engine.generate(
            {ids[r]: p for r, p in prompts.items()}, 1, {ids[r]: {"do_remote_decode": True} for r in prompts}
        )
        params = {r: outs[ids[r]]["kv_transfer_params"] for r in prompts}
        assert all(p and "kv_sidecar" in p for p in params.values()), params
        return params

    def decode(
        self, engine: VllmEngine, prompts: dict[str, list[int]], params: dict[str, dict[str, Any]]
    ) -> dict[str, list[int]]:
        ids = {r: f"d-{engine.name}-{r}" for r in prompts}
        outs = engine.generate(
            {ids[r]: p for r, p in prompts.items()}, MAX_TOKENS, {ids[r]: params[r] for r in prompts}
        )
        return {r: outs[ids[r]]["tokens"] for r in prompts}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    arch = request.param
    model = write_random_model(str(tmp_path_factory.mktemp(f"model-{arch}")), arch)
    sp, sd = SidecarProcess(f"{arch}-prefill-node"), SidecarProcess(f"{arch}-decode-node")
    common = {"model": model, "prefix_caching": False}
    conn = {"pull_timeout_s": 60.0}
    e32 = VllmEngine(
        f"{arch}-b32",
        common | {"block_size": 32, "connector": conn | {"sidecar_socket": sp.socket, "engine_id": "b32"}},
    )
    e64 = VllmEngine(
        f"{arch}-b64",
        common | {"block_size": 64, "connector": conn | {"sidecar_socket": sd.socket, "engine_id": "b64"}},
    )
    tp2 = VllmEngine(
        f"{arch}-tp2",
        common
        | {
            "block_size": 32,
            "tensor_parallel_size": 2,
            "connector": conn | {"sidecar_socket": sd.socket, "engine_id": "tp2"},
        },
    )
    try:
        start_all(e32, e64, tp2)
        yield Matrix(arch, e32, e64, tp2, sp, sd)
    finally:
        for e in (e32, e64, tp2):
            e.stop()
        codes = sp.stop(), sd.stop()
    assert codes == (0, 0), f"sidecars exited with {codes}"


def prompts_for(arch: str, seed: int) -> dict[str, list[int]]:
    return {f"{arch}-{n}": prompt(n, seed=seed + n) for n in LENGTHS}


def pulls_ok(engine: VllmEngine, n: int) -> list[dict[str, Any]]:
    pulls = engine.state()["pulls"][-n:]
    assert len(pulls) == n and all(p["ok"] for p in pulls), pulls
    return pulls


def test_a_wrong_kv_cache_changes_the_output(matrix: Matrix) -> None:
    """The tier can see a bad transfer: the right prompt over another prompt's KV decodes differently."""
    mine, other = prompt(100, seed=1), prompt(100, seed=2)
    want = matrix.alone(matrix.e64, {"x": mine})["x"]
    params = matrix.prefill(matrix.e32, {"x": other})
    got = matrix.decode(matrix.e64, {"x": mine}, params)["x"]
    pulls_ok(matrix.e64, 1)
    assert got != want, f"{matrix.arch}: the output does not depend on the KV cache; this tier proves nothing"


@pytest.mark.parametrize(
    ("prefill", "decode", "path"),
    [("e32", "e64", "host-nixl-staged"), ("e64", "e32", "host-nixl-staged"), ("e32", "tp2", None)],
    ids=["block32-to-64", "block64-to-32", "tp1-to-tp2"],
)
def test_disaggregated_equals_one_engine(matrix: Matrix, prefill: str, decode: str, path: str | None) -> None:
    p_engine, d_engine = getattr(matrix, prefill), getattr(matrix, decode)
    prompts = prompts_for(matrix.arch, seed=len(prefill + decode))
    want = matrix.alone(d_engine, prompts)
    sidecar = matrix.sd if d_engine is not matrix.e32 else matrix.sp
    failures = metric(sidecar.metrics_port, "kvsidecar_failures_total")
    got = matrix.decode(d_engine, prompts, matrix.prefill(p_engine, prompts))
    assert got == want, matrix.arch
    if decode != "tp2":  # the TP2 engine's workers keep their own pull logs
        pulls = pulls_ok(d_engine, len(prompts))
        assert {p["path"] for p in pulls} == {path}, pulls
    assert metric(sidecar.metrics_port, "kvsidecar_failures_total") == failures
