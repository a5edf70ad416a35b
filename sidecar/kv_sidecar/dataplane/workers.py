"""A worker process per device: its local copies (`device_workers`) and its staged transfers
(`staged_workers`, dataplane/staged_workers.py); docs/gpu.md, "Node scaling".

One sidecar interpreter serving every GPU of a node is what bounds it under load (issue 32): its GIL
queues every device's copies behind each other. With `device_workers` on, each device's local copies
(host-direct, gpu-direct) run in a process of their own, with its own interpreter, CUDA context and
streams. The sidecar hands a worker the ranks' memory as engines sent it and `LocalCopy` jobs, plain
data over a pipe (a PullBatch's copies into one device in one message, `post_copies`); the worker maps
the memory itself and answers bytes copied or an error.

A worker that dies fails the copies it held (UNAVAILABLE, naming the blocks they did not fill) and is
started again with every rank attached again; the sidecar stays up. A copy that outlives its deadline
by KILL_AFTER_S has its worker killed: nothing of ours writes into an engine's cache after the pull
answered. With `staged_workers` the worker also owns a NIXL agent and the device's rings and runs its
staged transfers (dataplane/staged_workers.py); NIXL READs (host-nixl) still run in the sidecar.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kv_sidecar.config import Settings
from kv_sidecar.dataplane import local_copies
from kv_sidecar.dataplane.jobs import HOST, Halt, IpcTensorRef, LocalCopy, RankKey, Receive, Send, ShmTensor
from kv_sidecar.dataplane.staged_workers import Deadline, StagedServer, decode_error, encode_error
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.execute import gpu_launch_counts
from kv_sidecar.metrics import Family, Metrics
from kv_sidecar.plan.spec import EngineSpec

log = logging.getLogger(__name__)

# A copy still running this long past its deadline is stuck: its worker is killed (and restarted).
KILL_AFTER_S = 5.0
# Copies a worker runs at once: a gpu-direct copy launches and then waits for its kernels; others
# launch meanwhile.
WORKER_THREADS = 4

_Memory = tuple[EngineSpec, bool, list[ShmTensor] | list[IpcTensorRef]]
_Job = LocalCopy | Receive | Send | None  # what a message's failure names


def _serve(
    conn: multiprocessing.connection.Connection, device: int, staged: tuple[str, Settings] | None
) -> None:  # the worker process
    """Attach and detach ranks in order, run copies on a few threads, answer each message once; with
    `staged` (its agent's name, the settings), the device's staged transfers too (staged_workers.py)."""
    from kv_sidecar.dataplane.ranks import MappedRanks

    # No NIXL: neither a local copy nor a staged one registers engine memory. Copies go into `device` only.
    ranks = MappedRanks(None, copies_into=None if device == HOST else device)
    # Its own registry: the sidecar counts pulls, bytes and failures from the answers, and asks for the
    # rest (rings, WRITEs, launches, NIXL objects) at each scrape ("metrics").
    metrics = Metrics()
    metrics.bind_gpu_launches(gpu_launch_counts)
    send_lock = threading.Lock()
    pool = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="copy")

    def answer(msg_id: int, ok: bool, value: Any) -> None:
        with send_lock:
            conn.send((msg_id, ok, value))

    def run(msg_id: int, fn: Any, *args: Any) -> None:
        try:
            answer(msg_id, True, fn(*args))
        except Exception as e:
            answer(msg_id, False, encode_error(e))

    pooled = 0  # copies handed to the pool and not yet answered
    pooled_lock = threading.Lock()

    def run_pooled(msg_id: int, fn: Any, *args: Any) -> None:
        nonlocal pooled
        try:
            run(msg_id, fn, *args)
        finally:
            with pooled_lock:
                pooled -= 1

    def start_copy(msg_id: int, fn: Any, *args: Any) -> None:
        """A copy on this, the reading, thread when no other copy runs and no message waits behind it:
        a lone pull then saves a copy thread's wake-up (0.17-0.2 ms of the ~0.6 a worker added to it on
        an H200, docs/benchmarks.md); else on the pool, side by side with the others while this thread
        reads on."""
        nonlocal pooled
        with pooled_lock:
            alone = pooled == 0 and not conn.poll(0)
            if not alone:
                pooled += 1
        if alone:
            run(msg_id, fn, *args)
        else:
            pool.submit(run_pooled, msg_id, fn, *args)

    server = None if staged is None else StagedServer(device, staged[0], staged[1], ranks, answer, metrics)

    def copy(job: LocalCopy, deadline: float) -> int:
        halt = Deadline(deadline, "the pull's deadline passed during its copy")
        if job.reads and ranks.is_gpu(job.reads[0].dst):
            return local_copies.copy_gpu(ranks, job, halt)
        return local_copies.copy_host(ranks, job, halt)

    def copy_all(jobs: list[tuple[LocalCopy, float]]) -> list[tuple[bool, Any]]:
        """A PullBatch's copies into this device, as the sidecar would make them (GPU ones launched
        together, local_copies.copy_all): each's bytes or its error, encoded."""
        halts = [(job, Deadline(d, "the pull's deadline passed during its copy")) for job, d in jobs]
        moved = local_copies.copy_all(ranks, halts)
        return [(False, encode_error(m)) if isinstance(m, BaseException) else (True, m) for m in moved]

    def attach(key: RankKey, spec: EngineSpec, gpu: bool, memory: Any) -> None:
        if gpu:
            ranks.attach_gpu(key, spec, memory)
        else:
            ranks.attach_host(key, spec, memory)

    while True:
        try:
            kind, msg_id, *args = conn.recv()
        except (EOFError, OSError):  # the sidecar went away
            break
        if kind == "copy":
            start_copy(msg_id, copy, *args)
        elif kind == "copy_all":
            start_copy(msg_id, copy_all, *args)
        elif kind == "attach":
            run(msg_id, attach, *args)
        elif kind == "detach":
            run(msg_id, ranks.detach, *args)
        elif kind == "metrics":
            run(msg_id, metrics.worker_families)
        elif kind == "ping":  # answered after every attach before it: the worker has mapped the ranks
            answer(msg_id, True, None)
        elif kind == "quit":
            break
        elif server is None or not server.handle(kind, msg_id, tuple(args)):
            answer(
                msg_id,
                False,
                ("error", int(Code.INTERNAL), f"a worker without staged transfers got {kind!r}"),
            )
    pool.shutdown(wait=True)
    if server is not None:
        server.close()
    ranks.close()


class CopyWorker:
    """The sidecar's handle on one device's worker process: starts it, restarts it when it dies."""

    def __init__(
        self,
        device: int,
        metrics: Metrics,
        staged: tuple[str, Settings] | None = None,
        on_change: Callable[[int], None] = lambda device: None,
    ) -> None:
        """staged: the worker runs the device's staged transfers too, on a NIXL agent of that name.
        on_change: called with the device when the process changed: once one that died was replaced (its
        jobs failed), and once a process (the first, or one that replaced another) is ready (`ready`)."""
        self.device = device
        self._metrics = metrics
        self._staged = staged
        self._on_change = on_change
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Future[Any], _Job]] = {}
        self.incarnation = 0  # processes started before this one: what a job ran in is gone once it moved on
        self._answered = 0  # the incarnation that answered its first ping: started, every rank mapped
        self._agent_of: tuple[int, tuple[str, bytes]] | None = None  # (incarnation, its staged agent)
        self._ranks: dict[RankKey, _Memory] = {}  # attached again after a restart
        self._closed = False
        self._proc: Any = None
        self._conn: multiprocessing.connection.Connection | None = None
        with self._lock:
            self._start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:  # holds self._lock
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA and threads
        parent, child = ctx.Pipe()
        name = "kvs-worker-host" if self.device == HOST else f"kvs-worker-gpu{self.device}"
        proc = ctx.Process(target=_serve, args=(child, self.device, self._staged), name=name, daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.incarnation += 1
        threading.Thread(target=self._follow, args=(proc, parent), name=f"{name}-follow", daemon=True).start()
        for key, (spec, gpu, memory) in self._ranks.items():
            self._post("attach", None, key, spec, gpu, memory)
        self._post("ping", None).add_done_callback(functools.partial(self._pinged, self.incarnation))

    def _pinged(self, incarnation: int, fut: Future[Any]) -> None:
        if fut.exception() is not None:
            return
        with self._lock:
            if incarnation != self.incarnation:
                return
            self._answered = incarnation
        self._on_change(self.device)

    @property
    def ready(self) -> bool:
        """Whether the process now running has started and mapped every rank it was given at its start
        (its first ping answered): a copy sent now waits for neither."""
        return self._answered == self.incarnation

    def _post(self, kind: str, job: _Job, *args: Any) -> Future[Any]:  # holds self._lock
        return self._post_id(kind, job, *args)[1]

    def _post_id(self, kind: str, job: _Job, *args: Any) -> tuple[int, Future[Any]]:  # holds self._lock
        fut: Future[Any] = Future()
        msg_id = next(self._ids)
        self._pending[msg_id] = (fut, job)
        assert self._conn is not None
        # A worker that just died: _follow fails this message with the others it held.
        with contextlib.suppress(OSError, ValueError):
            self._conn.send((kind, msg_id, *args))
        return msg_id, fut

    def _call(self, kind: str, job: _Job, *args: Any) -> Future[Any]:
        return self.request(kind, job, *args)[1]

    def request(self, kind: str, job: _Job, *args: Any) -> tuple[int, Future[Any]]:
        """Send a message that is answered: its id, and the answer's future (failed, naming `job`'s
        blocks, if the worker dies first)."""
        with self._lock:
            self._refuse_if_closed()
            return self._post_id(kind, job, *args)

    def request_two(self, kind: str, job: _Job, *args: Any) -> tuple[int, Future[Any], Future[Any]]:
        """Send a message answered twice: its id, and a future for each answer (the second's id is the
        message's second field)."""
        with self._lock:
            self._refuse_if_closed()
            second: Future[Any] = Future()
            later = next(self._ids)
            self._pending[later] = (second, job)
            msg_id, first = self._post_id(kind, job, later, *args)
            return msg_id, first, second

    def _refuse_if_closed(self) -> None:  # holds self._lock
        if self._closed:
            raise SidecarError(Code.UNAVAILABLE, "the sidecar is shutting down")

    def tell(self, kind: str, msg_id: int, *args: Any) -> None:
        """Send a message nobody waits for (lost with the worker, should it die)."""
        with self._lock:
            if self._closed or self._conn is None:
                return
            with contextlib.suppress(OSError, ValueError):
                self._conn.send((kind, msg_id, *args))

    def agent(self, timeout_s: float = 60) -> tuple[str, bytes]:
        """The NIXL agent of this worker's staged transfers, and its metadata (its rings registered).

        Asked of the worker each time (a handshake's, rare), never from a cache: a SIGKILLed worker may
        still read as alive while the kernel tears its CUDA context down, and a peer that handshakes
        then (a reader whose transfer met the dead agent retries at once) must be given the next
        worker's agent, not the dead one's. A dead worker does not answer; its death fails the question
        (`_follow`), and the next worker is asked."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._refuse_if_closed()
                asked = self.incarnation
                fut = self._post("hello", None) if self._proc is None or self._proc.is_alive() else None
            if fut is not None:
                try:
                    agent: tuple[str, bytes] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                    self._agent_of = (asked, agent)
                    return agent
                except FutureTimeout:
                    raise SidecarError(
                        Code.UNAVAILABLE, f"the worker of device {self.device} did not start its NIXL agent"
                    ) from None
                except SidecarError:
                    # Died before answering (`_follow` starts the next before it fails what the dead
                    # one held): ask the next. Any other failure is the answer.
                    if self.incarnation == asked or self._closed:
                        raise
            if time.monotonic() > deadline:
                raise SidecarError(
                    Code.UNAVAILABLE, f"the worker of device {self.device} was not started again"
                )
            time.sleep(0.005)

    def known_agent(self) -> tuple[str, bytes] | None:
        """What `agent` last answered, if the process that answered it still runs and is ready; None
        otherwise. Asks nothing: a worker busy with a long copy answers late, and its agent has not
        changed (a restart makes a new incarnation, and `on_change` says so)."""
        seen = self._agent_of
        if seen is None or seen[0] != self.incarnation or not self.ready:
            return None
        return seen[1]

    def ask_metrics(self) -> Future[list[Family]] | None:
        """Ask what it counts (`Metrics.worker_families`); None while the sidecar shuts down."""
        try:
            return self._call("metrics", None)
        except SidecarError:
            return None

    def _follow(self, proc: Any, conn: multiprocessing.connection.Connection) -> None:
        """Answer each message's future; when the worker dies, fail what it held and start another."""
        while True:
            try:
                msg_id, ok, value = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut, _ = self._pending.pop(msg_id, (None, None))
            if fut is None:
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(decode_error(value))
        proc.join(timeout=5)
        with self._lock:
            held, self._pending = self._pending, {}
            closed = self._closed
            if not closed:
                self._metrics.worker_restarts.labels(str(self.device)).inc()
                log.error(
                    "data-plane worker of device %s died (exit code %s): starting another",
                    self.device,
                    proc.exitcode,
                )
                self._start()
        for fut, job in held.values():
            fut.set_exception(_died(self.device, proc.exitcode, job, closed))
        if not closed:
            self._on_change(self.device)

    # -- what the data plane asks -------------------------------------------------------------------
    def attach(
        self, key: RankKey, spec: EngineSpec, gpu: bool, memory: list[ShmTensor] | list[IpcTensorRef]
    ) -> None:
        """Not waited for: the sidecar mapped the rank already (a bad handle failed there), and a copy
        that needs it comes after it on the pipe; should the worker fail to map it, that copy says so."""
        with self._lock:
            self._ranks[key] = (spec, gpu, memory)
            if not self._closed:
                self._post("attach", None, key, spec, gpu, memory).add_done_callback(_log_failure(key))

    def detach(self, key: RankKey) -> None:
        with self._lock:
            if self._ranks.pop(key, None) is not None and not self._closed:
                self._post("detach", None, key)

    def copy(self, job: LocalCopy, halt: Halt) -> int:
        deadline = time.monotonic() + halt.remaining()
        fut = self._call("copy", job, job, deadline)
        return int(self.answer_by(fut, deadline, "the copy", "its", f"; blocks not filled: {_blocks(job)}"))

    def answer_by(self, fut: Future[Any], deadline: float, what: str, owner: str, more: str = "") -> Any:
        """`fut`'s answer. One still awaited KILL_AFTER_S past `deadline` is stuck: the worker is killed
        (and started again), since nothing of ours may write into an engine's cache after the pull
        answered, and DEADLINE_EXCEEDED says so of `what` ("the copy"), whose (`owner`: "its") deadline
        and worker it was, and `more`."""
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()) + KILL_AFTER_S)
        except FutureTimeout:
            self.kill()
            raise SidecarError(
                Code.DEADLINE_EXCEEDED,
                f"{what} did not end {KILL_AFTER_S:g} s past {owner} deadline: {owner} worker was restarted"
                f"{more}",
            ) from None

    def post_copies(self, jobs: Sequence[tuple[LocalCopy, Halt]]) -> PostedCopies:
        """Send several copies (a PullBatch's into this device) in one message, without waiting: one
        hand-off for the batch instead of one per member, and its GPU copies launched together in the
        worker. A copy already stopped fails alone here."""
        out: list[int | BaseException] = [0] * len(jobs)
        sent: list[int] = []
        deadlines: list[float] = []
        for i, (_, halt) in enumerate(jobs):
            try:
                deadlines.append(time.monotonic() + halt.remaining())
                sent.append(i)
            except Exception as e:
                out[i] = e
        msg = [(jobs[i][0], d) for i, d in zip(sent, deadlines, strict=True)]
        fut = self._call("copy_all", None, msg) if msg else None
        return PostedCopies(self, out, sent, fut, max(deadlines, default=0.0))

    def kill(self) -> None:
        """Kill the worker process (it is started again)."""
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc, conn = self._proc, self._conn
            if conn is not None:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("quit", -1))
        if proc is not None:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@dataclass
class PostedCopies:
    """Copies sent to a worker in one message (CopyWorker.post_copies), until they are answered."""

    worker: CopyWorker
    out: list[int | BaseException]  # each copy's outcome: those stopped before sending already in
    sent: list[int]  # the copies the message holds, by index
    answer: Future[Any] | None  # None: nothing was sent
    deadline: float  # the latest of theirs

    def wait(self) -> list[int | BaseException]:
        """Each copy's bytes or what failed it. A worker that died fails every copy it held
        (UNAVAILABLE); one still copying KILL_AFTER_S past the last deadline is killed, as for a copy
        alone: nothing of ours writes into an engine's cache after the pulls answered."""
        if self.answer is None:
            return self.out
        try:
            answers = self.worker.answer_by(self.answer, self.deadline, "the copies", "their")
        except Exception as e:  # stuck, or the worker died with them
            return self._failed(e)
        for i, (ok, value) in zip(self.sent, answers, strict=True):
            self.out[i] = int(value) if ok else decode_error(value)
        return self.out

    def _failed(self, e: BaseException) -> list[int | BaseException]:
        """Every copy the message held failed with `e`."""
        for i in self.sent:
            self.out[i] = e
        return self.out


def _staged_agent(sidecar_agent: str, device: int) -> str:
    return f"{sidecar_agent}/host" if device == HOST else f"{sidecar_agent}/gpu{device}"


class CopyWorkers:
    """One `CopyWorker` per device: GPU ranks go to every GPU's worker (a gpu-direct copy on the decode
    GPU reads the source rank's memory through its own mapping of it), host ranks to the host's.

    With staged transfers (staged_workers) a device's worker starts when its first rank registers: its
    NIXL agent is what peers handshake with. Without, it starts at the first local copy into its
    device (`ready`), so that a sidecar that sees a node's GPUs but copies into few of them (a pod's,
    deploy/k8s/base) starts no process, and holds no GPU memory, for the others."""

    def __init__(
        self,
        metrics: Metrics,
        staged: tuple[str, Settings] | None = None,
        on_change: Callable[[int], None] = lambda device: None,
    ) -> None:
        """staged: (the sidecar's agent name, its settings): each worker also runs its device's staged
        transfers, on an agent named `<name>/gpu<N>` (`<name>/host`). on_change: a worker that died was
        replaced, or a worker became ready (CopyWorker)."""
        self._metrics = metrics
        self._staged = staged
        self._on_change = on_change
        self._lock = threading.Lock()
        self._workers: dict[int, CopyWorker] = {}
        self._ranks: dict[RankKey, _Memory] = {}  # every rank, for the workers started later

    def staged_agent_name(self, device: int) -> str | None:
        """The name of the agent that runs `device`'s staged transfers: fixed per device, every worker
        incarnation's alike (None without staged transfers)."""
        return None if self._staged is None else _staged_agent(self._staged[0], device)

    def attach_host(self, key: RankKey, spec: EngineSpec, tensors: list[ShmTensor]) -> None:
        with self._lock:
            self._ranks[key] = (spec, False, tensors)
            worker = self._workers.get(HOST)
            if worker is not None:
                worker.attach(key, spec, False, tensors)
            elif self._staged is not None:
                self._get(HOST)  # maps this rank too

    def attach_gpu(self, key: RankKey, spec: EngineSpec, device: int, refs: list[IpcTensorRef]) -> None:
        # Under one lock: a GPU's worker started meanwhile must neither miss this rank nor get it twice.
        with self._lock:
            self._ranks[key] = (spec, True, refs)
            fresh = self._get(device) if self._staged is not None and device not in self._workers else None
            for d, w in self._workers.items():
                if d != HOST and w is not fresh:
                    w.attach(key, spec, True, refs)

    def detach(self, key: RankKey) -> None:
        with self._lock:
            self._ranks.pop(key, None)
            workers = list(self._workers.values())
        for w in workers:
            w.detach(key)

    def ready(self, device: int) -> CopyWorker | None:
        """The device's worker if it is ready for a copy; else None, and it is started if it was not:
        the copy runs in the sidecar meanwhile rather than wait for a process to start (seconds, with
        CUDA) or to come back after it died."""
        with self._lock:
            worker = self._get(device)
        return worker if worker.ready else None

    def metrics(self, timeout_s: float = 0.5) -> dict[int, list[Family]]:
        """What each worker counts: device -> its families, asked side by side; a worker that does not
        answer within `timeout_s` (starting, or just died) is left out: a scrape must not wait on it."""
        with self._lock:
            asked = [(device, w.ask_metrics()) for device, w in self._workers.items()]
        deadline = time.monotonic() + timeout_s
        out = {}
        for device, fut in asked:
            if fut is None:
                continue
            try:
                out[device] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                continue
        return out

    def processes(self) -> list[tuple[int, int, int, bool]]:
        """(device, pid or 0, restarts, ready) of each worker started, by device."""
        with self._lock:
            workers = sorted(self._workers.items())
        return [(d, w.pid or 0, w.incarnation - 1, w.ready) for d, w in workers]

    def ready_agent(self, device: int, timeout_s: float = 1.0) -> tuple[str, bytes] | None:
        """The staged agent (name, metadata) of the device's worker if one runs and is ready: the one it
        gave already, else asked (at most `timeout_s`); None if none was started, it is (re)starting, or
        it did not answer. Starts nothing."""
        with self._lock:
            w = self._workers.get(device)
        if self._staged is None or w is None or not w.ready:
            return None
        known = w.known_agent()
        if known is not None:
            return known
        try:
            return w.agent(timeout_s)
        except SidecarError:
            return None

    def get(self, device: int) -> CopyWorker:
        """The device's worker, started if it is not yet."""
        with self._lock:
            return self._get(device)

    def _get(self, device: int) -> CopyWorker:  # holds self._lock
        w = self._workers.get(device)
        if w is None:
            staged = None
            if self._staged is not None:
                staged = (_staged_agent(self._staged[0], device), self._staged[1])
            w = self._workers[device] = CopyWorker(device, self._metrics, staged, self._on_change)
            for key, (spec, gpu, memory) in self._ranks.items():  # a GPU's every GPU rank; the host's, its
                if gpu == (device != HOST):
                    w.attach(key, spec, gpu, memory)
        return w

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.close()


def _blocks(job: _Job) -> str:
    if job is None:
        return "-"
    if isinstance(job, Send):
        return f"none here (transfer {job.transfer_id} out of rank {job.src.rank} of {job.src.engine_id!r})"
    ids = [int(b) for b in job.tokens.dst_blocks]
    return str(ids) if len(ids) <= 16 else f"{ids[:16]} and {len(ids) - 16} more"


def _died(device: int, exitcode: int | None, job: _Job, closed: bool) -> SidecarError:
    if closed:
        return SidecarError(Code.UNAVAILABLE, "the sidecar is shutting down")
    where = "the host" if device == HOST else f"GPU {device}"
    what = "the copy" if job is None or isinstance(job, LocalCopy) else "the staged transfer"
    # Several copies at once (job None): each pull names its own blocks not filled.
    blocks = "" if job is None else f"; blocks not filled: {_blocks(job)}"
    return SidecarError(
        Code.UNAVAILABLE,
        f"the data-plane worker of {where} died (exit code {exitcode}) during {what}; it was restarted{blocks}",
    )


def _log_failure(key: RankKey) -> Any:
    def done(fut: Future[Any]) -> None:
        if fut.exception() is not None:
            log.warning(
                "a data-plane worker could not map rank %s of %s: %s",
                key.rank,
                key.engine_id,
                fut.exception(),
            )

    return done
