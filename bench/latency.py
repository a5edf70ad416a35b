"""Latency of a one-block pull through the whole stack, next to a bare gRPC round trip.

Two real sidecars on loopback. This process plays both engines through the thin
client (KV caches in shared memory), so the numbers hold no JSON-lines or
subprocess overhead: a pull row is the engine's `pull()` call, from the request
leaving the engine to the answer coming back, with every layer of the stack in
between (engine socket, decode sidecar, OpenRead to the prefill sidecar, one NIXL
READ, the completion notification). The bare rows are grpc.health.v1 Check on the
same sockets in the same run: the floor any unary call pays. The first-contact
rows use a fresh decode engine id per sample, so each pays for a handshake.

    python bench/latency.py                 # writes a section of docs/benchmarks.md
    python bench/latency.py --iters 200 --no-write
    python bench/latency.py --baseline main # also main's sidecar, side by side in the same run
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_sidecar.plan.spec import EngineSpec, rank_block_bytes
from kv_sidecar.refengine import scrape
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient
from kv_sidecar_client.shm import ShmKVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline
from report import gpus, quantile, write_section

# One block = 16 tokens x 8 heads x 128 dims x bf16 = 32 KiB per (layer, K/V); 4 layers: 256 KiB.
SPEC = EngineSpec.from_dict(
    {
        "tp_size": 1,
        "num_layers": 4,
        "num_kv_heads": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
        "block_size": 16,
        "num_blocks": 64,
        "layout": "flash_attn_nhd",
    }
)
_ids = itertools.count()
MIB = 1 << 20


def percentiles(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50": quantile(samples, 0.5),
        "p99": quantile(samples, 0.99),
        "mean": statistics.fmean(samples),
    }


def timed(fn: Callable[[], object], iters: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def health_check(target: str) -> Callable[[], object]:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    req = health_pb2.HealthCheckRequest()
    return lambda: stub.Check(req, timeout=10)


def register(client: SidecarClient, engine_id: str, spec: EngineSpec = SPEC) -> ShmKVCache:
    cache = ShmKVCache(spec.rank_tensor_shapes(), torch.bfloat16)
    client.register_rank(engine_id, 0, spec.to_dict(), cache.handles())
    return cache


def pull_once(prefill: SidecarClient, pid: str, decode: SidecarClient, did: str) -> float:
    """Publish one block, pull it; returns the pull's wall time (publish excluded)."""
    params = prefill.publish(pid, f"r{next(_ids)}", [3], SPEC.block_size)
    t = time.perf_counter()
    res = decode.pull(params, did, [7])
    elapsed = time.perf_counter() - t
    if not res.ok:
        raise RuntimeError(f"pull failed: {res.error_code}: {res.error}")
    return elapsed


def pull_blocks(
    prefill: SidecarClient, pid: str, decode: SidecarClient, did: str, n: int, order: str
) -> float:
    """Publish n blocks with consecutive ids, pull them into n blocks whose ids are consecutive too
    (`order` "consecutive"), or the same ids backwards ("reversed": no two neighbours on both sides), or
    both lists backwards ("both reversed": as vLLM's tables often are, its blocks freed last first)."""
    src = list(range(4, 4 + n))
    params = prefill.publish(
        pid, f"r{next(_ids)}", src[::-1] if order == "both reversed" else src, n * SPEC.block_size
    )
    dst = list(range(n + 8, 2 * n + 8))
    t = time.perf_counter()
    res = decode.pull(params, did, dst if order == "consecutive" else dst[::-1])
    elapsed = time.perf_counter() - t
    if not res.ok:
        raise RuntimeError(f"pull failed: {res.error_code}: {res.error}")
    return elapsed


def handshake_seconds(metrics_port: int) -> tuple[float, float]:
    """The sidecar's handshake time so far, and how many handshakes."""
    name = "kvsidecar_handshake_duration_seconds"
    return scrape.value(metrics_port, f"{name}_sum"), scrape.value(metrics_port, f"{name}_count")


class Pair:
    """Two sidecars (prefill node, decode node) of one source tree, and the engines on them."""

    def __init__(
        self,
        tag: str,
        env: dict[str, str] | None = None,
        spec: EngineSpec = SPEC,
        extra: list[str] | None = None,
    ) -> None:
        self.tag = tag
        self.caches: list[ShmKVCache] = []
        self.owner = True
        self.sidecars = [
            SidecarProcess(f"lat-{tag}-prefill", env=env, start_timeout_s=120, extra=extra),
            SidecarProcess(f"lat-{tag}-decode", env=env, start_timeout_s=120, extra=extra),
        ]
        a, b = self.sidecars
        self.ca, self.cb = SidecarClient(a.socket), SidecarClient(b.socket)
        self.caches += [
            register(self.ca, "lat-p", spec),
            register(self.cb, "lat-d", spec),
            register(self.ca, "lat-d-local", spec),
        ]

    def remote(self) -> float:
        return pull_once(self.ca, "lat-p", self.cb, "lat-d")

    def remote_blocks(self, n: int, order: str) -> float:
        return pull_blocks(self.ca, "lat-p", self.cb, "lat-d", n, order)

    def local(self) -> float:
        return pull_once(self.ca, "lat-p", self.ca, "lat-d-local")

    def first_contact(self, i: int) -> float:
        did = f"lat-fresh-{i}"
        self.caches.append(register(self.cb, did))
        t = pull_once(self.ca, "lat-p", self.cb, did)
        self.cb.unregister_rank(did, 0)
        return t

    def over_grpc(self) -> Pair:
        """The same sidecars and engines, with clients that never use the engine lane."""
        view = copy.copy(self)
        view.tag, view.owner = f"{self.tag}-grpc", False
        a, b = self.sidecars
        view.ca, view.cb = SidecarClient(a.socket, lane=False), SidecarClient(b.socket, lane=False)
        return view

    def close(self) -> None:
        for client in (self.ca, self.cb):
            client.close()
        if not self.owner:
            return
        for c in self.caches:
            c.close()
        for sc in self.sidecars:
            sc.stop()


def interleaved(
    pairs: list[Pair], fn: Callable[[Pair], float], iters: int, warmup: int = 5
) -> list[list[float]]:
    """Samples of fn for each pair, taken in turn: the machine's noise falls on all of them alike."""
    out: list[list[float]] = [[] for _ in pairs]
    for i in range(warmup + iters):
        for k, pair in enumerate(pairs):
            t = fn(pair)
            if i >= warmup:
                out[k].append(t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300, help="samples per steady-state row")
    ap.add_argument("--first-contact", type=int, default=20, help="fresh decode engines (handshakes)")
    ap.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also run the sidecar of this revision (git archive of it), samples interleaved with this tree's",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="also run this tree's sidecars with these more options (repeatable), in the many-block rows",
    )
    ap.add_argument(
        "--blocks",
        default="",
        help="also pull this many blocks (comma-separated) across sidecars: consecutive ids, the destination "
        "ids reversed, and both lists reversed",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    sizes = [int(b) for b in args.blocks.split(",") if b]
    # Room for a request of the largest size and its destination blocks after it.
    spec = dataclasses.replace(SPEC, num_blocks=max(SPEC.num_blocks, 2 * max(sizes, default=0) + 16))
    load_before = os.getloadavg()[0]
    pairs: list[Pair] = []
    variants: list[Pair] = []
    rows: list[tuple[str, dict[str, float]]] = []
    try:
        pairs.append(Pair("new", spec=spec))
        pairs.append(pairs[0].over_grpc())
        if args.baseline:
            pairs.append(Pair("old", env=baseline.env(baseline.export(args.baseline)), spec=spec))
        names = ["this tree, engine lane", "this tree, gRPC"]
        names += [baseline.describe(args.baseline)] if args.baseline else []
        variants += [Pair(f"v{i}", spec=spec, extra=v.split()) for i, v in enumerate(args.variant)]
        _, b = pairs[0].sidecars
        rows.append(
            (
                "gRPC health Check, unix socket (bare round trip)",
                percentiles(timed(health_check(f"unix:{b.socket}"), args.iters)),
            )
        )
        rows.append(
            (
                "gRPC health Check, TCP loopback (bare round trip)",
                percentiles(timed(health_check(b.peer_address), args.iters)),
            )
        )
        for name, xs in zip(
            names,
            interleaved(
                pairs,
                lambda p: timed_call(lambda: p.ca.publish("lat-p", f"p{next(_ids)}", [3], 16)),
                args.iters,
            ),
            strict=True,
        ):
            rows.append((f"Publish, 1 block — {name}", percentiles(xs)))
        for name, xs in zip(names, interleaved(pairs, Pair.remote, args.iters), strict=True):
            rows.append((f"Pull 1 block (256 KiB), other sidecar (host-nixl) — {name}", percentiles(xs)))
        # Many blocks: the engine lane is not what these rows are about; this tree over it, and the baseline.
        wide = [pairs[0], *variants, *pairs[2:]]
        wide_names = [names[0], *(f"this tree, {v}" for v in args.variant), *names[2:]]
        for n in sizes:
            for order in ("consecutive", "reversed", "both reversed"):
                mib = n * rank_block_bytes(SPEC) / MIB
                for name, xs in zip(
                    wide_names,
                    interleaved(wide, partial(Pair.remote_blocks, n=n, order=order), args.iters),
                    strict=True,
                ):
                    rows.append(
                        (
                            f"Pull {n} blocks ({mib:g} MiB), {order} ids, other sidecar (host-nixl) — {name}",
                            percentiles(xs),
                        )
                    )
        for name, xs in zip(names, interleaved(pairs, Pair.local, args.iters), strict=True):
            rows.append((f"Pull 1 block (256 KiB), same sidecar (host-direct) — {name}", percentiles(xs)))
        hs0 = [handshake_seconds(p.sidecars[1].metrics_port) for p in pairs]
        fresh = itertools.count()
        first = interleaved(pairs, lambda p: p.first_contact(next(fresh)), args.first_contact, warmup=0)
        for name, xs, p, (s0, n0) in zip(names, first, pairs, hs0, strict=True):
            rows.append((f"First pull of a new engine pair (incl. handshake) — {name}", percentiles(xs)))
            if not p.owner:
                continue  # its sidecars' handshakes are counted with the pair that owns them
            hs_sum, hs_n = handshake_seconds(p.sidecars[1].metrics_port)
            rows.append(
                (
                    f"Handshake alone (decode sidecar's histogram, mean) — {name}",
                    {
                        "n": hs_n - n0,
                        "p50": float("nan"),
                        "p99": float("nan"),
                        "mean": (hs_sum - s0) / max(1.0, hs_n - n0),
                    },
                )
            )
    finally:
        for p in [*variants, *reversed(pairs)]:  # views before the pair that owns their sidecars
            p.close()

    def ms(x: float) -> str:
        return "-" if x != x else f"{x * 1e3:.3f}"

    table = "| operation | n | p50 ms | p99 ms | mean ms |\n|---|---|---|---|---|\n" + "".join(
        f"| {name} | {int(r['n'])} | {ms(r['p50'])} | {ms(r['p99'])} | {ms(r['mean'])} |\n"
        for name, r in rows
    )
    print(table)
    if not args.no_write:
        machine = (
            f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, {gpus()}"
        )
        cmd = f"python bench/latency.py --iters {args.iters} --first-contact {args.first_contact}"
        cmd += f" --baseline {args.baseline}" if args.baseline else ""
        cmd += f" --blocks {args.blocks}" if args.blocks else ""
        cmd += "".join(f" --variant '{v}'" for v in args.variant)
        body = (
            f"Command: `{cmd}` · machine: {machine} · date: {datetime.date.today()}\n\n"
            "Wall time seen by the engine (the thin client) for one call, both sidecars on this machine over "
            "loopback. Pull rows exclude the Publish that precedes each pull. The bare rows are "
            "grpc.health.v1 Check on the same sockets in the same run: the floor of one unary call. "
            "First-contact rows use a new decode engine id per sample, so the pull includes the handshake "
            "(NIXL metadata exchange, plan) and the first READ's descriptor-list preparation. "
            "'engine lane' rows call Publish and Pull over the sidecar's engine lane (a plain unix socket "
            "beside the gRPC one, the client's default); 'gRPC' rows call the same sidecars with "
            "SidecarClient(lane=False). "
            + (
                f"Rows marked {names[2]} run that revision's sidecar (exported with git archive) on a second "
                "pair of sidecars in the same run, its samples interleaved with this tree's, so both see "
                "the same machine. "
                if args.baseline
                else ""
            )
            + "Where the time goes: the next section.\n\n"
            + table
            + f"\nThis machine has {os.cpu_count()} cores shared with other work (1-minute load average "
            f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after); compare rows of one run, "
            "not numbers across runs.\n"
        )
        write_section(
            Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md",
            "Pull latency (bench/latency.py)",
            body,
        )
    return 0


def timed_call(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
