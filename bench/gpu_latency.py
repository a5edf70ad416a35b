"""Small GPU pulls and concurrent staged pulls through real sidecars (issue 11).

    python bench/gpu_latency.py --out DIR [--machine TEXT]      # on a machine with 2 GPUs
    python bench/gpu_latency.py --splice DIR/gpu_latency_section.md   # here: update docs/benchmarks.md
    python bench/gpu_latency.py --host --out DIR                # dry run on CPU (host memory, host-ring)

This process plays both engines: it allocates a model-shaped rank's KV cache
(32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks: 2 MiB per block)
on GPU0 (prefill) and one on GPU1 (decode), registers them over CUDA IPC with
real `kv-sidecar serve` processes and times the client's `pull()` (the
engine's wall clock), publish excluded:

  bare gRPC     grpc.health.v1 Check on the decode sidecar's engine socket
  gpu-direct    one sidecar holds both engines: one kernel per pull
  gpu-staged    two sidecars: the staged protocol (docs/gpu.md)

Rows: pulls of 1, 16 and 256 blocks (fragmented ids) on both paths, p50/p99
after warm-up; 1, 4 and 16 concurrent staged pulls of 64 MiB (32 blocks,
each thread its own blocks): aggregate GB/s over the whole round and per-pull
p50/p99. Every row in the same run as its ceiling (torch copy_ GPU0 -> GPU1 of
the same bytes between buffers this process owns, CUDA events) and anchor
(in-engine NIXL READ between two processes' own cudaMalloc caches, one
descriptor per (layer, K/V, block), from bench/gpu_pull.py). Bytes: the last
pull of every row goes into poisoned blocks and must equal the source blocks.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import quantile  # noqa: E402

SECTION = "## GPU pull latency and concurrency (bench/gpu_latency.py)"
MIB = 1 << 20
MODEL: dict[str, Any] = {
    "tp_size": 1,
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "dtype": "bfloat16",
    "block_size": 16,
    "layout": "flash_attn_nhd",
}
HOST_MODEL = MODEL | {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64}  # --host: 32 KiB blocks
SIZES = (1, 16, 256)
CONCURRENCY = (1, 4, 16)
CONC_BLOCKS = 32  # 64 MiB of the model rank
POOL = 640  # blocks per cache: fragmented ids, and 16 x 32 distinct blocks for the concurrent round
# The decode engine's GPU: 1, or 0 with --one-gpu (both caches on one GPU: compares revisions on a
# one-GPU machine, not with the two-GPU rows).
DECODE_GPU = 1

# Issue 11's targets for the engine's p50 (ms): (path, blocks) -> target
TARGETS = {
    ("staged", 1): 1.5,
    ("staged", 16): 2.0,
    ("staged", 256): 3.5,
    ("direct", 16): 0.5,
    ("direct", 256): 1.6,
}
NOTES = (
    "Notes. 'engine wall' is the host clock around SidecarClient.pull() in the engine process (this "
    "process), publish excluded; 'sidecar' is the duration the decode sidecar reports. Block ids are "
    "random (fragmented) in a pool of 640 blocks. The ceiling is the NVLink peer copy of the same bytes "
    "between two buffers one process owns (no control plane at all); the anchor is what an engine-"
    "integrated NIXL connector pays for the same blocks (one descriptor per layer, K/V and block, "
    "contiguous ids merge into few descriptors, fragmented ones do not). Concurrent rows: C threads, "
    "each pulling its own 32 blocks per round after one warm-up pull; aggregate = bytes of the timed "
    "rounds over their wall time. Staged rings: the sidecars' gpu_staging_bytes / gpu_staging_slots "
    "(default 640 MiB per GPU: 5 slots of 64 MiB per ring, at most 4 to one peer; until 2026-11-29 512 MiB, "
    "4 slots) unless the command says otherwise."
)


# -- helpers ----------------------------------------------------------------------------
def percentiles(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99), "mean": statistics.fmean(xs)}


def size(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def block_bytes(spec: dict[str, Any]) -> int:
    return spec["num_layers"] * 2 * spec["block_size"] * spec["num_kv_heads"] * spec["head_dim"] * 2


class Rig:
    """Both engines' caches in this process and the three sidecars."""

    def __init__(self, host: bool, ring_args: list[str]) -> None:
        import numpy as np
        import torch

        from kv_sidecar.plan.spec import EngineSpec
        from kv_sidecar.refengine.procs import SidecarProcess, together
        from kv_sidecar_client import SidecarClient

        self.host = host
        self.spec_dict = (HOST_MODEL if host else MODEL) | {"num_blocks": POOL}
        self.spec = EngineSpec.from_dict(self.spec_dict)
        self.block = block_bytes(self.spec_dict)
        self.rng = np.random.default_rng(7)
        extra = (["--host-transfer", "ring"] if host else []) + ring_args
        env = {"OMP_NUM_THREADS": "1"} if host else {}
        names = [("bench-node", []), ("bench-prefill", extra), ("bench-decode", extra)]
        # NIXL and CUDA start-up dominate: overlap them
        self.node, self.pre, self.dec = together(
            *(lambda ne=ne: SidecarProcess(ne[0], extra=ne[1], env=env, start_timeout_s=180) for ne in names)
        )
        dtype = torch.bfloat16
        shapes = self.spec.rank_tensor_shapes()
        if host:
            from kv_sidecar_client.shm import ShmKVCache

            self.pcache: Any = ShmKVCache(shapes, dtype)
            self.dcache: Any = ShmKVCache(shapes, dtype)
        else:
            from kv_sidecar.refengine.gpu_cache import GpuKVCache

            self.pcache = GpuKVCache(shapes, dtype, torch.device("cuda", 0))
            self.dcache = GpuKVCache(shapes, dtype, torch.device("cuda", DECODE_GPU))
        for t in self.pcache.tensors:
            t.view(torch.uint8).random_()
        self.sync()
        self.clients = {
            n: SidecarClient(sc.socket)
            for n, sc in (("node", self.node), ("pre", self.pre), ("dec", self.dec))
        }
        spec = self.spec.to_dict()
        self.clients["node"].register_rank("lp", 0, spec, self.pcache.handles())
        self.clients["node"].register_rank("ld", 0, spec, self.dcache.handles())
        self.clients["pre"].register_rank("sp", 0, spec, self.pcache.handles())
        self.clients["dec"].register_rank("sd", 0, spec, self.dcache.handles())
        self.paths = {
            "direct": (self.clients["node"], "lp", self.clients["node"], "ld"),
            "staged": (self.clients["pre"], "sp", self.clients["dec"], "sd"),
        }
        self._ids = iter(range(10**9))

    def sync(self) -> None:
        import torch

        if not self.host:
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(DECODE_GPU)

    def ids(self, n: int) -> tuple[list[int], list[int]]:
        return self.rng.permutation(POOL)[:n].tolist(), self.rng.permutation(POOL)[:n].tolist()

    def poison(self, dst: list[int]) -> None:
        for t in self.dcache.tensors:
            t[:, dst] = 0
        self.sync()

    def same(self, src: list[int], dst: list[int]) -> bool:
        import torch

        ok = True
        for p, d in zip(self.pcache.tensors, self.dcache.tensors, strict=True):
            a = p[:, src].to(d.device).view(torch.int16)
            ok = ok and bool(torch.equal(a, d[:, dst].view(torch.int16)))
        return ok

    def pull(self, path: str, src: list[int], dst: list[int]) -> tuple[float, Any]:
        pc, pid, dc, did = self.paths[path]
        params = pc.publish(pid, f"r{next(self._ids)}", src, len(src) * self.spec.block_size)
        t0 = time.perf_counter()
        res = dc.pull(params, did, dst, timeout_s=120)
        wall = time.perf_counter() - t0
        if not res.ok:
            raise RuntimeError(f"{path} pull of {len(src)} blocks failed: {res.error_code}: {res.error}")
        return wall, res

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for sc in (self.node, self.pre, self.dec):
            sc.stop()
        self.pcache.close()
        self.dcache.close()


# -- measurements ------------------------------------------------------------------------------
def bare_grpc(rig: Rig, iters: int) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix:{rig.dec.socket}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest()
        out = []
        for i in range(iters + 10):
            t0 = time.perf_counter()
            stub.Check(req, timeout=10)
            if i >= 10:
                out.append(time.perf_counter() - t0)
    return {"row": "bare gRPC round trip (health Check, decode engine socket)", **percentiles(out)}


def small_pulls(rig: Rig, iters: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for path in ("direct", "staged"):
        for n in SIZES:
            src, dst = rig.ids(n)
            walls, side, got = [], [], ""
            for i in range(warmup + iters):
                if i == warmup + iters - 1:
                    rig.poison(dst)
                wall, res = rig.pull(path, src, dst)
                got = res.path
                if i >= warmup:
                    walls.append(wall)
                    side.append(res.duration_s)
            row = {
                "path": path,
                "label": got,
                "blocks": n,
                "bytes": res.bytes,
                "wall": percentiles(walls),
                "sidecar_p50": statistics.median(side),
                "verified": rig.same(src, dst),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def concurrent_pulls(rig: Rig, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for c in CONCURRENCY:
        # More rounds for fewer threads: the same number of timed pulls at every level.
        row = concurrent_round(rig, c, max(2, rounds * 4 // c))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def concurrent_round(rig: Rig, c: int, n_rounds: int) -> dict[str, Any]:
    """`c` threads, each pulling its own CONC_BLOCKS blocks `n_rounds` times after one warm-up pull."""
    perm_s, perm_d = rig.rng.permutation(POOL), rig.rng.permutation(POOL)
    span = [slice(w * CONC_BLOCKS, (w + 1) * CONC_BLOCKS) for w in range(c)]
    jobs = [(perm_s[sl].tolist(), perm_d[sl].tolist()) for sl in span]
    start = threading.Barrier(c + 1)
    walls: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        src, dst = jobs[w]
        try:
            rig.pull("staged", src, dst)  # warm-up
        except Exception as e:
            errors.append(str(e))
        start.wait()
        for r in range(n_rounds):
            try:
                if r == n_rounds - 1:
                    for t in rig.dcache.tensors:  # poison only our own blocks
                        t[:, dst] = 0
                    rig.sync()
                wall, _ = rig.pull("staged", src, dst)
                with lock:
                    walls.append(wall)
            except Exception as e:
                errors.append(str(e))
                return

    t0, t1 = run_together(worker, c, start)
    elapsed = t1 - t0
    if errors:
        return {"concurrency": c, "error": errors[0][:300]}
    return {
        "concurrency": c,
        "pulls": len(walls),
        "bytes_per_pull": CONC_BLOCKS * rig.block,
        "aggregate_gbps": len(walls) * CONC_BLOCKS * rig.block / elapsed / 1e9,
        "wall": percentiles(walls),
        "verified": all(rig.same(src, dst) for src, dst in jobs),
    }


def run_together(worker: Any, c: int, go: threading.Barrier) -> tuple[float, float]:
    """Run worker(0..c-1) on threads of their own; each waits at `go` (c + 1 parties) once warmed up.
    Returns the clock when all were past `go` and when the last one ended."""
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(c)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return start, time.perf_counter()


def ceilings(rig: Rig, iters: int) -> dict[str, float]:
    """p50 ms of torch copy_ of n blocks' bytes GPU0 -> GPU1 (host: a CPU copy), keyed by bytes;
    "top": GB/s of a 1 GiB copy (64 MiB on the host), the bandwidth ceiling."""
    import torch

    out: dict[str, float] = {}
    top = 64 * MIB if rig.host else 1 << 30
    for nbytes in [n * rig.block for n in SIZES] + [top]:
        if rig.host:
            a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                b.copy_(a)
                times.append((time.perf_counter() - t0) * 1e3)
        else:
            a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{DECODE_GPU}")
            times = []
            with torch.cuda.device(DECODE_GPU):
                stream = torch.cuda.current_stream(DECODE_GPU)
                for i in range(iters + 3):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record(stream)
                    b.copy_(a)
                    e1.record(stream)
                    e1.synchronize()
                    if i >= 3:
                        times.append(e0.elapsed_time(e1))
        out[str(nbytes)] = statistics.median(times)
        del a, b
    out["top"] = top / out[str(top)] / 1e6
    if not rig.host:
        torch.cuda.empty_cache()
    return out


def anchors(iters: int) -> dict[int, dict[str, Any]]:
    """In-engine NIXL READ of n blocks between two processes' own caches (bench/gpu_pull.py), by n."""
    import torch.multiprocessing as tmp
    from gpu_pull import _nixl_api, run_nixl_pair

    try:
        _nixl_api()
    except ImportError as exc:
        return {n: {"error": f"nixl not importable: {exc}"} for n in SIZES}
    seg = MODEL["block_size"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * 2
    spec = MODEL | {"num_blocks": POOL}
    ctx = tmp.get_context("spawn")
    out: dict[int, dict[str, Any]] = {}
    for n in SIZES:
        status, value = run_nixl_pair(ctx, spec, seg, n, iters, 3)
        if status != "ok":
            out[n] = {"error": str(value)[:200]}
        else:
            out[n] = {("fragmented" if r["fragmented"] else "contiguous"): r for r in value}
            out[n]["bytes"] = n * block_bytes(MODEL)
        print(json.dumps({"anchor_blocks": n, **out[n]}), flush=True)
    return out


# -- the section ------------------------------------------------------------------------------
def section(res: dict[str, Any], machine: str, command: str) -> str:
    host = res["host"]
    block = res["block_bytes"]
    ceil, anch = res["ceilings"], res["anchors"]
    top_gbps = ceil["top"]
    lines = [
        SECTION,
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Date: {dt.date.today().isoformat()}",
        "",
        (
            "**Dry run on host memory** (`--host`: shared-memory caches, paths host-direct / host-ring, "
            f"{block // 1024} KiB blocks, no GPU): the flow of the benchmark, not GPU numbers."
            if host
            else "A model-shaped rank: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks = 2 MiB per "
            "block. Prefill cache on GPU0, decode cache on GPU1, owned by the benchmark process (the engine), "
            "registered over CUDA IPC with real `kv-sidecar serve` processes."
        ),
        "",
        "| pull | path | engine wall p50 ms | p99 ms | sidecar p50 ms | target p50 | ceiling: peer copy ms | "
        "anchor: in-engine NIXL ms (contig / frag) | bytes |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| bare gRPC round trip | - | {res['bare']['p50'] * 1e3:.3f} | {res['bare']['p99'] * 1e3:.3f} | - | - | - | - | - |",
    ]
    for r in res["small"]:
        n = r["blocks"]
        target = TARGETS.get((r["path"], n))
        p50 = r["wall"]["p50"] * 1e3
        tgt = "-" if target is None or host else f"{target} ({'met' if p50 <= target else '**missed**'})"
        a = anch.get(str(n), {})
        if "error" in a:
            anchor = f"failed: {a['error'][:60]}"
        elif a:
            anchor = f"{a['contiguous']['ms']:.3f} / {a['fragmented']['ms']:.3f} ({a['fragmented']['descs']} descs)"
        else:
            anchor = "not run"
        lines.append(
            f"| {n} block{'s' if n > 1 else ''} ({size(n * block)}) | {r['label']} | {p50:.3f} | "
            f"{r['wall']['p99'] * 1e3:.3f} | {r['sidecar_p50'] * 1e3:.3f} | {tgt} | {ceil[str(n * block)]:.3f} | "
            f"{anchor} | {'verified' if r['verified'] else '**MISMATCH**'} |"
        )
    wire = anch.get(str(SIZES[-1]), {})
    wire_gbps = wire["contiguous"]["bytes_gbps"] if wire and "error" not in wire else None
    lines += [
        "",
        f"Concurrent staged pulls of {CONC_BLOCKS} blocks ({size(CONC_BLOCKS * block)}) each. Ceiling: "
        f"peer copy of {'64 MiB' if host else '1 GiB'}, {top_gbps:.1f} GB/s"
        + (
            f"; anchor: in-engine NIXL READ of {SIZES[-1]} contiguous blocks, {wire_gbps:.1f} GB/s."
            if wire_gbps
            else "."
        ),
        "",
        "| concurrent pulls | timed pulls | aggregate GB/s | % of ceiling | % of NIXL anchor | per-pull p50 ms | p99 ms | bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["concurrent"]:
        if "error" in r:
            lines.append(f"| {r['concurrency']} | failed | {r['error'][:120]} | | | | | |")
            continue
        g = r["aggregate_gbps"]
        vs_anchor = f"{100 * g / wire_gbps:.0f} %" if wire_gbps else "-"
        lines.append(
            f"| {r['concurrency']} | {r['pulls']} | {g:.1f} | {100 * g / top_gbps:.0f} % | {vs_anchor} | "
            f"{r['wall']['p50'] * 1e3:.2f} | {r['wall']['p99'] * 1e3:.2f} | "
            f"{'verified' if r['verified'] else '**MISMATCH**'} |"
        )
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


def machine_text(extra: str, host: bool) -> str:
    import torch

    if host:
        return f"{extra + '; ' if extra else ''}{platform.machine()}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}, python {platform.python_version()}"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return (
        f"{extra + '; ' if extra else ''}{torch.cuda.device_count()}x [{names}], torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="directory for gpu_latency.json and gpu_latency_section.md")
    p.add_argument("--iters", type=int, default=100, help="timed pulls per small-pull row")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--rounds", type=int, default=8, help="timed rounds per thread at concurrency 4 (scaled by 4/C)"
    )
    p.add_argument("--ring-bytes", type=int, default=0, help="gpu_staging_bytes of the two staged sidecars")
    p.add_argument("--slots", type=int, default=0, help="gpu_staging_slots of the two staged sidecars")
    p.add_argument("--no-nixl", action="store_true", help="skip the in-engine NIXL anchor rows")
    p.add_argument(
        "--one-gpu",
        action="store_true",
        help="both caches on GPU0 (a one-GPU machine: compare revisions only)",
    )
    p.add_argument("--host", action="store_true", help="dry run on host memory (no GPU): tests the script")
    p.add_argument("--machine", default="", help="machine description to record")
    p.add_argument("--splice", type=Path, help="write this section file into docs/benchmarks.md and exit")
    args = p.parse_args()
    if args.splice:
        from report import write_section

        body = args.splice.read_text()
        body = body[len(SECTION) :].lstrip("\n") if body.startswith(SECTION) else body
        write_section(ROOT / "docs" / "benchmarks.md", SECTION.removeprefix("## "), body)
        return 0
    import torch

    if args.one_gpu:
        global DECODE_GPU
        DECODE_GPU = 0
    if not args.host and not args.one_gpu and torch.cuda.device_count() < 2:
        print("needs 2 GPUs (or --host for a dry run)", file=sys.stderr)
        return 2
    ring_bytes = args.ring_bytes or (
        8 * MIB if args.host else 0
    )  # --host: rings in host memory; keep them small
    ring_args = (["--gpu-staging-bytes", str(ring_bytes)] if ring_bytes else []) + (
        ["--gpu-staging-slots", str(args.slots)] if args.slots else []
    )
    rig = Rig(args.host, ring_args)
    try:
        res: dict[str, Any] = {"host": args.host, "block_bytes": rig.block}
        res["ceilings"] = ceilings(rig, 20)
        print(json.dumps({"ceilings_ms": res["ceilings"]}), flush=True)
        res["bare"] = bare_grpc(rig, 200)
        print(json.dumps(res["bare"]), flush=True)
        res["small"] = small_pulls(rig, args.iters, args.warmup)
        res["concurrent"] = concurrent_pulls(rig, args.rounds)
    finally:
        rig.close()
    res["anchors"] = {}
    if not args.host and not args.no_nixl and not args.one_gpu:
        res["anchors"] = {str(n): a for n, a in anchors(max(10, args.iters // 4)).items()}
        for a in res["anchors"].values():
            for kind in ("contiguous", "fragmented"):
                if kind in a:
                    a[kind]["bytes_gbps"] = a["bytes"] / (a[kind]["ms"] / 1e3) / 1e9
    shown = [
        "$OUT" if args.out and a == str(args.out) else (f'"{a}"' if " " in a else a) for a in sys.argv[1:]
    ]
    command = "PYTHONPATH=sidecar:client python bench/gpu_latency.py " + " ".join(shown)
    text = section(res, machine_text(args.machine, args.host), command.strip())
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_latency.json").write_text(json.dumps(res, indent=1))
        (args.out / "gpu_latency_section.md").write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
