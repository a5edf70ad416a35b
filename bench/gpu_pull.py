"""Same-node GPU pull bandwidth: the Triton executor against the NVLink peer-copy ceiling.

    python bench/gpu_pull.py --out DIR [--machine TEXT] [--sweep]   # on a machine with 2 GPUs
    python bench/gpu_pull.py --splice DIR/gpu_pull_section.md       # here: update docs/benchmarks.md

Rows (1 GiB per request; a segment is one (layer, K/V, block) chunk of a rank):
  ceiling  torch copy_ of 1 GiB GPU0 -> GPU1 between buffers this process owns;
  ours     engine caches owned by two *other* processes (GPU0 prefill, GPU1
           decode), exported over CUDA IPC, imported into GPU1's primary context,
           one kernel launch on GPU1 per request; homogeneous and NHD -> HND;
           block ids contiguous or a random permutation of a larger pool.
Times are CUDA events on GPU1's stream around the launch (index tables staged
before), median of --iters after --warmup; "e2e" adds host validation and
table upload (prepare_request + launch + sync, host clock).

With --sidecars, the same requests also go through the whole stack: real
`kv-sidecar serve` processes and reference-engine processes whose caches live
on GPU0 (prefill) and GPU1 (decode):
  via sidecar, same node   one sidecar holds both engines (path gpu-direct);
  via sidecars, staged     two sidecars: gather into the prefill sidecar's
                           ring, NIXL READ ring to ring, scatter (gpu-staged).
Their GB/s is bytes over the decode sidecar's own pull duration (OpenRead,
validation, every chunk, completion); "e2e" is the decode engine's wall clock
around the client's pull() call. Bytes are checked by digest: the prefill
blocks and the decode blocks, read back in logical token order, must hash alike.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## GPU pull (bench/gpu_pull.py)"
GIB = 1 << 30
STAGED_TARGET, STAGED_TARGET_2G = 0.51, 0.57  # staged rows' targets, shares of the ceiling (issue 11)
NOTES = (
    "Notes. Every 'ours' row is one kernel launch per 1 GiB request; 'fragmented' ids are a random "
    "permutation of a pool 1.25x the request. NIXL rows (anchor for what an engine-integrated NIXL "
    "connector gets): two processes each register their *own* cudaMalloc cache with NIXL (UCX backend), "
    "the decode side READs one descriptor per segment from prepped descriptor lists; host clock from "
    "make_prepped_xfer to DONE. With contiguous ids the per-descriptor cost cannot be paid per "
    "descriptor (15 ns each), so adjacent descriptors are evidently merged; with fragmented ids each "
    "costs ~5 us. docs/gpu.md discusses the profile.",
    " 'via sidecar(s)' rows go through real `kv-sidecar serve` processes and reference-engine processes "
    "(caches on GPU0 and GPU1, registered over CUDA IPC): GB/s is the decode sidecar's own pull duration, "
    "e2e the decode engine's wall clock around pull(); median of the timed pulls; bytes checked by "
    "digest. Their same-node target compares the whole pull (control plane included) with the ceiling; "
    "a staged row's target is 51 % of the ceiling (57 % with 2 GiB rings: issue 11's 200 and 225 GB/s "
    "on 2x H200), and at least the fragmented in-engine NIXL anchor of the same segment size (a "
    "conversion row is held to the homogeneous anchor, since NIXL cannot convert). Staged rings: default "
    "gpu_staging_bytes 640 MiB (5 slots of 64 MiB per ring, at most 4 to one peer; until 2026-11-29 512 MiB, "
    "4 slots) unless marked 2 GiB (slots as the row says).",
)


@dataclass(frozen=True)
class Config:
    name: str
    segment: int  # bytes of one (layer, K/V, block) chunk
    src: dict[str, Any]
    dst: dict[str, Any]
    note: str = ""


def _spec(layout: str, heads: int, block: int, num_blocks: int) -> dict[str, Any]:
    # One rank (tp 1) holding `heads` KV heads of head_dim 128, bf16, 32 layers.
    return {
        "tp_size": 1,
        "num_layers": 32,
        "num_kv_heads": heads,
        "head_dim": 128,
        "dtype": "bfloat16",
        "block_size": block,
        "num_blocks": num_blocks,
        "layout": layout,
    }


def configs() -> list[Config]:
    out = []
    # 16 KiB: 16 tokens x 4 heads x 128 x bf16; 1 GiB = 1024 blocks of 32 layers x K/V.
    # 4 KiB: 16 tokens x 1 head (e.g. 8 KV heads at TP 8), and 8 tokens x 2 heads for a real HND transpose.
    for seg, heads, block in ((16384, 4, 16), (4096, 1, 16), (4096, 2, 8)):
        per_block = 2 * 32 * seg
        n = GIB // per_block
        pool = n * 5 // 4  # a larger pool so that the fragmented ids are scattered
        for dst_layout in ("flash_attn_nhd", "flash_attn_hnd"):
            if (heads, block) == (2, 8) and dst_layout == "flash_attn_nhd":
                continue
            name = f"{'homog' if dst_layout == 'flash_attn_nhd' else 'nhd->hnd'} {seg >> 10}KiB h{heads} b{block}"
            note = "1 head: HND bytes = NHD bytes" if heads == 1 and dst_layout == "flash_attn_hnd" else ""
            out.append(
                Config(
                    name,
                    seg,
                    _spec("flash_attn_nhd", heads, block, pool),
                    _spec(dst_layout, heads, block, pool),
                    note,
                )
            )
    return out


def _events_ms(fn: Callable[[], object], device: int, iters: int, warmup: int) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    out = []
    stream = torch.cuda.current_stream(device)
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def ceiling(iters: int, warmup: int) -> dict[str, Any]:
    import torch

    bufs = {
        "a": torch.empty(GIB, dtype=torch.uint8, device="cuda:0").random_(0, 255),
        "b": torch.empty(GIB, dtype=torch.uint8, device="cuda:1"),
    }
    with torch.cuda.device(1):
        ms = _events_ms(lambda: bufs["b"].copy_(bufs["a"]), 1, iters, warmup)
    ok = bool(torch.equal(bufs["a"].to("cuda:1"), bufs["b"]))
    bufs.clear()
    torch.cuda.empty_cache()
    med = statistics.median(ms)
    return {
        "row": "ceiling: torch copy_ GPU0->GPU1, own buffers",
        "gbps": GIB / med / 1e6,
        "ms": med,
        "ok": ok,
    }


def _ids(n: int, pool: int, fragmented: bool, seed: int) -> list[int]:
    import numpy as np

    if not fragmented:
        return list(range(n))
    return np.random.default_rng(seed).permutation(pool)[:n].tolist()


def _check_identity_copy(src_view: Any, dst_view: Any, n: int, device: int) -> bool:
    """For contiguous ids and equal layouts, block range [0, n) of every layer must be byte-equal."""
    import torch

    from kv_sidecar.execute import gpu_geometry as geo
    from kv_sidecar_client.cuda_ipc import PrimaryContext, check, cuda_driver

    lib = cuda_driver()
    per_layer = geo.tensor_nbytes(src_view.spec)
    nbytes_half = per_layer // 2  # [2, N, ...]: K plane then V plane
    chunk = nbytes_half * n // src_view.spec.num_blocks
    ok = True
    with torch.cuda.device(device), PrimaryContext(device):
        a = torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{device}")
        b = torch.empty_like(a)
        for layer in (0, src_view.spec.num_layers - 1):
            for plane in (0, 1):
                off = plane * nbytes_half
                check(lib, lib.cuMemcpyDtoD_v2(a.data_ptr(), src_view.layer_ptrs[layer] + off, chunk), "copy")
                check(lib, lib.cuMemcpyDtoD_v2(b.data_ptr(), dst_view.layer_ptrs[layer] + off, chunk), "copy")
                ok = ok and bool(torch.equal(a, b))
    return ok


def ours(cfgs: list[Config], iters: int, warmup: int, sweep: bool) -> list[dict[str, Any]]:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from ipc_engine import Engine, Job

    from kv_sidecar.execute import gpu
    from kv_sidecar.execute import gpu_geometry as geo
    from kv_sidecar.memory.cuda_ipc import IpcRegistry
    from kv_sidecar.plan.spec import EngineSpec

    src_eng = Engine(0, [Job(c.name, c.src, 0, 1, fill="device") for c in cfgs])
    dst_eng = Engine(1, [Job(c.name, c.dst, 0, 2, fill="device") for c in cfgs])
    reg = IpcRegistry()
    rows: list[dict[str, Any]] = []
    try:
        for c in cfgs:
            s_spec, d_spec = EngineSpec.from_dict(c.src), EngineSpec.from_dict(c.dst)
            views = []
            for eng, spec in ((src_eng, s_spec), (dst_eng, d_spec)):
                n = geo.tensor_nbytes(spec)
                ts = [reg.open(e.handle, e.offset, n, 1) for e in eng.exports[c.name]]
                views.append(gpu.gpu_rank_view(spec, 0, ts, 1))
            sv, dv = views
            n_blocks = GIB // (2 * 32 * c.segment)
            tokens = n_blocks * s_spec.block_size
            heads = (0, s_spec.num_kv_heads)
            for fragmented in (False, True):
                sids = _ids(n_blocks, s_spec.num_blocks, fragmented, 11)
                dids = _ids(n_blocks, d_spec.num_blocks, fragmented, 12)
                prep = gpu.prepare_request(sv, dv, heads, sids, dids, tokens)
                assert prep.nbytes == GIB, prep.nbytes
                variants = [(gpu.TILE_BYTES, gpu.NUM_WARPS)]
                if sweep and fragmented:
                    variants += [(t, w) for t in (8192, 16384, 32768) for w in (4, 8)]
                    variants = list(dict.fromkeys(variants))
                for tile, warps in variants:
                    gpu.TILE_BYTES, gpu.NUM_WARPS = tile, warps
                    prep = gpu.prepare_request(sv, dv, heads, sids, dids, tokens)
                    with torch.cuda.device(1):
                        ms = _events_ms(prep.launch, 1, iters, warmup)
                    med = statistics.median(ms)
                    rows.append(
                        {
                            "row": f"ours {c.name} {'fragmented' if fragmented else 'contiguous'}",
                            "config": c.name,
                            "segment": c.segment,
                            "fragmented": fragmented,
                            "tile_bytes": tile,
                            "num_warps": warps,
                            "rows_per_program": prep.launch_args.rows,
                            "chunk_words": prep.launch_args.chunk,
                            "gbps": GIB / med / 1e6,
                            "ms": med,
                            "ms_min": min(ms),
                            "ms_max": max(ms),
                            "note": c.note,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
                gpu.TILE_BYTES, gpu.NUM_WARPS = variants[0]
                # End to end: validation + table upload + launch + sync, host clock.
                e2e = []
                for i in range(max(3, iters // 2)):
                    t0 = time.perf_counter()
                    gpu.copy_request(sv, dv, heads, sids, dids, tokens)
                    if i:
                        e2e.append(time.perf_counter() - t0)
                rows[-1 - (len(variants) - 1)]["e2e_gbps"] = GIB / statistics.median(e2e) / 1e9
                if not fragmented and c.src["layout"] == c.dst["layout"]:
                    rows[-1]["verified"] = _check_identity_copy(sv, dv, n_blocks, 1)
            for v in views:
                for t in v.keepalive:
                    t.release()
    finally:
        src_eng.close()
        dst_eng.close()
    return rows


def _nixl_api() -> Any:
    try:
        from nixl import _api
    except ImportError:
        from nixl_cu13 import _api
    return _api


def _own_cache(spec_dict: dict[str, Any], device: int, seed: int) -> tuple[Any, list[Any]]:
    """A cache this process allocates itself (as an engine does): per-layer tensors, random bytes."""
    import torch

    from kv_sidecar.plan.spec import EngineSpec

    spec = EngineSpec.from_dict(spec_dict)
    torch.manual_seed(seed)
    out = []
    for shape in spec.rank_tensor_shapes():
        t = torch.empty(shape, dtype=getattr(torch, spec.dtype), device=f"cuda:{device}")
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=flat.device))
        out.append(t)
    return spec, out


def _segments(ptrs: list[int], spec: Any, seg: int, device: int) -> Any:
    """(addr, len, dev) of every (layer, K/V, block) segment of an NHD cache: row (l*2+p)*N + block."""
    import numpy as np

    n = spec.num_blocks
    layer = np.asarray(ptrs, dtype=np.uint64)[:, None, None]
    plane = (np.arange(2, dtype=np.uint64) * np.uint64(n * seg))[None, :, None]
    block = (np.arange(n, dtype=np.uint64) * np.uint64(seg))[None, None, :]
    addr = (layer + plane + block).reshape(-1)
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addr, seg, device
    return out


def _segment_rows(ids: list[int], spec: Any) -> Any:
    import numpy as np

    n, ids_arr = spec.num_blocks, np.asarray(ids, dtype=np.int64)
    planes = np.arange(spec.num_layers * 2, dtype=np.int64)[:, None] * n
    return (planes + ids_arr[None, :]).reshape(-1).astype(np.int32)


def _plane_sum(t: Any, n: int) -> int:
    """Checksum of blocks [0, n) of layer t's K plane (NHD: [2, N, ...])."""
    import torch

    return int(t[0, :n].contiguous().view(torch.uint8).sum(dtype=torch.int64))


def nixl_prefill(spec_dict: dict[str, Any], n_blocks: int, out_q: Any, done_q: Any) -> None:
    try:
        import torch

        torch.cuda.set_device(0)
        api = _nixl_api()
        _, ts = _own_cache(spec_dict, 0, 1)
        agent = api.nixl_agent("P", api.nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in ts], "VRAM")
        torch.cuda.synchronize()
        out_q.put(("ok", agent.get_agent_metadata(), [t.data_ptr() for t in ts], _plane_sum(ts[0], n_blocks)))
        done_q.get(timeout=600)
    except Exception as exc:
        out_q.put(("error", repr(exc), None, None))


def nixl_decode(
    spec_dict: dict[str, Any], seg: int, n_blocks: int, iters: int, warmup: int, meta_q: Any, res_q: Any
) -> None:
    try:
        import torch

        torch.cuda.set_device(1)
        api = _nixl_api()
        spec, ts = _own_cache(spec_dict, 1, 2)
        agent = api.nixl_agent("D", api.nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 1, "") for t in ts], "VRAM")
        status, meta, rptrs, rsum = meta_q.get(timeout=300)
        if status != "ok":
            raise RuntimeError(f"prefill side failed: {meta}")
        peer = agent.add_remote_agent(meta)
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _segments([t.data_ptr() for t in ts], spec, seg, 1), "VRAM"
        )
        remote = agent.prep_xfer_dlist(peer, _segments(rptrs, spec, seg, 0), "VRAM")
        rows = []
        for fragmented in (False, True):
            sids = _ids(n_blocks, spec.num_blocks, fragmented, 11)
            dids = _ids(n_blocks, spec.num_blocks, fragmented, 12)
            li, ri = _segment_rows(dids, spec), _segment_rows(sids, spec)
            times = []
            for it in range(warmup + iters):
                t0 = time.perf_counter()
                h = agent.make_prepped_xfer("READ", local, li, remote, ri, b"")
                state = agent.transfer(h)
                while state == "PROC":
                    state = agent.check_xfer_state(h)
                elapsed = time.perf_counter() - t0
                agent.release_xfer_handle(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer ended in state {state}")
                if it >= warmup:
                    times.append(elapsed)
            torch.cuda.synchronize()
            med = statistics.median(times)
            row = {"fragmented": fragmented, "gbps": GIB / med / 1e9, "ms": med * 1e3, "descs": int(li.size)}
            if not fragmented:
                row["verified"] = _plane_sum(ts[0], n_blocks) == rsum
            rows.append(row)
        res_q.put(("ok", rows))
    except Exception as exc:
        res_q.put(("error", repr(exc)))


def run_nixl_pair(
    ctx: Any, spec: dict[str, Any], segment: int, n_blocks: int, iters: int, warmup: int
) -> tuple[str, Any]:
    """Start the anchor's prefill and decode processes, wait for the decode side's ("ok", rows) or
    ("error", why), then stop both (killed if they do not end)."""
    meta_q, res_q, done_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ps = [
        ctx.Process(target=nixl_prefill, args=(spec, n_blocks, meta_q, done_q)),
        ctx.Process(target=nixl_decode, args=(spec, segment, n_blocks, iters, warmup, meta_q, res_q)),
    ]
    for p in ps:
        p.start()
    try:
        status, value = res_q.get(timeout=300)
    except Exception as exc:
        status, value = "error", f"no answer: {exc!r}"
    done_q.put(1)
    for p in ps:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return status, value


def nixl_anchor(cfgs: list[Config], iters: int, warmup: int) -> list[dict[str, Any]]:
    """In-engine NIXL READ between two processes' own cudaMalloc caches, one descriptor per segment."""
    import torch.multiprocessing as tmp

    try:
        _nixl_api()
    except ImportError as exc:
        return [{"config": "-", "error": f"nixl not importable: {exc}"}]
    ctx = tmp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    for c in cfgs:
        if c.src["layout"] != c.dst["layout"]:
            continue  # NIXL moves bytes as they are: no layout conversion to compare
        n_blocks = GIB // (2 * 32 * c.segment)
        status, value = run_nixl_pair(ctx, c.src, c.segment, n_blocks, iters, warmup)
        if status != "ok":
            rows.append({"config": c.name, "error": value})
            print(json.dumps(rows[-1]), flush=True)
            continue
        for r in value:
            rows.append({"config": c.name, "segment": c.segment, **r})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def through_sidecars(
    cfgs: list[Config], iters: int, warmup: int, big_slots: list[int]
) -> list[dict[str, Any]]:
    """The requests of `cfgs` (fragmented ids) through real sidecar and engine processes.

    `big_slots`: the slot counts of the 2 GiB-ring pairs (one pair of sidecars each)."""
    from kv_sidecar.plan.spec import EngineSpec
    from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess

    rows: list[dict[str, Any]] = []
    node = SidecarProcess("bench-node")
    pre, dec = SidecarProcess("bench-prefill"), SidecarProcess("bench-decode")
    # The same staged path with larger rings (2 GiB per GPU): more bytes in flight, in as many slots
    # as asked (4: 256 MiB slots, 16: the default's 64 MiB slots).
    bigs: list[tuple[str, Any, Any]] = []
    for n in big_slots:
        extra = ["--gpu-staging-bytes", str(2 * GIB), "--gpu-staging-slots", str(n)]
        label = f"via sidecars, staged, 2 GiB rings ({n} x {2 * GIB // 2 // n >> 20} MiB slots)"
        bigs.append(
            (
                label,
                SidecarProcess(f"bench-prefill-2g{n}", extra=extra),
                SidecarProcess(f"bench-decode-2g{n}", extra=extra),
            )
        )
    try:
        for cfg in cfgs:
            pspec, dspec = EngineSpec.from_dict(cfg.src), EngineSpec.from_dict(cfg.dst)
            n = GIB // (2 * 32 * cfg.segment)
            src, dst = _ids(n, pspec.num_blocks, True, 1), _ids(n, dspec.num_blocks, True, 2)
            tokens = n * pspec.block_size
            variants = [
                ("via sidecar, same node", node.socket, node.socket),
                ("via sidecars, staged", pre.socket, dec.socket),
            ]
            if cfg.segment == 16384:
                variants += [(label, p.socket, d.socket) for label, p, d in bigs]
            for label, psock, dsock in variants:
                tag = f"{cfg.name}-{label}".replace(" ", "_").replace(",", "").replace(">", "")
                prefill = EngineProcess(psock, f"p-{tag}", pspec, devices=["cuda:0"], start_timeout_s=300)
                decode = EngineProcess(dsock, f"d-{tag}", dspec, devices=["cuda:1"], start_timeout_s=300)
                try:
                    prefill.send({"cmd": "randomize", "seed": 7}, timeout_s=300)
                    server, wall, path = [], [], ""
                    for i in range(warmup + iters):
                        pub = prefill.send(
                            {
                                "cmd": "prefill",
                                "request_id": f"r{i}",
                                "block_ids": src,
                                "num_tokens": tokens,
                                "seed": 0,
                                "fill": False,
                            }
                        )
                        res = decode.send(
                            {"cmd": "pull", "params": pub["params"], "block_ids": dst, "verify": False},
                            timeout_s=300,
                        )
                        if not res["ok"]:
                            raise RuntimeError(f"{cfg.name} {label}: {res['error_code']}: {res['error']}")
                        prefill.send({"cmd": "next_event", "timeout_s": 60})
                        path = res["path"]
                        if i >= warmup:
                            server.append(res["duration_s"])
                            wall.append(res["wall_s"])
                    want = prefill.send({"cmd": "digest", "block_ids": src}, timeout_s=300)["digests"]
                    got = decode.send({"cmd": "digest", "block_ids": dst}, timeout_s=300)["digests"]
                    row = {
                        "config": cfg.name,
                        "label": label,
                        "path": path,
                        "bytes": res["bytes"],
                        "gbps": res["bytes"] / statistics.median(server) / 1e9,
                        "e2e_gbps": res["bytes"] / statistics.median(wall) / 1e9,
                        "verified": want == got,
                    }
                except Exception as e:  # one failed row must not lose the others
                    row = {"config": cfg.name, "label": label, "error": f"{type(e).__name__}: {e}"}
                finally:
                    prefill.stop()
                    decode.stop()
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for sc in (node, pre, dec, *(sc for _, p, d in bigs for sc in (p, d))):
            sc.stop()
    return rows


def machine_text(extra: str) -> str:
    import torch

    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    import triton

    return (
        f"{extra + '; ' if extra else ''}{torch.cuda.device_count()}x [{names}], "
        f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}"
    )


def section(
    ceil: dict[str, Any],
    rows: list[dict[str, Any]],
    nixl_rows: list[dict[str, Any]],
    machine: str,
    command: str,
    stack_rows: list[dict[str, Any]] | None = None,
) -> str:
    from kv_sidecar.execute import gpu

    top = ceil["gbps"]
    lines = [
        SECTION,
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Date: {dt.date.today().isoformat()}",
        "",
        "1 GiB per request; a segment is one (layer, K/V, block) chunk of a rank (32 layers, head_dim 128, "
        "bf16). Source cache owned by an engine process on GPU0, destination by one on GPU1, both exported "
        "over CUDA IPC and imported into GPU1's primary context; one Triton launch per request on GPU1. "
        "Kernel time: CUDA events around the launch, median of the timed iterations after warm-up. "
        "e2e: host clock around `copy_request` (validation, index upload, launch, synchronize). "
        f"Target: >= 90 % of the ceiling. Tile {gpu.TILE_BYTES} B, {gpu.NUM_WARPS} warps.",
        "",
        "| row | ids | GB/s | % of ceiling | e2e GB/s | target | note |",
        "|---|---|---|---|---|---|---|",
        f"| ceiling: torch copy_ GPU0->GPU1, own buffers | - | {top:.1f} | 100 % | - | - | |",
    ]
    for r in rows:
        if (r["tile_bytes"], r["num_warps"]) != (gpu.TILE_BYTES, gpu.NUM_WARPS):
            continue
        pct = 100 * r["gbps"] / top
        ids = "fragmented" if r["fragmented"] else "contiguous"
        e2e = f"{r['e2e_gbps']:.1f}" if "e2e_gbps" in r else "-"
        target = "met" if pct >= 90 else "**missed**"
        note = r.get("note", "")
        if "verified" in r:
            note = (note + "; " if note else "") + ("bytes verified" if r["verified"] else "**MISMATCH**")
        lines.append(
            f"| ours {r['config']} | {ids} | {r['gbps']:.1f} | {pct:.1f} % | {e2e} | {target} | {note} |"
        )
    if not nixl_rows:
        lines.append(
            "| in-engine NIXL READ (anchor) | - | not run | - | - | - | run with --nixl (needs nixl) |"
        )
    for r in nixl_rows:
        if "error" in r:
            lines.append(
                f"| in-engine NIXL READ {r['config']} | - | failed | - | - | - | {r['error'][:120]} |"
            )
            continue
        ids = "fragmented" if r["fragmented"] else "contiguous"
        pct = 100 * r["gbps"] / top
        note = f"{r['descs']} descriptors, host clock"
        if "verified" in r:
            note += "; bytes verified" if r["verified"] else "; **MISMATCH**"
        lines.append(
            f"| in-engine NIXL READ {r['config']} (own cudaMalloc, UCX) | {ids} | {r['gbps']:.1f} | "
            f"{pct:.1f} % | - | reference | {note} |"
        )
    anchors = {r["config"]: r["gbps"] for r in nixl_rows if r.get("fragmented") and "gbps" in r}
    for r in stack_rows or []:
        if "error" in r:
            lines.append(
                f"| ours {r['label']} {r['config']} | fragmented | failed | - | - | - | {r['error'][:160]} |"
            )
            continue
        pct = 100 * r["gbps"] / top
        # NIXL cannot convert layouts, so a conversion row is held to the homogeneous anchor.
        anchor = anchors.get(r["config"].replace("nhd->hnd", "homog"))
        if "staged" in r["label"]:
            # Issue 11: >= 200 GB/s (default rings) and >= 225 GB/s (2 GiB rings) on 2x H200, whose
            # ceiling was 393 GB/s: as shares of this run's ceiling, and never below the NIXL anchor.
            share = STAGED_TARGET_2G if "2 GiB" in r["label"] else STAGED_TARGET
            floor = max(share * top, anchor or 0.0)
            target = ("met" if r["gbps"] >= floor else "**missed**") + f" (>= {floor:.1f}"
            target += f", anchor {anchor:.1f})" if anchor is not None else ", no anchor run)"
        else:
            target = "met" if pct >= 90 else "**missed**"
        note = f"path {r['path']}; " + ("bytes verified (digest)" if r["verified"] else "**MISMATCH**")
        lines.append(
            f"| ours {r['label']} {r['config']} | fragmented | {r['gbps']:.1f} | {pct:.1f} % | "
            f"{r['e2e_gbps']:.1f} | {target} | {note} |"
        )
    lines += ["", *NOTES]
    return "\n".join(lines) + "\n"


def splice(section_file: Path, doc: Path) -> None:
    """Replace (or append) our section of docs/benchmarks.md, leaving every other section alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import write_section  # the shared section writer of bench/

    body = section_file.read_text()
    if body.startswith(SECTION):
        body = body[len(SECTION) :].lstrip("\n")
    write_section(doc, SECTION.removeprefix("## "), body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="directory for gpu_pull.json and gpu_pull_section.md")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also time other tile sizes / warps (fragmented)")
    p.add_argument("--only", default="", help="comma-separated config name substrings")
    p.add_argument("--nixl", action="store_true", help="add the in-engine NIXL READ anchor rows (needs nixl)")
    p.add_argument(
        "--sidecars", action="store_true", help="add rows through real sidecar and engine processes"
    )
    p.add_argument(
        "--big-slots",
        default="4",
        help="comma-separated slot counts of the 2 GiB-ring rows (one pair of sidecars each)",
    )
    p.add_argument("--machine", default="", help="machine description to record (e.g. the device kind)")
    p.add_argument("--splice", type=Path, help="write this section file into docs/benchmarks.md and exit")
    args = p.parse_args()
    if args.splice:
        splice(args.splice, ROOT / "docs" / "benchmarks.md")
        return 0
    import torch

    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    cfgs = [c for c in configs() if not args.only or any(s in c.name for s in args.only.split(","))]
    ceil = ceiling(args.iters, args.warmup)
    print(json.dumps(ceil), flush=True)
    rows = ours(cfgs, args.iters, args.warmup, args.sweep)
    nixl_rows = nixl_anchor(cfgs, max(3, args.iters // 2), 2) if args.nixl else []
    stack_rows = (
        through_sidecars(cfgs, args.iters, args.warmup, [int(n) for n in args.big_slots.split(",")])
        if args.sidecars
        else []
    )
    shown = [
        "$OUT" if args.out and a == str(args.out) else (f'"{a}"' if " " in a else a) for a in sys.argv[1:]
    ]
    command = "PYTHONPATH=sidecar:client python bench/gpu_pull.py " + " ".join(shown)
    text = section(ceil, rows, nixl_rows, machine_text(args.machine), command.strip(), stack_rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_pull.json").write_text(
            json.dumps({"ceiling": ceil, "rows": rows, "nixl": nixl_rows, "stack": stack_rows}, indent=1)
        )
        (args.out / "gpu_pull_section.md").write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
