"""CPU pull throughput through the whole stack, next to a plain memcpy of the same bytes.

Two real sidecars and two reference-engine processes on this machine; every
row moves real KV blocks over NIXL (UCX, host memory) between the engines'
shared-memory caches. The memcpy row copies the same number of bytes between
two buffers of this process, in the same run: the ceiling.

    python bench/cpu_pull.py            # full table, writes docs/benchmarks.md
    python bench/cpu_pull.py --quick    # small sizes only, prints the table
    python bench/cpu_pull.py --tcp      # UCX over TCP only: emulated READs against host rings

With --tcp every sidecar's UCX may use only TCP (UCX_TLS=tcp), as between two
nodes without RDMA, where UCX has no native remote read: one pair READs with
emulation allowed (UCX_PROTO_EMULATION_ENABLE=y), the other keeps the default
(emulation off) and pulls through host rings (`host_transfer: ring`: the
source WRITEs, which TCP does natively), pulls alternating
(docs/operations.md, 5.9).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, tcp_only_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline
from report import gpus, write_section

MiB = 1 << 20
# 8 KV heads x head_dim 128 x bf16 = 2 KiB per token for K (and for V).
BASE: dict[str, Any] = {
    "num_layers": 4,
    "num_kv_heads": 8,
    "head_dim": 128,
    "dtype": "bfloat16",
    "layout": "flash_attn_nhd",
    "tp_size": 1,
}
TOKEN_BYTES = 8 * 128 * 2
NOTES = (
    "\nReading the table: small requests are latency-bound (a pull costs a few milliseconds whatever "
    "its size: two gRPC hops, OpenRead on the prefill sidecar, the completion notification). Large "
    "identity pulls are NIXL READs of one descriptor per segment over UCX's shared-memory transports; "
    "they approach 40 % of a one-thread memcpy with 64 KiB segments and about half that with 16 KiB "
    "segments (per-descriptor cost). The host-nixl-staged rows are bounded by the CPU conversion (torch "
    "advanced indexing on 2 cores), not by the wire. On a 2-core machine the NIXL driver thread, UCX and "
    "the engine processes share the cores; the GPU paths (docs/gpu.md) are the production data plane.\n"
)

TCP_NOTES = (
    "\nBoth pairs of sidecars run with UCX_TLS=tcp, as two nodes without RDMA (here over loopback, on the "
    "same 2 cores). UCX has no native remote read over TCP: 'emulated READ' allows it to emulate one with "
    "messages (UCX_PROTO_EMULATION_ENABLE=y); 'host ring' keeps the sidecar's default (emulation off) and "
    "sets `host_transfer: ring` on the decode sidecar, so the source WRITEs each chunk into the reader's "
    "host ring, which TCP does natively. Both move every byte; emulated READs are the faster of the two "
    "here, host rings need no change to UCX's settings. Host rings copy each chunk into and out of the "
    "ring with the host executor's per-token indexing, on top of the wire (docs/operations.md, 5.9): in a py-spy profile "
    "of 16 MiB host-ring pulls (64 KiB segments, 95 ms p50, 2026-11-25) each side's copy took ~13 ms and the "
    "source's WRITE post ~11 ms of each pull; the rest was waiting between those steps (not profiled further). "
    "Neither is the data plane a deployment should run on: that is RDMA between nodes.\n"
)


def memcpy_gbps(nbytes: int, iters: int) -> float:
    """One thread copying between two buffers whose pages are already touched: a plain memcpy."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


@dataclass
class PairPulls:
    """One pair of sidecars' pulls in a case: the times of all but the first (s), and what they moved."""

    server: list[float] = field(default_factory=list)  # the decode sidecar's pull duration
    wall: list[float] = field(default_factory=list)  # the decode engine's, around its Pull
    verified: bool = True  # the first pull's destination blocks
    path: str = ""
    bytes: int = 0


def run_case(
    pairs: list[tuple[SidecarProcess, SidecarProcess]],
    label: str,
    pover: dict[str, Any],
    dover: dict[str, Any],
    request_bytes: int,
    segment: int,
    iters: int,
) -> list[dict[str, Any]]:
    """One row per pair of sidecars; their pulls alternate, so all see the same machine."""
    block = (
        segment // TOKEN_BYTES
    )  # tokens per block so that one (layer, K/V, block) chunk is `segment` bytes
    tokens = request_bytes // (BASE["num_layers"] * 2 * TOKEN_BYTES)
    nblocks = math.ceil(tokens / block)
    pspec = EngineSpec.from_dict(BASE | {"block_size": block, "num_blocks": 2 * nblocks} | pover)
    dspec = EngineSpec.from_dict(BASE | {"block_size": block, "num_blocks": 2 * nblocks} | dover)
    engines: list[tuple[EngineProcess, EngineProcess]] = []
    out = [PairPulls() for _ in pairs]
    try:
        for k, (ps, ds) in enumerate(pairs):
            name = f"{label}-{request_bytes}-{segment}-{k}"
            engines.append(
                (
                    EngineProcess(ps.socket, f"bench-p-{name}", pspec),
                    EngineProcess(ds.socket, f"bench-d-{name}", dspec),
                )
            )
        for i in range(iters + 1):
            for (prefill, decode), r in zip(engines, out, strict=True):
                # Fragmented ids: every other block, in reverse on the decode side.
                src = list(range(0, 2 * math.ceil(tokens / pspec.block_size), 2))
                dst = list(range(2 * math.ceil(tokens / dspec.block_size) - 1, 0, -2))
                rid = f"r{i}"
                # Fill once; later iterations republish the same blocks. The first pull is the one
                # verified: its destination blocks still hold the engine's poison pattern.
                pub = prefill.send(
                    {
                        "cmd": "prefill",
                        "request_id": rid,
                        "block_ids": src,
                        "num_tokens": tokens,
                        "seed": 0,
                        "fill": i == 0,
                    },
                    timeout_s=600,
                )
                res = decode.send(
                    {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": 0, "verify": i == 0},
                    timeout_s=600,
                )
                if not res["ok"]:
                    raise RuntimeError(f"{label}: {res['error_code']}: {res['error']}")
                for _ in range(pspec.tp_size):
                    prefill.send({"cmd": "next_event", "timeout_s": 30})
                if i == 0:
                    r.verified = res["verified"]
                if i:  # the first pull pays for the handshake and connection set-up
                    r.server.append(res["duration_s"])
                    r.wall.append(res["wall_s"])
                r.path, r.bytes = res["path"], res["bytes"]
    finally:
        for prefill, decode in engines:
            prefill.stop()
            decode.stop()
    return [
        {
            "label": label,
            "request": request_bytes,
            "segment": segment,
            "path": r.path,
            "bytes": r.bytes,
            "server_gbps": r.bytes / statistics.median(r.server) / 1e9,
            "wall_gbps": r.bytes / statistics.median(r.wall) / 1e9,
            "p50_ms": statistics.median(r.wall) * 1e3,
            "verified": r.verified,
        }
        for r in out
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 and 16 MiB only; do not write docs/benchmarks.md")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also run the sidecar of this revision (git archive of it), pulls alternating with this tree's",
    )
    ap.add_argument(
        "--only", help="run only the rows whose request size in MiB is this (e.g. 16), for a quick check"
    )
    ap.add_argument(
        "--max-mib", type=int, default=1024, help="largest request to run (and the hetero rows' size)"
    )
    ap.add_argument(
        "--tcp",
        action="store_true",
        help="UCX over TCP only: emulated READs side by side with host rings (writes its own section)",
    )
    args = ap.parse_args()
    sizes = [MiB, 16 * MiB] if args.quick else [MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    sizes = [s for s in sizes if s <= args.max_mib * MiB]
    if args.only:
        sizes = [s for s in sizes if s == int(args.only) * MiB]
    hetero_size = min(sizes[-1], 256 * MiB) if sizes else 0
    cases: list[tuple[str, dict, dict, int, int]] = [
        ("homogeneous", {}, {}, size, seg) for seg in (16 * 1024, 64 * 1024) for size in sizes
    ]
    cases += (
        []
        if args.only
        else [
            ("TP1->TP2 head split", {}, {"tp_size": 2}, hetero_size, 64 * 1024),
            ("TP2->TP1 gather", {"tp_size": 2}, {}, hetero_size, 64 * 1024),
            ("NHD->HND", {}, {"layout": "flash_attn_hnd"}, hetero_size, 64 * 1024),
        ]
    )
    staging = ["--staging-bytes", str(512 * MiB)]
    # (label, environment, the decode sidecar's extra arguments), one pair of sidecars each.
    trees: list[tuple[str, dict[str, str], list[str]]] = [("this tree", {}, [])]
    if args.tcp:
        trees = [
            ("this tree, emulated READ", tcp_only_env(emulation=True), []),
            ("this tree, host ring", tcp_only_env(), ["--host-transfer", "ring"]),
        ]
    if args.baseline:
        trees.append((baseline.describe(args.baseline), baseline.env(baseline.export(args.baseline)), []))
    pairs = [
        (
            SidecarProcess(f"bench-prefill-{k}", extra=staging, env=env),
            SidecarProcess(f"bench-decode-{k}", extra=staging + decode_extra, env=env),
        )
        for k, (_, env, decode_extra) in enumerate(trees)
    ]
    rows = []
    try:
        for label, pover, dover, size, seg in cases:
            got = run_case(pairs, label, pover, dover, size, seg, args.iters)
            memcpy = memcpy_gbps(got[0]["bytes"], max(args.iters, 20))
            for (tree, _, _), row in zip(trees, got, strict=True):
                row["tree"], row["memcpy_gbps"] = tree, memcpy
                rows.append(row)
                print(
                    f"{label:>20} {size / MiB:7.0f} MiB seg {seg // 1024:3d} KiB {row['path']:>17} "
                    f"{row['wall_gbps']:6.2f} GB/s (memcpy {memcpy:6.2f}) {tree}",
                    flush=True,
                )
    finally:
        for a, b in pairs:
            a.stop()
            b.stop()
    header = (
        "| pairing | request | segment | sidecar | path | pull GB/s (engine wall) | pull GB/s (sidecar) | p50 ms "
        "| memcpy GB/s | pull / memcpy | verified |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    table = header + "".join(
        f"| {r['label']} | {r['request'] // MiB} MiB | {r['segment'] // 1024} KiB | {r['tree']} | {r['path']} | "
        f"{r['wall_gbps']:.2f} | {r['server_gbps']:.2f} | {r['p50_ms']:.1f} | {r['memcpy_gbps']:.2f} | "
        f"{r['wall_gbps'] / r['memcpy_gbps']:.0%} | {'yes' if r['verified'] else 'NO'} |\n"
        for r in rows
    )
    print(table)
    if not args.quick:
        machine = (
            f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
            f"Python {platform.python_version()}"
        )
        body = (
            f"Command: `python {' '.join(sys.argv)}` · machine: {machine} ({gpus()}) · "
            f"date: {datetime.date.today()} · median of {args.iters} pulls after one warm-up pull\n\n"
            "Request bytes are what the decode engine receives (all layers, K and V, all its ranks). "
            "Segment = one (layer, K/V, block) chunk. Block ids are fragmented (every other block on the "
            "prefill side, reversed on the decode side). The memcpy column copies the same bytes between two "
            "buffers of one process with one thread (numpy copyto), in the same run. 'engine wall' is measured around the client's pull() "
            "in the engine process; 'sidecar' is the time the decode sidecar reports.\n\n"
            + table
            + (TCP_NOTES if args.tcp else NOTES)
        )
        write_section(
            Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md",
            "CPU pull over TCP only (bench/cpu_pull.py --tcp)"
            if args.tcp
            else "CPU pull (bench/cpu_pull.py)",
            body,
        )
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
