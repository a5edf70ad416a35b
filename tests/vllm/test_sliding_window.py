"""A sliding-window model through two real vLLM engines and two real `kv-sidecar serve` processes (issue 34).

Every layer of the model has a window of 64 tokens (Mistral-7B-v0.1's kind: one KV cache group, whose
out-of-window blocks vLLM frees and replaces with its null block). The prefill publishes only the
blocks of the window; the decode engine pulls them into its own in-window blocks and continues. Its
greedy tokens, and their log-probabilities, must equal those of one engine that ran the whole request
itself, for prompts shorter than, equal to and many times longer than the window, between engines of
equal and of different block sizes; every request must be pulled, and move about a window's bytes
however long its prompt.

Engines: `a32` (block 32, prefill node, window_alignment 64), `b32` (block 32, decode node, the default
alignment), `c64` (block 64, decode node), and a reference without a connector.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient, params_from_json
from kv_sidecar_client.vllm.window import first_kept_token, prefill_tokens

from .harness import EnginePair, VllmEngine, assert_same_output, metric
from .models import MISTRAL_SLIDING, SLIDING_WINDOW, write_weights

W = SLIDING_WINDOW
# 4 layers x K,V x 2 KV heads x head_dim 64 x float32, per token
TOKEN_BYTES = 4 * 2 * 2 * 64 * 4
# Shorter than the window, one token short of it, equal, one past, block edges of the window's start
# ((N - W + 1) a multiple of the block size: the case a prefill of the whole prompt gets wrong), many
# windows (1000 tokens: 15 of them).
LENGTHS = (20, 63, 64, 65, 95, 96, 127, 150, 400, 1000)
MAX_TOKENS = 10
LEASE_MS = 30000


def prompt(n: int, seed: int) -> list[int]:
    """Random tokens: tests/vllm/test_pd.prompt repeats with period 1000, so two of its long prompts
    can share their last window, which is all this model's next token depends on."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


class Windows(EnginePair):
    max_tokens, lease_ms = MAX_TOKENS, LEASE_MS

    def __init__(self, tmp: str) -> None:
        model = write_weights(f"{tmp}/model", MISTRAL_SLIDING)
        self.sp, self.sd = SidecarProcess("sw-prefill-node"), SidecarProcess("sw-decode-node")
        conn = {"pull_timeout_s": 60.0, "lease_ms": LEASE_MS}
        self.a32 = VllmEngine(
            "sw-a32",
            {
                "model": model,
                "block_size": 32,
                "connector": conn
                | {"sidecar_socket": self.sp.socket, "engine_id": "a32", "window_alignment": 64},
            },
        )
        self.b32 = VllmEngine(
            "sw-b32",
            {
                "model": model,
                "block_size": 32,
                "connector": conn | {"sidecar_socket": self.sd.socket, "engine_id": "b32"},
            },
        )
        self.c64 = VllmEngine(
            "sw-c64",
            {
                "model": model,
                "block_size": 64,
                "connector": conn | {"sidecar_socket": self.sd.socket, "engine_id": "c64"},
            },
        )
        self.ref = VllmEngine("sw-reference", {"model": model, "block_size": 32})
        self.start(self.a32, self.b32, self.c64, self.ref)

    def sidecar_of(self, engine: VllmEngine) -> SidecarProcess:
        return self.sp if engine is self.a32 else self.sd


@pytest.fixture(scope="module")
def sw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Windows]:
    fixture = Windows(str(tmp_path_factory.mktemp("vllm-sliding-window")))
    yield fixture
    fixture.close()


def pulls_of(engine: VllmEngine, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The decode engine's pull records of these requests (vLLM suffixes the ids it is given)."""
    out = {}
    for p in engine.state()["pulls"]:
        for r in request_ids:
            if p["request_id"] == r or p["request_id"].startswith(f"{r}-"):
                out[r] = p
    return out


# (prefill, decode, path, the prefill's window_alignment)
PAIRINGS = {
    "equal-blocks": ("a32", "b32", "host-nixl", 64),
    "block32-to-64": ("a32", "c64", "host-nixl-staged", 64),
    "block64-to-32": ("c64", "a32", "host-nixl-staged", 64),
}


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_windowed_requests_are_pulled_and_decode_as_one_engine(sw: Windows, pairing: str) -> None:
    p_name, d_name, path, alignment = PAIRINGS[pairing]
    p_engine, d_engine = getattr(sw, p_name), getattr(sw, d_name)
    bp, bd = p_engine.opts["block_size"], d_engine.opts["block_size"]
    prompts = [prompt(n, seed=1000 * list(PAIRINGS).index(pairing) + n) for n in LENGTHS]
    want = sw.reference(prompts)
    sidecar = sw.sidecar_of(d_engine)
    ok_before = metric(sidecar.metrics_port, "kvsidecar_pulls_total", outcome="ok")

    params = sw.prefill(p_engine, prompts)
    for n, p in zip(LENGTHS, params, strict=True):
        kv = p["kv_sidecar"]
        held = prefill_tokens(n, W, alignment)
        first = first_kept_token(held, W, bp)
        # The prefill computed and published all but the last tokens; only the window's blocks.
        assert kv["num_tokens"] == held and kv.get("first_token", 0) == first, (n, kv)
        assert len(kv["block_ids"]) == -(-held // bp) - first // bp and 0 not in kv["block_ids"], (n, kv)
    got, ids = sw.decode(d_engine, prompts, params)
    assert_same_output(got, want, LENGTHS)

    # Every request was pulled (the decode sidecar counts an ok pull for each), on the expected path,
    # into the decode engine's in-window blocks only, from its first in-window one: whole blocks on
    # the identity path (it READs blocks), the tokens themselves where they are converted.
    pulls = pulls_of(d_engine, ids)
    assert len(pulls) == len(ids) and all(p["ok"] and p["path"] == path for p in pulls.values()), pulls
    assert metric(sidecar.metrics_port, "kvsidecar_pulls_total", outcome="ok") == ok_before + len(ids)
    for n, rid in zip(LENGTHS, ids, strict=True):
        held = prefill_tokens(n, W, alignment)
        start = first_kept_token(held, W, bd)
        tokens = (-(-held // bd) - start // bd) * bd if path == "host-nixl" else held - start
        assert pulls[rid]["bytes"] == tokens * TOKEN_BYTES, (n, pulls[rid])
    # However long the prompt, a window's worth (with its blocks' rounding), not the prompt's.
    assert pulls[ids[-1]]["bytes"] <= (W + 2 * max(bp, bd)) * TOKEN_BYTES < LENGTHS[-1] * TOKEN_BYTES / 5
    sw.settled(p_engine)


def test_bytes_moved_for_a_long_prompt_are_the_window(sw: Windows) -> None:
    """The decode sidecar's byte counter: a prompt of 30 windows moves one window, as does one of 3."""
    moved = {}
    for n in (200, 1900):
        p = [prompt(n, seed=700 + n)]
        before = metric(sw.sd.metrics_port, "kvsidecar_pull_bytes_total")
        got, _ = sw.decode(sw.b32, p, sw.prefill(sw.a32, p))
        assert_same_output(got, sw.reference(p), (n,))
        moved[n] = metric(sw.sd.metrics_port, "kvsidecar_pull_bytes_total") - before
    assert moved[1900] == moved[200] == 2 * 32 * TOKEN_BYTES, moved  # tokens [x, x + W - 1): 2 blocks
    assert moved[1900] < 1900 * TOKEN_BYTES / 25
    sw.settled(sw.a32)


def test_a_decode_whose_blocks_do_not_divide_the_alignment_computes_those_requests(sw: Windows) -> None:
    """b32 aligns windows to 32 tokens; c64 (same sidecar) can take a window only where it starts on
    its own grid. The others it computes itself, and tells the prefill to free their blocks at once."""
    lengths = (40, 159, 191)  # no window; a window from token 64 (on c64's grid); from token 96 (not)
    prompts = [prompt(n, seed=900 + n) for n in lengths]
    want = sw.reference(prompts)
    params = sw.prefill(sw.b32, prompts)
    assert [p["kv_sidecar"].get("first_token", 0) for p in params] == [0, 64, 96]
    got, ids = sw.decode(sw.c64, prompts, params)
    assert_same_output(got, want, lengths)
    pulls = pulls_of(sw.c64, ids)
    assert set(pulls) == {ids[0], ids[1]} and all(
        p["ok"] and p["path"] == "host-direct" for p in pulls.values()
    )
    sw.settled(sw.b32)  # the third request's blocks too, long before its lease


def test_a_failed_windowed_pull_is_computed_from_the_start(sw: Windows) -> None:
    """A pull that fails (here: the prefill's sidecar knows no such request) leaves the decode engine's
    blocks before the window null: vLLM must compute the request from its first token, not from the
    first unfilled block, whose window it does not hold."""
    n = 400
    p = [prompt(n, seed=4242)]
    want = sw.reference(p)
    (params,) = sw.prefill(sw.a32, p)
    bad = params | {"kv_sidecar": params["kv_sidecar"] | {"request_id": "no-such-request"}}
    got, ids = sw.decode(sw.b32, p, [bad])
    assert_same_output(got, want, (n,))
    (pull,) = pulls_of(sw.b32, ids).values()
    assert not pull["ok"] and "no-such-request" in pull["error"], pull
    # The published request was never read: release it as its reader would.
    real = params_from_json(params["kv_sidecar"])
    with SidecarClient(sw.sd.socket) as client:
        assert client.abort("b32", real.request_id, real)
    sw.settled(sw.a32)


def test_a_decode_prefix_cache_hit_inside_the_window_pulls_only_the_rest(sw: Windows) -> None:
    """The decode engine decoded a request; a longer one that begins with it finds the last blocks of the
    first one's window in its prefix cache (vLLM keeps null blocks before them) and pulls only after."""
    first = prompt(1000, seed=31)
    got, _ = sw.decode(sw.b32, [first], sw.prefill(sw.a32, [first]))
    assert_same_output(got, sw.reference([first]), (1000,))
    second = first + prompt(30, seed=32)
    (params,) = sw.prefill(sw.a32, [second])
    held = params["kv_sidecar"]["num_tokens"]
    assert (held, params["kv_sidecar"]["first_token"]) == (1023, 960)
    got, ids = sw.decode(sw.b32, [second], [params])
    assert_same_output(got, sw.reference([second]), (1030,))
    (pull,) = pulls_of(sw.b32, ids).values()
    # Blocks of tokens 960-991 come from the decode engine's own cache; tokens [992, 1023) are pulled.
    assert pull["ok"] and pull["bytes"] == 32 * TOKEN_BYTES, pull
    sw.settled(sw.a32)
