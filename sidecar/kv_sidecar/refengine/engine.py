"""A reference engine process: one engine (its TP ranks) with KV caches in shared memory or on GPUs.

Driven by JSON lines on stdin, answering one JSON line each on stdout:
  {"cmd": "prefill", "request_id": .., "block_ids": [..], "num_tokens": N, "seed": S, "lease_ms": 0,
   "fill": true, "publish": true, "first_token": 0, "delay_ms": 0}
      -> {"ok": true, "params": {...}}   (fills the blocks from the seed, unless fill is false, publishes;
      with first_token, block_ids hold tokens [first_token, N) only, as a sliding-window engine's;
      delay_ms: a kernel that long runs before the fill's, on the GPU, as on a busy one)
      with "publish": false only fills: the ranks of a multi-node engine that live
      on a member sidecar; the process on the leader's node publishes.
  {"cmd": "pull", "params": {...}, "block_ids": [..], "seed": S, "start_token": 0, "ranks": []}
      -> {"ok": .., "bytes": .., "duration_s": .., "gbps": .., "path": .., "verified": .., "errors": [..]}
  {"cmd": "pull_many", "pulls": [{"params": {...}, "block_ids": [..], "seed": S, "start_token": 0,
   "ranks": []}, ..], "timeout_s": T}
      -> {"ok": .., "results": [{"ok": .., "path": .., "verified": .., "errors": [..], ..}, ..],
          "untouched_outside": ..}   (one PullBatch call; each member checked as "pull" checks it, and
      no byte outside the members' blocks changed)
  {"cmd": "randomize"} -> {"ok": true}   (every cache byte random: fast set-up for large benchmarks)
  {"cmd": "digest", "block_ids": [..]} -> {"ok": true, "digests": {rank: hex}}
      (sha256 of the blocks in logical token order: equal across layouts for equal block sizes)
  {"cmd": "next_event", "timeout_s": 10} -> {"ok": true, "rank": r, "kind": .., "request_id": ..}
  {"cmd": "abort", "request_id": ..} -> {"ok": true, "found": ..}
  {"cmd": "publish_batch", "prefix": "b0-", "block_ids": [[..], ..], "num_tokens": N, "lease_ms": 0}
      -> {"ok": true, "params": [{...}, ..]}   (request prefix+i of block_ids[i], filled before)
  {"cmd": "pull_batch", "items": [{"params": {...}, "block_ids": [..], "seed": S, "start_token": 0}, ..],
   "concurrency": C, "num_tokens": N, "start_token": 0, "start_at": T, "per_call": K, "own_ranks": false}
      -> {"ok": .., "lat": [..], "wall_s": .., "cpu_s": .., "t_end": .., "paths": {..}, "errors": [..]}
      (C threads pull the items in turn, each into blocks no other item shares; with start_at, a
      time.time() on this host, the pulls start then: several engines' batches start together; with
      per_call K > 1, each thread takes K items at a time and pulls them in one PullBatch call; an
      item's start_token pulls past a prefix held, the batch's (the same for all) is what verify checks;
      an item with "expect_error": true must fail: "bad": {"count", "codes"}, and "lat" leaves it out;
      cpu_s: this process's CPU seconds from the pulls' start to their end, not the checks around them;
      own_ranks: each pull names this process's ranks, as a TP worker's does where the engine's other
      ranks are other processes on the same sidecar)
  {"cmd": "verify_batch"} -> {"ok": .., "checked": n, "errors": [..], "bad_untouched": ..}
      (every byte the last pull_batch's pulls wrote, against their seeds; bad_untouched: whether the
      blocks of its items meant to fail kept their bytes, which a failed pull may write: host-nixl's
      early READ)
  {"cmd": "count_events", "kind": "consumed", "timeout_s": 10, "expect": N}
      -> {"ok": true, "count": n}   (events of that kind taken off the queue, waiting up to
      timeout_s for `expect` of them)
  {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import sys
import threading
import time
from typing import Any

import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.gpu_cache import GpuKVCache
from kv_sidecar.refengine.layout_io import (
    changed_outside,
    check_request,
    fill_request,
    gather_blocks,
    logical_kv,
)
from kv_sidecar_client import BatchPull, KVSidecarError, SidecarClient, params_from_json, params_to_json
from kv_sidecar_client.shm import SHM_DIR, ShmKVCache


class RefEngine:
    def __init__(
        self,
        socket: str,
        engine_id: str,
        spec: EngineSpec,
        ranks: list[int],
        poison: int,
        devices: list[torch.device] | None = None,
        leader: str = "",
        shm_names: str = "",
        placement: str = "",
    ) -> None:
        """`shm_names`: host caches in objects named `<shm_names>-<rank>`, made anew (one left by an
        engine before is removed), as an engine that names them by its pid does in a fresh container
        (vLLM's pool); default: a random name each. `placement`: SidecarClient's (control shards)."""
        self.spec = spec
        self.engine_id = engine_id
        self.client = SidecarClient(socket, placement=placement)
        self.client.wait_ready()
        self.caches: dict[int, ShmKVCache | GpuKVCache] = {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._batch: tuple[list[dict[str, Any]], list[Any], int, int] = ([], [], 0, 0)
        # The blocks of the last pull_batch's items meant to fail, and their digests before it.
        self._bad_before: tuple[list[int], dict[str, str]] = ([], {})
        dtype = getattr(torch, spec.dtype)
        for r in ranks:
            cache: ShmKVCache | GpuKVCache
            if devices:
                cache = GpuKVCache(spec.rank_tensor_shapes(), dtype, devices[r % len(devices)])
            elif shm_names:
                name = f"{shm_names}-{r}"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
                cache = ShmKVCache(spec.rank_tensor_shapes(), dtype, name=name)
            else:
                cache = ShmKVCache(spec.rank_tensor_shapes(), dtype)
            for t in cache.tensors:
                t.view(torch.uint8).fill_(poison)  # poison: any byte we did not write is recognisable
            self.caches[r] = cache
            self._settle()
            self.client.register_rank(engine_id, r, spec.to_dict(), cache.handles(), leader_address=leader)
            stream = self.client.events(engine_id, r)
            threading.Thread(target=self._follow, args=(r, stream), daemon=True).start()

    def _follow(self, rank: int, stream: Any) -> None:
        try:
            for ev in stream:
                if ev.kind != "ready":
                    self.events.put(
                        {
                            "rank": rank,
                            "kind": ev.kind,
                            "request_id": ev.request_id,
                            "block_ids": ev.block_ids,
                        }
                    )
        except KVSidecarError as e:
            self.events.put({"rank": rank, "kind": "stream_error", "error": str(e)})

    def _settle(self) -> None:
        """Wait for this engine's own writes to its GPU caches. The sidecar reads them from another
        process on its own streams, which see only what has completed: an engine publishes a request
        once the kernels that wrote its KV are done (vLLM's step has synchronised by then), and takes
        a snapshot to compare with before a pull writes. A blocking `copy_` into a block's strided
        view returns with its last kernel still queued, which runs ms later on a GPU that other
        processes keep busy: the likely cause of a pull found wrong under the GPU suite's load."""
        for dev in {c.device for c in self.caches.values() if isinstance(c, GpuKVCache)}:
            torch.cuda.synchronize(dev)

    def prefill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("fill", True):  # benchmarks republish blocks filled once; filling 1 GiB costs seconds
            logical = logical_kv(self.spec, cmd["num_tokens"], cmd["seed"])
            delay_ms = cmd.get("delay_ms", 0)
            for r, cache in self.caches.items():
                src = logical
                if delay_ms > 0 and isinstance(cache, GpuKVCache):
                    # A busy GPU: the writes, all kernels from a copy on the device, queue behind one
                    # that spins delay_ms (cycles at ~2 GHz: at least that long on the GPUs lent here).
                    src = logical.to(cache.device)
                    with torch.cuda.device(cache.device):
                        torch.cuda._sleep(int(delay_ms * 2e6))
                fill_request(self.spec, r, cache.tensors, cmd["block_ids"], src, cmd.get("first_token", 0))
            self._settle()
        if not cmd.get("publish", True):
            return {"ok": True}
        params = self.client.publish(
            self.engine_id,
            cmd["request_id"],
            cmd["block_ids"],
            cmd["num_tokens"],
            cmd.get("lease_ms", 0),
            first_token=cmd.get("first_token", 0),
        )
        return {"ok": True, "params": json.loads(params_to_json(params))}

    def pull(self, cmd: dict[str, Any]) -> dict[str, Any]:
        params = params_from_json(cmd["params"])
        ranks = cmd.get("ranks") or sorted(self.caches)
        start = cmd.get("start_token", 0)
        verify = cmd.get("verify", True)
        before = {r: [t.clone() for t in self.caches[r].tensors] for r in ranks} if verify else {}
        self._settle()
        t0 = time.perf_counter()
        res = self.client.pull(
            params,
            self.engine_id,
            cmd["block_ids"],
            ranks=cmd.get("ranks") or (),
            start_token=start,
            timeout_s=cmd.get("timeout_s"),
        )
        wall = time.perf_counter() - t0
        out: dict[str, Any] = {
            "wall_s": wall,
            "ok": res.ok,
            "bytes": res.bytes,
            "duration_s": res.duration_s,
            "gbps": res.gbps,
            "path": res.path,
            "error_code": res.error_code,
            "error": res.error,
            "unfilled_blocks": res.unfilled_blocks,
        }
        if res.ok and verify:
            errors = self._check_filled(ranks, cmd["block_ids"], params.num_tokens, cmd["seed"], start)
            for r in ranks:
                errors += changed_outside(self.spec, before[r], self.caches[r].tensors, cmd["block_ids"])
            out["verified"] = not errors
            out["errors"] = errors[:20]
        elif verify:
            # A failed pull must not touch blocks it was not asked to fill.
            errors = [
                e
                for r in ranks
                for e in changed_outside(self.spec, before[r], self.caches[r].tensors, cmd["block_ids"])
            ]
            out["verified"] = not errors
            out["errors"] = errors[:20]
            # Whether it wrote nothing at all, not even into the requested blocks.
            out["untouched"] = not any(
                changed_outside(self.spec, before[r], self.caches[r].tensors, []) for r in ranks
            )
        return out

    def _check_filled(
        self, ranks: list[int], block_ids: list[int], num_tokens: int, seed: int, start_token: int
    ) -> list[str]:
        """What differs from the seed's tokens [start_token, num_tokens) in these blocks of these ranks."""
        logical = logical_kv(self.spec, num_tokens, seed)
        return [
            e
            for r in ranks
            for e in check_request(self.spec, r, self.caches[r].tensors, block_ids, logical, start_token)
        ]

    def pull_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One PullBatch call; every member checked as `pull` checks one."""
        members = cmd["pulls"]
        ranks = sorted(self.caches)
        before = {r: [t.clone() for t in self.caches[r].tensors] for r in ranks}
        self._settle()
        batch = [
            BatchPull(
                params_from_json(m["params"]),
                m["block_ids"],
                ranks=m.get("ranks") or (),
                start_token=m.get("start_token", 0),
            )
            for m in members
        ]
        t0 = time.perf_counter()
        results = self.client.pull_batch(self.engine_id, batch, timeout_s=cmd.get("timeout_s"))
        wall = time.perf_counter() - t0
        out: list[dict[str, Any]] = []
        for m, b, res in zip(members, batch, results, strict=True):
            one: dict[str, Any] = {
                "ok": res.ok,
                "bytes": res.bytes,
                "path": res.path,
                "error_code": res.error_code,
                "error": res.error,
                "unfilled_blocks": res.unfilled_blocks,
            }
            if res.ok:
                errors = self._check_filled(
                    m.get("ranks") or ranks, m["block_ids"], b.params.num_tokens, m["seed"], b.start_token
                )
                one["verified"] = not errors
                one["errors"] = errors[:20]
            out.append(one)
        # A member that failed, like one that succeeded, wrote nowhere but the members' blocks.
        every = sorted({x for m in members for x in m["block_ids"]})
        outside = [
            e for r in ranks for e in changed_outside(self.spec, before[r], self.caches[r].tensors, every)
        ]
        return {
            "ok": all(o["ok"] for o in out),
            "results": out,
            "wall_s": wall,
            "untouched_outside": not outside,
            "outside_errors": outside[:20],
        }

    def randomize(self, cmd: dict[str, Any]) -> dict[str, Any]:
        g = torch.Generator(device=next(iter(self.caches.values())).tensors[0].device).manual_seed(
            cmd.get("seed", 0)
        )
        for cache in self.caches.values():
            for t in cache.tensors:
                if t.device != g.device:
                    g = torch.Generator(device=t.device).manual_seed(cmd.get("seed", 0))
                t.view(torch.uint8).random_(generator=g)
        self._settle()
        return {"ok": True}

    def digest(self, cmd: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, str] = {}
        for r, cache in self.caches.items():
            h = hashlib.sha256()
            for layer in range(self.spec.num_layers):
                blocks = gather_blocks(self.spec, cache.tensors, layer, cmd["block_ids"])
                h.update(blocks.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            out[str(r)] = h.hexdigest()
        return {"ok": True, "digests": out}

    def next_event(self, cmd: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"ok": True, **self.events.get(timeout=cmd.get("timeout_s", 10))}
        except queue.Empty:
            return {"ok": False, "error": "no event"}

    def abort(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "found": self.client.abort(self.engine_id, cmd["request_id"])}

    def publish_batch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Publish request prefix+i of block_ids[i] for each i (blocks filled before, e.g. by prefill
        with publish false): a load bench's publishes, outside the pulls it times."""
        out = []
        for i, ids in enumerate(cmd["block_ids"]):
            params = self.client.publish(
                self.engine_id, f"{cmd['prefix']}{i}", ids, cmd["num_tokens"], cmd.get("lease_ms", 0)
            )
            out.append(json.loads(params_to_json(params)))
        return {"ok": True, "params": out}

    def pull_batch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Pull `items` with `concurrency` threads, as an engine's workers would: each thread takes the
        next item and pulls it into that item's blocks, which no other item shares (verify_batch checks
        them afterwards: a check costs more than a small pull). Latency: each pull call alone."""
        items = cmd["items"]
        lat = [0.0] * len(items)
        results: list[Any] = [None] * len(items)
        bad = [i for i, it in enumerate(items) if it.get("expect_error")]
        bad_blocks = [b for i in bad for b in items[i]["block_ids"]]
        bad_before = self.digest({"block_ids": bad_blocks})["digests"] if bad else {}
        lock = threading.Lock()
        order = iter(range(len(items)))
        per_call = cmd.get("per_call", 1)
        # "own_ranks": pull only this process's ranks, as a TP worker does where its engine's other ranks
        # are other processes on the same sidecar (else every rank registered there is filled).
        ranks = sorted(self.caches) if cmd.get("own_ranks") else ()

        def worker() -> None:
            while True:
                with lock:
                    take = [i for i in (next(order, None) for _ in range(per_call)) if i is not None]
                if not take:
                    return
                t0 = time.perf_counter()
                if per_call == 1:
                    (i,) = take
                    results[i] = self.client.pull(
                        params_from_json(items[i]["params"]),
                        self.engine_id,
                        items[i]["block_ids"],
                        ranks=ranks,
                        start_token=items[i].get("start_token", 0),
                    )
                else:
                    batch = [
                        BatchPull(
                            params_from_json(items[i]["params"]),
                            items[i]["block_ids"],
                            ranks=ranks,
                            start_token=items[i].get("start_token", 0),
                        )
                        for i in take
                    ]
                    for i, res in zip(take, self.client.pull_batch(self.engine_id, batch), strict=True):
                        results[i] = res
                for i in take:
                    lat[i] = time.perf_counter() - t0

        workers = [threading.Thread(target=worker) for _ in range(cmd["concurrency"])]
        if "start_at" in cmd:
            time.sleep(max(0.0, cmd["start_at"] - time.time()))
        t0, cpu0 = time.perf_counter(), time.process_time()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        t_end = time.time()
        self._batch = (items, results, cmd["num_tokens"], cmd.get("start_token", 0))
        self._bad_before = (bad_blocks, bad_before)
        paths: dict[str, int] = {}
        for res in results:
            paths[res.path or "failed"] = paths.get(res.path or "failed", 0) + 1
        meant = set(bad)
        failed = [
            f"pull {i}: {r.error_code}: {r.error}"
            for i, r in enumerate(results)
            if not r.ok and i not in meant
        ]
        failed += [
            f"pull {i}: meant to fail, it moved {results[i].bytes} bytes" for i in bad if results[i].ok
        ]
        codes: dict[str, int] = {}
        for i in bad:
            if not results[i].ok:
                codes[results[i].error_code] = codes.get(results[i].error_code, 0) + 1
        return {
            "ok": not failed,
            "lat": [x for i, x in enumerate(lat) if i not in meant],
            "wall_s": wall,
            "cpu_s": cpu,
            "t_end": t_end,
            "paths": paths,
            "errors": failed[:20],
            "bad": {"count": len(bad), "codes": codes},
        }

    def verify_batch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Check every byte the last pull_batch's successful pulls wrote against their seeds. Pulls of
        one seed and whole blocks are checked together (their blocks in a row hold that seed's tokens
        over and over): a load bench's thousands of pulls then take seconds, not minutes."""
        items, results, num_tokens, start = self._batch
        errors: list[str] = []
        by_seed: dict[int, list[list[int]]] = {}
        for it, res in zip(items, results, strict=True):
            if res.ok:
                by_seed.setdefault(it["seed"], []).append(it["block_ids"])
        whole = num_tokens % self.spec.block_size == 0
        for seed, lists in by_seed.items():
            logical = logical_kv(self.spec, num_tokens, seed)
            if whole:  # each pull's blocks hold tokens [start, num_tokens): in a row, those over and over
                moved = logical[:, :, start:]
                want = moved.repeat(1, 1, len(lists), 1, 1)
                ids = [b for block_ids in lists for b in block_ids]
                for r, cache in self.caches.items():
                    errors += check_request(self.spec, r, cache.tensors, ids, want)[:3]
                continue
            for r, cache in self.caches.items():
                for ids in lists:
                    errors += check_request(self.spec, r, cache.tensors, ids, logical, start)[:3]
        # Reported, not a failure: a failed pull names its blocks unfilled, and may have written them.
        # Looked at here, not at the batch's end: a load bench reads its processes' CPU in between.
        bad_blocks, bad_before = self._bad_before
        untouched = not bad_blocks or self.digest({"block_ids": bad_blocks})["digests"] == bad_before
        return {
            "ok": not errors,
            "checked": sum(r.ok for r in results),
            "errors": errors[:20],
            "bad_untouched": untouched,
        }

    def count_events(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Take events of `kind` off the queue (others are dropped), waiting up to timeout_s for `expect`."""
        deadline = time.monotonic() + cmd.get("timeout_s", 10)
        count = 0
        while count < cmd.get("expect", 0) or not self.events.empty():
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            count += ev["kind"] == cmd["kind"]
        return {"ok": True, "count": count}

    def close(self) -> None:
        for r in list(self.caches):
            # The sidecar may be gone already.
            with contextlib.suppress(KVSidecarError):
                self.client.unregister_rank(self.engine_id, r)
            self.caches.pop(r).close()
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kv-sidecar reference engine (stdin/stdout JSON lines)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--spec", required=True, help="engine spec as JSON")
    ap.add_argument("--ranks", default="", help="comma-separated ranks to host (default: all)")
    ap.add_argument("--poison", type=int, default=0xA5)
    ap.add_argument(
        "--devices",
        default="",
        help="comma-separated CUDA devices (e.g. cuda:0,cuda:1): rank r's cache goes on device r mod n "
        "and is shared over CUDA IPC; default: host shared memory",
    )
    ap.add_argument("--leader", default="", help="peer address of the engine's leader sidecar (multi-node)")
    ap.add_argument(
        "--shm-names",
        default="",
        help="host caches in /dev/shm/<this>-<rank>, made anew (default: random names)",
    )
    ap.add_argument(
        "--placement", default="", help="control shards: host engines that name one key share a shard"
    )
    args = ap.parse_args(argv)
    spec = EngineSpec.from_dict(json.loads(args.spec))
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(spec.tp_size))
    try:
        devices = [torch.device(d) for d in args.devices.split(",") if d]
        engine = RefEngine(
            args.socket,
            args.engine_id,
            spec,
            ranks,
            args.poison,
            devices,
            args.leader,
            args.shm_names,
            args.placement,
        )
    except KVSidecarError as e:
        print(json.dumps({"ok": False, "error_code": e.code, "error": e.message}), flush=True)
        return 1
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    handlers = {
        "prefill": engine.prefill,
        "pull": engine.pull,
        "next_event": engine.next_event,
        "randomize": engine.randomize,
        "digest": engine.digest,
        "abort": engine.abort,
        "publish_batch": engine.publish_batch,
        "pull_batch": engine.pull_batch,
        "pull_many": engine.pull_many,
        "verify_batch": engine.verify_batch,
        "count_events": engine.count_events,
    }
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            try:
                reply = handlers[cmd["cmd"]](cmd)
            except KVSidecarError as e:
                reply = {"ok": False, "error_code": e.code, "error": e.message}
            print(json.dumps(reply), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
