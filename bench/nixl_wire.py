"""What NIXL's WRITE moves between two GPUs' staging buffers, by UCX setting: the staged path's wire alone.

A staged chunk is one NIXL WRITE from the source sidecar's send slot (memory it allocated itself) into a
receive slot of the reader's ring (memory the reader allocated), over UCX: between GPUs of one host, its
cuda_ipc transport. This measures that wire with nothing else: two processes, each owning one buffer on its
GPU, WRITEs made from one-descriptor lists prepared once (as the sidecar's driver makes them), no sidecar,
no gRPC, no gather or scatter. The same rows run under each UCX setting given (each a fresh pair of
processes: UCX reads its environment once), beside the NVLink ceiling (torch's peer copy) in the same run.

Rows: one WRITE of 2 MiB, 64 MiB, 256 MiB or 1 GiB at a time; and 1 GiB as 16 WRITEs of 64 MiB (or 4 of
256 MiB) with at most --depth in flight, each posted as soon as one ends, as a ring of that many slots
does. Every row is checked: the receiving buffer zeroed, one more pass, then each MiB's sum against the
sender's, by place.

    python bench/nixl_wire.py                                  # default UCX, then the --variants
    python bench/nixl_wire.py --variants "UCX_CUDA_IPC_MAX_STREAMS=1" "nixl.num_workers=4"
                                                               # UCX_* set in the environment, nixl.K=V
                                                               # given to NIXL's UCX backend
    python bench/nixl_wire.py --proto-info                     # UCX_PROTO_INFO=y on the default (logs)

Needs 2 GPUs (1 works: both buffers on GPU0) and nixl. Prints a table; --write adds it to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_pull import ceiling
from report import write_section

from kv_sidecar.transport.nixl_driver import import_nixl

MIB = 1 << 20
GIB = 1 << 30
BUF = GIB + 256 * MIB  # room for 1 GiB at any offset below 256 MiB
SIZES = (2 * MIB, 64 * MIB, 256 * MIB, GIB)
RINGS = ((64 * MIB, 16), (256 * MIB, 4))  # (chunk, chunks): 1 GiB through slots of that size


def _agent(name: str, env: dict[str, str]) -> Any:
    """A NIXL agent with its UCX backend: `env`'s UCX_* keys set in the environment first (UCX reads it
    when the backend starts), its `nixl.K` keys given to the backend as parameter K."""
    os.environ.update({k: v for k, v in env.items() if not k.startswith("nixl.")})
    api = import_nixl()  # as the sidecar imports it (UCX's emulation off unless env says otherwise)
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    params = dict(agent.get_plugin_params("UCX")) | {
        k[5:]: v for k, v in env.items() if k.startswith("nixl.")
    }
    agent.create_backend("UCX", params)
    return agent


def _device(dev: int) -> str:
    return "cpu" if dev < 0 else f"cuda:{dev}"


def _mem(dev: int) -> str:
    return "DRAM" if dev < 0 else "VRAM"


def checksum(b: Any) -> int:
    """Each MiB's byte sum, weighted by its place: a chunk written at another offset changes it."""
    import torch

    rows = b.view(-1, MIB).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device)
    return int((rows * weights).sum().item())


def _target(dev: int, env: dict[str, str], meta_q: Any, ctl_q: Any, res_q: Any) -> None:
    """The reader's side: owns the receive buffer, answers checksums until told to stop."""
    import torch

    buf = torch.zeros(BUF, dtype=torch.uint8, device=_device(dev))
    agent = _agent("wire-target", env)
    agent.register_memory([(buf.data_ptr(), BUF, max(dev, 0), "")], _mem(dev))
    meta_q.put((agent.get_agent_metadata(), buf.data_ptr(), dev))
    while True:
        try:
            msg = ctl_q.get_nowait()
        except queue.Empty:
            agent.get_new_notifs()  # progress: the connection's wire-up needs this end too
            time.sleep(0.0002)
            continue
        if msg is None:
            break
        if msg == "zero":
            buf.zero_()
            if dev >= 0:
                torch.cuda.synchronize(dev)
            res_q.put(0)
            continue
        off, n = msg
        res_q.put(checksum(buf[off : off + n]))


def _initiator(
    dev: int, env: dict[str, str], iters: int, depth: int, meta_q: Any, ctl_q: Any, chk_q: Any, res_q: Any
) -> None:
    """The source's side: owns the send buffer, WRITEs into the target's, times each row."""
    import torch

    buf = torch.arange(BUF, dtype=torch.int64, device=_device(dev)).remainder_(251).to(torch.uint8)
    agent = _agent("wire-source", env)
    mem, d = _mem(dev), max(dev, 0)
    agent.register_memory([(buf.data_ptr(), BUF, d, "")], mem)
    meta, raddr, rdev = meta_q.get()
    peer = agent.add_remote_agent(meta)
    while not agent.check_remote_metadata(peer):
        time.sleep(0.001)
    lists: dict[tuple[int, int], tuple[Any, Any]] = {}

    def pair(off: int, n: int) -> tuple[Any, Any]:
        if (off, n) not in lists:
            lists[(off, n)] = (
                agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.data_ptr() + off, n, d)], mem),
                agent.prep_xfer_dlist(peer, [(raddr + off, n, max(rdev, 0))], mem),
            )
        return lists[(off, n)]

    def post(off: int, n: int) -> Any:
        lh, rh = pair(off, n)
        h = agent.make_prepped_xfer("WRITE", lh, [0], rh, [0], b"")
        if agent.transfer(h) == "ERR":
            raise RuntimeError("transfer failed to post")
        return h

    def done(h: Any) -> bool:
        st = agent.check_xfer_state(h)
        if st == "ERR":
            raise RuntimeError("transfer failed")
        if st == "DONE":
            agent.release_xfer_handle(h)
            return True
        return False

    def run(chunk: int, count: int, depth: int) -> float:
        """count WRITEs of `chunk` bytes at consecutive offsets, at most `depth` in flight."""
        t0 = time.perf_counter()
        inflight: list[Any] = []
        nxt = 0
        while nxt < count or inflight:
            while nxt < count and len(inflight) < depth:
                inflight.append(post(nxt * chunk, chunk))
                nxt += 1
            inflight = [h for h in inflight if not done(h)]
        return time.perf_counter() - t0

    rows = []
    cases = [(f"{s // MIB} MiB, one WRITE", s, 1, 1) for s in SIZES] + [
        (f"1 GiB as {k} x {c // MIB} MiB, {d} in flight", c, k, d)
        for c, k in RINGS
        for d in sorted({1, depth})
    ]
    for label, chunk, count, inflight in cases:
        for _ in range(3):
            run(chunk, count, inflight)  # warm-up: connection, the lists, UCX's handle cache
        ts = [run(chunk, count, inflight) for _ in range(iters)]
        ctl_q.put("zero")  # the check reads one pass's bytes alone, none left by the passes before
        chk_q.get()
        run(chunk, count, inflight)
        ctl_q.put((0, chunk * count))
        ok = chk_q.get() == checksum(buf[: chunk * count])
        med = statistics.median(ts)
        rows.append((label, chunk * count, med, ok))
    ctl_q.put(None)
    res_q.put(rows)


def one_variant(env: dict[str, str], src: int, dst: int, iters: int, depth: int) -> list[tuple[Any, ...]]:
    ctx = mp.get_context("spawn")
    meta_q, ctl_q, chk_q, res_q = (ctx.Queue() for _ in range(4))
    t = ctx.Process(target=_target, args=(dst, env, meta_q, ctl_q, chk_q))
    i = ctx.Process(target=_initiator, args=(src, env, iters, depth, meta_q, ctl_q, chk_q, res_q))
    t.start()
    i.start()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                rows: list[tuple[Any, ...]] = res_q.get(timeout=1)
                break
            except queue.Empty:
                if not i.is_alive() or not t.is_alive() or time.monotonic() > deadline:
                    print(f"variant {env}: a process ended without its rows (its log above)", flush=True)
                    return []
    finally:
        i.join(30)
        ctl_q.put(None)
        t.join(30)
        for p in (i, t):
            if p.is_alive():
                p.kill()
    return rows


def parse_env(s: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in s.split() if kv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="*", default=[], help='UCX settings to compare, each "K=V K2=V2"')
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--depth", type=int, default=4, help="WRITEs in flight in the ring rows (a ring's slots)")
    ap.add_argument("--proto-info", action="store_true", help="UCX_PROTO_INFO=y for the default run")
    ap.add_argument("--write", action="store_true", help="add the table to docs/benchmarks.md")
    ap.add_argument("--host", action="store_true", help="host memory instead (no GPU: checks the script)")
    args = ap.parse_args()
    import torch

    n = 0 if args.host else torch.cuda.device_count()
    src, dst = (-1, -1) if args.host else (0, 1 if n > 1 else 0)
    # The link's ceiling (gpu_pull.py's: torch's copy of 1 GiB, GPU0 -> GPU1), where there are two GPUs.
    ceil = ceiling(10, 3)["gbps"] if n > 1 else 0.0
    base = {"UCX_PROTO_INFO": "y"} if args.proto_info else {}
    variants = [("default", base)] + [(v, parse_env(v)) for v in args.variants]
    results = {name: one_variant(env, src, dst, args.iters, args.depth) for name, env in variants}
    labels = next(([r[0] for r in rows] for rows in results.values() if rows), [])
    head = "| WRITE | " + " | ".join(f"{name} GB/s (ms)" for name, _ in variants) + " |"
    lines = [head, "|---" * (len(variants) + 1) + "|"]
    for k, label in enumerate(labels):
        cells = []
        for name, _ in variants:
            if not results[name]:
                cells.append("failed")
                continue
            _, nbytes, med, ok = results[name][k]
            cells.append(f"{nbytes / med / 1e9:.1f} ({med * 1e3:.3f})" + ("" if ok else " **WRONG BYTES**"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    where = (
        "host memory, one process to another"
        if args.host
        else f"{n}x {torch.cuda.get_device_name(src)}, GPU{src} -> GPU{dst}"
    )
    body = "\n".join(
        [
            f"Command: `python bench/nixl_wire.py {' '.join(sys.argv[1:])}`  ",
            f"Machine: {platform.machine()}, {where}, Python {platform.python_version()}  ",
            f"Date: {date.today().isoformat()}  ",
            "",
            f"Medians of {args.iters} passes after 3 warm-up passes; every row's bytes checked."
            + (
                f" The link's ceiling (torch peer copy of 1 GiB, same run): **{ceil:.1f} GB/s**."
                if ceil
                else ""
            ),
            "",
            *lines,
        ]
    )
    print(body)
    if args.write:
        write_section(
            Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md",
            "NIXL's WRITE between two GPUs' staging buffers, by UCX setting (bench/nixl_wire.py)",
            body,
        )
    return 0 if all(r[3] for rows in results.values() for r in rows) and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
