"""A TP engine pair's pulls in one sidecar process, or spread over one process per rank (issue 32).

`control_shard_ranks: spread` puts each rank of a TP engine on its own GPU's shard, a shard being a
sidecar process that the front door runs; between two engines spread over the same shards, each decode
rank copies the prefill rank beside it in its own process. A shard is a whole sidecar joined to the
others by the multi-node membership (docs/multinode.md), so this bench stands the shards up as that:
one sidecar per rank, rank 0's leading, each engine rank in a process of its own as vLLM's workers are.

  whole   one sidecar holds both engines, every rank (control_shard_ranks: whole, or no shards)
  spread  sidecar r holds rank r of both engines, rank 0's sidecar leading each engine

The prefill engine publishes N requests of B blocks (not timed); then every decode rank's process
pulls its rank of all N with C in flight (PullBatch calls of K members, or Pull calls), all ranks
starting at one instant. requests/s: N over the wall time from that instant to the last rank's last
pull; rank pulls/s: N times TP over it. Every byte of every pull is checked after the row, and every
prefill rank must hear "consumed" N times. Each sidecar's CPU is reported (100 % = one core). The
setups alternate their order round by round; only ratios within a run compare.

With --gpus G, prefill rank r sits on GPU r mod G and decode rank r on GPU (r + TP) mod G where G holds
both engines' ranks apart (G >= 2 TP), else on GPU r mod G beside its prefill rank: on 2 GPUs and TP 2,
rank r of both engines on GPU r, as `control_shard_gpus "0;1"` would group them; on 4, prefill on GPUs
0-1 and decode on 2-3, as "0,2;1,3" would. On one GPU (the default) every rank shares it, as a node's
ranks would not: what is measured is then the host side's work, which one process per rank splits.

    python bench/spread_ranks.py --gpu --gpus 2 --rounds 3 --out $OUT   # a GPU machine of 2 GPUs
    python bench/spread_ranks.py --pulls 128 --no-write              # this machine (host memory)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kv_sidecar.plan.spec import EngineSpec, rank_block_bytes
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, cpu_ticks, together

sys.path.insert(0, str(Path(__file__).resolve().parent))
import latency
from node_scaling import GPU_SPEC, HZ
from report import gpus, quantile, write_section

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
TITLE = "Spread ranks against whole (bench/spread_ranks.py)"
SOURCES = 16  # filled source requests the publishes reuse: distinct contents to catch a misplaced pull
LEASE_MS = 600_000


@dataclass
class Row:
    setup: str
    round: int
    requests: int
    wall_s: float
    lat_s: list[float]
    cpu: dict[str, float]
    verified: bool
    consumed: int
    paths: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def rate(self) -> float:
        return self.requests / self.wall_s

    def pct(self, q: float) -> float:
        return 1000 * quantile(self.lat_s, q, empty=0.0)


class Setup:
    """One arrangement's sidecars and engines: a prefill and a decode engine of TP `tp`."""

    def __init__(self, name: str, tp: int, spec: EngineSpec, blocks: int, n_gpus: int) -> None:
        """n_gpus: 0 for host memory, else how many GPUs the ranks are placed on (`rank_gpus`)."""
        self.name, self.tp, self.blocks = name, tp, blocks
        self.dspec = spec
        self.pspec = dataclasses.replace(spec, num_blocks=SOURCES * blocks)
        wait = ["--leader-wait-ms", "20000"]
        count = 1 if name == "whole" else tp
        self.sidecars = together(
            *[lambda k=k: SidecarProcess(f"{name}-{k}", extra=wait) for k in range(count)]
        )
        lead = self.sidecars[0].peer_address

        def engine(role: str, spec: EngineSpec, ranks: list[int]) -> EngineProcess:
            home = self.sidecars[0 if name == "whole" else ranks[0]]
            leader = "" if home is self.sidecars[0] else lead
            placed = rank_gpus(role == "d", tp, n_gpus) if n_gpus else None
            return EngineProcess(
                home.socket,
                f"{role}-{name}",
                spec,
                ranks=ranks,
                devices=[placed[r] for r in ranks] if placed else None,
                leader=leader,
                start_timeout_s=180,
            )

        # Prefill: one process for every rank (whole), or one per rank on its own sidecar (spread);
        # decode: one process per rank, as vLLM's workers are, either way.
        self.p_ranks = [list(range(tp))] if name == "whole" else [[r] for r in range(tp)]
        self.prefill = together(*[lambda r=r: engine("p", self.pspec, r) for r in self.p_ranks])
        self.decode = together(*[lambda r=r: engine("d", self.dspec, [r]) for r in range(tp)])
        self.tokens = blocks * spec.block_size
        for k in range(SOURCES):
            fill = {
                "cmd": "prefill",
                "block_ids": list(range(k * blocks, (k + 1) * blocks)),
                "num_tokens": self.tokens,
                "seed": 1000 + k,
                "publish": False,
            }
            for p in self.prefill:
                assert p.send(fill, timeout_s=600)["ok"]
        self.rounds = 0

    def run(self, pulls: int, concurrency: int, per_call: int) -> Row:
        self.rounds += 1
        published = self.prefill[0].send(
            {
                "cmd": "publish_batch",
                "prefix": f"r{self.rounds}-",
                "block_ids": [
                    list(range((k % SOURCES) * self.blocks, (k % SOURCES + 1) * self.blocks))
                    for k in range(pulls)
                ],
                "num_tokens": self.tokens,
                "lease_ms": LEASE_MS,
            },
            timeout_s=600,
        )
        assert published["ok"], published
        items = [
            {
                "params": p,
                "block_ids": list(range(k * self.blocks, (k + 1) * self.blocks)),
                "seed": 1000 + k % SOURCES,
            }
            for k, p in enumerate(published["params"])
        ]
        before = {s.name: cpu_ticks(s.proc.pid) for s in self.sidecars}
        start_at = time.time() + 0.3
        for d in self.decode:
            d.post(
                {
                    "cmd": "pull_batch",
                    "items": items,
                    "concurrency": max(1, concurrency // per_call),
                    **({"per_call": per_call} if per_call > 1 else {}),
                    "num_tokens": self.tokens,
                    "start_at": start_at,
                    "own_ranks": True,
                }
            )
        got = [json.loads(d.readline(900)) for d in self.decode]
        span = max(time.time() - start_at, 1e-9)
        cpu = {s.name: 100.0 * (cpu_ticks(s.proc.pid) - before[s.name]) / HZ / span for s in self.sidecars}
        wall = max(g["t_end"] for g in got) - start_at
        checked = [d.send({"cmd": "verify_batch"}, timeout_s=900) for d in self.decode]
        consumed = sum(
            p.send(
                {"cmd": "count_events", "kind": "consumed", "expect": pulls * n, "timeout_s": 30},
                timeout_s=60,
            )["count"]
            for p, n in zip(self.prefill, [len(r) for r in self.p_ranks], strict=True)
        )
        paths: Counter[str] = Counter()
        for g in got:
            paths.update(g.get("paths", {}))
        return Row(
            setup=self.name,
            round=self.rounds,
            requests=pulls,
            wall_s=wall,
            lat_s=[x for g in got for x in g["lat"]],
            cpu=cpu,
            verified=all(g["ok"] for g in got) and all(c["ok"] and c["checked"] == pulls for c in checked),
            consumed=consumed,
            paths=dict(paths),
            errors=[e for g in got for e in g.get("errors", [])][:5],
        )

    def close(self) -> None:
        for e in [*self.decode, *self.prefill]:
            e.stop()
        for s in self.sidecars:
            s.stop()


def rank_gpus(decode: bool, tp: int, n_gpus: int) -> list[str]:
    """Each rank's device: the engines' ranks apart where `n_gpus` holds both (decode after prefill),
    else rank r of either engine on GPU r mod `n_gpus`."""
    shift = tp if decode and n_gpus >= 2 * tp else 0
    return [f"cuda:{(r + shift) % n_gpus}" for r in range(tp)]


def placement(tp: int, n_gpus: int) -> str:
    if not n_gpus:
        return "host memory"
    prefill, decode = (", ".join(rank_gpus(d, tp, n_gpus)) for d in (False, True))
    return f"GPU memory: prefill ranks on {prefill}, decode ranks on {decode}"


def table(rows: list[Row], tp: int) -> str:
    out = [
        "| setup | round | requests | requests/s | rank pulls/s | p50 ms | p99 ms | CPU % per sidecar | paths | bytes | consumed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = " / ".join(f"{v:.0f}" for v in r.cpu.values())
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r.paths.items()))
        out.append(
            f"| {r.setup} | {r.round} | {r.requests} | {r.rate():,.0f} | {r.rate() * tp:,.0f} | {r.pct(0.5):.2f} | "
            f"{r.pct(0.99):.2f} | {cpu} | {paths} | {'verified' if r.verified else 'WRONG: ' + '; '.join(r.errors)} | "
            f"{r.consumed}/{r.requests * tp} |"
        )
    return "\n".join(out)


def ratios(rows: list[Row]) -> str:
    by_round: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_round.setdefault(r.round, {})[r.setup] = r
    got = [b["spread"].rate() / b["whole"].rate() for b in by_round.values() if {"spread", "whole"} <= set(b)]
    if not got:
        return ""
    each = ", ".join(f"{x:.2f}x" for x in got)
    return f"spread over whole, requests/s: {each} (median {statistics.median(got):.2f}x)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="GPU memory (else host memory)")
    ap.add_argument("--gpus", type=int, default=1, help="with --gpu: GPUs the ranks are placed on")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=1, help="blocks per pull")
    ap.add_argument("--pulls", type=int, default=1024, help="requests per round (each rank pulls each)")
    ap.add_argument("--concurrency", type=int, default=16, help="pulls in flight per decode rank")
    ap.add_argument("--per-call", type=int, default=16, help="pulls per PullBatch call (1: Pull calls)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the section here")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    if args.gpus < 1:
        ap.error("--gpus takes 1 or more")
    base = GPU_SPEC if args.gpu else dataclasses.replace(latency.SPEC, num_blocks=64)
    spec = dataclasses.replace(
        base, tp_size=args.tp, num_blocks=max(base.num_blocks, args.pulls * args.blocks)
    )
    n_gpus = args.gpus if args.gpu else 0
    setups = {name: Setup(name, args.tp, spec, args.blocks, n_gpus) for name in ("whole", "spread")}
    rows: list[Row] = []
    try:
        for k in range(args.rounds):
            order = ["whole", "spread"] if k % 2 == 0 else ["spread", "whole"]
            for name in order:
                rows.append(setups[name].run(args.pulls, args.concurrency, args.per_call))
                print(table(rows[-1:], args.tp).splitlines()[-1], flush=True)
    finally:
        for s in setups.values():
            s.close()
    rows.sort(key=lambda r: (r.round, r.setup))
    size = rank_block_bytes(spec) * args.blocks
    calls = f"PullBatch calls of {args.per_call}" if args.per_call > 1 else "Pull calls"
    body = "\n\n".join(
        [
            f"Command: `python bench/spread_ranks.py {' '.join(sys.argv[1:])}`  \n"
            f"Machine: {platform.machine()}, {gpus()}, Python {platform.python_version()}  \n"
            f"Date: {datetime.date.today().isoformat()}",
            f"TP {args.tp} → TP {args.tp}, {placement(args.tp, n_gpus)}, "
            f"{size / (1 << 20):g} MiB a rank's pull, {args.concurrency} in flight per decode rank as {calls}. "
            "whole: one sidecar; spread: a sidecar per rank, rank 0's leading (the shards of "
            "`control_shard_ranks: spread`). CPU: each sidecar process over the row.",
            table(rows, args.tp),
            ratios(rows),
        ]
    )
    print("\n" + body)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spread_ranks_section.md").write_text(body + "\n")
    if not args.no_write:
        write_section(DOCS, TITLE, body)
    ok = all(r.verified and r.consumed == r.requests * args.tp for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
