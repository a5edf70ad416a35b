"""`kv-sidecar status`: what a running sidecar is doing (engines, peers, transfers, throughput)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc
from google.protobuf import json_format

from kv_sidecar.config import ENV_PREFIX, ConfigError, load_settings
from kv_sidecar.security import PeerSecurity
from kv_sidecar_client._proto.kvsidecar.v1 import engine_pb2_grpc, peer_pb2_grpc, status_pb2

_PEER_FLAGS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name", "token_file")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="show what a running sidecar is doing",
        description="Ask a running sidecar for its registered engines and ranks, the peers it has "
        "handshaken with, transfers in flight and the throughput of the last 60 s. By default it "
        "connects to the engine socket; --peer reaches the peer port instead, with the peer TLS and "
        f"token settings (flags, {ENV_PREFIX}* environment or --config, as for `serve`).",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument("--engine-socket", metavar="PATH", help="engine socket (default: as `serve`)")
    target.add_argument("--peer", metavar="HOST:PORT", help="a sidecar's peer address")
    p.add_argument("--config", metavar="FILE", help="YAML settings file, as for `serve`")
    for name in _PEER_FLAGS:
        p.add_argument(
            "--" + name.replace("_", "-"), dest=name, metavar=name.upper(), help=f"as for `serve` ({name})"
        )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the status as JSON (proto3 JSON mapping: 64-bit integers are strings)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=5.0, help="give up after this many seconds (default: 5)"
    )
    p.set_defaults(func=run)


def fetch(args: argparse.Namespace) -> status_pb2.StatusResponse:
    flags = {name: getattr(args, name) for name in (*_PEER_FLAGS, "engine_socket")}
    settings = load_settings(flags, args.config)
    if args.peer:
        security = PeerSecurity.from_settings(settings)
        with security.channel(args.peer, []) as ch:
            return peer_pb2_grpc.PeerServiceStub(ch).Status(
                status_pb2.StatusRequest(), timeout=args.timeout_s, metadata=security.call_metadata()
            )
    with grpc.insecure_channel(f"unix:{settings.engine_socket}") as ch:
        return engine_pb2_grpc.EngineServiceStub(ch).Status(
            status_pb2.StatusRequest(), timeout=args.timeout_s
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def render(st: status_pb2.StatusResponse) -> str:
    if st.shards:
        return render_front_door(st)
    state = "DRAINING" if st.draining else "serving"
    lines = [
        f"sidecar {st.sidecar_id} (kv-sidecar {st.version}), {state}, up {st.uptime_s:.0f} s",
        f"  peer address {st.peer_address}, peer security {st.peer_security}",
        f"  engine lane {st.engine_lane}: {st.engine_lane_connections} connections open"
        if st.engine_lane
        else "  engine lane off",
        f"engines: {len({r.engine_id for r in st.ranks})} ({len(st.ranks)} ranks), "
        f"published requests held: {st.published_requests}",
    ]
    lines += [
        f"  {r.engine_id} rank {r.rank}/{r.tp_size}  {r.layout}  {r.num_blocks} blocks  {_size(r.bytes)}  "
        f"sessions {r.sessions}"
        for r in st.ranks
    ]
    lines.append(f"peers handshaken: {len(st.peers)}")
    lines += [
        f"  {p.direction:8s} {p.address}  {p.sidecar_id}  engine {p.engine_id} read by {p.reader_engine_id}  "
        f"plan {p.plan_hash}"
        for p in st.peers
    ]
    lines.append(f"in flight: {len(st.inflight)}")
    for t in st.inflight:
        arrow = "<-" if t.kind == "pull" else "->"
        size = f"  {_size(t.bytes)}" if t.bytes else ""
        lines.append(
            f"  {t.kind:5s} {t.request_id}  {t.engine_id} {arrow} {t.remote_engine_id} ({t.peer})  "
            f"{t.elapsed_s:.2f} s{size}"
        )
    r = st.recent
    window_gbps = r.bytes / r.window_s / 1e9 if r.window_s else 0.0
    busy_gbps = r.bytes / r.busy_s / 1e9 if r.busy_s else 0.0
    lines.append(
        f"last {r.window_s:.0f} s: {r.pulls} pulls ({r.failed_pulls} failed), {_size(r.bytes)}, "
        f"{window_gbps:.3g} GB/s over the window, {busy_gbps:.3g} GB/s while pulling; "
        f"{r.served_reads} reads served"
    )
    lines.append(f"data-plane workers: {len(st.workers)} (device_workers {st.device_workers or 'false'})")
    for w in st.workers:
        what = " and ".join(x for x, on in (("local copies", w.local_copies), ("staged", w.staged)) if on)
        where = "host" if w.device < 0 else f"GPU {w.device}"
        pid = f"pid {w.pid}" if w.pid else "not running"
        starting = ", starting (its copies run in the sidecar meanwhile)" if w.starting else ""
        lines.append(
            f"  {where}: {pid}, runs {what or 'nothing yet (ranks mapped)'}, restarts {w.restarts}{starting}"
        )
    refused = sum(p.count for p in st.publish_refusals)
    lines.append(
        f"publishes refused: {refused}" + (" (their decode engines compute them)" if refused else "")
    )
    lines += [
        f"  {p.engine_id or '(no engine id)'}  {p.reason}  x{p.count}  last "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(p.last_unix_s))}: {p.last_message[:200]}"
        for p in st.publish_refusals
    ]
    return "\n".join(lines)


def render_front_door(st: status_pb2.StatusResponse) -> str:
    """A node sidecar of control shards: the front door, then each shard as a sidecar of its own."""
    state = "DRAINING" if st.draining else "serving"
    lines = [
        f"sidecar {st.sidecar_id} (kv-sidecar {st.version}), {state}, up {st.uptime_s:.0f} s: front door "
        f"of {len(st.shards)} control shards",
        f"  peer address {st.peer_address} (health only; peers call the shards)",
    ]
    for index, shard in enumerate(st.shards):
        gpus = ", ".join(map(str, shard.shard_gpus))
        lines.append(f"shard {index} ({f'GPUs {gpus}' if gpus else 'no GPU'}):")
        body = render(shard) if shard.sidecar_id else "not answering (starting again?)"
        lines += ["  " + line for line in body.splitlines()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        st = fetch(args)
    except ConfigError as e:
        print(f"kv-sidecar: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        where = args.peer or "the engine socket"
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
        print(f"kv-sidecar: cannot get the status of {where}: {detail}", file=sys.stderr)
        return 1
    if args.json:
        doc = json_format.MessageToDict(
            st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        print(json.dumps(doc, indent=2))
    else:
        print(render(st))
    return 0
