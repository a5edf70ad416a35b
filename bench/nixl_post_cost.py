"""What posting one host-nixl READ costs, by how its descriptors are given to NIXL.

Two NIXL agents in two processes (this one reads; a spawned one holds the source memory and polls), host
memory shaped like a host-nixl rank: `regions` tensors, each `outer` planes (K/V) of `--num-blocks`
chunks. For n consecutive blocks, three ways to READ the same bytes, samples interleaved:

  prepared   indices into per-block descriptor lists prepared once (prep_xfer_dlist, make_prepped_xfer):
             what host-nixl does by default; "reversed": the same blocks listed last first, so that no
             descriptor is followed by its neighbour in memory
  merged     one descriptor per (region, outer) run, lists built for the READ (plan/chunks.merged_segments,
             initialize_xfer): host_read_merge
  per-block  one descriptor per block chunk, lists built for the READ: the cost of building alone

Columns (medians, microseconds): build (the descriptor list or indices), init (NIXL's transfer handle),
transfer (the transfer() call; over shared memory UCX copies within it), wait (polling to DONE), and
their sum.
No sidecar, no gRPC: only what the descriptor lists change.

    python bench/nixl_post_cost.py
    python bench/nixl_post_cost.py --chunks 2048,32768 --blocks 1,8,128 --iters 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from kv_sidecar.plan.chunks import (
    ChunkGeometry,
    chunk_indices,
    descriptor_table,
    descriptors,
    merged_segments,
    segment_descriptors,
)
from kv_sidecar.transport.nixl_driver import import_nixl

REGIONS, OUTER = 4, 2  # bench/latency.py's rank: 4 layers, K and V


def agent(name: str) -> Any:
    api = import_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def serve(conn: Connection, region_bytes: int) -> None:
    """The source: registers its memory, sends its metadata and addresses, polls until told to stop
    (a READ's completion waits for the target's progress)."""
    src = agent("source")
    bufs = [np.full(region_bytes, 7, dtype=np.uint8) for _ in range(REGIONS)]
    src.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
    conn.send((src.get_agent_metadata(), [b.ctypes.data for b in bufs]))
    while not conn.poll(0):
        src.get_new_notifs()
        time.sleep(0.0001)


def measure(chunk: int, num_blocks: int, sizes: list[int], iters: int) -> None:
    """Rows of one chunk size, against a source process of its own."""
    geo = ChunkGeometry(REGIONS, OUTER, num_blocks * chunk, chunk, num_blocks, OUTER * num_blocks * chunk)
    ctx = mp.get_context("spawn")  # a child forked after NIXL was loaded hung at its first READ (tried)
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(theirs, geo.region_bytes))
    proc.start()
    try:
        metadata, remote_bases = ours.recv()
        reader = agent(f"reader-{chunk}")
        bufs = [np.zeros(geo.region_bytes, dtype=np.uint8) for _ in range(REGIONS)]
        reader.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
        reader.add_remote_agent(metadata)
        local_bases = [b.ctypes.data for b in bufs]
        local_list = reader.prep_xfer_dlist("NIXL_INIT_AGENT", descriptor_table(geo, local_bases), "DRAM")
        remote_list = reader.prep_xfer_dlist("source", descriptor_table(geo, remote_bases), "DRAM")

        def run(handle: Any, marks: list[float]) -> list[float]:
            state = reader.transfer(handle)
            marks.append(time.perf_counter())
            while state != "DONE":
                if state not in ("PROC",):
                    raise RuntimeError(f"transfer {state}")
                state = reader.check_xfer_state(handle)
            marks.append(time.perf_counter())
            handle.release()
            return marks

        def prepared(ids: np.ndarray) -> tuple[int, list[float]]:
            marks = [time.perf_counter()]
            idx = chunk_indices(geo, ids).astype(np.int32)
            marks.append(time.perf_counter())
            h = reader.make_prepped_xfer("READ", local_list, idx, remote_list, idx, b"")
            marks.append(time.perf_counter())
            return len(idx), run(h, marks)

        def built(ids: np.ndarray, merge: bool) -> tuple[int, list[float]]:
            marks = [time.perf_counter()]
            if merge:
                lo, re_ = segment_descriptors(merged_segments(geo, geo, ids, ids), local_bases, remote_bases)
            else:
                lo, re_ = descriptors(geo, local_bases, ids), descriptors(geo, remote_bases, ids)
            marks.append(time.perf_counter())
            h = reader.initialize_xfer(
                "READ",
                reader.get_xfer_descs(lo, "DRAM"),
                reader.get_xfer_descs(re_, "DRAM"),
                "source",
                b"",
            )
            marks.append(time.perf_counter())
            return len(lo), run(h, marks)

        for n in sizes:
            ids = np.arange(8, 8 + n)
            ways: dict[str, Callable[[], tuple[int, list[float]]]] = {
                "prepared": partial(prepared, ids),
                "prepared, reversed": partial(prepared, ids[::-1]),
                "merged": partial(built, ids, True),
                "per-block": partial(built, ids, False),
            }
            samples: dict[str, list[np.ndarray]] = {w: [] for w in ways}
            counts: dict[str, int] = {}
            for i in range(5 + iters):  # interleaved: the machine's noise falls on all three
                for w, fn in ways.items():
                    count, marks = fn()
                    counts[w] = count
                    if i >= 5:
                        samples[w].append(np.diff(marks))
            for w in ways:
                med = [statistics.median(col) * 1e6 for col in np.array(samples[w]).T]
                cells = " | ".join(f"{x:.1f}" for x in med)
                print(f"| {chunk} | {n} | {w} | {counts[w]} | {cells} | {sum(med):.1f} |", flush=True)
    finally:
        ours.send(None)
        proc.join(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="2048,8192,32768", help="bytes of one block chunk, comma-separated")
    ap.add_argument("--blocks", default="1,8,128", help="consecutive blocks per READ, comma-separated")
    ap.add_argument("--num-blocks", type=int, default=512, help="blocks of each side's cache")
    ap.add_argument("--iters", type=int, default=40, help="samples per row (after 5 warm-up)")
    args = ap.parse_args()
    sizes = [int(b) for b in args.blocks.split(",")]
    print("| chunk | blocks | how | descriptors | build us | init us | transfer us | wait us | sum us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        measure(chunk, args.num_blocks, sizes, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
