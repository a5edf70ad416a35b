"""Node scaling: pulls/s, GB/s and their tail as GPU pairs and pulls in flight grow (issue 32).

One sidecar per node must feed every GPU of the node. Each row runs P pairs of engines, each engine its
own process (the reference engine, `python -m kv_sidecar.refengine`), C pulls in flight per pair:

  gpu-staged   prefill engines on sidecar A, decode engines on sidecar B (the staged protocol)
  gpu-direct   every engine on sidecar A (a CUDA IPC copy inside one sidecar)
  host-nixl    host memory, decode engine on sidecar B (B READs from A over NIXL)
  host-direct  host memory, decode engine on sidecar A
  host-ring    host memory, decode engine on a sidecar with host_transfer: ring (the staged protocol)

GPU pair i runs prefill GPU 2i -> decode GPU 2i+1 where there are 2P GPUs; on 2 GPUs, pair 1 is the
reverse of pair 0 (GPU1 -> GPU0), so that both GPUs carry a data plane at once. A row: each prefill
engine publishes N requests of B blocks from a few filled source requests (not timed); then every
decode engine pulls its N with C threads, all pairs starting at one instant, each pull into blocks of
its own. pulls/s and GB/s are all pairs' pulls and bytes over the wall time from that instant to the
last pull's end; p50/p99 are the engines' pull() calls. After the row every byte of every pull is
checked against its seed, and every prefill engine must get exactly N "consumed" events. Each
process's CPU over the row is reported (100 % = one core), a sidecar's child processes (device_workers)
beside it: a load bench must show that it is not itself the bottleneck it measures.

--per-call K also runs this tree with each decode thread sending K pulls in one PullBatch call, the
same pulls in flight as C Pull calls (C/K threads), side by side; its p50/p99 are the batch calls'.
--per-call 16,8 runs both: 16 in flight as one batch, or as two batches of 8 that overlap (a decode
engine whose requests arrive at different steps has several batches in flight).
--bad-every N also runs every tree's calls (this tree's Pull and PullBatch calls, a baseline's) with
every Nth pull of each pair naming a request its source does not hold, beside the same calls without
("this tree, 1 in N failing";
issue 32's "a failing pull fails only itself" under load): it must fail, with no "consumed" event for it,
while every other pull arrives exact; pulls, rates and latencies count the others, and the bytes
column says how the bad ones failed and whether their blocks kept their bytes (a failed pull names its
blocks unfilled and may have written them: host-nixl READs before the source's open answers,
server/lease_view.py).
--beside decode|matmuls keeps every decode GPU busy throughout with another process (bench/gpu_share.py
--load: decode-step-shaped work, or matmuls back to back), a stand-in for the decode engine's own work,
which the sidecars' copies take turns with on the GPU unless CUDA MPS is on (the section says which).
--prefix-blocks K has the decode engine hold the first K blocks of each request already, as a prefix
cache hit would, and pull only the rest (start_token); sizes and GB/s are then of what moved.

With --baseline REV (or --baseline-tree DIR: a `git archive` of REV's sidecar/ and client/, where there
is no git) the same rows also run against that revision's sidecars, started beside this tree's, rows
interleaved, the order of the two trees alternating: only ratios measured side by side mean anything.
Where two copies of one tree differ (an A/A run: gpu-direct 64 MiB PullBatches of 16 on 2x H200 read
0.87x, docs/benchmarks.md, twenty-fifth session), --baseline-first starts the baseline's processes first,
and --rounds N runs each row N times, the trees' order alternating, and gives each ratio's median and
range over the rounds: the spread that one round's ratio must clear to mean anything.
--profile DIR records both sidecars with py-spy (raw collapsed stacks) during the rows at the most
pulls in flight, for one pull size. py-spy shows wall time here (a thread asleep in a lock or a sleep
counts as busy); with --profile-gil only samples of the thread holding the GIL, which is where a
sidecar bound by its one interpreter spends it (any Python version). --cpu-profile DIR shows CPU:
this tree's sidecars run every thread under cProfile timed by the thread's own CPU clock
(bench/cpu_sampler/, Python 3.11 only), over all their rows, into
DIR/<path>.<pid>.sidecar (with --per-call, the PullBatch tree's into DIR/<path>-batch.<pid>.sidecar);
read one with `python -m pstats FILE` (sort tottime, stats 40). Those rows are marked and left out of
ratios.

    python bench/node_scaling.py --paths host-nixl,host-direct --baseline 2b8f1ac   # the CPU machine
    python bench/node_scaling.py --paths gpu-staged,gpu-direct --pairs 1,2 --out $OUT  # a GPU machine
    python bench/node_scaling.py --splice $OUT/node_scaling_gpu_section.md            # into docs/
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_sidecar.plan.spec import EngineSpec, rank_block_bytes
from kv_sidecar.refengine import scrape
from kv_sidecar.refengine.procs import (
    EngineProcess,
    SidecarProcess,
    cpu_ticks,
    descendants,
    side_by_side,
    together,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline
import latency
from gpu_share import mps_state
from report import gpus, quantile, write_section

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
TITLES = {
    "gpu": "Node scaling, GPU paths (bench/node_scaling.py)",
    "host": "Node scaling, host paths (bench/node_scaling.py)",
}
HERE = Path(__file__).resolve().parent
HZ = os.sysconf("SC_CLK_TCK")
MIB = 1 << 20
# A model-shaped rank: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks = 2 MiB a block. The
# decode caches hold 16 GiB, so that every pull of a row lands in blocks of its own.
GPU_SPEC = EngineSpec.from_dict(
    {
        "tp_size": 1,
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
        "block_size": 16,
        "num_blocks": 8192,
        "layout": "flash_attn_nhd",
    }
)
# bench/latency.py's one-block rank (256 KiB a block), 512 blocks a decode cache.
HOST_SPEC = dataclasses.replace(latency.SPEC, num_blocks=512)
PATHS = {
    "gpu-staged": "prefill engines on sidecar A, decode engines on sidecar B (the staged protocol)",
    "gpu-direct": "every engine on sidecar A (one sidecar copies between its engines' GPUs)",
    "host-nixl": "decode engine on sidecar B, which READs from A over NIXL",
    "host-direct": "decode engine on sidecar A",
    "host-ring": "decode engine on sidecar B with host_transfer: ring (the staged protocol)",
}
# host-ring's rings: 16 slots of 1 MiB, so that 16 pulls in flight each hold one.
RING = ["--host-transfer", "ring", "--gpu-staging-bytes", str(2 * 16 * MIB), "--gpu-staging-slots", "16"]


def source_count(blocks: int) -> int:
    """Filled source requests per pull size: enough distinct contents to catch a pull landing another
    pull's bytes, few enough to fill quickly (filling is block by block, in Python)."""
    return 64 if blocks == 1 else 8


# What each process on a GPU takes besides its caches (its CUDA context; a sidecar's rings): enough to
# tell a run that cannot fit from one that can.
PROCESS_GPU_BYTES = 1 << 30


def gpu_free_bytes() -> dict[int, int]:
    """Each GPU's free memory from nvidia-smi ({} where it cannot say, or where CUDA_VISIBLE_DEVICES
    renumbers the GPUs): asked of torch, it would cost this process a CUDA context on every GPU, memory
    the engines need."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return {int(i): int(mib) << 20 for i, mib in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def check_gpu_memory(
    places: list[tuple[int, int]], trees: int, sizes: list[int], decode_blocks: int, free: dict[int, int]
) -> None:
    """Every tree's engines and sidecars live at once: refuse, naming --decode-blocks, a run whose
    caches cannot fit the GPUs' free memory (engines ran out of memory part way through, otherwise)."""
    decode = dataclasses.replace(GPU_SPEC, num_blocks=decode_blocks or GPU_SPEC.num_blocks)
    block = decode.rank_bytes() // decode.num_blocks
    prefill_blocks = sum(b * source_count(b) for b in sizes)
    need: dict[int, int] = {}
    for p, d in places:
        need[p] = need.get(p, 0) + prefill_blocks * block + 2 * PROCESS_GPU_BYTES  # an engine, a sidecar
        need[d] = need.get(d, 0) + decode.num_blocks * block + 2 * PROCESS_GPU_BYTES
    for gpu, per_tree in sorted(need.items()):
        if gpu in free and trees * per_tree > free[gpu]:
            spare = free[gpu] // trees - (per_tree - decode.num_blocks * block)
            fits = max(0, spare // block) if spare > 0 else 0
            raise SystemExit(
                f"GPU {gpu}: {trees} trees (this tree, its variants and baselines, each with engines of "
                f"its own) need ~{trees * per_tree / 2**30:.0f} GiB, {free[gpu] / 2**30:.0f} GiB is free; "
                f"run fewer trees or pass --decode-blocks {fits // 1024 * 1024 or fits} or less"
            )


def gpu_pairs(count: int, gpus_present: int) -> list[tuple[int, int]]:
    """(prefill GPU, decode GPU) of each pair: disjoint GPUs where there are enough, else the two
    directions between GPU 0 and 1; on a machine of one GPU, one pair within it (the copy crosses no
    link, so its rows show the control plane's pulls/s, not a link's bandwidth)."""
    if gpus_present >= 2 * count:
        return [(2 * i, 2 * i + 1) for i in range(count)]
    if gpus_present >= 2 and count <= 2:
        return [(0, 1), (1, 0)][:count]
    if gpus_present == 1 and count == 1:
        return [(0, 0)]
    raise SystemExit(
        f"{count} GPU pairs need {2 * count} GPUs (or 2 for two pairs); this machine has {gpus_present}"
    )


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """CPU ticks of each of a process's threads: {tid: (native name, ticks)}."""
    out: dict[int, tuple[str, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[int(tid)] = (name, cpu_ticks(pid, int(tid)))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def child_ticks(pid: int) -> dict[int, int]:
    """CPU ticks of every process below `pid` (device_workers' workers, multiprocessing's helpers)."""
    out: dict[int, int] = {}
    for kid in descendants(pid):
        with contextlib.suppress(OSError):
            out[kid] = cpu_ticks(kid)
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """{native tid: Python thread name} from `py-spy dump` where py-spy is there (else {}): Python's
    threads all carry the process's native name, so only this tells the NIXL thread from a gRPC
    handler. Pool threads lose their number ("peer_3" -> "peer"), so that a pool adds up."""
    try:
        dump = subprocess.run(["py-spy", "dump", "-p", str(pid)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for m in re.finditer(r'^Thread (\d+) \(\w+\): "(.*)"', dump.stdout, re.MULTILINE):
        name = m.group(2)
        names[int(m.group(1))] = "nixl" if name.startswith("nixl-") else re.sub(r"[_-]\d+$", "", name)
    return names


def thread_cpu(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], names: dict[int, str], span: float
) -> dict[str, float]:
    """% of one core by thread (Python name where known, else native name), threads that ran."""
    out: dict[str, float] = {}
    for tid, (native, ticks) in after.items():
        used = ticks - before.get(tid, (native, 0))[1]
        if used > 0:
            key = names.get(tid, native)
            out[key] = out.get(key, 0.0) + 100.0 * used / HZ / span
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


@dataclass
class Row:
    tree: str
    path: str
    pairs: int
    concurrency: int
    blocks: int
    block_bytes: int
    pulls: int
    wall_s: float
    lat_s: list[float]
    cpu: dict[str, float]  # process -> % of one core over the row
    threads: dict[str, dict[str, float]]  # sidecar -> thread name -> % of one core (threads that ran)
    verified: bool
    consumed: int
    paths: dict[str, int]
    errors: list[str]
    profiled: str = ""  # the profiler that ran on the sidecars: slower, not comparable with other rows
    prefix: int = 0  # blocks of each pull the decode engine holds already (a prefix cache hit)
    short: int = 0  # tokens each pull's request is short of whole blocks (its last block partial)
    block_tokens: int = 16  # tokens a block holds
    # Staged transfers the decode sidecar received over the row and the reads they carried (groups:
    # staged_group_reads); None where its tree has no such metric or the path is not staged.
    transfers: tuple[int, int] | None = None
    # Pulls meant to fail (--bad-every), left out of pulls, rates and latencies; their status codes.
    bad: int = 0
    bad_codes: dict[str, int] = dataclasses.field(default_factory=dict)
    bad_untouched: bool = True  # their blocks kept their bytes (a failed pull may write them: early READs)
    round: int = 0  # which of --rounds repeats of the row (0: the first, or the only one)

    @property
    def rate(self) -> float:
        return self.pulls / self.wall_s if self.wall_s else 0.0

    @property
    def moved(self) -> int:
        """Blocks each pull moves: those past the prefix."""
        return self.blocks - self.prefix

    @property
    def gbps(self) -> float:
        return self.pulls * self.pull_bytes / self.wall_s / 1e9 if self.wall_s else 0.0

    @property
    def pull_bytes(self) -> int:
        """Bytes each pull moves: its blocks past the prefix, less the tokens its last block lacks."""
        whole = self.moved * self.block_bytes
        return whole - whole * self.short // (self.moved * self.block_tokens) if self.short else whole

    def pct(self, q: float) -> float:
        return 1e3 * quantile(self.lat_s, q, empty=0.0)

    def cpu_of(self, prefix: str) -> float:
        """The busiest process whose name starts with prefix."""
        return max((v for k, v in self.cpu.items() if k.startswith(prefix)), default=0.0)


# The decode sidecar's histogram of reads per staged transfer (its _count: transfers, _sum: reads).
GROUP_METRIC = "kvsidecar_staged_transfer_reads"


def staged_transfers(metrics_port: int) -> tuple[int, int] | None:
    """(transfers, reads) a sidecar's staged receptions counted so far; None if it has no such metric."""
    values: dict[str, float] = {}
    for s in scrape.samples(metrics_port):  # summed over shards (control_shards: a sample per shard)
        if s.name.startswith(GROUP_METRIC):
            values[s.name] = values.get(s.name, 0.0) + s.value
    if GROUP_METRIC + "_count" not in values:
        return None
    return int(values[GROUP_METRIC + "_count"]), int(values[GROUP_METRIC + "_sum"])


def _all_transfers(sidecars: list[SidecarProcess]) -> tuple[int, int] | None:
    """staged_transfers summed over the decode sidecars (several where each pair has its own)."""
    counts = [staged_transfers(s.metrics_port) for s in sidecars]
    if any(c is None for c in counts):
        return None
    return sum(c[0] for c in counts if c), sum(c[1] for c in counts if c)


def _transfers_between(
    before: tuple[int, int] | None, after: tuple[int, int] | None
) -> tuple[int, int] | None:
    if before is None or after is None:
        return None
    return after[0] - before[0], after[1] - before[1]


class Node:
    """One tree's sidecars and engines for one path: a prefill and a decode engine per pair."""

    def __init__(
        self,
        tree: str,
        env: dict[str, str] | None,
        path: str,
        pairs: list[tuple[int, int]] | None,
        sizes: list[int],
        extra: list[str] | None = None,
        decode_blocks: int = 0,
        per_call: int = 1,
        prefix: int = 0,
        split: bool = False,
        bad_every: int = 0,
        short: int = 0,
    ) -> None:
        """per_call: pulls each decode engine thread sends in one PullBatch call (1: Pull calls); prefix:
        blocks of each pull the decode engine holds already, which it pulls past (start_token); split:
        each GPU pair its own sidecars (what a process per GPU could reach at most), not the node's;
        bad_every N: every Nth pull of a pair names a request its source does not hold, and must fail
        alone (its blocks unchanged, no "consumed" event); short: tokens each request is short of whole
        blocks."""
        self.tree, self.path, self.per_call, self.prefix = tree, path, per_call, prefix
        self.short = short
        self.bad_every = bad_every
        self.profiler = "cProfile" if env and "KVS_CPU_PROFILE" in env else ""
        self.on_gpu = path.startswith("gpu-")
        decode_spec = GPU_SPEC if self.on_gpu else HOST_SPEC
        if decode_blocks:
            decode_spec = dataclasses.replace(decode_spec, num_blocks=decode_blocks)
        # The prefill cache holds the source requests of every size, one after another.
        self.sources: dict[int, list[tuple[list[int], int]]] = {}
        offset = 0
        for b in sizes:
            self.sources[b] = [
                (list(range(offset + k * b, offset + (k + 1) * b)), 1000 * b + k)
                for k in range(source_count(b))
            ]
            offset += b * source_count(b)
        prefill_spec = dataclasses.replace(decode_spec, num_blocks=offset)
        self.spec = decode_spec
        tag = f"{'this' if tree.startswith('this tree') else 'base'}-{path}"
        two = path in ("gpu-staged", "host-nixl", "host-ring")
        b_extra = (RING if path == "host-ring" else []) + (extra or [])
        places = pairs if self.on_gpu and pairs else [(-1, -1)]
        sets = len(places) if split else 1
        sidecars = together(
            *[
                m
                for k in range(sets)
                for m in (
                    lambda k=k: SidecarProcess(f"a{k}-{tag}", extra=extra, env=env),
                    *([lambda k=k: SidecarProcess(f"b{k}-{tag}", extra=b_extra, env=env)] if two else []),
                )
            ]
        )
        per_set = 2 if two else 1
        # Pair i's sidecars: A (its prefill engine's) and B (its decode engine's; A on same-sidecar paths).
        self.pair_sidecars = [
            (sidecars[per_set * (i % sets)], sidecars[per_set * (i % sets) + per_set - 1])
            for i in range(len(places))
        ]
        self.a, self.b = self.pair_sidecars[0]

        def engine(sock: str, name: str, spec: EngineSpec, gpu: int) -> EngineProcess:
            return EngineProcess(
                sock, name, spec, devices=[f"cuda:{gpu}"] if gpu >= 0 else None, start_timeout_s=180
            )

        makers = []
        for i, (p, d) in enumerate(places):
            sa, sb = self.pair_sidecars[i]
            makers.append(lambda i=i, p=p, sa=sa: engine(sa.socket, f"p{i}-{tag}", prefill_spec, p))
            makers.append(lambda i=i, d=d, sb=sb: engine(sb.socket, f"d{i}-{tag}", decode_spec, d))
        engines = together(*makers)
        self.prefill, self.decode = engines[0::2], engines[1::2]
        for pe in self.prefill:
            for b in sizes:
                for ids, seed in self.sources[b]:
                    got = pe.send(
                        {
                            "cmd": "prefill",
                            "block_ids": ids,
                            "num_tokens": b * decode_spec.block_size - short,  # as they are pulled
                            "seed": seed,
                            "publish": False,
                        },
                        timeout_s=600,
                    )
                    assert got["ok"], got
        self.batches = 0

    def capacity(self, blocks: int) -> int:
        return self.spec.num_blocks // (blocks - self.prefix)

    def run(
        self,
        pairs: int,
        concurrency: int,
        blocks: int,
        pulls: int,
        profile: Path | None = None,
        spy_gil: bool = False,
    ) -> Row:
        self.batches += 1
        pulls = min(pulls, self.capacity(blocks))
        tokens = blocks * self.spec.block_size - self.short
        moved, start = blocks - self.prefix, self.prefix * self.spec.block_size
        items: list[list[dict[str, Any]]] = []
        for i in range(pairs):
            sources = [self.sources[blocks][k % len(self.sources[blocks])] for k in range(pulls)]
            published = self.prefill[i].send(
                {
                    "cmd": "publish_batch",
                    "prefix": f"b{self.batches}-{i}-",
                    "block_ids": [ids for ids, _ in sources],
                    "num_tokens": tokens,
                    "lease_ms": LEASE_MS,
                },
                timeout_s=600,
            )
            assert published["ok"], published
            items.append(
                [
                    {
                        "params": p,
                        "block_ids": list(range(k * moved, (k + 1) * moved)),
                        "seed": seed,
                        "start_token": start,
                    }
                    for k, (p, (_, seed)) in enumerate(zip(published["params"], sources, strict=True))
                ]
            )
            for k in range(self.bad_every - 1, pulls, self.bad_every) if self.bad_every else ():
                # A request its source does not hold (released, or never published there): it must fail.
                item = items[i][k]
                item["params"] = dict(item["params"], request_id=f"{item['params']['request_id']}-gone")
                item["expect_error"] = True
        bad = pulls // self.bad_every if self.bad_every else 0
        good = pulls - bad
        procs: dict[str, Any] = {}
        for i, (a, b) in enumerate(self.pair_sidecars[:pairs]):
            if a is self.a and i:
                break  # one set of sidecars for every pair (not split)
            # Split: pair i's as "sidecar A i", its CPU in the table the busiest A's (and B's).
            procs[f"sidecar A{f' {i}' if i else ''}"] = a
            if b is not a:
                procs[f"sidecar B{f' {i}' if i else ''}"] = b
        decoders = list(dict.fromkeys(b for _, b in self.pair_sidecars[:pairs]))
        for i in range(pairs):
            procs[f"prefill {i}"] = self.prefill[i]
            procs[f"decode {i}"] = self.decode[i]
        spies = (
            _spy(profile, procs, f"{self.tree}-{self.path}-{pairs}x{concurrency}", spy_gil) if profile else []
        )
        sidecars = {name: p.proc.pid for name, p in procs.items() if name.startswith("sidecar")}
        before_threads = {name: thread_ticks(pid) for name, pid in sidecars.items()}
        before = {name: cpu_ticks(p.proc.pid) for name, p in procs.items()}
        before_kids = {name: child_ticks(pid) for name, pid in sidecars.items()}
        staged = self.path in ("gpu-staged", "host-ring")
        transfers_before = _all_transfers(decoders) if staged else None
        # The engines look at a bad pull's blocks before it (a digest: ~0.5 GB/s), then start together.
        start_at = time.time() + 0.2 + bad * moved * rank_block_bytes(self.spec) / 0.5e9
        per_call = min(self.per_call, concurrency)  # 4 in flight with batches of 16: batches of 4
        for i in range(pairs):  # every pair's batch starts at start_at
            self.decode[i].post(
                {
                    "cmd": "pull_batch",
                    "items": items[i],
                    # The same pulls in flight: `concurrency` Pull calls, or fewer PullBatch calls of per_call.
                    "concurrency": max(1, concurrency // per_call),
                    **({"per_call": per_call} if per_call > 1 else {}),
                    "num_tokens": tokens,
                    "start_token": start,
                    "start_at": start_at,
                }
            )
        got = [json.loads(self.decode[i].readline(900)) for i in range(pairs)]
        after = {name: cpu_ticks(p.proc.pid) for name, p in procs.items()}
        after_kids = {name: child_ticks(pid) for name, pid in sidecars.items()}
        after_threads = {name: thread_ticks(pid) for name, pid in sidecars.items()}
        span = max(time.time() - start_at, 1e-9)
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
        wall = max(g.get("t_end", start_at) for g in got) - start_at
        errors = [e for g in got for e in (g.get("errors") or ([g["error"]] if "error" in g else []))]
        checked = [self.decode[i].send({"cmd": "verify_batch"}, timeout_s=900) for i in range(pairs)]
        errors += [e for c in checked for e in c["errors"]]
        consumed = sum(
            self.prefill[i].send(
                {"cmd": "count_events", "kind": "consumed", "expect": good, "timeout_s": 20}, timeout_s=60
            )["count"]
            for i in range(pairs)
        )
        bad_codes: dict[str, int] = {}
        for g in got:
            for code, n in g.get("bad", {}).get("codes", {}).items():
                bad_codes[code] = bad_codes.get(code, 0) + n
        # verify_batch says (an older tree's engine: pull_batch's answer).
        bad_untouched = all(
            c.get("bad_untouched", g.get("bad", {}).get("untouched", True))
            for g, c in zip(got, checked, strict=True)
        )
        transfers = _transfers_between(transfers_before, _all_transfers(decoders) if staged else None)
        paths: dict[str, int] = {}
        for g in got:
            for k, v in g.get("paths", {}).items():
                paths[k] = paths.get(k, 0) + v
        return Row(
            tree=self.tree,
            path=self.path,
            pairs=pairs,
            concurrency=concurrency,
            blocks=blocks,
            block_bytes=rank_block_bytes(self.spec),
            pulls=good * pairs,
            wall_s=wall,
            lat_s=[x for g in got for x in g.get("lat", [])],
            cpu={name: 100.0 * (after[name] - before[name]) / HZ / span for name in procs}
            | {
                # A decode engine's own count over its pulls: the ticks above also hold its looks at the
                # failing pulls' blocks before them (an older tree's engine: after them too).
                f"decode {i}": 100.0 * g["cpu_s"] / max(g["wall_s"], 1e-9)
                for i, g in enumerate(got)
                if "cpu_s" in g
            }
            | {
                # A sidecar's child processes (device_workers), over the row: a worker started during it
                # counts from zero, one that exited is not counted.
                f"{name} children": 100.0
                * sum(t - before_kids[name].get(k, 0) for k, t in after_kids[name].items())
                / HZ
                / span
                for name in sidecars
                if after_kids[name]
            }
            | {
                # ... and the busiest of them (staged_workers: a GPU's worker carries its transfers).
                f"{name} busiest child": 100.0
                * max(t - before_kids[name].get(k, 0) for k, t in after_kids[name].items())
                / HZ
                / span
                for name in sidecars
                if after_kids[name]
            },
            threads={
                name: thread_cpu(before_threads[name], after_threads[name], python_thread_names(pid), span)
                for name, pid in sidecars.items()
            },
            verified=all(g.get("ok") for g in got)
            and all(c["ok"] and c["checked"] == good for c in checked)
            and sum(bad_codes.values()) == bad * pairs,
            consumed=consumed,
            paths=paths,
            errors=errors[:10],
            profiled="py-spy" if profile is not None else self.profiler,
            prefix=self.prefix,
            short=self.short,
            block_tokens=self.spec.block_size,
            transfers=transfers,
            bad=bad * pairs,
            bad_codes=bad_codes,
            bad_untouched=bad_untouched,
        )

    def close(self) -> None:
        """The engines, then the sidecars, each group side by side."""
        side_by_side(*(e.stop for e in (*self.prefill, *self.decode)))
        sidecars = {id(s): s for pair in self.pair_sidecars for s in pair}
        side_by_side(*(s.stop for s in sidecars.values()))


# A row's requests are all published before its first pull: under py-spy (which stops the sidecars
# hundreds of times a second) 6,000 pulls a pair took longer than the default 30 s lease, and the last
# ones failed with FAILED_PRECONDITION (lease expired), as they must (2026-11-30).
LEASE_MS = 600_000


def _spy(out: Path, procs: dict[str, Any], label: str, gil: bool) -> list[subprocess.Popen[bytes]]:
    """py-spy on each sidecar until SIGINT: raw collapsed stacks, one file per process."""
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, p in procs.items():
        if name.startswith("sidecar"):
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{label}-{name}")
            spies.append(
                subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "-p",
                        str(p.proc.pid),
                        "-r",
                        "500",
                        "-f",
                        "raw",
                        "-o",
                        str(out / f"{safe}.txt"),
                        *(["--gil"] if gil else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    time.sleep(1.0)  # py-spy attaches before the row starts
    return spies


def size_label(row: Row) -> str:
    size = row.moved * row.block_bytes
    label = f"{size // MIB} MiB" if size >= MIB else f"{size // 1024} KiB"
    if row.short:
        label += f" less {row.short} token{'s' if row.short > 1 else ''}"
    return f"{label} past a {row.prefix}-block prefix" if row.prefix else label


def _own_cpu(r: Row, name: str) -> list[float]:
    """The CPU % of each sidecar of that role (one, or one per pair), their child processes left out."""
    return [
        v
        for k, v in r.cpu.items()
        if k == name or (k.startswith(f"{name} ") and not k.endswith(("children", "child")))
    ]


def _sidecar_cpu(r: Row, name: str) -> str:
    """A sidecar's CPU % (the busiest of that role where each pair has its own), and its child
    processes' (device_workers) where it has any."""
    kids = r.cpu.get(f"{name} children")
    busiest = r.cpu.get(f"{name} busiest child")
    cpu = max(_own_cpu(r, name))
    if kids is None:
        return f"{cpu:.0f}"
    most = f", the busiest {busiest:.0f}" if busiest is not None and busiest < kids - 0.5 else ""
    return f"{cpu:.0f} (+{kids:.0f} in child processes{most})"


def table(rows: list[Row]) -> str:
    out = [
        "| path | pairs | in flight per pair | pull | sidecars | pulls | pulls/s | GB/s | p50 ms | p99 ms | "
        "p99/p50 | CPU % sidecar A / B | CPU % busiest prefill / decode engine | reads per transfer | bytes | "
        "consumed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = _sidecar_cpu(r, "sidecar B") if "sidecar B" in r.cpu else "-"
        p50 = r.pct(0.5)
        out.append(
            f"| {r.path} | {r.pairs} | {r.concurrency} | {size_label(r)} | {r.tree}{_round(r)}{f' ({r.profiled})' if r.profiled else ''} | "
            f"{r.pulls} | {r.rate:.0f} | "
            f"{r.gbps:.1f} | {p50:.2f} | {r.pct(0.99):.2f} | {r.pct(0.99) / p50 if p50 else 0:.1f} | "
            f"{_sidecar_cpu(r, 'sidecar A')} / {b} | {r.cpu_of('prefill'):.0f} / {r.cpu_of('decode'):.0f} | "
            f"{_per_transfer(r)} | {'verified' if r.verified else '**FAILED**'}{_bad(r)} | {r.consumed}/{r.pulls} |"
        )
    return "\n".join(out)


def _round(r: Row) -> str:
    return f", round {r.round + 1}" if r.round else ""


def _bad(r: Row) -> str:
    """The pulls meant to fail: how they failed (each alone: verified says the rest arrived, the failed
    ones' blocks unchanged)."""
    if not r.bad:
        return ""
    codes = ", ".join(f"{n} {code}" for code, n in sorted(r.bad_codes.items()))
    kept = "their blocks unchanged" if r.bad_untouched else "their blocks written (named unfilled)"
    return f"; {r.bad} bad: {codes or 'none failed'}, {kept}"


def _per_transfer(r: Row) -> str:
    """Reads per staged transfer over the row (and the transfers): how the reads that waited grouped."""
    if r.transfers is None or not r.transfers[0]:
        return "-"
    n, reads = r.transfers
    return f"{reads / n:.1f} ({n})"


def _reference(tree: str) -> str:
    """The row of this tree a row of `tree` compares with: the same kind of call (Pull calls, or
    PullBatch calls of as many pulls) with as many failing pulls; this tree's own rows: its PullBatch
    rows with its Pull calls, its rows with failing pulls with the same calls without."""
    batch = re.search(r", PullBatch of \d+", tree)
    fail = re.search(r", 1 in \d+ failing", tree)
    calls = batch.group(0) if batch else ""
    mine = "this tree" + calls + (fail.group(0) if fail else "")
    if tree != mine:
        return mine
    return "this tree" + calls if fail else "this tree"


def cpu_ms_per_pull(r: Row, name: str) -> float | None:
    """A sidecar's CPU per pull over the row, ms (its process and child processes; the busiest of that
    role where each pair has its own): the work a pull costs it, which bounds pulls/s once the sidecar
    is busy (on the CPU machine it varied between rounds as the rate did). It includes the NIXL thread's
    polling, which costs per second, not per pull. None where the row has no such sidecar."""
    own = _own_cpu(r, name)
    if not own or not r.pulls:
        return None
    pct = max(own) + r.cpu.get(f"{name} children", 0.0)
    return pct / 100.0 * r.wall_s / r.pulls * 1e3


def _cpu_ratio(r: Row, b: Row, name: str) -> float | None:
    mine, theirs = cpu_ms_per_pull(r, name), cpu_ms_per_pull(b, name)
    return mine / theirs if mine is not None and theirs else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _over_rounds(v: list[float]) -> str:
    return f"{statistics.median(v):.2f}x | {min(v):.2f}-{max(v):.2f}x" if v else "- | -"


def ratios(rows: list[Row]) -> str:
    """Every other tree's (baseline, variants) pulls/s against this tree's, row by row (same run,
    machine), the same kind of call against the same (Pull calls, PullBatch), round by round, with each
    sidecar's CPU per pull (cpu_ms_per_pull); with --rounds, each comparison's median and range over the
    rounds after them: the spread that a single round's ratio sits in."""
    rows = [r for r in rows if not r.profiled]
    by_key = {(r.tree, r.path, r.pairs, r.concurrency, r.blocks, r.round): r for r in rows}
    lines = []
    spread: dict[tuple[str, str, str, int, int, str], tuple[list[float], list[float], list[float]]] = {}
    for b in rows:
        if b.tree == "this tree":
            continue
        ref = _reference(b.tree)
        r = by_key.get((ref, b.path, b.pairs, b.concurrency, b.blocks, b.round))
        if r is not None and b.rate:
            cpu_a, cpu_b = _cpu_ratio(r, b, "sidecar A"), _cpu_ratio(r, b, "sidecar B")
            lines.append(
                f"| {r.path} | {r.pairs} | {r.concurrency} | {size_label(r)} | {ref}{_round(r)} | {b.tree} | "
                f"{r.rate / b.rate:.2f}x | {r.pct(0.5) / b.pct(0.5) if b.pct(0.5) else 0:.2f}x | "
                f"{r.pct(0.99) / b.pct(0.99) if b.pct(0.99) else 0:.2f}x | {_x(cpu_a)} / {_x(cpu_b)} |"
            )
            key = (r.path, ref, b.tree, r.pairs, r.concurrency, size_label(r))
            rates, cpus_a, cpus_b = spread.setdefault(key, ([], [], []))
            rates.append(r.rate / b.rate)
            if cpu_a is not None:
                cpus_a.append(cpu_a)
            if cpu_b is not None:
                cpus_b.append(cpu_b)
    if not lines:
        return ""
    head = (
        "| path | pairs | in flight per pair | pull | this tree | against | pulls/s, this tree / it | p50 | p99 | "
        "CPU a pull, sidecar A / B |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = head + "\n".join(lines) + "\n"
    if any(len(v[0]) > 1 for v in spread.values()):
        body += (
            "\nOver the rounds (this tree / it: pulls/s; each sidecar's CPU a pull, lower is less work):\n\n"
            "| path | pairs | in flight per pair | pull | this tree | against | rounds | pulls/s median | range | "
            "CPU a pull, A median | range | B median | range |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(
                f"| {path} | {pairs} | {c} | {size} | {ref} | {other} | {len(v[0])} | "
                f"{_over_rounds(v[0])} | {_over_rounds(v[1])} | {_over_rounds(v[2])} |"
                for (path, ref, other, pairs, c, size), v in spread.items()
            )
            + "\n"
        )
    return body


def scaling(rows: list[Row]) -> str:
    """Each row with more than one pair against the same tree's one-pair row."""
    rows = [r for r in rows if not r.profiled]
    one = {(r.tree, r.path, r.concurrency, r.blocks, r.round): r for r in rows if r.pairs == 1}
    lines = []
    for r in rows:
        o = one.get((r.tree, r.path, r.concurrency, r.blocks, r.round))
        if r.pairs > 1 and o is not None and o.rate:
            lines.append(
                f"| {r.path} | {r.tree}{_round(r)} | {r.concurrency} | {size_label(r)} | {r.pairs} | "
                f"{r.rate / o.rate:.2f}x |"
            )
    if not lines:
        return ""
    return (
        "| path | sidecars | in flight per pair | pull | pairs | pulls/s against one pair |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {gpus()}, Python {platform.python_version()}"


def start_loads(work: str, devices: set[int]) -> list[subprocess.Popen[bytes]]:
    """A process per decode GPU that keeps it busy as an engine would (`bench/gpu_share.py --load`), for
    the whole run, its set-up included: the sidecars' copies take turns with it unless MPS is on."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "gpu_share.py"),
                "--load",
                work,
                "--load-s",
                "86400",
                "--device",
                str(d),
            ]
        )
        for d in sorted(devices)
    ]
    time.sleep(5)  # their contexts up and their loops running before the first sidecar starts
    if any(p.poll() is not None for p in procs):
        raise SystemExit(f"a --beside {work} load exited at its start")
    return procs


def beside_text(work: str, places: list[tuple[int, int]]) -> str:
    what = {
        "decode": "decode-step-shaped work (64 short bf16 matmuls, a wait for their end, 0.5 ms of host time)",
        "matmuls": "8192 x 8192 bf16 matmuls back to back",
    }[work]
    devices = sorted({d for _, d in places})
    gpus_text = ", ".join(f"GPU{d}" for d in devices)
    return (
        f"Beside the pairs: on {gpus_text} another process runs {what} throughout "
        f"(`bench/gpu_share.py --load {work}`), a stand-in for the decode engine's own work; CUDA MPS "
        f"{mps_state(devices[0])}.  \n"
    )


def render(
    rows: list[Row], kind: str, places: list[tuple[int, int]] | None, cut: bool = False, beside: str = ""
) -> str:
    """The section: command, machine, date, the rows, and the ratios measured side by side."""
    rows = sorted(
        rows, key=lambda r: (r.path, r.blocks, r.pairs, r.concurrency, r.round, r.tree != "this tree")
    )
    places_text = ""
    if places:
        places_text = (
            "GPU pairs (prefill -> decode): " + ", ".join(f"GPU{p} -> GPU{d}" for p, d in places) + ".  \n"
        )
        if any(p == d for p, d in places):
            places_text += (
                "Both engines of a pair on one GPU: no link is crossed, GB/s is not a link's; the two sidecars "
                "(and device workers) take turns on the GPU by time slices, which staged rows pay "
                "(bench/gpu_share.py).  \n"
            )
        if beside:
            places_text += beside_text(beside, places)
    command = " ".join(["python", "bench/node_scaling.py", *sys.argv[1:]])
    body = (
        (f"**Cut short: {len(rows)} rows, the run did not finish.**\n\n" if cut else "")
        + f"Command: `{command}`  \nMachine: {machine()}  \nDate: {datetime.date.today().isoformat()}  \n"
        f"{places_text}\n"
        + (
            "A model-shaped rank on GPU: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks = 2 MiB a block. "
            if kind == "gpu"
            else "A host rank: 4 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks = 256 KiB a block. "
        )
        + "Each engine is its own process; each pair's decode engine pulls with its own threads, all pairs "
        "starting together. pulls/s and GB/s: all pairs' pulls over the wall time from the common start "
        "to the last pull's end; p50/p99: the engines' pull() calls. CPU: each process's user+system "
        "time over the row (100 % = one core; for engines, the busiest). reads per transfer: staged paths, "
        "the reads each staged transfer the decode sidecar received carried on average over the row "
        "(above 1: reads that waited went as one, staged_group_reads), with the transfers in brackets. "
        "bytes: every byte of every pull "
        'checked against its seed after the row; consumed: the prefill engines\' "consumed" events.\n\n'
        + table(rows)
        + "\n"
    )
    if r := ratios(rows):
        body += "\nThis tree against the others, same run:\n\n" + r
    if s := scaling(rows):
        body += "\nMore pairs against one pair, same tree and run:\n\n" + s
    return body


def save(out: Path, kind: str, rows: list[Row], body: str) -> None:
    """The section and the rows' JSON under `out` (rewritten after every row)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"node_scaling_{kind}_section.md").write_text(body)
    (out / f"node_scaling_{kind}.json").write_text(
        json.dumps([dataclasses.asdict(r) | {"rate": r.rate, "gbps": r.gbps} for r in rows], indent=1)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="host-nixl,host-direct", help=f"comma-separated, of {sorted(PATHS)}")
    ap.add_argument("--pairs", default="1", help="GPU pairs per row, comma-separated (GPU paths)")
    ap.add_argument("--concurrency", default="1,4,16", help="pulls in flight per pair, comma-separated")
    ap.add_argument(
        "--blocks", default="", help="blocks per pull, comma-separated (default: GPU 1,32; host 1)"
    )
    ap.add_argument(
        "--pulls", type=int, default=0, help="pulls per pair and row (default: GPU 2048, host 300)"
    )
    ap.add_argument(
        "--prefix-blocks",
        type=int,
        default=0,
        help="blocks of each pull the decode engine holds already (a prefix cache hit): it pulls the rest, "
        "from that token on (this tree only: older reference engines pull from token 0)",
    )
    ap.add_argument(
        "--short-tokens",
        type=int,
        default=0,
        help="each pull's request this many tokens short of whole blocks (its last block partial), as "
        "real prompts are: a copy whose row count is not a multiple of 16 ran at half bandwidth until "
        "2026-11-29 (bench/kernel_compiles.py)",
    )
    ap.add_argument(
        "--bad-every",
        type=int,
        default=0,
        help="also run every tree's calls (this tree's, a baseline's) with every Nth pull of each pair naming a "
        "request its source does not hold: it must fail alone while the others arrive",
    )
    ap.add_argument(
        "--decode-blocks",
        type=int,
        default=0,
        help="blocks of each decode cache (default: GPU 8192, host 512); a row's pulls land in blocks of "
        "their own, so it has at most this / --blocks pulls",
    )
    ap.add_argument("--baseline", default="", help="also run this git revision's sidecars, side by side")
    ap.add_argument(
        "--baseline-tree", default="", help="a directory holding another revision's sidecar/ and client/"
    )
    ap.add_argument(
        "--sidecar-args", default="", help="more `kv-sidecar serve` options for this tree's sidecars"
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="also run this tree's sidecars with these more options, side by side (repeatable)",
    )
    ap.add_argument(
        "--variant-per-call",
        action="store_true",
        help="with --per-call: the variants send PullBatch calls of that many pulls too",
    )
    ap.add_argument(
        "--per-call",
        default="1",
        help="also run this tree with each decode thread sending this many pulls in one PullBatch call "
        "(in flight per pair stays the same: fewer threads), side by side; comma-separated for several "
        "(the first is the variants' and the baseline's)",
    )
    ap.add_argument(
        "--batches-only",
        action="store_true",
        help="with --per-call: leave out this tree's rows of Pull calls (the targets' rows are PullBatches; on "
        "a GPU machine whose calls are limited in time they took a third of a run, 2026-11-30)",
    )
    ap.add_argument(
        "--split-sidecars",
        action="store_true",
        help="also run this tree with each GPU pair on sidecars of its own, side by side: what one process "
        "per GPU could reach at most, against one sidecar for the node",
    )
    ap.add_argument(
        "--baseline-per-call",
        action="store_true",
        help="with --per-call and a baseline: the baseline's PullBatch rows too (a baseline from before "
        "PullBatch, 2026-11-27, has none)",
    )
    ap.add_argument(
        "--baseline-first",
        action="store_true",
        help="start the baseline's sidecars and engines before this tree's, not after: run against a copy of "
        "this tree (an A/A run), with and without, it tells whether the order of start-up favours a tree",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every row N times, the trees' order alternating from round to round, and give each "
        "comparison's median and range over the rounds: a row of 64 MiB pulls moves a decode cache's "
        "worth (16 GiB) in ~0.1 s, and one round's ratio is that short a sample",
    )
    ap.add_argument("--profile", type=Path, help="py-spy both sidecars at the most pulls in flight, into DIR")
    ap.add_argument(
        "--profile-gil",
        action="store_true",
        help="with --profile: only samples of threads holding the GIL (where a GIL-bound sidecar's time goes)",
    )
    ap.add_argument(
        "--cpu-profile",
        type=Path,
        help="cProfile (thread CPU time) this tree's sidecars over every row, into DIR",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="write the section and the rows' JSON into DIR (not into docs/), after every row: a run cut short keeps its rows",
    )
    ap.add_argument(
        "--beside",
        choices=["decode", "matmuls"],
        help="GPU paths: another process keeps each decode GPU busy throughout (bench/gpu_share.py --load), "
        "as its engine would; run it under CUDA MPS or not to compare",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--splice", type=Path, help="write this section file into docs/benchmarks.md and exit")
    args = ap.parse_args()
    if args.splice:
        kind = "gpu" if "gpu" in args.splice.name else "host"
        write_section(DOCS, TITLES[kind], args.splice.read_text())
        return 0
    paths = [p for p in args.paths.split(",") if p]
    if unknown := set(paths) - set(PATHS):
        ap.error(f"unknown paths {sorted(unknown)}")
    on_gpu = {p.startswith("gpu-") for p in paths}
    if len(on_gpu) != 1:
        ap.error("GPU and host paths run in separate invocations (separate sections)")
    kind = "gpu" if on_gpu.pop() else "host"
    levels = [int(c) for c in args.concurrency.split(",") if c]
    pair_counts = [int(c) for c in args.pairs.split(",") if c] if kind == "gpu" else [1]
    sizes = [int(b) for b in (args.blocks or ("1,32" if kind == "gpu" else "1")).split(",") if b]
    pulls = args.pulls or (2048 if kind == "gpu" else 300)
    if args.bad_every == 1 or args.bad_every < 0:
        ap.error("--bad-every needs N >= 2")
    if not 0 <= args.short_tokens < 16:  # both specs' blocks hold 16 tokens
        ap.error("--short-tokens must be less than a block's 16 tokens")
    if args.prefix_blocks and (min(sizes) <= args.prefix_blocks or args.baseline or args.baseline_tree):
        ap.error("--prefix-blocks needs pulls of more blocks (--blocks), and runs this tree's variants only")
    places: list[tuple[int, int]] | None = None
    if kind == "gpu":
        import torch

        places = gpu_pairs(max(pair_counts), torch.cuda.device_count())
    extra = args.sidecar_args.split()
    mine: dict[str, str] | None = None
    if args.cpu_profile:
        args.cpu_profile.mkdir(parents=True, exist_ok=True)
        sampler = str(Path(__file__).resolve().parent / "cpu_sampler")
        mine = {
            "PYTHONPATH": os.pathsep.join(p for p in (sampler, os.environ.get("PYTHONPATH", "")) if p),
            "KVS_CPU_PROFILE": str(args.cpu_profile.resolve() / "{path}"),
        }
    trees: list[tuple[str, dict[str, str] | None, list[str], int, bool, int]] = [
        ("this tree", mine, extra, 1, False, 0)
    ]
    batches = [k for k in (int(c) for c in args.per_call.split(",") if c) if k > 1]
    first_batch = batches[0] if batches else 1
    for k in batches:
        suffix = "-batch" if k == first_batch else f"-batch{k}"
        batch_env = mine and {key: v.replace("{path}", "{path}" + suffix) for key, v in mine.items()}
        trees.append((f"this tree, PullBatch of {k}", batch_env, extra, k, False, 0))
    for v in args.variant:  # the same code, other settings, in the same run
        if args.variant_per_call and first_batch > 1:
            trees.append(
                (
                    f"this tree, {v}, PullBatch of {first_batch}",
                    None,
                    extra + v.split(),
                    first_batch,
                    False,
                    0,
                )
            )
        else:
            trees.append((f"this tree, {v}", None, extra + v.split(), 1, False, 0))
    if args.split_sidecars:
        trees.append(("this tree, sidecars per GPU pair", None, extra, 1, True, 0))
    if args.batches_only:
        if first_batch == 1:
            ap.error("--batches-only needs --per-call K with K > 1")
        trees = [t for t in trees if t[0] != "this tree"]
    base: tuple[str, dict[str, str]] | None = None
    if args.baseline:
        base = (baseline.describe(args.baseline), baseline.env(baseline.export(args.baseline)))
    elif args.baseline_tree:
        tree = Path(args.baseline_tree)
        base = (f"baseline ({tree.name})", baseline.env(str(tree.resolve())))
    if base is not None:
        trees.append((base[0], base[1], [], 1, False, 0))
        if args.baseline_per_call and first_batch > 1:
            trees.append((f"{base[0]}, PullBatch of {first_batch}", base[1], [], first_batch, False, 0))
    if args.bad_every:  # every tree's calls again with failing pulls among them, beside them
        trees += [
            (
                f"{name}, 1 in {args.bad_every} failing",
                None if name.startswith("this tree") else env,  # this tree's profiles: clean rows only
                more,
                k,
                split,
                args.bad_every,
            )
            for name, env, more, k, split, _ in list(trees)
        ]
    if args.baseline_first and base is not None:  # sorted stably: each tree's rows keep their order
        trees.sort(key=lambda t: not t[0].startswith(base[0]))
    if places is not None and (free := gpu_free_bytes()):
        check_gpu_memory(places, len(trees), sizes, args.decode_blocks, free)
    if args.beside and places is None:
        ap.error("--beside keeps GPUs busy: GPU paths only")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    loads = start_loads(args.beside, {d for _, d in places}) if args.beside and places else []
    try:
        rows = run_rows(args, paths, trees, places, sizes, pair_counts, levels, pulls, kind)
    finally:
        for load in loads:
            load.kill()
            load.wait()
    body = render(rows, kind, places, beside=args.beside or "")
    print("\n" + body)
    if args.out:
        save(args.out, kind, rows, body)
    elif not args.no_write:
        write_section(DOCS, TITLES[kind], body)
    return 0 if all(r.verified and r.consumed == r.pulls for r in rows) else 1


def run_rows(
    args: argparse.Namespace,
    paths: list[str],
    trees: list[tuple[str, dict[str, str] | None, list[str], int, bool, int]],
    places: list[tuple[int, int]] | None,
    sizes: list[int],
    pair_counts: list[int],
    levels: list[int],
    pulls: int,
    kind: str,
) -> list[Row]:
    """Every row: per path, each tree's sidecars warmed up, then sizes x pairs x pulls in flight, the trees'
    order alternating from row to row."""
    rows: list[Row] = []
    turn = 0
    for path in paths:
        nodes = [
            Node(
                name,
                env and {k: v.replace("{path}", path) for k, v in env.items()},
                path,
                places,
                sizes,
                more,
                args.decode_blocks,
                per_call,
                args.prefix_blocks,
                split,
                bad,
                args.short_tokens,
            )
            for name, env, more, per_call, split, bad in trees
        ]
        try:
            for node in nodes:  # warm-up: handshakes, first touch of the caches and rings
                for b in sizes:
                    for p in range(max(pair_counts)):
                        node.run(p + 1, 1, b, 20)
                        if node.per_call > 1:  # and a batch's own launches (kernels built on first use)
                            node.run(p + 1, node.per_call, b, 2 * node.per_call)
            for b in sizes:
                for p in pair_counts:
                    for c, round_ in itertools.product(levels, range(args.rounds)):
                        spy = (
                            args.profile
                            if (args.profile and c == max(levels) and b == sizes[0] and not round_)
                            else None
                        )
                        order = nodes if turn % 2 == 0 else nodes[::-1]
                        turn += 1
                        for node in order:
                            row = dataclasses.replace(
                                node.run(p, c, b, pulls, spy, args.profile_gil), round=round_
                            )
                            rows.append(row)
                            print(table([row]).splitlines()[-1], flush=True)
                            if args.out:  # what is done so far survives a run cut short (a time limit)
                                save(
                                    args.out, kind, rows, render(rows, kind, places, True, args.beside or "")
                                )
                            print(f"  threads (CPU %): {row.threads}", flush=True)
                            if row.errors:
                                print(f"  errors: {row.errors}", file=sys.stderr, flush=True)
        finally:
            for node in nodes:
                node.close()
    return rows


if __name__ == "__main__":
    sys.exit(main())
