"""Where a one-block pull's time goes: spans inside both sidecars, lined up with the engine's call.

Two real sidecars on loopback with bench/pulltrace/sitecustomize.py loaded: it wraps
the functions named below and records when each call starts and ends. This process
plays both engines through the thin client (as bench/latency.py) and pulls one block
at a time; each span is placed on the pull whose engine call it falls in (the clock,
CLOCK_MONOTONIC, is common to the processes), and the table gives per span the
median start and end relative to the engine's call and the median duration.

    python bench/trace_pull.py                  # other sidecar (host-nixl)
    python bench/trace_pull.py --local          # same sidecar (host-direct)
    python bench/trace_pull.py --ring [--blocks 16]   # other sidecar, the staged protocol (host-ring)
    python bench/trace_pull.py --gpu                  # other sidecar, gpu-staged, 2 MiB model blocks
    python bench/trace_pull.py --gpu --local          # same sidecar, gpu-direct (GPU0 -> GPU1 where there are 2)
    python bench/trace_pull.py --gpu --blocks 32 --concurrent 4   # one pull at a time, then 4 at once
    python bench/trace_pull.py --gpu --blocks 512 --gpu-staging-bytes 2147483648 --slots 4 --timeline
                                                      # a 1 GiB pull through 2 GiB rings, span by span
    python bench/trace_pull.py --idle 1.5 --iters 40  # each pull after a quiet spell (default 2 ms)
    python bench/trace_pull.py --gpu --batch 16 --timeline    # each engine call a PullBatch of 16 pulls

--batch N: each engine call is a PullBatch of N pulls (N requests, each of --blocks blocks), so the
table's rows are per batch: how often each span ran in one batch and its busy time summed over them.
The engine's own side of the call (the thin client in this process: the call built and sent, its
frames read, the results made) is traced too, as side "engine".

--concurrent C: spans overlap between pulls in flight together, so instead of placing them on a
pull the table compares each span's median duration, one pull at a time against C at a time.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import baseline  # noqa: E402
from gpu_latency import MODEL, run_together  # noqa: E402
from latency import SPEC  # noqa: E402

from kv_sidecar.plan.spec import EngineSpec  # noqa: E402
from kv_sidecar.refengine.procs import SidecarProcess  # noqa: E402
from kv_sidecar_client import BatchPull, SidecarClient  # noqa: E402
from kv_sidecar_client.shm import ShmKVCache  # noqa: E402

# --small: 32 KiB blocks (2 heads, head_dim 64), so that the host copies, which a GPU does in a
# kernel, do not hide the control flow of a staged pull.
SMALL = dataclasses.replace(SPEC, num_kv_heads=2, head_dim=64)


# --gpu: bench/gpu_latency.py's model rank, 32 layers, 8 heads, head_dim 128, bf16: 2 MiB per block.
GPU_MODEL = EngineSpec.from_dict(MODEL | {"num_blocks": 64})


def register(client: SidecarClient, engine_id: str, spec: EngineSpec, device: int | None = None) -> Any:
    """A cache in shared memory, or on GPU `device`, registered as rank 0 of `engine_id`."""
    import torch

    if device is None:
        cache: Any = ShmKVCache(spec.rank_tensor_shapes(), torch.bfloat16)
    else:
        from kv_sidecar.refengine.gpu_cache import GpuKVCache

        cache = GpuKVCache(spec.rank_tensor_shapes(), torch.bfloat16, torch.device("cuda", device))
    client.register_rank(engine_id, 0, spec.to_dict(), cache.handles())
    return cache


NIXL = [
    "nixl_cu13._api:nixl_agent.transfer",
    "nixl_cu13._api:nixl_agent.check_xfer_state",
    "nixl_cu13._api:nixl_agent.get_new_notifs",
    "nixl_cu13._api:nixl_agent.send_notif",
]
GRPC = ["grpc._server:_unary_response_in_pool", "grpc._server:_call_behavior"]
# The staged protocol (server/staged_reader.py, staged_source.py; dataplane/receive.py, send.py) on host memory: host_transfer ring.
STAGED = {
    "decode": [
        "kv_sidecar.server.staged_reader:StagedReader.read",
        "kv_sidecar.server.staged_reader:_receive",
        "kv_sidecar.dataplane.receive:Reception.__init__",
        "kv_sidecar.dataplane.receive:Reception.prepare",
        "kv_sidecar.dataplane.receive:Reception.wait",
        "kv_sidecar.server.staged_reader:spec_to_proto",
        "kv_sidecar.server.pull:Puller._push_with_open",
        "kv_sidecar.server.routing:Opener.request",
        "kv_sidecar.server.staged_reader:_PushCall.__init__",
        "kv_sidecar.server.staged_reader:signed_notif",
        "kv_sidecar.transport.nixl_driver:NixlDriver.notify",
        "kv_sidecar.plan.pair:PairPlan.hash",
        "grpc._channel:_UnaryUnaryMultiCallable.future",
        "grpc._channel:_UnaryUnaryMultiCallable.__call__",
        "kv_sidecar.server.push_threads:PushThreads.call",
        "threading:Thread.start",
        "kv_sidecar.server.staged_reader:_stop_source",
        "kv_sidecar.dataplane.chunk_copies:HostCopies.launch",
        "kv_sidecar.dataplane.chunk_copies:GpuCopies.launch",
        "kv_sidecar.dataplane.receive:_Credits.poll",
        "kv_sidecar.dataplane.staged_protocol:SlotPool.acquire",
        "kv_sidecar.dataplane.staged_protocol:RecvState.arrive",
        "kv_sidecar.transport.nixl_driver:NixlDriver.add_poller",
        "kv_sidecar.transport.nixl_driver:NixlDriver._poll_notifs",
        "kv_sidecar.transport.nixl_driver:NixlDriver._poll_transfers",
        "kv_sidecar.transport.nixl_driver:NixlDriver._run_pollers",
        "kv_sidecar.transport.nixl_driver:NixlDriver.send_notif",
        "kv_sidecar.transport.nixl_driver:NixlDriver.load_remote",
        "nixl_cu13._api:nixl_agent.send_notif",
    ],
    "prefill": [
        "kv_sidecar.server.staged_source:StagedSource.serve",
        "kv_sidecar.server.staged_source:cached_plan",
        "kv_sidecar.server.staged_source:StagedSource.from_notification",
        "kv_sidecar.server.staged_source:StagedSource._run_push",
        "kv_sidecar.server.push_runs:PushKeys.check",
        "kv_sidecar.server.push_threads:PushThreads.run_source",
        "kv_sidecar.dataplane.chunk_copies:HostCopies.launch",
        "kv_sidecar.dataplane.chunk_copies:GpuCopies.launch",
        "kv_sidecar.dataplane.send:_Pump.poll",
        "kv_sidecar.server.published:PublishedStore.get_live",
        "kv_sidecar.dataplane.staged_protocol:SlotPool.acquire",
        "kv_sidecar.dataplane.staged_protocol:SendState.next_gather",
        "kv_sidecar.dataplane.staged_protocol:SendState.wait_finished",
        "kv_sidecar.dataplane.staged_protocol:SendState.write_done",
        "kv_sidecar.dataplane.staged_protocol:SendState.credit",
        "kv_sidecar.transport.nixl_driver:NixlDriver.add_poller",
        "kv_sidecar.transport.nixl_driver:NixlDriver.write_slot_now",
        "kv_sidecar.transport.nixl_driver:NixlDriver.load_remote",
        "kv_sidecar.transport.nixl_driver:NixlDriver._poll_notifs",
        "kv_sidecar.transport.nixl_driver:NixlDriver._poll_transfers",
        "kv_sidecar.transport.nixl_driver:NixlDriver._run_pollers",
        "nixl_cu13._api:nixl_agent.initialize_xfer",
        # the source's host steps between the start and the gather launch
        "kv_sidecar.server.staged_source:StagedSource._push",
        "kv_sidecar.server.staged_source:spec_from_proto",
        "kv_sidecar.server.staged_source:read_heads",
        "kv_sidecar.server.staged_source:StagedSource._open_from_push",
        "kv_sidecar.server.reads:SourceReads.open_for_reader",
        "kv_sidecar.server.engines:EngineRegistry.spec",
        "kv_sidecar.server.published:Published.readers_here",
        "kv_sidecar.server.reads:opened_bytes",
        "kv_sidecar.server.reads:begin_serve",
        "kv_sidecar.transport.nixl_driver:NixlDriver.wake",
        "kv_sidecar.server.staged_source:StagedSource._members",
        "kv_sidecar.server.staged_source:check_tokens",
        "kv_sidecar.dataplane.send:Transmission.run",
        "kv_sidecar.dataplane.staged_protocol:plan_chunks",
        "kv_sidecar.dataplane.staged_protocol:SendState.__init__",
        "kv_sidecar.dataplane.plane:DevicePlane.ring",
        "kv_sidecar.server.engines:EngineRegistry.get",
        "kv_sidecar.transport.nixl_driver:NixlDriver.listen",
    ],
}
# --batch: a PullBatch's own steps and each member's work outside the moves.
BATCH = [
    "kv_sidecar.server.adapters.engine_lane:EngineLane._pull_batch",
    "kv_sidecar.server.pull_batch:PullBatches.run",
    "kv_sidecar.server.pull_batch:PullBatches._together_run",
    "kv_sidecar.server.pull_batch:PullBatches._settle",
    "multiprocessing.connection:Connection.send_bytes",
    "logging.handlers:QueueHandler.emit",
    "kv_sidecar.server.transfers:TransferTracker.end_pull",
    "kv_sidecar.server.inflight:InflightPulls.end",
    "kv_sidecar.server.routing:Opener.request",
    "kv_sidecar.server.pull_batch:repeated_members",
    "kv_sidecar.server.pull:Puller.goes_together",
    "kv_sidecar.server.pull:Puller.move_all",
    "kv_sidecar.server.pull:Puller._local_ranks",
    "kv_sidecar.server.staged_reader:StagedReader.read_all",
    "kv_sidecar.dataplane.local_copies:copy_gpu_all",
    "kv_sidecar.server.inflight:InflightPulls.begin",
    "kv_sidecar.server.inflight:InflightPulls.end",
    "kv_sidecar.server.after_answer:run_later",
    "kv_sidecar.plan.blocks:check_start",
    "kv_sidecar.plan.blocks:check_pull",
    "kv_sidecar.server.routing:holders_needed",
    # device_workers: a batch's copies sent to a device's worker and their answer awaited
    "kv_sidecar.dataplane.plane:DataPlane.copy_local_all",
    "kv_sidecar.dataplane.workers:CopyWorker.post_copies",
    "kv_sidecar.dataplane.workers:PostedCopies.wait",
]
# --batch: the engine's own side of a PullBatch call, traced in this process (the thin client): the call
# built and sent, each frame read, the members' results made.
ENGINE = [
    "kv_sidecar_client.client:SidecarClient.pull_batch_async",
    "kv_sidecar_client.client:SidecarClient._route",
    "kv_sidecar_client.client:start_batch",
    "kv_sidecar_client.lane:Lane.send",
    "kv_sidecar_client.lane:read_answer",
    "kv_sidecar_client.lane:LaneBatch._ahead",
    "kv_sidecar_client.lane:LaneBatch.member_result",
    "kv_sidecar_client.results:batch_results",
]
# device_workers, a pull's copy through its worker (these spans also run in the worker, as "... worker"):
# the message out, the copy there, its answer out, the answer taken in (set_result) and awaited.
WORKER = [
    "kv_sidecar.dataplane.workers:CopyWorker.copy",
    "kv_sidecar.dataplane.workers:CopyWorker._post_id",
    "kv_sidecar.dataplane.workers:CopyWorker.answer_by",
    "kv_sidecar.dataplane.local_copies:copy_all",
    "kv_sidecar.dataplane.local_copies:copy_host",
    "multiprocessing.connection:Connection.send",
    "concurrent.futures._base:Future.set_result",
]
# --gpu: inside the copies of a staged transfer (validation, upload, launch templates, the launch).
GPU_DETAIL = [
    "kv_sidecar.execute.gpu:StagedCopies.__init__",
    "kv_sidecar.execute.gpu:StagedCopies._template",
    "kv_sidecar.execute.gpu:check_copy",
    "kv_sidecar.execute.gpu:_upload_ids",
    "kv_sidecar.execute.gpu:_DeviceState.templates",
    "kv_sidecar.execute.gpu:_DeviceState.arange",
    "kv_sidecar.execute.gpu:plan_launch",
    "kv_sidecar.execute.gpu:staging_view",
    "kv_sidecar.execute.gpu:_DeviceState.layer_table",
    "kv_sidecar.execute.gpu_kernels:kv_copy_kernel.run",
    "kv_sidecar.execute.gpu_kernels:Launcher.__call__",
    "kv_sidecar.dataplane.chunk_copies:GpuCopies.__init__",
    "kv_sidecar.dataplane.chunk_copies:GpuCopies.synchronize",
]
# --gpu --local: a gpu-direct pull's validation, upload, launch and synchronisation.
GPU_DIRECT = [
    "kv_sidecar.dataplane.local_copies:copy_gpu",
    "kv_sidecar.execute.gpu:copy_request",
    "kv_sidecar.execute.gpu:prepare_request",
    "kv_sidecar.execute.gpu:PreparedCopy.launch",
    "kv_sidecar.execute.gpu:check_copy",
    "kv_sidecar.execute.gpu:plan_launch",
    "kv_sidecar.execute.gpu:_upload_ids",
    "kv_sidecar.execute.gpu:_DeviceState.layer_table",
    "kv_sidecar.execute.gpu_kernels:kv_copy_kernel.run",
    "kv_sidecar.execute.gpu_kernels:Launcher.__call__",
]
SPANS = {
    "decode": [
        *GRPC,
        "kv_sidecar.server.pull:Puller.pull",
        "kv_sidecar.server.pull_direct:DirectPulls.pull",
        "kv_sidecar.server.pull_direct:DirectPulls._copy",
        "kv_sidecar.server.peers:Peers.remote_engine",
        "kv_sidecar.server.routing:Opening.__init__",
        "kv_sidecar.server.routing:Opener.request",
        "kv_sidecar.server.notified_opens:NotifiedOpen.__init__",
        "kv_sidecar.server.routing:Opening.finish",
        "kv_sidecar.server.notified_opens:NotifiedOpen.result",
        "kv_sidecar.server.pull_job:build_job",
        "kv_sidecar.server.pull:Puller._read_remote",
        "kv_sidecar.dataplane.nixl_reads:NixlReads.post",
        "kv_sidecar.dataplane.nixl_reads:NixlReads.finish",
        "kv_sidecar.server.pull:Puller.send_done",
        "kv_sidecar.transport.nixl_driver:NixlDriver.read_prepped",
        "kv_sidecar.transport.nixl_driver:NixlDriver._post",
        "kv_sidecar.transport.nixl_driver:NixlDriver._release",
        "kv_sidecar.dataplane.nixl_reads:NixlReads.wait",
        "kv_sidecar.transport.nixl_driver:NixlDriver.send_notif",
        "kv_sidecar.server.published:PublishedStore.open_read",
        "kv_sidecar.server.published:PublishedStore.mark_done",
        "kv_sidecar.server.transfers:TransferTracker.begin_pull",
        "kv_sidecar.server.transfers:TransferTracker.end_pull",
        "kv_sidecar.server.staged_reader:joined_tokens",
        "kv_sidecar.server.staged_reader:groupable",
        "kv_sidecar.server.staged_reader:_Halts.remaining",
        "kv_sidecar.server.staged_reader:_UntilLost.remaining",
        "kv_sidecar.server.staged_reader:StagedReader._lead",
        "kv_sidecar.server.staged_reader:StagedReader._transfer",
        "kv_sidecar.server.group_commit:GroupCommit.enqueue",
        "kv_sidecar.server.group_commit:GroupCommit.finish",
        "kv_sidecar.dataplane.plane:DataPlane.receive",
        "kv_sidecar.server.peers:Peers.link",
        "kv_sidecar.server.peers:RemoteEngine.sender_of",
        "kv_sidecar.server.staged_common:read_heads",
        *NIXL,
    ],
    "prefill": [
        *GRPC,
        "kv_sidecar.server.adapters.peer_service:PeerServicer.Push",
        "kv_sidecar.server.notified_opens:OpenAnswers.answer",
        "kv_sidecar.server.published:PublishedStore.open_read",
        "kv_sidecar.server.transfers:TransferTracker.begin_serve",
        "kv_sidecar.server.published:PublishedStore.mark_done",
        "kv_sidecar.server.transfers:TransferTracker.serve_rank_done",
        "kv_sidecar.server.staged_source:StagedSource._check_open",
        "kv_sidecar.server.staged_source:StagedSource._open_checked",
        "kv_sidecar.server.reads:SourceReads._pin",
        "kv_sidecar.dataplane.plane:DataPlane.send",
        "kv_sidecar.dataplane.plane:DataPlane._uploaded",
        *NIXL,
    ],
}


def start(
    name: str, spans: list[str], out: str, tree: str | None, extra: list[str] | None = None
) -> SidecarProcess:
    path = [str(HERE / "pulltrace")] + (baseline.env(tree)["PYTHONPATH"].split(os.pathsep) if tree else [])
    env = {
        "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]),
        "KV_SIDECAR_TRACE": out,
        "KV_SIDECAR_TRACE_SPANS": ",".join(spans),
    }
    return SidecarProcess(name, extra=extra, env=env, start_timeout_s=120)


def trace_here(targets: list[str]) -> list[tuple[str, str, float, float]]:
    """Wrap `targets` in this process as the sidecars' tracer does (bench/pulltrace); the list their
    spans go to."""
    spec = importlib.util.spec_from_file_location("pulltrace_here", HERE / "pulltrace" / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    tracer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tracer)  # inert here: no KV_SIDECAR_TRACE in this process's environment
    for t in targets:
        tracer._patch(t)
    return tracer._SPANS


def collect(sc: SidecarProcess, path: str) -> list[tuple[str, str, float, float]]:
    os.kill(sc.proc.pid, signal.SIGUSR2)
    time.sleep(1.0)
    return _read_spans(path)


def _read_spans(path: str) -> list[tuple[str, str, float, float]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f]


def collect_workers(sc: SidecarProcess, path: str) -> list[tuple[str, str, float, float]]:
    """The spans of the sidecar's device workers (its child processes), all workers in one list."""
    children = sc.worker_pids()
    for pid in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR2)
    if not children:
        return []
    time.sleep(1.0)
    return [r for pid in children for r in _read_spans(f"{path}.worker{pid}")]


def wait_for_workers(sc: SidecarProcess, timeout_s: float = 120) -> None:
    """Until the decode sidecar's workers answer: the first copy starts a device's worker, and copies
    run in the sidecar until it answers, so that pulls traced before would not go through it."""
    deadline = time.monotonic() + timeout_s
    while not sc.worker_pids() or len(sc.answering_workers()) < len(sc.worker_pids()):
        if time.monotonic() > deadline:
            raise SystemExit("the decode sidecar's workers did not answer")
        time.sleep(0.05)


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--local", action="store_true", help="same sidecar (host-direct)")
    ap.add_argument("--baseline", metavar="GIT_REF", help="trace the sidecar of this revision instead")
    ap.add_argument("--ring", action="store_true", help="the staged protocol on host memory (host-ring)")
    ap.add_argument("--gpu", action="store_true", help="gpu-staged: GPU caches, default rings")
    ap.add_argument("--blocks", type=int, default=1, help="blocks per pull (256 KiB each)")
    ap.add_argument("--small", action="store_true", help="32 KiB blocks instead of 256 KiB")
    ap.add_argument("--ring-bytes", type=int, default=64 << 20, help="--ring: gpu_staging_bytes (host rings)")
    ap.add_argument(
        "--gpu-staging-bytes", type=int, default=0, help="--gpu: the sidecars' rings (0: their default)"
    )
    ap.add_argument("--slots", type=int, default=0, help="--gpu, --ring: slots per ring (0: the default)")
    ap.add_argument(
        "--fragmented",
        action="store_true",
        help="random block ids in a pool 1.25x the pull (not --concurrent)",
    )
    ap.add_argument(
        "--timeline", action="store_true", help="also list every span of the median pull, in order"
    )
    ap.add_argument("--concurrent", type=int, default=1, help="compare with C pulls in flight at once")
    ap.add_argument("--batch", type=int, default=0, help="each engine call a PullBatch of N pulls")
    ap.add_argument("--sidecar-args", default="", help="more `kv-sidecar serve` options for both sidecars")
    ap.add_argument(
        "--spans",
        default="",
        help="more functions to trace on both sidecars, comma-separated module:qualname "
        "(e.g. kv_sidecar.dataplane.receive:_Credits.add)",
    )
    ap.add_argument(
        "--idle", type=float, default=0.002, help="seconds between pulls (1.5: each after a quiet second)"
    )
    args = ap.parse_args()
    extra = ["--host-transfer", "ring", "--gpu-staging-bytes", str(args.ring_bytes)] if args.ring else []
    if args.gpu and args.gpu_staging_bytes:
        extra += ["--gpu-staging-bytes", str(args.gpu_staging_bytes)]
    if args.slots:
        extra += ["--gpu-staging-slots", str(args.slots)]
    extra += shlex.split(args.sidecar_args)
    # Copies go through device workers (whose spans are then traced too, once they answer).
    workers_on = re.search(r"--device-workers[= ]true\b", args.sidecar_args) is not None
    spans_of = {
        k: v
        + (STAGED[k] if args.ring or (args.gpu and not args.local) else [])
        + ((GPU_DIRECT if args.local else GPU_DETAIL) if args.gpu else [])
        + (BATCH if args.batch and k == "decode" else [])
        + (WORKER if workers_on else [])
        + [x for x in args.spans.split(",") if x]
        for k, v in SPANS.items()
    }
    tree = baseline.export(args.baseline) if args.baseline else None
    tmp = tempfile.mkdtemp(prefix="pulltrace-")
    files = {"prefill": f"{tmp}/prefill.jsonl", "decode": f"{tmp}/decode.jsonl"}
    a = start(
        "trace-prefill",
        spans_of["prefill"] + (spans_of["decode"] if args.local else []),
        files["prefill"],
        tree,
        extra,
    )
    b = start("trace-decode", spans_of["decode"], files["decode"], tree, extra)
    caches = []
    calls: list[tuple[float, float]] = []
    try:
        time.sleep(1.5)  # the tracer patches once the server modules are in
        ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
        dec = ca if args.local else cb
        spec = GPU_MODEL if args.gpu else SMALL if args.small else SPEC
        pool = args.blocks * 5 // 4 if args.fragmented else args.blocks
        spec = dataclasses.replace(spec, num_blocks=max(spec.num_blocks, pool))
        rng = random.Random(1)
        # --fragmented: both sides' ids a random pick of the pool (as bench/gpu_pull.py's sidecar rows).
        src_ids = (
            rng.sample(range(spec.num_blocks), args.blocks) if args.fragmented else list(range(args.blocks))
        )
        dst_ids = (
            rng.sample(range(spec.num_blocks), args.blocks)
            if args.fragmented
            else list(range(spec.num_blocks - args.blocks, spec.num_blocks))
        )
        if args.concurrent > 1 or args.batch:  # each puller (member) its own destination blocks
            spec = dataclasses.replace(
                spec, num_blocks=max(spec.num_blocks, (max(args.concurrent, args.batch) + 1) * args.blocks)
            )
        devices = (0, 1 if torch.cuda.device_count() > 1 else 0) if args.gpu else (None, None)
        caches += [register(ca, "tr-p", spec, devices[0]), register(dec, "tr-d", spec, devices[1])]
        if args.concurrent > 1:
            windows = [run_phase(ca, dec, spec, args.blocks, c, args.iters) for c in (1, args.concurrent)]
            spans = {k: collect(sc, files[k]) for k, sc in (("prefill", a), ("decode", b))}
            compare_phases(windows, spans, args.blocks * block_bytes(spec))
            return 0
        n = args.blocks
        here = trace_here(ENGINE) if args.batch else None  # the engine's side, this process
        for i in range(args.iters + 20):
            if args.batch:
                members = [
                    BatchPull(
                        ca.publish("tr-p", f"t{i}-{k}", src_ids, n * spec.block_size),
                        list(range(spec.num_blocks - (k + 1) * n, spec.num_blocks - k * n)),
                    )
                    for k in range(args.batch)
                ]
                t0 = time.perf_counter()
                results = dec.pull_batch("tr-d", members)
                t1 = time.perf_counter()
            else:
                params = ca.publish("tr-p", f"t{i}", src_ids, n * spec.block_size)
                t0 = time.perf_counter()
                results = [dec.pull(params, "tr-d", dst_ids)]
                t1 = time.perf_counter()
            for res in results:
                assert res.ok, res
                assert not args.gpu or res.path == ("gpu-direct" if args.local else "gpu-staged"), res.path
            if i == 0 and workers_on:
                wait_for_workers(a if args.local else b)
            if i >= 20:
                calls.append((t0, t1))
            time.sleep(args.idle)  # keep pulls apart, so late spans (notifications) stay on their pull
        spans = {k: collect(sc, files[k]) for k, sc in (("prefill", a), ("decode", b))}
        if here is not None:
            spans["engine"] = list(here)
        for k, sc in (("prefill", a), ("decode", b)):  # device_workers: the workers' own spans
            if in_workers := collect_workers(sc, files[k]):
                spans[f"{k} worker"] = in_workers
    finally:
        for c in caches:
            c.close()
        a.stop()
        b.stop()
    print(
        f"{'gpu-direct' if args.gpu and args.local else 'local' if args.local else 'ring' if args.ring else 'gpu-staged' if args.gpu else 'remote'}, {args.blocks} block(s)"
        f"{f', PullBatches of {args.batch}' if args.batch else ''}: {len(calls)} calls, engine wall p50 "
        f"{statistics.median(t1 - t0 for t0, t1 in calls) * 1e3:.3f} ms, {args.idle:g} s apart "
        f"(load {os.getloadavg()[0]:.1f})"
    )
    print(
        "| side | span | thread | n/pull | start ms | end ms | duration ms | busy ms |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for side, recs in spans.items():
        recs.sort(key=lambda r: r[2])
        starts = [r[2] for r in recs]
        per: dict[tuple[str, str], list[tuple[float, float, int, float]]] = {}
        for t0, t1 in calls:
            hits: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for thread, name, s, e in recs[
                bisect.bisect_left(starts, t0) : bisect.bisect_right(starts, t1 + 0.002)
            ]:
                kind = "nixl" if thread.startswith("nixl") else thread.rstrip("0123456789_")
                hits.setdefault((name, kind), []).append((s - t0, e - t0))
            for key, h in hits.items():
                first = min(x[0] for x in h)
                last = max(x[1] for x in h)
                per.setdefault(key, []).append((first, last, len(h), sum(x[1] - x[0] for x in h)))
        rows = sorted(per.items(), key=lambda kv: statistics.median(x[0] for x in kv[1]))
        for (name, thread), xs in rows:
            if len(xs) < len(calls) // 2:
                continue
            st = statistics.median(x[0] for x in xs) * 1e3
            en = statistics.median(x[1] for x in xs) * 1e3
            n = statistics.median(x[2] for x in xs)
            du = statistics.median(x[1] - x[0] for x in xs) * 1e3
            busy = statistics.median(x[3] for x in xs) * 1e3
            print(f"| {side} | {name} | {thread} | {n:g} | {st:.3f} | {en:.3f} | {du:.3f} | {busy:.3f} |")
    if args.timeline:
        timeline(spans, calls)
    return 0


# Called on every turn of the NIXL thread's loop: counted in the timeline, not listed.
POLLS = ("_poll_notifs", "_poll_transfers", "_run_pollers", "check_xfer_state", "get_new_notifs", "poll")


def timeline(spans: dict[str, list[tuple[str, str, float, float]]], calls: list[tuple[float, float]]) -> None:
    """Every span of the pull whose engine wall time is the median, in the order they started."""
    t0, t1 = sorted(calls, key=lambda c: c[1] - c[0])[len(calls) // 2]
    rows = []
    polls: dict[tuple[str, str], int] = {}
    for side, recs in spans.items():
        for thread, name, s, e in recs:
            if not t0 <= s <= t1 + 0.002:
                continue
            kind = "nixl" if thread.startswith("nixl") else thread
            if name.rsplit(".", 1)[-1] in POLLS:
                polls[(side, name)] = polls.get((side, name), 0) + 1
                continue
            rows.append((s - t0, e - t0, side, name, kind))
    print(
        f"\nTimeline of the median pull ({(t1 - t0) * 1e3:.3f} ms at the engine), ms from the engine's call:"
    )
    print("| start | end | side | span | thread |\n|---|---|---|---|---|")
    for s, e, side, name, kind in sorted(rows):
        print(f"| {s * 1e3:.3f} | {e * 1e3:.3f} | {side} | {name} | {kind} |")
    print(
        "Polls in that window: "
        + ", ".join(f"{side} {name} x{n}" for (side, name), n in sorted(polls.items()))
    )


def block_bytes(spec: EngineSpec) -> int:
    import torch

    return (
        sum(math.prod(s) for s in spec.rank_tensor_shapes())
        * torch.finfo(torch.bfloat16).bits
        // 8
        // spec.num_blocks
    )


def run_phase(
    ca: SidecarClient, dec: SidecarClient, spec: EngineSpec, n: int, c: int, pulls: int
) -> tuple[int, float, float, list[float]]:
    """`pulls` pulls of `n` blocks, `c` in flight at once (after a warm-up round): (c, start, end, walls)."""
    walls: list[float] = []
    lock = threading.Lock()
    rounds = max(2, pulls // c)
    go = threading.Barrier(c + 1)
    ids = itertools.count()

    def worker(w: int) -> None:
        dst = list(range(spec.num_blocks - (w + 1) * n, spec.num_blocks - w * n))
        for r in range(rounds + 1):
            if r == 1:
                go.wait()
            params = ca.publish("tr-p", f"c{c}-{next(ids)}", list(range(n)), n * spec.block_size)
            t0 = time.perf_counter()
            res = dec.pull(params, "tr-d", dst)
            assert res.ok, res
            if r:
                with lock:
                    walls.append(time.perf_counter() - t0)

    start, end = run_together(worker, c, go)
    time.sleep(0.5)
    return c, start, end, walls


def compare_phases(
    windows: list[tuple[int, float, float, list[float]]],
    spans: dict[str, list[tuple[str, str, float, float]]],
    pull_bytes: int,
) -> None:
    heads = []
    for c, start, end, walls in windows:
        gbps = len(walls) * pull_bytes / (end - start) / 1e9
        heads.append(
            f"{c} at once: {len(walls)} pulls, engine wall p50 {statistics.median(walls) * 1e3:.3f} ms, {gbps:.2f} GB/s"
        )
    print("; ".join(heads) + f" (load {os.getloadavg()[0]:.1f})")
    cs = [w[0] for w in windows]
    print(
        "| side | span | thread | "
        + " | ".join(f"{c} at once: calls/pull, p50 ms, p90 ms" for c in cs)
        + " |\n|---|---|---|"
        + "---|" * len(cs)
    )
    for side, recs in spans.items():
        per: dict[tuple[str, str], list[list[float]]] = {}
        for thread, name, s, e in recs:
            kind = "nixl" if thread.startswith("nixl") else thread.rstrip("0123456789_")
            for i, (_, start, end, _) in enumerate(windows):
                if start <= s <= end:
                    per.setdefault((name, kind), [[] for _ in windows])[i].append(e - s)
        for (name, kind), durs in sorted(per.items(), key=lambda kv: -statistics.median(kv[1][-1] or [0])):
            if any(len(d) < len(w[3]) // 2 for d, w in zip(durs, windows, strict=True)):
                continue  # not once per pull in every phase: polls, or another path's spans
            cells = []
            for d, w in zip(durs, windows, strict=True):
                d = sorted(d)
                cells.append(
                    f"{len(d) / len(w[3]):.1f}, {statistics.median(d) * 1e3:.3f}, {d[int(0.9 * (len(d) - 1))] * 1e3:.3f}"
                )
            print(f"| {side} | {name} | {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
