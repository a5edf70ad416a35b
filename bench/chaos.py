"""Pulls under failures: sidecars and engines killed, stopped and restarted while pulls run.

"A bad request or a dead peer gives a clear error and loses nothing" (issue 32's target 7, under
failures rather than load). Three `kv-sidecar serve` processes on loopback, each with a prefill engine
P<i> and a decode engine D<i> (reference engines, each its own process, caches in shared memory); D1
holds another layout (host-nixl-staged: READs into staging, converted), and S2 reads with
`host_transfer: ring` (host-ring: the staged protocol). One worker thread per decode engine loops:
publish a request on a random node's prefill engine (its own: host-direct), pull it, check the outcome;
two times in five, 2-4 such requests pulled in one PullBatch call, whose members must each obey the
rules below, and which as a whole must write nowhere but its members' blocks. One request in five comes
from a multi-node prefill engine M of TP 2 over two more sidecars (its leader S3 holds rank 0; rank 1
sits on S4, as a member, or on S3), whose pulls gather both ranks from their holders; now and then a
worker holds a request of M back and pulls it 2-6 s later, across what the chaos thread did meanwhile.
Meanwhile a chaos thread, every 1-3 s, does one of:

  kill-sidecar    SIGKILL a sidecar, then start it again on the same ports, and its two engines
                  (as a pod's restart)
  stop-sidecar    SIGSTOP a sidecar for 0.3-2 s, then SIGCONT
  kill-decode     SIGKILL a decode engine mid-pull, then start it again
  kill-prefill    SIGKILL a prefill engine, then start it again
  move-rank       stop M's rank 1 and start it on its other sidecar (S4 -> S3 or S3 -> S4: a pod
                  rescheduled onto another node); requests published before are gone with it
  restart-rank    stop M's rank 1 and start a new process for it on the same sidecar (a TP worker
                  restarted while rank 0 runs on): requests published before are gone with the old
                  process, and must never be read from the new one's blocks of the same ids

Every outcome is checked, and whatever breaks a rule is a fault:
  - a pull that succeeds: every byte of the request exact, no byte outside its blocks changed (the
    engine checks both);
  - a pull that fails: a status of the expected set (UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND,
    FAILED_PRECONDITION, CANCELLED, ABORTED) with a message, its unfilled blocks among those asked
    for, and no byte outside them changed;
  - the engine answers within the pull's timeout and a margin (a pull never hangs);
  - a sidecar the chaos thread did not kill is alive throughout.
A pull that failed is pulled again once by another decode engine, as a router's retry on another
decode instance would; its outcome is counted (it must obey the same rules). Once the chaos stops,
one pull between every two sidecars, and one from M into every decode engine, must succeed within a
few tries (recovery).

    python bench/chaos.py                  # 3 minutes; writes its section of docs/benchmarks.md
    python bench/chaos.py --seconds 30 --no-write
    python bench/chaos.py --gpu            # every cache on a GPU: gpu-staged and gpu-direct pulls
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, ProcessError, SidecarProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

TITLE = "Pulls under failures (bench/chaos.py)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BASE: dict[str, Any] = {
    "tp_size": 1,
    "num_layers": 2,
    "num_kv_heads": 4,
    "head_dim": 32,
    "dtype": "bfloat16",
    "block_size": 16,
    "num_blocks": 1024,
    "layout": "flash_attn_nhd",
}
SRC = EngineSpec.from_dict(BASE)
DSTS = [SRC, EngineSpec.from_dict(BASE | {"layout": "flash_attn_hnd"}), SRC]
SIDECAR_ARGS = [[], [], ["--host-transfer", "ring"]]
# --gpu: every engine's cache on a GPU (cuda:0; with two GPUs decode engines on cuda:1): pulls go
# gpu-staged between sidecars and gpu-direct within one; host_transfer does not apply.
DEVICES: dict[str, list[str] | None] = {"prefill": None, "decode": None}
EXPECTED = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "NOT_FOUND", "FAILED_PRECONDITION", "CANCELLED", "ABORTED"}
PULL_TIMEOUT_S = 3.0
ANSWER_MARGIN_S = 15.0  # an engine's answer later than the pull's timeout by this much is a hang
SIZES = (1, 8, 64, 256)  # blocks of 16 KiB; 256 long enough to be cut midway now and then
# Block regions: a worker's in every prefill engine, its own pulls' in its decode engine, and another
# engine's retries' there (a retry runs while that engine's own worker waits for its lock).
SRC_REGION, RETRY_BASE = 300, 512
ACTIONS = ("kill-sidecar", "stop-sidecar", "kill-decode", "kill-prefill", "move-rank", "restart-rank")
SPLIT = EngineSpec.from_dict(BASE | {"tp_size": 2})  # M, the multi-node prefill engine
SPLIT_SHARE = 0.2  # of the requests a worker publishes
# One request of M at a time per worker is held back: published, then pulled 2-6 s later, across
# whatever the chaos thread did meanwhile. Its blocks: from HELD_BLOCKS in the worker's source region
# (past the 4 members of 64) and in its decode engine (below the retries').
HOLD_SHARE, HOLD_S, HELD_BLOCKS = 0.15, (2.0, 6.0), 256


class Engine:
    """One engine process behind a lock (its commands run one at a time), replaced when restarted."""

    def __init__(self, make: Callable[[], EngineProcess]) -> None:
        self.make = make  # starts it on its node's sidecar as the node has it now
        self.lock = threading.Lock()
        self.proc = make()
        self.killed_at = 0.0  # when the chaos thread last killed it (its command then fails: expected)

    def send(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self.lock:
            return self.proc.send(cmd, timeout_s)

    def restart(self) -> None:
        """Under the lock: a new process (the old one killed first, if it still runs)."""
        self.proc.kill()
        self.proc = self.make()


@dataclass
class Node:
    """A sidecar and its two engines (P<i>, D<i>), which start on whichever sidecar the node has."""

    index: int
    sidecar: SidecarProcess
    down: threading.Event = field(default_factory=threading.Event)  # set while killed or stopped
    prefill: Engine = field(init=False)
    decode: Engine = field(init=False)

    def __post_init__(self) -> None:
        self.prefill = Engine(
            lambda: EngineProcess(self.sidecar.socket, f"P{self.index}", SRC, devices=DEVICES["prefill"])
        )
        self.decode = Engine(
            lambda: EngineProcess(
                self.sidecar.socket, f"D{self.index}", DSTS[self.index], devices=DEVICES["decode"]
            )
        )


class SplitEngine:
    """M: a prefill engine of TP 2 whose rank 0 is on its leader sidecar and rank 1 on a member sidecar
    or on the leader, moved between the two by the chaos thread. One lock: a publish fills rank 1 and
    publishes on rank 0, and a move must not come between."""

    def __init__(self) -> None:
        self.leader, self.member = SidecarProcess("chaos-s3"), SidecarProcess("chaos-s4")
        self.lock = threading.Lock()
        self.on_member = True
        self.changes = 0  # rank 1's moves and restarts so far
        self.rank0 = EngineProcess(self.leader.socket, "M", SPLIT, ranks=[0], devices=DEVICES["prefill"])
        self.rank1 = self._rank1()

    def _rank1(self) -> EngineProcess:
        if self.on_member:
            return EngineProcess(
                self.member.socket, "M", SPLIT, ranks=[1], leader=self.leader.peer_address,
                devices=DEVICES["prefill"],
            )  # fmt: skip
        return EngineProcess(self.leader.socket, "M", SPLIT, ranks=[1], devices=DEVICES["prefill"])

    def publish(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self.lock:
            filled = self.rank1.send(cmd | {"publish": False}, timeout_s)
            if not filled.get("ok"):
                return filled
            return self.rank0.send(cmd, timeout_s)

    def move(self, elsewhere: bool = True) -> None:
        """Rank 1's process stopped and a new one started on its other sidecar, or (`elsewhere` False)
        on the same one."""
        with self.lock:
            self.rank1.stop()  # unregisters: a member reports it holds none, the leader forgets it
            self.on_member ^= elsewhere
            self.rank1 = self._rank1()
            self.changes += 1

    def close(self) -> list[int]:
        for proc in (self.rank0, self.rank1):
            proc.stop()
        return [self.leader.stop(30), self.member.stop(30)]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    batched: collections.Counter[str] = field(default_factory=collections.Counter)  # PullBatch members
    actions: collections.Counter[str] = field(default_factory=collections.Counter)
    split: collections.Counter[str] = field(default_factory=collections.Counter)  # M's, first tries
    held: collections.Counter[str] = field(
        default_factory=collections.Counter
    )  # held back, by what came between
    faults: list[str] = field(default_factory=list)
    said: dict[str, str] = field(default_factory=dict)  # a failure's status -> the first message of it

    def fault(self, what: str) -> None:
        with self.lock:
            self.faults.append(what)
        print(f"FAULT: {what}", flush=True)


def _outcome(res: dict[str, Any]) -> str:
    return f"ok ({res['path']})" if res["ok"] else str(res.get("error_code"))


def check(res: dict[str, Any], blocks: list[int], what: str, tally: Tally) -> None:
    """The rules a pull's outcome obeys, whatever failed around it."""
    if res["ok"]:
        if not res.get("verified"):
            tally.fault(f"{what}: succeeded with wrong bytes: {res.get('errors')}")
        return
    code = res.get("error_code")
    if code not in EXPECTED or not res.get("error"):
        tally.fault(f"{what}: failed with {code}: {res.get('error')!r}")
    if not set(res.get("unfilled_blocks") or ()) <= set(blocks):
        tally.fault(f"{what}: names blocks it was not asked to fill: {res.get('unfilled_blocks')}")
    if res.get("verified") is False:
        tally.fault(f"{what}: a failed pull changed bytes outside its blocks: {res.get('errors')}")


class Chaos:
    def __init__(self, nodes: list[Node], split: SplitEngine, tally: Tally, seed: int) -> None:
        self.nodes = nodes
        self.split = split
        self.tally = tally
        self.rng = random.Random(seed)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)):
            action = self.rng.choice(ACTIONS)
            node = self.rng.choice(self.nodes)
            with self.tally.lock:
                self.tally.actions[action] += 1
            if action == "move-rank":
                print(f"chaos: move-rank to {'S3' if self.split.on_member else 'S4'}", flush=True)
                self.split.move()
                continue
            if action == "restart-rank":
                print(f"chaos: restart-rank on {'S4' if self.split.on_member else 'S3'}", flush=True)
                self.split.move(elsewhere=False)
                continue
            print(f"chaos: {action} on node {node.index}", flush=True)
            if action == "kill-sidecar":
                self._kill_sidecar(node)
            elif action == "stop-sidecar":
                node.down.set()
                os.kill(node.sidecar.proc.pid, signal.SIGSTOP)
                time.sleep(self.rng.uniform(0.3, 2.0))
                os.kill(node.sidecar.proc.pid, signal.SIGCONT)
                node.down.clear()
            else:
                engine = node.decode if action == "kill-decode" else node.prefill
                engine.killed_at = time.monotonic()
                engine.proc.kill()  # mid-command, perhaps: its worker expects that
                with engine.lock:
                    engine.restart()

    def _kill_sidecar(self, node: Node) -> None:
        node.down.set()
        node.prefill.killed_at = node.decode.killed_at = time.monotonic()
        sc = node.sidecar
        sc.proc.kill()
        sc.proc.wait(10)
        port = sc.peer_address.rpartition(":")[2]
        with node.prefill.lock, node.decode.lock:  # their commands end: their sidecar is gone
            node.prefill.proc.kill()
            node.decode.proc.kill()
            node.sidecar = SidecarProcess(
                f"chaos-s{node.index}", extra=[*SIDECAR_ARGS[node.index], "--peer-port", port]
            )
            for engine in (node.prefill, node.decode):
                engine.restart()
        node.down.clear()


class Worker:
    """Pulls into one decode engine, from the prefill engines of every node, until stopped."""

    def __init__(
        self,
        j: int,
        nodes: list[Node],
        split: SplitEngine,
        tally: Tally,
        rng: random.Random,
        stop: threading.Event,
    ) -> None:
        self.j, self.nodes, self.split, self.tally, self.rng, self.stop = j, nodes, split, tally, rng, stop
        self.count = 0
        self.held: dict[str, Any] | None = None  # a request of M held back (HOLD_SHARE)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.once()
            except Exception as e:  # the bench's own trouble: counted, and the loop goes on
                self.tally.fault(f"worker {self.j}: {type(e).__name__}: {e}")
                time.sleep(0.2)

    def once(self) -> None:
        """One pull, or (two times in five) a PullBatch of 2-4 members, each from a random node."""
        self._held_request()
        batch = self.rng.random() < 0.4
        members = self.rng.randrange(2, 5) if batch else 1
        pulls = []
        for m in range(members):
            pub = self._publish(m, SIZES[:3] if batch else SIZES)
            if pub is not None:
                pulls.append(pub)
        if not pulls:
            return
        dst = self.nodes[self.j].decode
        t0 = time.monotonic()
        if batch:
            outcomes = self._pull_batch(dst, pulls, t0)
        else:
            p = pulls[0]
            outcomes = [self._pull(dst, p["params"], p["block_ids"], p["seed"], p["what"], t0)]
        for p, res in zip(pulls, outcomes, strict=True):
            if res is None or res["ok"]:
                continue
            # As a router retries on another decode instance: the request may be taken over, or is gone.
            k = self.rng.choice([k for k in range(len(self.nodes)) if k != self.j])
            self._pull(
                self.nodes[k].decode, p["params"], [RETRY_BASE + b for b in p["block_ids"]], p["seed"],
                f"retry of {p['what']} on node {k}", time.monotonic(), retry=True,
            )  # fmt: skip

    def _held_request(self) -> None:
        """Holds one request of M back: published now, pulled 2-6 s later. A rank of M that moved or
        restarted meanwhile took the request's bytes with its old process: the pull must fail, never
        bring the new process's bytes of the same blocks."""
        if self.held is None:
            if self.rng.random() < HOLD_SHARE and (pub := self._publish(0, (1, 8), held=True)) is not None:
                self.held = pub | {
                    "due": time.monotonic() + self.rng.uniform(*HOLD_S),
                    "changes": self.split.changes,
                }
            return
        if time.monotonic() < self.held["due"]:
            return
        p, self.held = self.held, None
        what = f"held {p['what']}"
        res = self._pull(
            self.nodes[self.j].decode, p["params"], p["block_ids"], p["seed"], what, time.monotonic()
        )
        if res is None:
            return
        across = (
            "across a move or restart of its rank 1"
            if self.split.changes != p["changes"]
            else "no rank change"
        )
        with self.tally.lock:
            self.tally.held[f"{_outcome(res)}, {across}"] += 1
            if not res["ok"]:
                self.tally.said.setdefault(f"{res.get('error_code')} (held back)", res["error"])

    def _publish(self, m: int, sizes: tuple[int, ...], held: bool = False) -> dict[str, Any] | None:
        """A request of a random node's prefill engine for member `m` (blocks of its own on both sides),
        or (`held`) of M, in the held request's blocks: its params, blocks to pull into, seed and name;
        None where the publish failed."""
        self.count += 1
        split = held or self.rng.random() < SPLIT_SHARE
        i = self.rng.randrange(len(self.nodes))
        n = self.rng.choice(sizes)
        src = self.nodes[i].prefill
        rid, seed = f"w{self.j}-{self.count}", self.j * 1_000_000 + self.count
        source = "M" if split else f"node {i}"
        # A batch's members (at most 64 blocks each) side by side, the held request past them.
        first = SRC_REGION * self.j + (HELD_BLOCKS if held else 64 * m)
        t0 = time.monotonic()
        fill = {"cmd": "prefill", "request_id": rid, "block_ids": list(range(first, first + n)),
                "num_tokens": n * 16 - 3, "seed": seed}  # fmt: skip
        try:
            if split:  # not killed by the chaos thread: no answer is a fault
                pub = self.split.publish(fill, PULL_TIMEOUT_S + ANSWER_MARGIN_S)
            else:
                pub = src.send(fill, timeout_s=PULL_TIMEOUT_S + ANSWER_MARGIN_S)
        except (ProcessError, OSError):  # no answer, or its stdin closed: it died
            if split:
                self.tally.fault(
                    f"M gave no answer to a publish within {PULL_TIMEOUT_S + ANSWER_MARGIN_S:g} s"
                )
            else:
                self._engine_died(src, t0, f"prefill on node {i}")
            return None
        if not pub.get("ok"):
            with self.tally.lock:
                self.tally.outcomes[f"publish refused ({pub.get('error_code')})"] += 1
            return None
        blocks = list(range(HELD_BLOCKS, HELD_BLOCKS + n) if held else range(64 * m, 64 * m + n))
        return {
            "params": pub["params"],
            "block_ids": blocks,
            "seed": seed,
            "what": f"{rid} {source} -> {self.j}",
        }

    def _pull_batch(
        self, engine: Engine, pulls: list[dict[str, Any]], t0: float
    ) -> list[dict[str, Any] | None]:
        """One PullBatch of `pulls`: each member checked as a pull is, and nothing outside them written."""
        try:
            res = engine.send(
                {"cmd": "pull_many", "timeout_s": PULL_TIMEOUT_S,
                 "pulls": [{k: p[k] for k in ("params", "block_ids", "seed")} for p in pulls]},
                timeout_s=PULL_TIMEOUT_S + ANSWER_MARGIN_S,
            )  # fmt: skip
        except (ProcessError, OSError):
            self._engine_died(engine, t0, f"PullBatch of {[p['what'] for p in pulls]}")
            return [None] * len(pulls)
        if "results" not in res:  # the call itself refused
            self.tally.fault(f"PullBatch of {len(pulls)} refused whole: {res}")
            return [None] * len(pulls)
        if not res["untouched_outside"]:
            self.tally.fault(f"a PullBatch wrote outside its members' blocks: {res['outside_errors']}")
        for p, one in zip(pulls, res["results"], strict=True):
            one.setdefault("verified", True)  # a failed member's outside check is the batch's, above
            self._count(one, p["block_ids"], f"batch member {p['what']}", batched=True)
        return list(res["results"])

    def _pull(
        self,
        engine: Engine,
        params: dict[str, Any],
        blocks: list[int],
        seed: int,
        what: str,
        t0: float,
        retry: bool = False,
    ) -> dict[str, Any] | None:
        try:
            res = engine.send(
                {
                    "cmd": "pull",
                    "params": params,
                    "block_ids": blocks,
                    "seed": seed,
                    "timeout_s": PULL_TIMEOUT_S,
                },
                timeout_s=PULL_TIMEOUT_S + ANSWER_MARGIN_S,
            )
        except (ProcessError, OSError):
            self._engine_died(engine, t0, what)
            return None
        self._count(res, blocks, what, retry=retry)
        return res

    def _count(
        self, res: dict[str, Any], blocks: list[int], what: str, retry: bool = False, batched: bool = False
    ) -> None:
        check(res, blocks, what, self.tally)
        kind = "retries" if retry else "batched" if batched else "outcomes"
        with self.tally.lock:
            getattr(self.tally, kind)[_outcome(res)] += 1
            if " M -> " in what and not retry:
                self.tally.split[_outcome(res)] += 1
            if not res["ok"]:
                self.tally.said.setdefault(f"{res.get('error_code')} ({kind})", res["error"])

    def _engine_died(self, engine: Engine, t0: float, what: str) -> None:
        """An engine gave no answer: expected where the chaos thread killed it (or its sidecar) since."""
        if engine.killed_at >= t0 - 0.5:
            with self.tally.lock:
                self.tally.outcomes["engine killed mid-command"] += 1
            deadline = time.monotonic() + 60
            while not engine.proc.alive and time.monotonic() < deadline:  # its restart, first
                time.sleep(0.05)
            return
        self.tally.fault(f"{what}: the engine gave no answer within {PULL_TIMEOUT_S + ANSWER_MARGIN_S:g} s")


def recover(nodes: list[Node], split: SplitEngine, tally: Tally) -> list[str]:
    """One pull between every two nodes, and from M into every node, once the chaos stopped: each must
    succeed within a few tries."""
    rows = []
    sources: list[tuple[str, Callable[[dict[str, Any], float], dict[str, Any]]]] = [
        *((str(i), node.prefill.send) for i, node in enumerate(nodes)),
        ("M", split.publish),
    ]
    for i, publish in sources:
        for j, dst in enumerate(nodes):
            ok, tries, res = False, 0, {}
            deadline = time.monotonic() + 20
            while not ok and time.monotonic() < deadline:
                tries += 1
                rid = f"recover-{i}-{j}-{tries}"
                pub = publish(
                    {
                        "cmd": "prefill",
                        "request_id": rid,
                        "block_ids": [1000, 1001],
                        "num_tokens": 29,
                        "seed": tries,
                    },
                    30,
                )
                if not pub.get("ok"):
                    time.sleep(0.5)
                    continue
                res = dst.decode.send(
                    {"cmd": "pull", "params": pub["params"], "block_ids": [1000, 1001], "seed": tries},
                    timeout_s=60,
                )
                check(res, [1000, 1001], f"recovery pull {i} -> {j}", tally)
                ok = bool(res["ok"] and res.get("verified"))
                if not ok:
                    time.sleep(0.5)
            if not ok:
                tally.fault(f"recovery pull {i} -> {j} never succeeded: {res}")
            rows.append(
                f"{i} -> {j}: {'ok' if ok else 'FAILED'} after {tries} tries ({res.get('path', '-')})"
            )
    return rows


class _CutShort(Exception):
    """SIGTERM, e.g. a `timeout` that ran out before the run's end: it stops and says what it saw."""


def _cut_short(signum: int, frame: object) -> None:
    raise _CutShort


def _kill_all(nodes: list[Node], split: SplitEngine) -> None:
    """Every process of the run, at once (no orderly stop: the time is up)."""
    for node in nodes:
        for engine in (node.prefill, node.decode):
            engine.proc.kill()
        node.sidecar.kill()
    for proc in (split.rank0, split.rank1, split.leader, split.member):
        proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gpu", action="store_true", help="engines' caches on GPUs (gpu-staged, gpu-direct)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.gpu:
        import torch

        gpus = torch.cuda.device_count()
        DEVICES.update(prefill=["cuda:0"], decode=[f"cuda:{min(1, gpus - 1)}"])
    tally = Tally()
    nodes = [Node(i, SidecarProcess(f"chaos-s{i}", extra=SIDECAR_ARGS[i])) for i in range(3)]
    split = SplitEngine()
    chaos = Chaos(nodes, split, tally, args.seed)
    stop = threading.Event()
    workers = [Worker(j, nodes, split, tally, random.Random(rng.random()), stop) for j in range(len(nodes))]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    chaos_thread = threading.Thread(target=chaos.run, daemon=True)
    chaos_thread.start()
    watch = threading.Thread(target=_watch, args=(nodes, split, tally, stop), daemon=True)
    watch.start()
    # A `timeout` that runs out sends SIGTERM: the report of what was seen until then still comes out.
    signal.signal(signal.SIGTERM, _cut_short)
    try:
        time.sleep(args.seconds)
        chaos.stop.set()
        chaos_thread.join(60)
        stop.set()
        for t in threads:
            t.join(PULL_TIMEOUT_S * 2 + ANSWER_MARGIN_S * 2)
        wall = time.monotonic() - t0
        rows = recover(nodes, split, tally)
        codes = []
        for node in nodes:
            for engine in (node.prefill, node.decode):
                engine.proc.stop()
            codes.append(node.sidecar.stop(30))
        codes += split.close()
    except _CutShort:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the run at once
        wall = time.monotonic() - t0
        chaos.stop.set()
        stop.set()
        _kill_all(nodes, split)
        body = _section(args, wall, tally, ["not run: the run was cut short (SIGTERM)"])
        print(
            f"{body}\n\nCut short by SIGTERM after {wall:.0f} s: the rows are the pulls until then; "
            "docs/benchmarks.md was left alone.",
            flush=True,
        )
        return 2
    if any(codes):
        tally.fault(f"sidecar exit codes at the end: {codes} (0 expected)")
    body = _section(args, wall, tally, rows)
    print(body)
    if not args.no_write:
        report.write_section(DOCS, TITLE + (", GPU" if args.gpu else ""), body)
    return 1 if tally.faults else 0


def _watch(nodes: list[Node], split: SplitEngine, tally: Tally, stop: threading.Event) -> None:
    """A sidecar that dies when the chaos thread did not kill it is a fault (M's are never killed)."""
    seen = False
    while not stop.wait(0.2):
        if not seen and not (split.leader.alive and split.member.alive):
            tally.fault("a sidecar of M died by itself")
            seen = True
        for node in nodes:
            sc = node.sidecar
            if not sc.alive and not node.down.is_set():
                tally.fault(f"sidecar of node {node.index} died by itself: {sc.proc.poll()}")
                node.down.set()  # reported once; a restart by the chaos thread clears it


def _section(args: argparse.Namespace, wall: float, tally: Tally, rows: list[str]) -> str:
    cmd = "python bench/chaos.py" + ("" if args.seconds == 180 else f" --seconds {args.seconds:g}")
    cmd += " --gpu" if args.gpu else ""
    cmd += "" if args.seed == 1 else f" --seed {args.seed}"
    lines = [
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {report.gpus()}, Python "
        f"{platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}; {wall:.0f} s of pulls under failures, seed {args.seed}",
        "",
        "What the chaos thread did: " + ", ".join(f"{a} {tally.actions[a]}" for a in ACTIONS),
        "",
        "Requests of M (the multi-node engine), pulls and batch members, first tries: "
        + (", ".join(f"{k} {v}" for k, v in sorted(tally.split.items())) or "none"),
        "",
        "Requests of M held back 2-6 s before their pull (one at a time per worker), by what came between: "
        + (", ".join(f"{k}: {v}" for k, v in sorted(tally.held.items())) or "none"),
        "",
        "| outcome | pulls | members of PullBatches | retries on another decode engine |",
        "|---|---|---|---|",
    ]
    keys = sorted(
        set(tally.outcomes) | set(tally.batched) | set(tally.retries),
        key=lambda k: (not k.startswith("ok"), k),
    )
    lines += [
        f"| {k} | {tally.outcomes.get(k, 0)} | {tally.batched.get(k, 0)} | {tally.retries.get(k, 0)} |"
        for k in keys
    ]
    lines += ["", "What the failures said (the first of each kind):", ""]
    lines += [f"- {k}: `{v}`" for k, v in sorted(tally.said.items())]
    lines += [
        "",
        "Recovery once the chaos stopped (one pull between every two nodes, and from M into each): "
        + "; ".join(rows),
        "",
    ]
    lines.append(
        f"Faults: {len(tally.faults)}"
        + ("" if not tally.faults else ":\n" + "\n".join(f"- {f}" for f in tally.faults[:20]))
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
