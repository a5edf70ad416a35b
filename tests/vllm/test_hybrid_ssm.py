"""An SSM hybrid (Mamba-2 and attention layers) through two real vLLM engines and two real sidecars
(issue 33, item 5).

The Granite-4-shaped model of tests/vllm/models.py (`GRANITE4_HYBRID`: Mamba-2 layers 0 and 2,
attention layers 1 and 3, random weights) runs with vLLM's hybrid KV cache manager on and prefix
caching off (mamba_cache_mode "none"): two KV cache groups, a Mamba group whose one block per request
holds its conv and SSM state, and a full-attention group of blocks of 128 tokens (vLLM raises the
attention block size until an attention page holds a Mamba page). The prefill computes all but the
last prompt token and publishes each group as its own sidecar record; the decode engine pulls the
state block and the attention blocks and computes the last prompt token from the state.

Greedy tokens and their log-probabilities must equal one engine's for prompts shorter than, equal to
and several times longer than a block; the bytes each group moves are counted; a failed pull of the
Mamba group makes the decode engine compute the request. Between TP sizes (1 -> 2, 2 -> 1) the sidecar
converts the state: each decode rank's state block gets its conv channels (its share of x, the one
group's B and C whole) and SSM heads, and the output equals the decode TP size's engine alone. A decode
engine whose Mamba state does not correspond (another head split) is refused, naming the layer, and
computes the request itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess

from .failures import a_failed_pull_of_one_group_is_computed
from .harness import (
    LOGPROB_TOLERANCE,
    EnginePair,
    VllmEngine,
    assert_same_output,
    metric,
    pulls_of,
    start_all,
)
from .models import GRANITE4_HYBRID, write_weights
from .test_hybrid import prompt

BLOCK = 128  # vLLM's attention block size for this model (one Mamba page)
REGIONS = 2  # layer positions: (Mamba layer 0, attention layer 1), (Mamba layer 2, attention layer 3)
PAGE = 131072  # bytes of one block of one region: 128 tokens x 2 KV heads x (K, V) x 64 x float32
TOKEN_BYTES = PAGE // BLOCK  # one attention layer's K and V of one token
# One Mamba layer's state on one rank: conv (3, 544) and SSM (8, 64, 16), float32, back to back.
CONV, SSM = (3 * 544 * 4, 8 * 64 * 16 * 4)
LENGTHS = (20, 127, 128, 129, 300, 700)
MAX_TOKENS = 10
LEASE_MS = 30000


class SsmPair(EnginePair):
    max_tokens, lease_ms = MAX_TOKENS, LEASE_MS
    params_key = "kv_sidecar_groups"  # a Mamba hybrid's prefill publishes every group

    def __init__(self, tmp: str, prefix: str = "ssm", **conn: Any) -> None:
        """`conn`: connector settings over the defaults (a 60 s pull timeout, a 30 s lease)."""
        model = write_weights(f"{tmp}/granite4", GRANITE4_HYBRID)
        self.model = model
        self.sp, self.sd = SidecarProcess(f"{prefix}-prefill-node"), SidecarProcess(f"{prefix}-decode-node")
        conn = {"pull_timeout_s": 60.0, "lease_ms": LEASE_MS} | conn
        self.lease_ms = conn["lease_ms"]
        # block_size None: vLLM sets it from the Mamba page; prefix caching off: mamba_cache_mode "none".
        self.base = {"model": model, "hybrid": True, "block_size": None, "prefix_caching": False}

        def engine(name: str, sidecar: SidecarProcess | None, **over: Any) -> VllmEngine:
            opts = self.base | over
            if sidecar is not None:
                opts["connector"] = conn | {"sidecar_socket": sidecar.socket, "engine_id": name}
            return VllmEngine(f"{prefix}-{name}", opts)

        self.P = engine("p", self.sp)
        self.D = engine("d", self.sd)
        self.ref = engine("ref", None)
        self.start(self.P, self.D, self.ref)


@pytest.fixture(scope="module")
def ssm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SsmPair]:
    fixture = SsmPair(str(tmp_path_factory.mktemp("vllm-ssm")))
    yield fixture
    fixture.close()


def test_the_hybrid_manager_is_on_with_a_mamba_group(ssm: SsmPair) -> None:
    """Two groups (Mamba, full attention) at every engine, our connector loaded or not, and the decode
    engine keeps the capacity of an engine without a connector."""
    for e in ssm.engines:
        assert e.ready["kv_cache_groups"] == 2, (e.name, e.ready)
    assert ssm.free["ssm-d"] == ssm.free["ssm-ref"] == ssm.free["ssm-p"]
    # 64 MiB of blocks of one page per layer position; block 0 is vLLM's null block.
    assert ssm.free["ssm-d"] == (64 << 20) // (REGIONS * PAGE) - 1


def test_ssm_hybrid_requests_decode_as_one_engine_and_move_exact_bytes(ssm: SsmPair) -> None:
    prompts = [prompt(n, seed=500 + n) for n in LENGTHS]
    want = ssm.reference(prompts)
    bytes_before = metric(ssm.sd.metrics_port, "kvsidecar_pull_bytes_total")
    params = ssm.prefill(ssm.P, prompts)
    for n, p in zip(LENGTHS, params, strict=True):
        mamba, attention = p["kv_sidecar_groups"]
        assert [g["name"] for g in mamba["state"]] == ["conv", "ssm"], mamba
        assert mamba["layers"] == ["model.layers.0.mixer", "model.layers.2.mixer"], mamba
        # The prefill stopped one token short: the decode engine computes the last from the state.
        assert attention["params"]["num_tokens"] == n - 1 and p["kv_sidecar"] == attention["params"], p
        assert len(attention["params"]["block_ids"]) == -(-(n - 1) // BLOCK), p
        # One state block, published as that block's tokens; no block id is in two groups.
        assert mamba["params"]["num_tokens"] == BLOCK and len(mamba["params"]["block_ids"]) == 1, p
        assert not set(mamba["params"]["block_ids"]) & set(attention["params"]["block_ids"]), p
    got, ids = ssm.decode(ssm.D, prompts, params)
    assert_same_output(got, want, LENGTHS)

    pulls = pulls_of(ssm.D, ids)
    total = 0
    for n, rid in zip(LENGTHS, ids, strict=True):
        by_group = sorted(pulls[rid], key=lambda q: q["bytes"])
        assert len(by_group) == 2 and all(q["ok"] for q in by_group), pulls[rid]
        attention_bytes = REGIONS * TOKEN_BYTES * -(-(n - 1) // BLOCK) * BLOCK  # whole blocks are READ
        state_bytes = REGIONS * PAGE  # the state block of each region, its padding included
        assert {q["bytes"] for q in by_group} == {attention_bytes, state_bytes}, (n, by_group)
        total += attention_bytes + state_bytes
    assert metric(ssm.sd.metrics_port, "kvsidecar_pull_bytes_total") - bytes_before == total
    assert REGIONS * (CONV + SSM) < REGIONS * PAGE  # what the state itself is: the rest is page padding
    ssm.settled(ssm.P)


def test_the_output_depends_on_the_state_moved(ssm: SsmPair) -> None:
    """The control: two requests' Mamba records swapped (each decode engine request gets the other's
    state, its own attention blocks): both pulls succeed and the output is no longer one engine's, so
    the equality above is the state's doing, not the attention's alone."""
    n = 300
    prompts = [prompt(n, seed=71), prompt(n, seed=72)]
    want = ssm.reference(prompts)
    a, b = ssm.prefill(ssm.P, prompts)
    ga, gb = list(a["kv_sidecar_groups"]), list(b["kv_sidecar_groups"])
    ga[0], gb[0] = gb[0], ga[0]
    got, ids = ssm.decode(ssm.D, prompts, [a | {"kv_sidecar_groups": ga}, b | {"kv_sidecar_groups": gb}])
    pulls = pulls_of(ssm.D, ids)
    assert all(len(pulls[r]) == 2 and all(q["ok"] for q in pulls[r]) for r in ids), pulls
    for g, w in zip(got, want, strict=True):
        worst = max(abs(x - y) for x, y in zip(g["logprobs"], w["logprobs"], strict=True))
        assert g["tokens"] != w["tokens"] or worst > 100 * LOGPROB_TOLERANCE, (g, w)
    ssm.settled(ssm.P)


def test_a_one_token_prompt_is_computed_by_the_decode_engine(ssm: SsmPair) -> None:
    """A prefill cannot stop short of a one-token prompt: its published state holds that token, and the
    decode engine computes the request itself rather than advance the state twice."""
    p = [prompt(1, seed=1)]
    want = ssm.reference(p)
    params = ssm.prefill(ssm.P, p)
    got, ids = ssm.decode(ssm.D, p, params)
    assert_same_output(got, want, (1,))
    assert not pulls_of(ssm.D, ids)
    ssm.settled(ssm.P)  # released by the decode engine, long before the lease


def test_a_state_of_the_whole_prompt_is_not_loaded(ssm: SsmPair) -> None:
    """Params whose state already holds every prompt token (here: a prefill of the prompt and one more
    token, stopped one short): vLLM would compute the last prompt token again from that state, advancing
    it twice (measured with this check off: other tokens, log-probabilities off by 1.5). The decode
    engine computes such a request itself and releases the prefill's records."""
    n = 300
    x = prompt(n, seed=909)
    want = ssm.reference([x])
    (params,) = ssm.prefill(ssm.P, [[*x, 5]])
    assert params["kv_sidecar"]["num_tokens"] == n
    got, ids = ssm.decode(ssm.D, [x], [params])
    assert_same_output(got, want, (n,))
    assert not pulls_of(ssm.D, ids)
    ssm.settled(ssm.P)
    with open(ssm.D.log_path, errors="replace") as f:
        assert "published the Mamba state of all 300 prompt tokens" in f.read()


def test_a_failed_pull_of_the_mamba_group_is_computed_by_the_decode_engine(ssm: SsmPair) -> None:
    a_failed_pull_of_one_group_is_computed(ssm, ssm.P, ssm.D, "d", prompt(300, seed=4242), group=0)


def _tp2_engine(ssm: SsmPair, name: str, sidecar: SidecarProcess, engine_id: str) -> Iterator[VllmEngine]:
    engine = VllmEngine(
        name,
        ssm.base
        | {
            "tensor_parallel_size": 2,
            "connector": {"sidecar_socket": sidecar.socket, "engine_id": engine_id, "lease_ms": LEASE_MS},
        },
    )
    try:
        start_all(engine)
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def tp2(ssm: SsmPair) -> Iterator[VllmEngine]:
    yield from _tp2_engine(ssm, "ssm-d-tp2", ssm.sd, "d-tp2")


# One TP 2 rank's Mamba state: conv (3, 256 + 16 + 16) and SSM (4, 64, 16), float32.
CONV_TP2, SSM_TP2 = (3 * 288 * 4, 4 * 64 * 16 * 4)


# Engines of TP 1 and TP 2 compute the model with other reduction orders, so the same prompt's
# log-probabilities differ between them by float noise (measured: 1.2e-4 between a TP 1 prefill's state
# continued on TP 2 and TP 2 alone), while a wrong state moves them by ~1
# (test_the_output_depends_on_the_state_moved). A request prefilled at one TP size and decoded at the
# other is held to this bound, and to no more than twice the two engines' own difference.
CROSS_TP_TOLERANCE = 1e-3


def _worst(got: dict[str, Any], want: dict[str, Any]) -> float:
    return max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))


def _same(got: dict[str, Any], want: dict[str, Any], tolerance: float = LOGPROB_TOLERANCE) -> None:
    assert got["tokens"] == want["tokens"], (got, want)
    assert _worst(got, want) < tolerance, (_worst(got, want), got, want)


def _computed_locally(engine: VllmEngine) -> bool:
    with open(engine.log_path, errors="replace") as f:
        return "KV cache groups of the two engines do not correspond" in f.read()


def test_tp1_to_tp2_converts_the_state_into_each_ranks_shard(ssm: SsmPair, tp2: VllmEngine) -> None:
    """A TP 1 prefill, a TP 2 decode engine: each decode rank pulls its attention heads and its state,
    which the sidecar converts (its half of the conv x channels and the one group's B and C whole, its
    4 of the 8 SSM heads); tokens and log-probabilities equal the TP 2 engine's alone, and the bytes are
    exactly those: the attention tokens converted, each rank's state arrays (not the page padding)."""
    lengths = (20, 128, 300)
    prompts = [prompt(n, seed=800 + n) for n in lengths]
    want = tp2.generate(
        {f"alone-{n}": p for n, p in zip(lengths, prompts, strict=True)}, MAX_TOKENS, logprobs=0
    )
    tp1 = ssm.reference(prompts)
    port = ssm.sd.metrics_port
    before = {
        "pulls": metric(port, "kvsidecar_pulls_total", outcome="ok"),
        "state": metric(port, "kvsidecar_pull_bytes_total", path="host-nixl-state"),
        "staged": metric(port, "kvsidecar_pull_bytes_total", path="host-nixl-staged"),
    }
    got, _ = ssm.decode(tp2, prompts, ssm.prefill(ssm.P, prompts))
    for n, g, one in zip(lengths, got, tp1, strict=True):
        alone = want[f"alone-{n}"]
        _same(g, alone, CROSS_TP_TOLERANCE)
        # No further from the TP 2 engine than the TP 1 engine's own output is (the prefill's TP noise).
        assert _worst(g, alone) <= max(LOGPROB_TOLERANCE, 2 * _worst(one, alone)), (n, g, alone, one)
    assert not _computed_locally(tp2)
    # One pull per decode rank, group and request; its workers run elsewhere: count at the sidecar.
    assert metric(port, "kvsidecar_pulls_total", outcome="ok") - before["pulls"] == 2 * 2 * len(lengths)
    state = metric(port, "kvsidecar_pull_bytes_total", path="host-nixl-state") - before["state"]
    assert state == len(lengths) * 2 * REGIONS * (CONV_TP2 + SSM_TP2)  # 2 ranks, each region's arrays
    # The attention heads converted token by token: each rank its one KV head of the n - 1 tokens.
    attention = metric(port, "kvsidecar_pull_bytes_total", path="host-nixl-staged") - before["staged"]
    assert attention == sum(REGIONS * TOKEN_BYTES * (n - 1) for n in lengths)
    ssm.settled(ssm.P)


@pytest.fixture(scope="module")
def tp2_prefill(ssm: SsmPair, tp2: VllmEngine) -> Iterator[VllmEngine]:
    yield from _tp2_engine(ssm, "ssm-p-tp2", ssm.sp, "p-tp2")


def test_tp2_to_tp2_moves_each_ranks_state_shard(
    ssm: SsmPair, tp2: VllmEngine, tp2_prefill: VllmEngine
) -> None:
    """Equal TP 2 engines: each decode rank pulls its own rank's state block (its Mamba heads and conv
    channels) and attention heads; the output equals the TP 2 engine's alone."""
    prompts = {f"t{n}": prompt(n, seed=700 + n) for n in (20, 128, 300)}
    want = tp2.generate({f"alone-{r}": p for r, p in prompts.items()}, MAX_TOKENS, logprobs=0)
    pulls = metric(ssm.sd.metrics_port, "kvsidecar_pulls_total", outcome="ok")
    outs = tp2_prefill.generate(
        {f"p{r}": p for r, p in prompts.items()}, 1, {f"p{r}": {"do_remote_decode": True} for r in prompts}
    )
    params = {r: outs[f"p{r}"]["kv_transfer_params"] for r in prompts}
    got = tp2.generate(
        {f"d{r}": p for r, p in prompts.items()},
        MAX_TOKENS,
        {f"d{r}": params[r] for r in prompts},
        logprobs=0,
    )
    for r in prompts:
        g, w = got[f"d{r}"], want[f"alone-{r}"]
        assert g["tokens"] == w["tokens"], r
        assert (
            max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) < LOGPROB_TOLERANCE
        ), r
    # One pull per decode rank, group and request.
    assert metric(ssm.sd.metrics_port, "kvsidecar_pulls_total", outcome="ok") - pulls == 2 * 2 * len(prompts)
    state = tp2_prefill.settle(LEASE_MS / 1000 / 3)
    assert state["ok"] and state["free_blocks"] == tp2_prefill.ready["free_blocks"], state


def test_tp2_to_tp1_gathers_the_state_from_both_ranks(ssm: SsmPair, tp2_prefill: VllmEngine) -> None:
    """A TP 2 prefill, the TP 1 decode engine: its one rank's state gathered from both prefill ranks (x
    and SSM heads from each, B and C from rank 0); tokens and log-probabilities equal one TP 1 engine's."""
    lengths = (20, 129, 300)
    prompts = [prompt(n, seed=900 + n) for n in lengths]
    want = ssm.reference(prompts)
    outs = tp2_prefill.generate(
        {f"p21-{n}": p for n, p in zip(lengths, prompts, strict=True)},
        1,
        {f"p21-{n}": {"do_remote_decode": True} for n in lengths},
    )
    params = [outs[f"p21-{n}"]["kv_transfer_params"] for n in lengths]
    alone = tp2_prefill.generate(
        {f"a21-{n}": p for n, p in zip(lengths, prompts, strict=True)}, MAX_TOKENS, logprobs=0
    )
    got, ids = ssm.decode(ssm.D, prompts, params)
    for n, g, w in zip(lengths, got, want, strict=True):
        _same(g, w, CROSS_TP_TOLERANCE)
        # No further from the TP 1 engine than the TP 2 engine's own output is.
        assert _worst(g, w) <= max(LOGPROB_TOLERANCE, 2 * _worst(alone[f"a21-{n}"], w)), (n, g, w)
    pulls = pulls_of(ssm.D, ids)
    for n, rid in zip(lengths, ids, strict=True):
        by_group = sorted(pulls[rid], key=lambda q: q["bytes"])
        assert len(by_group) == 2 and all(q["ok"] for q in by_group), pulls[rid]
        # The state: the TP 1 arrays of each region; the attention: n - 1 tokens of both heads.
        assert [q["bytes"] for q in by_group] == sorted(
            [REGIONS * (CONV + SSM), REGIONS * TOKEN_BYTES * (n - 1)]
        )
    state = tp2_prefill.settle(LEASE_MS / 1000 / 3)
    assert state["ok"] and state["free_blocks"] == tp2_prefill.ready["free_blocks"], state


@pytest.fixture(scope="module")
def other_heads(ssm: SsmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """The model with its Mamba heads split otherwise (16 heads of 32: the same conv state and page
    sizes, another SSM state), a decode engine on the decode sidecar."""
    model = write_weights(
        str(tmp_path_factory.mktemp("vllm-ssm-heads") / "granite4"),
        GRANITE4_HYBRID | {"mamba_n_heads": 16, "mamba_d_head": 32},
    )
    engine = VllmEngine(
        "ssm-d-heads",
        ssm.base
        | {
            "model": model,
            "connector": {"sidecar_socket": ssm.sd.socket, "engine_id": "d-heads", "lease_ms": LEASE_MS},
        },
    )
    try:
        start_all(engine)
        yield engine
    finally:
        engine.stop()


def test_state_that_does_not_correspond_is_refused_naming_the_mamba_layer(
    ssm: SsmPair, other_heads: VllmEngine
) -> None:
    """SSM state (8, 64, 16) published, (16, 32, 16) here: no conversion is exact, so the decode engine
    computes the request itself, saying which layer differs and how, and the prefill frees its blocks at
    once (no pull is made)."""
    n = 300
    p = [prompt(n, seed=303)]
    want = other_heads.generate({"alone": p[0]}, MAX_TOKENS, logprobs=0)["alone"]
    pulls = metric(ssm.sd.metrics_port, "kvsidecar_pulls_total")
    got, _ = ssm.decode(other_heads, p, ssm.prefill(ssm.P, p))
    _same(got[0], want)
    assert metric(ssm.sd.metrics_port, "kvsidecar_pulls_total") == pulls
    ssm.settled(ssm.P)
    with open(other_heads.log_path, errors="replace") as f:
        log = f.read()
    assert (
        "KV cache groups of the two engines do not correspond: layer model.layers.0.mixer (KV cache group 0)"
        in log
    )
    assert "ssm (8, 64, 16) float32 at byte 6528) on the prefill engine" in log
    assert "ssm (16, 32, 16) float32 at byte 6528) on this engine" in log


def test_prefix_caching_on_stops_the_engine_naming_the_setting(tmp_path: object) -> None:
    """mamba_cache_mode "align" (vLLM's default with prefix caching on) keeps a request's state in
    checkpoint blocks that move every step: refused at start, naming the setting to change."""
    model = write_weights(os.path.join(str(tmp_path), "granite4"), GRANITE4_HYBRID)
    sidecar = SidecarProcess("ssm-align-node")
    try:
        engine = VllmEngine(
            "ssm-align",
            {
                "model": model,
                "hybrid": True,
                "block_size": None,
                "prefix_caching": True,
                "connector": {"sidecar_socket": sidecar.socket, "engine_id": "align"},
            },
        )
        with pytest.raises(Exception, match=r"mamba_cache_mode 'align'.*--no-enable-prefix-caching"):
            engine.wait_ready()
    finally:
        assert sidecar.stop() == 0
