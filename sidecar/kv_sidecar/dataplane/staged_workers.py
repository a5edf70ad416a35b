"""Staged transfers in a device's worker process (`staged_workers`; docs/gpu.md, "Node scaling").

A staged transfer's data plane (its ring slots, gathers, scatters, NIXL WRITEs, chunk notifications
and credits) is most of a staged pull's CPU on both sidecars, and one interpreter runs it for every
GPU of the node (issue 32). With `staged_workers` each device's worker process (dataplane/workers.py)
also owns a NIXL agent, `<sidecar id>/gpu<N>` (`/host` for host rings), that device's two rings, and
runs `Reception` and `Transmission` (dataplane/receive.py, send.py) unchanged inside it. Peers learn
the worker agents at handshake: chunks go worker to worker.

Two halves: `StagedServer` runs in the worker and answers messages; `WorkerReception` and
`WorkerTransmission` are what the control side holds instead of a `Reception` or a `Transmission`,
with the same methods, each one or two messages over the worker's pipe.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.jobs import CANCEL_WAIT_S, Halt, Receive, ReceiveSlots, Send, Sent
from kv_sidecar.errors import Code, SidecarError, as_sidecar_error
from kv_sidecar.mailbox import Mailbox

if TYPE_CHECKING:
    from kv_sidecar.config import Settings
    from kv_sidecar.dataplane.ranks import MappedRanks
    from kv_sidecar.dataplane.receive import Reception
    from kv_sidecar.dataplane.send import Transmission
    from kv_sidecar.dataplane.workers import CopyWorker
    from kv_sidecar.metrics import Metrics

# A reception's loop in the worker looks at its commands (stop, describe, close) this often.
_TURN_S = 0.05
# How long the control side waits for a worker to close a reception beyond its cancel wait.
_CLOSE_WAIT_S = CANCEL_WAIT_S + 5
# Staged transfers one worker runs at once (each holds a thread for its whole transfer, as a pull does
# in the sidecar); more wait for a thread.
STAGED_THREADS = 256

log = logging.getLogger(__name__)

Answer = Callable[[int, bool, Any], None]


def encode_error(e: BaseException) -> tuple[str, int, str]:
    """An exception as it crosses the pipe: the staged protocol's own kinds keep their type."""
    if isinstance(e, sp.ProtocolError):
        return ("protocol", 0, str(e))
    if isinstance(e, sp.Stopped):
        return ("stopped", 0, str(e))
    err = as_sidecar_error(e if isinstance(e, Exception) else Exception(str(e)))
    return ("error", int(err.code), err.message)


def decode_error(value: tuple[str, int, str]) -> Exception:
    kind, code, message = value
    if kind == "protocol":
        return sp.ProtocolError(message)
    if kind == "stopped":
        return sp.Stopped(message)
    return SidecarError(Code(code), message)


class Deadline:
    """A job's `Halt` inside the worker: its deadline (time.monotonic is one clock for every process)."""

    def __init__(self, deadline: float, what: str = "the pull's deadline passed") -> None:
        self.deadline = deadline
        self._what = what

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SidecarError(Code.DEADLINE_EXCEEDED, self._what)
        return left


# -- in the worker process --------------------------------------------------------------------------


class StagedServer:
    """The worker's staged transfers, on its own NIXL agent and rings; every message answered once."""

    def __init__(
        self,
        device: int,
        agent_name: str,
        settings: Settings,
        ranks: MappedRanks,
        answer: Answer,
        metrics: Metrics,
    ):
        """`metrics`: the worker's own registry, which the sidecar asks for at each scrape."""
        from kv_sidecar.dataplane.plane import DevicePlane
        from kv_sidecar.transport.nixl_driver import NixlDriver
        from kv_sidecar.transport.notifications import SEP, TRANSFER_TAG

        self._nixl = NixlDriver(
            agent_name,
            on_notif=lambda agent, msg: None,  # its loop then progresses the agent; transfers listen
            busy_wait_s=settings.nixl_busy_poll_us / 1e6,
            lone_wait_s=settings.nixl_lone_poll_us / 1e6,
            quiet_wait_s=max(1, settings.nixl_quiet_poll_ms) / 1000,
        )
        self._nixl.start()
        self._nixl.route(TRANSFER_TAG + SEP)
        metrics.bind_nixl(self._nixl.counts)
        self._plane = DevicePlane(device, settings, self._nixl, metrics, ranks)
        # Messages told rather than asked carry id -1: nobody waits for their answer.
        self._answer: Answer = lambda msg_id, ok, value: None if msg_id < 0 else answer(msg_id, ok, value)
        self._pool = ThreadPoolExecutor(STAGED_THREADS, thread_name_prefix="staged")
        self._lock = threading.Lock()
        self._receptions: dict[int, Mailbox[tuple[Any, ...]]] = {}
        # Receptions past their slots, by id: a command wakes its loop, which otherwise looks only
        # between chunks or every _TURN_S (a refused transfer's describe and close waited that).
        self._scattering: dict[int, Reception] = {}
        self._sendings: dict[int, Transmission] = {}
        self._settles: dict[int, Callable[[bool], None] | bool] = {}

    def handle(self, kind: str, msg_id: int, args: tuple[Any, ...]) -> bool:
        """One message from the control side; False if it is not a staged one."""
        if kind == "hello":
            self._run(msg_id, self._hello)
        elif kind == "receive":  # (result id, job, deadline): answered with the slots, then the result
            with self._lock:
                self._receptions[msg_id] = Mailbox()
            self._pool.submit(self._reception, msg_id, *args)
        elif kind == "rx":
            rxid, cmd, *rest = args
            with self._lock:
                cmds = self._receptions.get(rxid)
                rx = self._scattering.get(rxid)
            if cmds is not None:
                cmds.put((cmd, msg_id, *rest))
                if rx is not None:
                    rx.poke()
            elif msg_id >= 0:  # long over (or before a restart): nothing of it is left to stop or close
                self._answer(msg_id, True, "the transfer's reception had ended")
        elif kind == "rx_settled":
            self._settled(msg_id, bool(args[0]))
        elif kind == "send":  # (job, deadline)
            self._start_send(msg_id, *args)
        elif kind == "stop_orphan":
            self._pool.submit(self._stop_orphan, *args)
        elif kind == "tx_stop":
            with self._lock:
                tx = self._sendings.get(msg_id)
            if tx is not None:
                tx.stop(str(args[0]))  # a Transmission keeps a stop that comes before its run
        else:
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._nixl.stop()

    def _run(self, msg_id: int, fn: Callable[[], Any]) -> None:
        try:
            self._answer(msg_id, True, fn())
        except Exception as e:
            self._answer(msg_id, False, encode_error(e))

    def _hello(self) -> tuple[str, bytes]:
        # Both rings allocated and registered before a peer learns the agent (the handshake asks this).
        self._plane.ring("send")
        self._plane.ring("recv")
        return self._nixl.name, self._nixl.metadata()

    # -- the reader's end ----------------------------------------------------------------------------
    def _reception(self, rxid: int, result_id: int, job: Receive, deadline: float) -> None:
        """Take the slots and answer them (`rxid`), then scatter at once until the transfer is complete
        and answer that (`result_id`): a transfer that ends well closes here, without a message more.
        Then, or after a failure, the control side's commands until it closes the reception."""
        with self._lock:
            cmds = self._receptions[rxid]
        try:
            halt = Deadline(deadline, "the pull's deadline passed waiting for a receive slot")
            try:
                if job.source_metadata:  # credits go to the source's agent: it must be loaded here
                    self._nixl.load_remote(job.source_agent, job.source_metadata)
                rx = self._plane.receive(job, halt)
            except Exception as e:
                self._answer(rxid, False, encode_error(e))
                self._answer(result_id, False, encode_error(e))
                return
            if rx is not None:
                with self._lock:
                    self._scattering[rxid] = rx
                if not cmds.empty():  # came before it was here to wake
                    rx.poke()
            self._answer(rxid, True, None if rx is None else rx.slots)
            if rx is None:
                self._answer(result_id, True, 0)
                return
            self._drive(rxid, rx, cmds, self._run_reception(rx, cmds, result_id, Deadline(deadline)))
        finally:
            with self._lock:
                self._receptions.pop(rxid, None)
                self._scattering.pop(rxid, None)

    def _run_reception(
        self, rx: Reception, cmds: Mailbox[tuple[Any, ...]], result_id: int, halt: Deadline
    ) -> tuple[Any, ...] | None:
        """Scatter until the transfer is complete, looking at the commands between chunks; answer the
        result. A close that came meanwhile is returned, to be done once the loop is out."""
        closing = None
        try:
            rx.prepare()
            while not rx.wait(_TURN_S):
                halt.remaining()
                stopped, closing = self._between(rx, cmds)
                if stopped:
                    raise sp.Stopped("the reader stopped the transfer")
        except Exception as e:
            self._answer(result_id, False, encode_error(e))
            return closing
        rx.close(True)  # complete: nothing of the source is in flight, the slots go back now
        self._answer(result_id, True, rx.nbytes)
        return ("closed", -1)

    def _drive(
        self, rxid: int, rx: Reception, cmds: Mailbox[tuple[Any, ...]], closing: tuple[Any, ...] | None
    ) -> None:
        """The commands that follow a reception's run, in order, until its close."""
        while True:
            cmd, msg_id, *args = closing if closing is not None else cmds.get()
            closing = None
            if cmd == "closed":  # it closed itself when complete; a close sent before it knew is answered
                with self._lock:
                    self._receptions.pop(rxid, None)  # from now on `handle` answers them itself
                with contextlib.suppress(queue.Empty):
                    while True:
                        late = cmds.get_nowait()
                        if late[0] != "describe":
                            self._answer(late[1], True, None)
                return
            if cmd == "close":
                quiet, confirmed = args
                try:
                    rx.close(quiet, (lambda fn: self._settle_with(rxid, fn)) if confirmed else None)
                finally:
                    self._answer(msg_id, True, None)
                return
            self._command(rx, cmd, msg_id)

    def _between(self, rx: Reception, cmds: Mailbox[tuple[Any, ...]]) -> tuple[bool, tuple[Any, ...] | None]:
        """Commands that came while chunks were scattered: whether one stopped the transfer, and a
        close, which ends the loop too (done once the loop is out)."""
        stopped = False
        while True:
            try:
                item = cmds.get_nowait()
            except queue.Empty:
                return stopped, None
            if item[0] == "close":
                return True, item
            self._command(rx, item[0], item[1])
            stopped = stopped or item[0] in ("stop_source", "stop_credits")

    def _command(self, rx: Reception, cmd: str, msg_id: int) -> None:
        if cmd == "stop_source":
            rx.stop_source()
        elif cmd == "stop_credits":
            rx.stop_credits()
        elif cmd == "describe":
            self._answer(msg_id, True, rx.describe())
            return
        self._answer(msg_id, True, None)

    def _settle_with(self, rxid: int, fn: Callable[[bool], None]) -> None:
        """Reception.close's `settles`: `fn` once the control side says the Push call ended."""
        with self._lock:
            early = self._settles.pop(rxid, None)
            if not isinstance(early, bool):
                self._settles[rxid] = fn
                return
        fn(early)

    def _settled(self, rxid: int, ok: bool) -> None:
        with self._lock:
            fn = self._settles.pop(rxid, None)
            if not callable(fn):
                self._settles[rxid] = ok  # before close registered its callback
                return
        fn(ok)

    def _stop_orphan(self, source_agent: str, source_metadata: bytes, transfer_id: str) -> None:
        """Ask a source to stop a transfer into the worker that was here before this one (it died):
        under the same agent name, as the reader it sends to, so that it stops now instead of waiting
        for credits until its deadline with its send slots held."""
        try:
            if source_metadata:
                self._nixl.load_remote(source_agent, source_metadata)
            self._nixl.send_notif(source_agent, sp.stop_notif(transfer_id))
        except Exception as e:
            log.warning(
                "could not ask %s to stop transfer %s of a worker that died: %s", source_agent, transfer_id, e
            )

    # -- the source's end ----------------------------------------------------------------------------
    def _start_send(self, txid: int, job: Send, deadline: float) -> None:
        """Make the transmission here, where a stop can find it by id at once; run it on a thread."""
        try:
            tx = self._plane.send(job, None)  # no ids uploaded at Publish here: the gather uploads them
        except Exception as e:
            self._answer(txid, True, (True, None, encode_error(e)))
            return
        with self._lock:
            self._sendings[txid] = tx
        self._pool.submit(self._send, txid, tx, deadline)

    def _send(self, txid: int, tx: Transmission, deadline: float) -> None:
        try:
            sent = tx.run(Deadline(deadline, "the transfer's deadline passed"))
            self._answer(txid, True, (True, (sent.chunks, sent.nbytes), None))
        except Exception as e:
            self._answer(txid, True, (tx.quiet, None, encode_error(e)))
        finally:
            with self._lock:
                self._sendings.pop(txid, None)


# -- on the control side ----------------------------------------------------------------------------


def receive_in(worker: CopyWorker, job: Receive, halt: Halt) -> WorkerReception | None:
    """The receiving end of a staged transfer in `worker`, its slots taken there; None if it moves
    nothing. Waits for the slots as `DataPlane.receive` does; a reader stopped meanwhile leaves the
    worker to close the reception once it has them."""
    rxid, fut, result = worker.request_two("receive", job, job, time.monotonic() + halt.remaining())
    while True:
        try:
            left = halt.remaining()
        except BaseException:
            worker.tell("rx", -1, rxid, "close", True, False)  # once it has the slots, it gives them back
            raise
        try:
            slots = fut.result(timeout=min(_TURN_S, left))
            break
        except FutureTimeout:
            continue
    if slots is None:
        return None
    return WorkerReception(worker, job, rxid, slots, result)


class WorkerReception:
    """A `Reception` that runs in a worker: the same methods, as messages."""

    def __init__(
        self, worker: CopyWorker, job: Receive, rxid: int, slots: ReceiveSlots, result: Future[Any]
    ) -> None:
        """`result`: the worker's answer once the transfer is complete (it scatters from the moment it
        has the slots, and closes a transfer that ended well itself)."""
        self._worker, self._job, self._id, self.slots = worker, job, rxid, slots
        self._incarnation = worker.incarnation
        self._run = result
        self._inbox: Mailbox[bool] = Mailbox()
        result.add_done_callback(lambda _: self._inbox.put(True))
        self.nbytes = 0
        self.chunks: int | None = None  # the worker's to know; describe() says how far it got

    def describe(self) -> str:
        try:
            _, fut = self._worker.request("rx", self._job, self._id, "describe")
            return str(fut.result(timeout=2))
        except Exception as e:
            return f"its worker did not say how far it got ({e})"

    def prepare(self) -> None:
        """Nothing to ask: the worker prepared its scatters once it had the slots."""

    def wait(self, timeout_s: float) -> bool:
        run = self._run
        if not run.done():
            with contextlib.suppress(queue.Empty):
                self._inbox.get(timeout=timeout_s)
            if not run.done():
                return False  # poked, or nothing yet
        self.nbytes = int(run.result())  # raises what broke the transfer
        return True

    def poke(self) -> None:
        self._inbox.put(False)

    def stop_credits(self) -> None:
        self._worker.tell("rx", -1, self._id, "stop_credits")

    def stop_source(self) -> None:
        if self._worker.incarnation == self._incarnation:
            self._worker.tell("rx", -1, self._id, "stop_source")
        else:  # its worker died: the next one asks the source, under the same agent name
            job = self._job
            self._worker.tell("stop_orphan", -1, job.source_agent, job.source_metadata, job.transfer_id)

    def close(self, quiet: bool, settles: Callable[[Callable[[bool], None]], None] | None = None) -> None:
        """As `Reception.close`: returns once no scatter of the worker writes into the rank (or the
        worker is gone, and its scatters with it)."""
        if self._run.done() and self._run.exception() is None:
            return  # complete: the worker closed it then
        _, fut = self._worker.request("rx", self._job, self._id, "close", quiet, settles is not None)
        if settles is not None:
            settles(lambda ok: self._worker.tell("rx_settled", self._id, ok))
        with contextlib.suppress(Exception):
            fut.result(timeout=_CLOSE_WAIT_S)


class WorkerTransmission:
    """A `Transmission` that runs in a worker: `run` sends the job and waits for its answer, asking the
    control side's halt between; `stop` and `quiet` as the original."""

    def __init__(self, worker: CopyWorker, job: Send) -> None:
        self._worker, self._job = worker, job
        self._lock = threading.Lock()
        self._id: int | None = None
        self._stopped: str | None = None
        self.quiet = True

    def stop(self, reason: str) -> None:
        with self._lock:
            self._stopped = self._stopped or reason
            txid = self._id
        if txid is not None:
            self._worker.tell("tx_stop", txid, reason)

    def run(self, halt: Halt) -> Sent:
        halt.remaining()
        # The job's own deadline: a halt may answer less for now (a transfer its notification started
        # asks again until its call joins), and is asked here between answers.
        txid, fut = self._worker.request("send", self._job, self._job, self._job.deadline)
        with self._lock:
            self._id, stopped = txid, self._stopped
        self.quiet = False
        if stopped is not None:
            self._worker.tell("tx_stop", txid, stopped)
        while True:
            try:
                quiet, sent, err = fut.result(timeout=_TURN_S)
                break
            except FutureTimeout:
                pass
            except SidecarError:
                self.quiet = True  # the worker died: nothing of it is in flight any more
                raise
            try:
                halt.remaining()
            except BaseException:
                self._worker.tell("tx_stop", txid, "the push was stopped")
                try:  # its answer says whether its WRITEs ended; a worker that died has none in flight
                    self.quiet = bool(fut.result(timeout=CANCEL_WAIT_S + 1)[0])
                except SidecarError:
                    self.quiet = True
                except FutureTimeout:
                    pass  # still not answered: not quiet
                raise
        self.quiet = bool(quiet)
        if err is not None:
            raise decode_error(err)
        return Sent(*sent)
