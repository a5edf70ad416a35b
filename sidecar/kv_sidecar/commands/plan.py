"""`kv-sidecar plan`: show the transfer plan between two engine specs, offline.

Imports only the pure planner (no torch, no NIXL) so it runs anywhere,
e.g. to check a deployment's pairing before rolling it out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kv_sidecar.plan.pair import PairPlan, plan_pair
from kv_sidecar.plan.spec import EngineSpec, PlanError, rank_block_bytes

EXIT_IMPOSSIBLE = 2
IDENTITY_NOTE = "  (identity: blocks move byte for byte)"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show which decode rank reads which heads from which prefill rank",
        description=(
            "Compute the transfer plan between a prefill and a decode engine. SPEC is a path to a JSON "
            "file or inline JSON with the EngineSpec fields (tp_size, num_layers, num_kv_heads, head_dim, "
            "dtype, block_size, num_blocks, layout, optional kernel_block_size and cross_layer). "
            f"Exits {EXIT_IMPOSSIBLE} if the engines cannot be paired."
        ),
    )
    parser.add_argument("--prefill", required=True, metavar="SPEC", help="prefill engine spec")
    parser.add_argument("--decode", required=True, metavar="SPEC", help="decode engine spec")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(func=run)


def load_spec(text: str) -> EngineSpec:
    """Inline JSON if it looks like an object, else a path to a JSON file."""
    if text.lstrip().startswith("{"):
        source, raw = "inline spec", text
    else:
        source = text
        try:
            raw = Path(text).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read spec file {text}: {exc.strerror}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{source} must be a JSON object, got {type(data).__name__}")
    return EngineSpec.from_dict(data)


def run(args: argparse.Namespace) -> int:
    try:
        prefill = _load(args.prefill, "prefill")
        decode = _load(args.decode, "decode")
        plan = plan_pair(prefill, decode)
    except PlanError as exc:
        print(f"kv-sidecar plan: {exc}", file=sys.stderr)
        return EXIT_IMPOSSIBLE
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_table(plan))
    return 0


def _load(text: str, side: str) -> EngineSpec:
    try:
        return load_spec(text)
    except PlanError as exc:
        raise PlanError(f"--{side}: {exc}", exc.code) from None


def _describe(spec: EngineSpec) -> str:
    kernel = f" (kernel {spec.kernel_block_size})" if spec.kernel_block_size else ""
    cross = ", cross-layer" if spec.cross_layer else ""
    return (
        f"TP{spec.tp_size} {spec.layout.value}{cross}, {spec.num_kv_heads} kv heads x {spec.head_dim}, "
        f"{spec.num_layers} layers, {spec.dtype}, block {spec.block_size}{kernel}, "
        f"{rank_block_bytes(spec)} bytes/block/rank"
    )


def render_table(plan: PairPlan) -> str:
    rows = [("decode rank", "reads prefill rank", "heads", "bytes/decode block", "notify only")]
    for rank_plan in plan.decode_ranks:
        notify = ",".join(map(str, rank_plan.notify_only)) or "-"
        per_token = plan.read_bytes_per_token(rank_plan)
        for i, (read, nbytes) in enumerate(zip(rank_plan.reads, per_token, strict=True)):
            heads = "latent" if read.heads is None else f"[{read.heads[0]}, {read.heads[1]})"
            first = i == 0  # rank and notify-only go on a rank's first row only
            block_bytes = str(nbytes * plan.decode.block_size)
            rows.append(
                (
                    str(rank_plan.rank) if first else "",
                    str(read.prefill_rank),
                    heads,
                    block_bytes,
                    notify if first else "",
                )
            )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        f"prefill: {_describe(plan.prefill)}",
        f"decode:  {_describe(plan.decode)}",
        f"plan {plan.hash()[:16]}" + (IDENTITY_NOTE if plan.is_identity() else ""),
        "",
    ]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
