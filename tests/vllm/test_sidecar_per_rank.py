"""A TP2 prefill engine whose ranks each have a sidecar of their own on the node (a sidecar per GPU):
`sidecar_socket` names `{rank}`, and `leader_address` is rank 0's sidecar, which rank 1's reports to
(docs/multinode.md). A TP1 decode engine on a third sidecar reads rank 0's heads from the leader and
rank 1's from the member; its output must equal what it computes itself without a prefill engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_sidecar.refengine.procs import SidecarProcess, together
from kv_sidecar_client.vllm.scheduler import PARAMS_KEY

from .engine import write_model
from .harness import VllmEngine, metric, prefill_then_decode, start_all, wait_until
from .test_pd import BLOCK, prompt


@pytest.fixture(scope="module")
def split_prefill(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmEngine, VllmEngine, list[SidecarProcess]]]:
    model = write_model(str(tmp_path_factory.mktemp("vllm-per-rank") / "model"))
    workdir = str(tmp_path_factory.mktemp("sockets"))
    # Sockets workdir/rank0.sock and workdir/rank1.sock: one sidecar per prefill rank.
    sp0, sp1, sd = together(
        # Records of reads served (read by _served) are kept only with transfer_log: all.
        lambda: SidecarProcess("rank0", workdir=workdir, extra=["--transfer-log", "all"]),
        lambda: SidecarProcess("rank1", workdir=workdir, env={"KV_SIDECAR_TRANSFER_LOG": "all"}),
        lambda: SidecarProcess("decode-node"),
    )
    P = VllmEngine(
        "prefill-tp2-per-rank",
        {
            "model": model,
            "block_size": BLOCK,
            "tensor_parallel_size": 2,
            "connector": {
                "sidecar_socket": f"{workdir}/rank{{rank}}.sock",
                "leader_address": sp0.peer_address,
                "engine_id": "p2",
            },
        },
    )
    D = VllmEngine(
        "decode-tp1",
        {
            "model": model,
            "block_size": BLOCK,
            "prefix_caching": False,  # so that its own run of a prompt is a clean reference
            "connector": {"sidecar_socket": sd.socket, "engine_id": "d1"},
        },
    )
    try:
        start_all(P, D)
        yield P, D, [sp0, sp1, sd]
    finally:
        P.stop()
        D.stop()
        for sc in (sp0, sp1, sd):
            sc.stop()


def _served(sidecar: SidecarProcess) -> int:
    """The reads this sidecar served to the end (its "read served" records)."""
    return sum(1 for line in sidecar.stderr_lines(5000) if "msg=read served" in line and "outcome=ok" in line)


def test_a_prefill_engine_with_a_sidecar_per_rank_equals_the_decode_engine_alone(
    split_prefill: tuple[VllmEngine, VllmEngine, list[SidecarProcess]],
) -> None:
    P, D, (sp0, sp1, sd) = split_prefill
    # Each prefill rank registered on its own sidecar.
    assert [metric(s.metrics_port, "kvsidecar_registered_ranks") for s in (sp0, sp1)] == [1, 1]
    prompts = {f"r{n}": prompt(n, seed=90 + n) for n in (9, 64, 200)}
    want = {rid: out["tokens"] for rid, out in D.generate(prompts, 10).items()}
    pulls = metric(sd.metrics_port, "kvsidecar_pulls_total", outcome="ok")
    # Published (a rank left out of the engine's map would have the Publish refused: no params), with
    # params that name the leader, the one address a decode engine needs.
    got, params = prefill_then_decode(P, D, prompts, 10)
    assert got == want
    assert {p[PARAMS_KEY]["sidecar_address"] for p in params.values()} == {sp0.peer_address}, params
    assert metric(sd.metrics_port, "kvsidecar_pulls_total", outcome="ok") - pulls == len(prompts)
    # Both prefill sidecars served each request: the leader rank 0's heads, the member rank 1's.
    wait_until(lambda: [_served(s) for s in (sp0, sp1)] == [len(prompts)] * 2, 10, "both served reads logged")
    assert sum(metric(s.metrics_port, "kvsidecar_failures_total") for s in (sp0, sp1, sd)) == 0
    settled = P.settle(30)
    assert settled["ok"] and settled["free_blocks"] == P.ready["free_blocks"], settled
