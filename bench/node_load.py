"""Node load on the host paths: pulls/s and their tail at 1, 4 and 16 pulls in flight, every byte checked.

Issue 32's item 6, the host half of "one sidecar per node must scale with the node". Two real sidecars
on loopback (A and B); every engine is its own process, as real engines are (the reference engine,
`python -m kv_sidecar.refengine`): a prefill engine on A, a decode engine on B (host-nixl: B READs from
A over NIXL) and one on A (host-direct: A copies between its own engines). A row: the prefill engine
publishes N one-block requests (not timed), then the decode engine pulls them with C threads, each
pull into blocks of its own; pulls/s is N over the wall time of those pulls, and every byte of every
pull is checked after the row (a check costs more than a small pull). Each process's CPU over the pull
command is reported (100 % = one core), so that the bench is seen not to be the bottleneck it
measures, and the prefill engine must receive exactly N "consumed" events.

With --baseline REV the same rows run against REV's sidecars (bench/baseline.py: `git archive` of its
sidecar and client), started beside this tree's, rows interleaved: on a shared machine only ratios
measured side by side mean anything.

    python bench/node_load.py                          # writes its section of docs/benchmarks.md
    python bench/node_load.py --baseline 2b8f1ac --no-write
    python bench/node_load.py --pulls 100 --concurrency 1,4 --paths host-nixl
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline
import latency
from report import write_section

# bench/latency.py's one-block rank (256 KiB a block), with 512 blocks (128 MiB a cache): a row's pulls
# each land in blocks of their own, checked after the row; the sources are the first SOURCES blocks,
# each filled from its own seed.
SPEC = dataclasses.replace(latency.SPEC, num_blocks=512)
TOKENS = SPEC.block_size  # one-block requests: what a pull costs, not how fast bytes move
SOURCES = 64
HZ = os.sysconf("SC_CLK_TCK")
PATHS = {
    "host-nixl": "decode engine on the other sidecar",
    "host-direct": "decode engine on the same sidecar",
    "host-ring": "decode engine on a third sidecar with host_transfer: ring (the staged protocol)",
}
# The ring sidecar's rings: 16 slots of 1 MiB, so that 16 pulls in flight each hold one.
RING = [
    "--host-transfer",
    "ring",
    "--gpu-staging-bytes",
    str(2 * 16 * (1 << 20)),
    "--gpu-staging-slots",
    "16",
]


def cpu_ticks(pid: int) -> int:
    """User + system time of a process, in clock ticks (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@dataclass
class Row:
    tree: str
    path: str
    concurrency: int
    pulls: int
    rate: float
    p50_ms: float
    p99_ms: float
    cpu: dict[str, float]  # process -> % of one core over the pull command's span
    verified: bool
    consumed: int
    paths: dict[str, int]


class Node:
    """One tree's two sidecars and its three engines."""

    def __init__(self, tree: str, env: dict[str, str] | None) -> None:
        self.tree = tree
        self.a = SidecarProcess(f"load-a-{len(tree)}", env=env)
        self.b = SidecarProcess(f"load-b-{len(tree)}", env=env)
        self.c = SidecarProcess(f"load-c-{len(tree)}", extra=RING, env=env)
        tag = "base" if env else "this"
        self.prefill = EngineProcess(self.a.socket, f"p-{tag}", SPEC)
        self.decode = {
            "host-nixl": EngineProcess(self.b.socket, f"d-{tag}", SPEC),
            "host-direct": EngineProcess(self.a.socket, f"ds-{tag}", SPEC),
            "host-ring": EngineProcess(self.c.socket, f"dr-{tag}", SPEC),
        }
        for block in range(SOURCES):  # each source block holds its own seed's tokens
            got = self.prefill.send(
                {
                    "cmd": "prefill",
                    "block_ids": [block],
                    "num_tokens": TOKENS,
                    "seed": block,
                    "publish": False,
                }
            )
            assert got["ok"], got
        self.batches = 0

    def run(self, path: str, concurrency: int, pulls: int) -> Row:
        self.batches += 1
        if pulls > SPEC.num_blocks:
            raise ValueError(f"at most {SPEC.num_blocks} pulls a row: each lands in a block of its own")
        sources = [[i % SOURCES] for i in range(pulls)]
        published = self.prefill.send(
            {
                "cmd": "publish_batch",
                "prefix": f"b{self.batches}-",
                "block_ids": sources,
                "num_tokens": TOKENS,
            }
        )
        assert published["ok"], published
        items = [
            {"params": p, "block_ids": [i], "seed": s[0]}
            for i, (p, s) in enumerate(zip(published["params"], sources, strict=True))
        ]
        decode = self.decode[path]
        procs = {
            "sidecar A": self.a,
            "sidecar B": self.c if path == "host-ring" else self.b,  # the reading sidecar, another than A
            "prefill engine": self.prefill,
            "decode engine": decode,
        }
        before = {name: cpu_ticks(p.proc.pid) for name, p in procs.items()}
        t0 = time.perf_counter()
        got = decode.send(
            {"cmd": "pull_batch", "items": items, "concurrency": concurrency, "num_tokens": TOKENS},
            timeout_s=600,
        )
        after = {name: cpu_ticks(p.proc.pid) for name, p in procs.items()}
        span = time.perf_counter() - t0  # the pulls, and the command's own hand-offs around them
        checked = decode.send({"cmd": "verify_batch"}, timeout_s=600)
        if not checked["ok"]:
            print(f"{self.tree} {path} x{concurrency}: bytes differ: {checked['errors']}", file=sys.stderr)
        consumed = self.prefill.send(
            {"cmd": "count_events", "kind": "consumed", "expect": pulls, "timeout_s": 10}
        )
        if not got.get("ok"):
            print(
                f"{self.tree} {path} x{concurrency}: {got.get('errors') or got.get('error')}", file=sys.stderr
            )
        wall = got.get("wall_s", 0.0) or 1e-9
        lat = sorted(got.get("lat", [0.0]))
        return Row(
            self.tree,
            path,
            concurrency,
            pulls,
            pulls / wall,
            1e3 * statistics.median(lat),
            1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            {name: 100.0 * (after[name] - before[name]) / HZ / span for name in procs},
            bool(got.get("ok")) and checked["ok"] and checked["checked"] == pulls,
            consumed["count"],
            got.get("paths", {}),
        )

    def close(self) -> None:
        for e in (self.prefill, *self.decode.values()):
            e.stop()
        for s in (self.a, self.b, self.c):
            s.stop()


def table(rows: list[Row]) -> str:
    out = [
        "| path | in flight | sidecar | pulls | pulls/s | p50 ms | p99 ms | p99/p50 | CPU % sidecar A / B | "
        "CPU % prefill / decode engine | bytes | consumed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.cpu
        out.append(
            f"| {r.path} | {r.concurrency} | {r.tree} | {r.pulls} | {r.rate:.0f} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {r.p99_ms / r.p50_ms if r.p50_ms else 0:.1f} | "
            f"{c['sidecar A']:.0f} / {c['sidecar B']:.0f} | {c['prefill engine']:.0f} / {c['decode engine']:.0f} | "
            f"{'verified' if r.verified else '**FAILED**'} | {r.consumed}/{r.pulls} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pulls", type=int, default=300, help="pulls per row")
    ap.add_argument("--concurrency", default="1,4,16", help="pulls in flight, comma-separated")
    ap.add_argument("--paths", default="host-nixl,host-direct", help=f"comma-separated, of {sorted(PATHS)}")
    ap.add_argument("--baseline", default="", help="also run this git revision's sidecars, side by side")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if unknown := set(paths) - set(PATHS):
        ap.error(f"unknown paths {sorted(unknown)}")
    nodes = [Node("this tree", None)]
    if args.baseline:
        nodes.append(Node(baseline.describe(args.baseline), baseline.env(baseline.export(args.baseline))))
    rows: list[Row] = []
    try:
        for node in nodes:  # warm-up: handshakes, first-touch of the caches
            for path in paths:
                node.run(path, 1, 20)
        for path in paths:
            for c in levels:
                for node in nodes:
                    rows.append(node.run(path, c, args.pulls))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        for node in nodes:
            node.close()
    body = (
        f"Command: `python bench/node_load.py{' --baseline ' + args.baseline if args.baseline else ''} "
        f"--pulls {args.pulls} --concurrency {args.concurrency} --paths {args.paths}`  \n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}  \n"
        f"Date: {datetime.date.today().isoformat()}\n\n"
        f"One-block requests of 256 KiB (4 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks); "
        f"each engine its own process. p50/p99: the engine's pull() call; CPU: each process's user+system "
        f"time over the pull command (the pulls and the command's hand-offs around them; 100 % = one core). "
        f"Reading it: pulls/s that stay flat as more pulls are in flight, while latency grows with them and "
        f"a sidecar sits near 100 %, mean the sidecar serves like one core (one GIL), whatever the "
        f"machine has; the engines' low CPU shows they are not what limits it.\n\n" + table(rows) + "\n"
    )
    print("\n" + body)
    if not args.no_write:
        write_section(
            Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md",
            "Node load, host paths (bench/node_load.py)",
            body,
        )
    return 0 if all(r.verified and r.consumed == r.pulls for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
