"""`kv-sidecar demo`: a local 1P1D pair on CPU, end to end, verified byte for byte.

Starts two sidecars (one per "node") and two reference-engine processes,
prefills a request on one, pulls it through both sidecars over NIXL into the
other, checks every byte, waits for the prefill side's "consumed" event, and
prints bytes, time and GB/s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

DEFAULT_SPEC: dict[str, Any] = {
    "tp_size": 1,
    "num_layers": 8,
    "num_kv_heads": 8,
    "head_dim": 128,
    "dtype": "bfloat16",
    "block_size": 16,
    "num_blocks": 1024,
    "layout": "flash_attn_nhd",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a local prefill/decode pair on CPU and verify a transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--prefill", metavar="SPEC", help="prefill engine spec, JSON (default: a 8-layer bf16 model)"
    )
    p.add_argument("--decode", metavar="SPEC", help="decode engine spec, JSON (default: same as prefill)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens to transfer (default: 8192)")
    p.add_argument("--repeat", type=int, default=3, help="requests to transfer (default: 3)")
    p.set_defaults(func=run)


def _spec(text: str | None, default: dict[str, Any]) -> dict[str, Any]:
    if not text:
        return dict(default)
    if text.lstrip().startswith("{"):
        return default | json.loads(text)
    with open(text) as fh:
        return default | json.load(fh)


def run(args: argparse.Namespace) -> int:
    from kv_sidecar.plan.spec import EngineSpec
    from kv_sidecar.refengine.procs import EngineProcess, ProcessError, SidecarProcess

    pspec = EngineSpec.from_dict(_spec(args.prefill, DEFAULT_SPEC))
    dspec = EngineSpec.from_dict(_spec(args.decode, pspec.to_dict()))
    tokens = args.tokens
    need_p, need_d = math.ceil(tokens / pspec.block_size), math.ceil(tokens / dspec.block_size)
    if need_p > pspec.num_blocks or need_d > dspec.num_blocks:
        print(
            f"kv-sidecar demo: {tokens} tokens do not fit the caches ({pspec.num_blocks} / {dspec.num_blocks} blocks)",
            file=sys.stderr,
        )
        return 2
    print(
        f"prefill: TP{pspec.tp_size} {pspec.layout.value} block {pspec.block_size}; "
        f"decode: TP{dspec.tp_size} {dspec.layout.value} block {dspec.block_size}; {tokens} tokens"
    )
    t0 = time.perf_counter()
    sidecars: list[Any] = []
    engines: list[Any] = []
    failed = False
    try:
        sidecars = [SidecarProcess("prefill-node"), SidecarProcess("decode-node")]
        print(
            f"2 sidecars up in {time.perf_counter() - t0:.1f}s: {sidecars[0].peer_address} and {sidecars[1].peer_address}"
        )
        prefill = EngineProcess(sidecars[0].socket, "prefill-engine", pspec)
        decode = EngineProcess(sidecars[1].socket, "decode-engine", dspec)
        engines = [prefill, decode]
        print(f"{'request':>8} {'path':>17} {'MiB':>9} {'ms':>9} {'GB/s':>7}  verified  consumed")
        for i in range(args.repeat):
            # Fragmented, permuted block ids on both sides, as a real allocator hands out.
            src = [(7 * j + 3 * i) % pspec.num_blocks for j in range(need_p)]
            dst = [(pspec.num_blocks - 1 - 5 * j - i) % dspec.num_blocks for j in range(need_d)]
            if len(set(src)) != need_p or len(set(dst)) != need_d:
                src, dst = list(range(need_p)), list(range(need_d))
            rid = f"demo-{i}"
            pub = prefill.send(
                {"cmd": "prefill", "request_id": rid, "block_ids": src, "num_tokens": tokens, "seed": i}
            )
            if not pub["ok"]:
                raise ProcessError(f"publish failed: {pub}")
            res = decode.send({"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": i})
            if not res["ok"]:
                raise ProcessError(f"pull failed: {res['error_code']}: {res['error']}")
            consumed = 0
            for _ in range(pspec.tp_size):
                ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
                consumed += ev.get("kind") == "consumed" and ev.get("request_id") == rid
            ok = res.get("verified", False)
            failed |= not ok or consumed != pspec.tp_size
            print(
                f"{rid:>8} {res['path']:>17} {res['bytes'] / 2**20:9.1f} {res['duration_s'] * 1e3:9.2f} "
                f"{res['gbps']:7.2f}  {'yes' if ok else 'NO'}       {consumed}/{pspec.tp_size} ranks"
            )
            for err in res.get("errors", []):
                print(f"  {err}")
    except ProcessError as e:
        print(f"kv-sidecar demo: {e}", file=sys.stderr)
        failed = True
    finally:
        for engine in engines:
            engine.stop()
        codes = [s.stop() for s in sidecars]
        if any(codes):
            print(f"sidecar exit codes {codes}", file=sys.stderr)
            failed = True
    print("demo FAILED" if failed else f"demo passed in {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0
