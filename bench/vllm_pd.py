"""P/D with vLLM's API servers as a user runs them: kv-sidecar against vLLM's own NixlConnector, in one run.

Three stacks serve the same model at once, all `vllm serve` (python -m vllm.entrypoints.openai.api_server)
with the same flags, on this machine's CPU:
  aggregated  one server, no connector; the client sends to it directly;
  NixlConnector  a prefill and a decode server with vLLM's NixlConnector (kv_buffer_device "cpu": NIXL
              registers each engine's KV cache and the decode engine READs the prefill's blocks), behind
              examples/pd_router.py;
  kv-sidecar  a prefill and a decode server with KVSidecarConnector and a kv-sidecar per "node", behind
              another examples/pd_router.py (the same script, unchanged);
  kv-sidecar-batch  (only when --modes names it) the same with the decode connector's `pull_batch` on: a
              step's pulls (several requests, or one hybrid request's KV cache groups) go in one PullBatch
              call; its own pair of sidecars and servers.
Every request goes to all three; the order of the stacks turns by one each request (each round, for the
concurrent rows), so drift on the machine falls on every stack alike. Prompts are random token ids, a
fresh one per request (so no stack's prefix cache can answer it) and the same for the three stacks; the
answer is greedy, --max-tokens tokens, and the three answers must be equal: a row where any differ says
how many. A dense model (Llama-shaped) and a hybrid one (Gemma-3-shaped: sliding-window and full-attention
layers, run with vLLM's hybrid KV cache manager on in every server: `--no-disable-hybrid-kv-cache-manager`,
with which vLLM refuses to start rather than turn it off). Every server's OpenMP threads are bound alike, to
all cores (VLLM_CPU_OMP_THREADS_BIND): vLLM's own binding would give the server without a connector one
thread on 2 cores and the others two. Each stack's CPU while no request runs is measured too: a process that
polls slows every stack on the machine.

Columns (per request; the medians over the row's requests, p90 beside the client's):
  client      the client's time for the whole completion: through the router for P/D (prefill server, then
              decode server), straight to the server for aggregated;
  prefill     the prefill server's own request latency (vLLM's e2e_request_latency: arrival at the API
              server -> its one-token answer);
  decode TTFT the decode (aggregated: the only) server's time to first token (vLLM's time_to_first_token);
  decode      the decode (aggregated: the only) server's request latency (e2e_request_latency: arrival ->
              last token); client - prefill - decode is the router's and HTTP's share;
  arrival -> KV ready  the decode server's queue time (vLLM's request_queue_time): the request's arrival
              at the engine core -> its first forward scheduled, which for both connectors is after vLLM's
              scheduler saw the connector report the KV cache received (both load asynchronously: the
              request waits in WAITING_FOR_REMOTE_KVS); the same vLLM timestamps for both, so a fair
              comparison; for aggregated, the engine computes the KV itself (decode TTFT shows that);
  transfer    the mover's own time for the KV of one request: NixlConnector's NIXL transfer time
              (vllm:nixl_xfer_time_seconds, READ posted -> done) or the decode sidecar's pull duration
              (kvsidecar_pull_duration_seconds, Pull received -> answered: the control messages to the
              prefill sidecar and the READ; one pull per KV cache group, summed, though they overlap); not
              the same span, so compare the two connectors on arrival -> KV ready;
  KV bytes    bytes moved per request (vllm:nixl_bytes_transferred / kvsidecar_pull_bytes_total);
  NIXL descriptors  descriptors of the request's NIXL READs (vllm:nixl_num_descriptors /
              kvsidecar_nixl_descriptors_per_transfer, the decode sidecar's);
  CPU         CPU seconds per request of every process of the stack (API servers with their engine
              cores, sidecars, router), measured around the request or burst; idle processes of the other
              stacks are not counted.
The server-side columns are differences of the servers' Prometheus histogram sums before and after each
request (one at a time), or means over a burst (concurrent rows).

    .venv-vllm/bin/python bench/vllm_pd.py              # writes a section of docs/benchmarks.md
    .venv-vllm/bin/python bench/vllm_pd.py --iters 3 --tokens 512 --models dense --no-write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import write_section  # noqa: E402

from kv_sidecar.refengine.procs import SidecarProcess  # noqa: E402
from kv_sidecar_client.vllm.shm_pool import remove_orphans  # noqa: E402
from tests.vllm.harness import metric  # noqa: E402
from tests.vllm.models import ARCHITECTURES, write_weights  # noqa: E402
from tests.vllm.serve import (  # noqa: E402
    NIXL_KV_CONFIG,
    api_server,
    complete,
    free_port,
    nixl_env,
    router,
    sidecar_kv_config,
    stop,
    wait_http,
)

# The docstring without its first line and usage: what the report says each column is.
ABOUT = __doc__.split("\n\n    .venv")[0].split("\n\n", 1)[1].strip()
TITLE = "P/D through vLLM's API servers: aggregated, NixlConnector, kv-sidecar (bench/vllm_pd.py)"
ALL_MODES = ("aggregated", "NixlConnector", "kv-sidecar", "kv-sidecar-batch")
DEFAULT_MODES = ALL_MODES[:3]
MODES: tuple[str, ...] = DEFAULT_MODES  # those of this run (--modes)
SIDECAR_MODES = {"kv-sidecar": "k", "kv-sidecar-batch": "b"}  # mode -> its servers' key
IDLE_S = 5.0
BLOCK = 32
VOCAB = 2048
# KV of tens of KiB per token (MHA: 8 KV heads of 64, float32, as many query heads), on a narrow hidden
# size so that a 4k-token prompt still prefills in seconds on 2 cores; the attention, which scales with
# the KV width, is most of a long prompt's compute anyway.
_WIDE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
}
MODELS: dict[str, dict[str, Any]] = {
    "dense": _WIDE
    | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # tests/vllm/models.py's Gemma-3 shape (its layer pattern and window), as wide as the dense one.
    "hybrid": ARCHITECTURES["gemma3"]
    | _WIDE
    | {"initializer_range": ARCHITECTURES["gemma3"]["initializer_range"]},
}


def kv_per_token(cfg: dict[str, Any]) -> int:
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def describe(name: str, cfg: dict[str, Any]) -> str:
    shape = (
        f"{cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, float32, "
        f"{kv_per_token(cfg) // 1024} KiB of KV per token"
    )
    if "layer_types" in cfg:
        n_sw = cfg["layer_types"].count("sliding_attention")
        shape += f" ({n_sw} of the layers sliding-window {cfg['sliding_window']})"
    return f"{name}: {shape}"


@dataclass
class Stack:
    """One mode's servers: where to send a request, which /metrics to read, which processes to count."""

    mode: str
    port: int  # the router's (P/D) or the server's (aggregated)
    decode_port: int
    prefill_port: int | None = None
    sidecar_metrics: int | None = None  # the decode sidecar's
    procs: dict[str, list[psutil.Process]] = field(default_factory=dict)  # by role: "prefill server", ...

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of each role's processes."""
        out = {}
        for role, procs in self.procs.items():
            out[role] = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                    out[role] += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        return out

    def cpu_since(self, before: dict[str, float], n: int = 1) -> dict[str, float]:
        now = self.cpu_s()
        return {role: (now[role] - before[role]) / n for role in now}

    def counters(self) -> dict[str, float]:
        """The histogram sums and counts this mode's columns are differences of."""
        d = self.decode_port
        c = {
            "d_e2e_n": metric(d, "vllm:e2e_request_latency_seconds_count"),
            "d_e2e": metric(d, "vllm:e2e_request_latency_seconds_sum"),
            "d_ttft": metric(d, "vllm:time_to_first_token_seconds_sum"),
            "d_queue": metric(d, "vllm:request_queue_time_seconds_sum"),
        }
        if self.prefill_port is not None:
            c["p_e2e"] = metric(self.prefill_port, "vllm:e2e_request_latency_seconds_sum")
            c["p_e2e_n"] = metric(self.prefill_port, "vllm:e2e_request_latency_seconds_count")
        if self.mode == "NixlConnector":
            c["xfer"] = metric(d, "vllm:nixl_xfer_time_seconds_sum")
            c["xfer_n"] = metric(d, "vllm:nixl_xfer_time_seconds_count")
            c["bytes"] = metric(d, "vllm:nixl_bytes_transferred_sum")
            c["desc"] = metric(d, "vllm:nixl_num_descriptors_sum")
        if self.sidecar_metrics is not None:  # the kv-sidecar modes (Bench._start sets it for each)
            if self.mode == "kv-sidecar-batch":
                c["batch_pulls"] = metric(self.sidecar_metrics, "kvsidecar_pull_batch_pulls_sum")
                c["batch_calls"] = metric(self.sidecar_metrics, "kvsidecar_pull_batch_pulls_count")
            c["xfer"] = metric(self.sidecar_metrics, "kvsidecar_pull_duration_seconds_sum")
            c["xfer_n"] = metric(self.sidecar_metrics, "kvsidecar_pull_duration_seconds_count")
            c["bytes"] = metric(self.sidecar_metrics, "kvsidecar_pull_bytes_total")
            c["desc"] = metric(self.sidecar_metrics, "kvsidecar_nixl_descriptors_per_transfer_sum")
        return c

    def settled(self, before: dict[str, float], n: int, timeout_s: float = 10) -> dict[str, float]:
        """Counters once the servers have recorded n more requests (vLLM records a request's stats as it
        answers it, not necessarily before the client has read the answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            after = self.counters()
            done = all(after[k] >= before[k] + n for k in ("d_e2e_n", "p_e2e_n", "xfer_n") if k in after)
            if done or time.monotonic() > deadline:
                return after
            time.sleep(0.05)


def splits(stack: Stack, before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """Per-request server-side columns (means over n requests) from two counter snapshots."""
    per = {k: (after[k] - before[k]) / n for k in after}
    out = {"ttft": per["d_ttft"], "decode": per["d_e2e"], "queue": per["d_queue"]}
    if "p_e2e" in per:
        out["prefill"] = per["p_e2e"]
    if "xfer" in per:
        out |= {"xfer": per["xfer"], "bytes": per["bytes"], "desc": per["desc"]}
    if "batch_calls" in per:
        out |= {"batch_pulls": per["batch_pulls"], "batch_calls": per["batch_calls"]}
    return out


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Bench:
    def __init__(self, name: str, cfg: dict[str, Any], tmp: str, args: argparse.Namespace) -> None:
        self.name, self.cfg, self.args = name, cfg, args
        self.hybrid = "layer_types" in cfg
        self.model = write_weights(f"{tmp}/{name}", cfg)
        self.log = open(f"{tmp}/{name}-servers.log", "wb")  # noqa: SIM115 (closed in stop())
        print(f"{name}: server logs in {self.log.name}", flush=True)
        longest = max(args.lengths) + args.max_tokens
        # Room for one burst of the longest prompt, with blocks to spare (a hybrid model's groups round up).
        kv_bytes = max(max(args.concurrency, 1) * (longest + 4 * BLOCK) * kv_per_token(cfg), 64 << 20)
        cores = os.cpu_count()
        if cores is None:
            raise RuntimeError(
                "os.cpu_count() does not know this machine's cores: cannot bind the servers' threads"
            )
        server_kw: dict[str, Any] = {
            # vLLM's CPU auto-binding gives an engine without a connector one OpenMP thread on 2 cores (it
            # keeps a core for the engine core process, and one more with a connector, which here leaves
            # it nothing to keep and so both): bind every server's threads alike.
            "env": {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"},
            "hybrid": self.hybrid,
            "max_model_len": longest,
            "kv_cache_bytes": kv_bytes,
            "block_size": BLOCK,
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sidecars: list[SidecarProcess] = []
        try:
            self._start(server_kw)
        except BaseException:
            self.stop()  # a server that failed to start must not leave the others running
            raise

    def _start(self, server_kw: dict[str, Any]) -> None:
        """Start the servers, sidecars and routers of the modes asked for (all at once: they boot in
        parallel) and wait for them."""
        name, model, log = self.name, self.model, self.log
        servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}

        def server(key: str, kv: dict[str, Any] | None, env: dict[str, str] | None = None) -> None:
            port = free_port()
            kw = server_kw | {"env": server_kw["env"] | (env or {})}
            servers[key] = (api_server(model, port, log, kv, **kw), port)

        if "aggregated" in MODES:
            server("agg", None)
        if "NixlConnector" in MODES:
            server("np", NIXL_KV_CONFIG, nixl_env())
            server("nd", NIXL_KV_CONFIG, nixl_env())
        pairs: dict[str, tuple[SidecarProcess, SidecarProcess]] = {}
        for mode, r in SIDECAR_MODES.items():
            if mode not in MODES:
                continue
            sp, sd = SidecarProcess(f"{name}-{r}-prefill-node"), SidecarProcess(f"{name}-{r}-decode-node")
            self.sidecars += [sp, sd]
            pairs[mode] = sp, sd
            decode_kv = sidecar_kv_config(sd.socket, "decode")
            if mode == "kv-sidecar-batch":
                decode_kv["kv_connector_extra_config"]["pull_batch"] = True
            server(f"{r}p", sidecar_kv_config(sp.socket, "prefill"))
            server(f"{r}d", decode_kv)
        self.procs += [p for p, _ in servers.values()]
        routers = {}
        for r in ("n", *SIDECAR_MODES.values()):
            if f"{r}p" in servers:
                port = free_port()
                routers[r] = (router(servers[f"{r}p"][1], servers[f"{r}d"][1], port, log), port)
                self.procs.append(routers[r][0])
        t0 = time.monotonic()
        for proc, port in servers.values():
            wait_http(f"http://127.0.0.1:{port}/health", proc, 900)
        print(f"{name}: {len(servers)} servers up in {time.monotonic() - t0:.0f} s", flush=True)

        def tree(*pids: int) -> list[psutil.Process]:
            out = []
            for pid in pids:
                ps = psutil.Process(pid)
                out += [ps, *ps.children(recursive=True)]  # the API server, its engine core and worker
            return out

        def pd(r: str) -> dict[str, Any]:
            (pp, pport), (dp, dport), (rp, rport) = servers[f"{r}p"], servers[f"{r}d"], routers[r]
            procs = {"prefill server": tree(pp.pid), "decode server": tree(dp.pid), "router": tree(rp.pid)}
            return {"port": rport, "decode_port": dport, "prefill_port": pport, "procs": procs}

        self.stacks = {}
        if "aggregated" in MODES:
            agg, port = servers["agg"]
            self.stacks["aggregated"] = Stack("aggregated", port, port, procs={"server": tree(agg.pid)})
        if "NixlConnector" in MODES:
            self.stacks["NixlConnector"] = Stack("NixlConnector", **pd("n"))
        for mode, (sp, sd) in pairs.items():
            st = self.stacks[mode] = Stack(mode, sidecar_metrics=sd.metrics_port, **pd(SIDECAR_MODES[mode]))
            st.procs["sidecars"] = tree(sp.proc.pid, sd.proc.pid)
        # Every stack once (NixlConnector's first request also makes its handshake), then each stack's CPU
        # while nothing is asked of it: a process that polls costs the machine's other stacks too.
        for mode in MODES:
            self.request(mode, prompt(64, 7))
        time.sleep(2)
        cpu0 = {m: st.cpu_s() for m, st in self.stacks.items()}
        time.sleep(IDLE_S)
        self.idle = {m: st.cpu_since(cpu0[m], 1) for m, st in self.stacks.items()}
        self.idle = {m: {r: v / IDLE_S for r, v in d.items()} for m, d in self.idle.items()}
        print(f"{name}: idle cores {self.idle}", flush=True)

    def stop(self) -> None:
        stop(self.procs)
        for s in self.sidecars:
            s.stop()
        # vLLM ends its workers with SIGTERM, which skips their exit hooks: free their KV caches in /dev/shm.
        for label in ("prefill-r0", "decode-r0"):
            remove_orphans(label)
        self.log.close()

    def request(self, mode: str, tokens: list[int]) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = complete(self.stacks[mode].port, self.model, tokens, max_tokens=self.args.max_tokens)
        return time.perf_counter() - t0, out

    def one_at_a_time(self, n: int, seed: int, iters: int) -> dict[str, Any]:
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        differ = 0
        for i in range(-1, iters):  # i == -1: warm-up, not counted
            tokens = prompt(n, seed + i)
            outs = {}
            for mode in rotated(i):
                st = self.stacks[mode]
                before, cpu0 = st.counters(), st.cpu_s()
                lat, outs[mode] = self.request(mode, tokens)
                after = st.settled(before, 1)
                if i >= 0:
                    cpu = sum(st.cpu_since(cpu0).values())
                    samples[mode].append({"client": lat, "cpu": cpu, **splits(st, before, after, 1)})
            differ += i >= 0 and len({tuple(o) for o in outs.values()}) > 1
        return {"samples": samples, "differ": differ, "n": iters}

    def concurrent(self, n: int, seed: int, turn: int) -> dict[str, Any]:
        """`turn`: where the rotation of the stacks' order starts (the row's index), so that with one
        round per row the first place still goes to each stack in turn."""
        k = self.args.concurrency
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        walls: dict[str, list[float]] = {m: [] for m in MODES}
        means: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        cpu: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        differ = 0
        with ThreadPoolExecutor(k) as pool:
            for r in range(self.args.rounds):
                prompts = [prompt(n, seed + 1000 * r + j) for j in range(k)]
                outs: dict[str, list[list[int]]] = {}
                for mode in rotated(turn + r):
                    st = self.stacks[mode]
                    before, cpu0 = st.counters(), st.cpu_s()
                    t0 = time.perf_counter()
                    results = list(pool.map(lambda t, m=mode: self.request(m, t), prompts))
                    walls[mode].append(time.perf_counter() - t0)
                    after = st.settled(before, k)
                    outs[mode] = [o for _, o in results]
                    samples[mode] += [{"client": lat} for lat, _ in results]
                    cpu[mode].append(st.cpu_since(cpu0, k))
                    means[mode].append({"cpu": sum(cpu[mode][-1].values()), **splits(st, before, after, k)})
                differ += sum(len({tuple(outs[m][j]) for m in MODES}) > 1 for j in range(k))
        return {
            "samples": samples,
            "walls": walls,
            "means": means,
            "cpu": cpu,
            "differ": differ,
            "n": k * self.args.rounds,
        }


def rotated(i: int) -> list[str]:
    j = i % len(MODES)
    return [*MODES[j:], *MODES[:j]]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def ms(x: float | None) -> str:
    return "—" if x is None else (f"{x * 1e3:.0f} ms" if x >= 0.1 else f"{x * 1e3:.1f} ms")


def col(rows: list[dict[str, float]], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return med(vals) if vals else None


def ratio_cell(s: dict[str, list[dict[str, float]]], mode: str) -> str:
    """A kv-sidecar mode's client p50 over NixlConnector's."""
    if mode not in SIDECAR_MODES or mode not in s or "NixlConnector" not in s:
        return ""
    return f"{med([x['client'] for x in s[mode]]) / med([x['client'] for x in s['NixlConnector']]):.2f}"


def batch_row(
    model: str, n: int, kind: str, s: dict[str, list[dict[str, float]]], m: dict[str, list[dict[str, float]]]
) -> list[str]:
    """kv-sidecar-batch against kv-sidecar in one row: client p50 and arrival -> KV ready ratios, and the
    pulls per PullBatch call. `s`: the client samples, `m`: the server-side columns, by mode."""
    if "kv-sidecar-batch" not in s or "kv-sidecar" not in s:
        return []
    b, k = "kv-sidecar-batch", "kv-sidecar"
    client = med([x["client"] for x in s[b]]) / med([x["client"] for x in s[k]])
    qb, qk = col(m[b], "queue"), col(m[k], "queue")
    queue = f"{qb / qk:.2f}" if qb is not None and qk else "—"
    calls = sum(x.get("batch_calls", 0) for x in m[b])
    per_call = f"{sum(x.get('batch_pulls', 0) for x in m[b]) / calls:.1f}" if calls else "—"
    return [f"| {model} | {n} | {kind} | {client:.2f} | {queue} | {per_call} |"]


HEAD_BATCH = [
    "| model | prompt tokens | rows | client p50, batch / not | arrival -> KV ready, batch / not "
    "| pulls per PullBatch call |",
    "|---|---:|---|---:|---:|---:|",
]


def outputs_cell(res: dict[str, Any]) -> str:
    if len(MODES) < 2:
        return "—"
    return "equal" if res["differ"] == 0 else f"**{res['differ']} of {res['n']} differ**"


def table_one(model: str, n: int, res: dict[str, Any]) -> list[str]:
    s = res["samples"]
    outputs = outputs_cell(res)
    lines = []
    for mode in MODES:
        rows = s[mode]
        client = [x["client"] for x in rows]
        b = col(rows, "bytes")
        lines.append(
            f"| {model} | {n} | {mode} | {ms(med(client))} | {ms(p90(client))} "
            f"| {ratio_cell(s, mode)} | {ms(col(rows, 'prefill'))} "
            f"| {ms(col(rows, 'ttft'))} | {ms(col(rows, 'decode'))} "
            f"| {ms(col(rows, 'queue')) if mode != 'aggregated' else '—'} "
            f"| {ms(col(rows, 'xfer'))} | {'—' if b is None else f'{b / 2**20:.2f} MiB'} "
            f"| {'—' if b is None else round(col(rows, 'desc') or 0)} "
            f"| {col(rows, 'cpu') or 0:.2f} s | {outputs if mode == MODES[-1] else ''} |"
        )
    return lines


def table_burst(model: str, n: int, res: dict[str, Any]) -> list[str]:
    s, w, m = res["samples"], res["walls"], res["means"]
    outputs = outputs_cell(res)
    lines = []
    for mode in MODES:
        client = [x["client"] for x in s[mode]]
        lines.append(
            f"| {model} | {n} | {mode} | {ms(med(client))} | {ms(p90(client))} | {ms(med(w[mode]))} "
            f"| {ratio_cell(s, mode)} | {ms(col(m[mode], 'prefill'))} "
            f"| {ms(col(m[mode], 'ttft'))} | {ms(col(m[mode], 'decode'))} "
            f"| {ms(col(m[mode], 'queue')) if mode != 'aggregated' else '—'} "
            f"| {ms(col(m[mode], 'xfer'))} | {col(m[mode], 'cpu') or 0:.2f} s "
            f"| {outputs if mode == MODES[-1] else ''} |"
        )
    return lines


HEAD_ONE = [
    "| model | prompt tokens | mode | client p50 | client p90 | kv-sidecar / Nixl (p50) | prefill | decode TTFT "
    "| decode | arrival -> KV ready | transfer | KV bytes | NIXL descriptors | CPU / request | outputs |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
]
HEAD_BURST = [
    "| model | prompt tokens | mode | client p50 | client p90 | wall (all N) | kv-sidecar / Nixl (p50) | prefill (mean) "
    "| decode TTFT (mean) | decode (mean) | arrival -> KV ready (mean) | transfer (mean) | CPU / request "
    "| outputs |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
]


def cpu_table(rows: list[tuple[str, int, str, dict[str, float]]]) -> list[str]:
    roles = ["server", "prefill server", "decode server", "sidecars", "router"]
    lines = [
        "| model | prompt tokens | mode | " + " | ".join(roles) + " | all |",
        "|---|---:|---|" + "---:|" * 6,
    ]
    for model, n, mode, d in rows:
        cells = " | ".join(f"{d[r]:.2f} s" if r in d else "" for r in roles)
        lines.append(f"| {model} | {n} | {mode} | {cells} | {sum(d.values()):.2f} s |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="dense,hybrid", help=f"comma separated, of {', '.join(MODELS)}")
    ap.add_argument("--tokens", default="64,512,2048,4096", help="prompt lengths, comma separated")
    ap.add_argument("--iters", type=int, default=6, help="requests per mode per one-at-a-time row")
    ap.add_argument("--iters-long", type=int, default=3, help="--iters for prompts of 2048 tokens or more")
    ap.add_argument("--rounds", type=int, default=1, help="bursts per mode per concurrent row")
    ap.add_argument(
        "--concurrency", type=int, default=8, help="requests at once in a concurrent row (0: none)"
    )
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma separated, of {', '.join(ALL_MODES)} (default: the first three)",
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    global MODES
    MODES = tuple(m for m in ALL_MODES if m in args.modes.split(","))
    if not MODES:
        ap.error(f"--modes: choose from {', '.join(ALL_MODES)}")
    args.lengths = [int(x) for x in args.tokens.split(",")]
    names = [m for m in args.models.split(",") if m]
    if not names or any(m not in MODELS for m in names):
        ap.error(f"--models: choose from {', '.join(MODELS)}")
    tmp = tempfile.mkdtemp(prefix="vllm-pd-bench-")
    one: list[str] = []
    burst: list[str] = []
    burst_cpu: list[tuple[str, int, str, dict[str, float]]] = []
    batched: list[str] = []
    idle: list[str] = []
    started = time.monotonic()
    for name in names:
        bench = Bench(name, MODELS[name], tmp, args)
        try:
            idle.append(
                f"{name}: "
                + ", ".join(f"{m} {sum(d.values()):.2f}" for m, d in bench.idle.items())
                + " ("
                + "; ".join(
                    f"{m}: " + ", ".join(f"{r} {v:.2f}" for r, v in d.items())
                    for m, d in bench.idle.items()
                    if len(d) > 1
                )
                + ")"
            )
            for turn, n in enumerate(args.lengths):
                res = bench.one_at_a_time(n, seed=n, iters=args.iters if n < 2048 else args.iters_long)
                one += table_one(name, n, res)
                batched += batch_row(name, n, "one at a time", res["samples"], res["samples"])
                print("\n".join(one[-len(MODES) :]), flush=True)
                if args.concurrency:
                    res = bench.concurrent(n, seed=10**6 + n, turn=turn)
                    burst += table_burst(name, n, res)
                    batched += batch_row(name, n, f"{args.concurrency} at once", res["samples"], res["means"])
                    for mode in MODES:
                        rounds = res["cpu"][mode]
                        burst_cpu.append((name, n, mode, {r: med([x[r] for x in rounds]) for r in rounds[0]}))
                    print("\n".join(burst[-len(MODES) :]), flush=True)
        finally:
            bench.stop()
    tables = "One at a time:\n\n" + "\n".join(HEAD_ONE + one)
    if burst:
        head = [HEAD_BURST[0].replace("all N", f"all {args.concurrency}"), HEAD_BURST[1]]
        tables += f"\n\n{args.concurrency} requests at once:\n\n" + "\n".join(head + burst)
        tables += (
            f"\n\nCPU per request in the {args.concurrency}-at-once rows, by process (API servers with their "
            "engine core and worker processes; both sidecars together):\n\n" + "\n".join(cpu_table(burst_cpu))
        )
    if batched:
        tables += (
            "\n\nkv-sidecar-batch against kv-sidecar (the decode connector's `pull_batch` on and off), in the same "
            "rows:\n\n" + "\n".join(HEAD_BATCH + batched)
        )
    tables += (
        f"\n\nCPU of each stack while no request runs (cores, over {IDLE_S:.0f} s after warm-up): "
        + "; ".join(idle)
        + "."
    )
    print(tables)
    if args.no_write:
        return
    load = os.getloadavg()
    body = (
        f"Command: `.venv-vllm/bin/python bench/vllm_pd.py --models {','.join(names)} --tokens {args.tokens} "
        f"--iters {args.iters} --iters-long {args.iters_long} --rounds {args.rounds} "
        f"--concurrency {args.concurrency} --max-tokens {args.max_tokens} --modes {','.join(MODES)}` "
        f"(vllm-cpu {version('vllm-cpu')}, nixl {version('nixl')}; "
        + "; ".join(describe(n, MODELS[n]) for n in names)
        + f"; block {BLOCK}; seeded random weights as tests/vllm/models.py writes them).  \n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"date: {datetime.date.today().isoformat()}; {(time.monotonic() - started) / 60:.0f} min; load average "
        f"at the end {load[0]:.1f}. One at a time: medians of {args.iters} requests per mode "
        f"({args.iters_long} from 2048 tokens) after one warm-up. {args.concurrency} at once: {args.rounds} "
        "burst(s) per mode, medians over their requests, server-side columns as means over a burst.\n\n"
        + tables
        + "\n\n"
        + ABOUT
        + "\n"
    )
    # A run of other modes than the default is a section of its own: it leaves the main table alone.
    title = (
        TITLE
        if MODES == DEFAULT_MODES
        else f"P/D through vLLM's API servers: {', '.join(MODES)} (bench/vllm_pd.py)"
    )
    write_section(ROOT / "docs" / "benchmarks.md", title, body)


def version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
