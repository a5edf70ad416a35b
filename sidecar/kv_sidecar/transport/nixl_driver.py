"""The sidecar's one NIXL agent, driven from one thread.

NIXL agents are not thread-safe, while gRPC handlers run on a thread pool.
Every NIXL call therefore goes through `NixlDriver`: handlers submit work and
wait on futures; the driver thread runs the calls, polls in-flight transfers
and delivers notifications.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np

from kv_sidecar.mailbox import Mailbox

log = logging.getLogger(__name__)
T = TypeVar("T")


# import_nixl sets it to "n" where the environment does not set it.
UCX_EMULATION = "UCX_PROTO_EMULATION_ENABLE"


def import_nixl() -> Any:
    """The NIXL python API, from the `nixl` meta-package or a CUDA-specific wheel."""
    # Make UCX fail loudly instead of silently emulating over TCP (DESIGN.md section 1).
    os.environ.setdefault(UCX_EMULATION, "n")
    try:
        from nixl import _api
    except ImportError:
        try:
            from nixl_cu13 import _api  # type: ignore[no-redef]
        except ImportError:
            from nixl_cu12 import _api  # type: ignore[no-redef]
    return _api


class TransferError(RuntimeError):
    pass


class AgentDisconnected(TransferError):
    """NIXL found the peer's agent disconnected as the transfer started: the peer is gone, or UCX has no
    transport that reaches its memory (with emulation off, two nodes with only TCP between them)."""


def ended(transfers: Sequence[Future[None]], timeout_s: float) -> bool:
    """Whether every transfer's future is done within `timeout_s`, whatever its outcome. A transfer
    that failed with TimeoutError (its NIXL deadline passed: the driver released its handle, which
    cancels it) has ended; only a future still pending has not. `result(timeout)` cannot tell the two
    apart, since both raise TimeoutError."""
    return not wait(transfers, timeout=timeout_s).not_done


_UCX_NO = frozenset({"n", "no", "off", "0", "false"})  # how UCX's boolean settings say "no"


def ucx_emulation_disabled() -> bool:
    """Whether UCX may not emulate RMA over active messages (import_nixl's default)."""
    return os.environ.get(UCX_EMULATION, "").strip().lower() in _UCX_NO


class _Released:
    """Stands in for a transfer handle NIXL already released."""

    def release(self) -> None:
        pass


_RELEASED = _Released()
# One-descriptor lists write_slot_now prepares and keeps: one per slot of each ring in use (ours and
# the readers') and chunk length; past this many the least recently used are released (~10 us each
# to make again).
WRITE_LISTS_MAX = 1024
Desc = tuple[int, int, int]  # (address, length, device)
_FIRST = np.zeros(1, dtype=np.int32)  # the one descriptor of a one-descriptor list
# A transfer past its deadline that NIXL could not cancel is tried again this often, and dropped from
# the polls this long after its deadline (longer than any caller waits for a cancelled transfer to end).
CANCEL_RETRY_S = 0.1
OVERDUE_GIVE_UP_S = 60.0
_WAKE: Any = ("wake",)  # a queue item that only makes the driver thread poll

# What a poller returns when it has nothing to do until its owner calls `NixlDriver.resume` (a
# reception with no scatter in flight, a transmission with no gathered chunk or no credit): parked
# pollers cost the loop nothing, where polling each of 16 idle transfers every turn held the GIL
# the transfers themselves need.
PARK: Final = "park"
Poller = Callable[[Any], "bool | str"]


@dataclass(frozen=True)
class _Resume:
    """A queue item: poll `fn` again if it is parked."""

    fn: Poller


_PR_SET_TIMERSLACK = 29
_TIMER_SLACK_NS = 1_000


def tighten_timer_slack() -> bool:
    """Let this thread's timed waits end when asked. Linux lets a wait overrun by the thread's timer
    slack, 50 us by default: the driver's 20 us poll took ~100 us and its 100 us poll ~190 us (measured
    on the CPU machine), and a pull waits on several such polls in series. Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _make_current(device: int) -> None:
    """Give the driver thread a current CUDA context: UCX's CUDA transports query and copy within it."""
    import torch

    torch.cuda.set_device(device)


@dataclass
class _Inflight:
    handle: Any
    future: Future[None]
    started: float
    deadline: float
    release: list[Any] = field(default_factory=list)
    agent: str = ""  # the remote agent, where known: a failure marks its connection broken
    retry_at: float = 0.0  # past its deadline and not cancelled yet: when to try again
    lists: tuple[int, ...] = ()  # the prepared lists it was made from (kept while it is in flight)


def _decoded(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


class NixlDriver:
    """Owns the NIXL agent; all methods are safe to call from any thread."""

    def __init__(
        self,
        name: str,
        on_notif: Callable[[str, bytes], None] | None = None,
        idle_wait_s: float = 0.002,
        quiet_wait_s: float = 0.05,
        busy_wait_s: float = 20e-6,
        lone_wait_s: float | None = None,
        serving: Callable[[], bool] | None = None,
        serving_wait_s: float = 0.0001,
    ) -> None:
        self.name = name
        self._on_notif = on_notif
        self._idle = idle_wait_s
        self._quiet = quiet_wait_s
        self._busy = busy_wait_s
        self._lone = busy_wait_s if lone_wait_s is None else lone_wait_s
        self._serving = serving or (lambda: False)
        self._serving_wait = serving_wait_s
        self._last_activity = 0.0
        # Mailbox: a few C calls a hand-off; this loop waits on it ~10^4 times a second when busy,
        # and queue.Queue's Python Condition cost every wait GIL time the transfers need. Not a bare
        # SimpleQueue, whose timed get can wait for the next put instead (kv_sidecar/mailbox.py).
        self._queue: Mailbox[Any] = Mailbox()
        self._inflight: list[_Inflight] = []
        self._thread = threading.Thread(target=self._run, name=f"nixl-{name}", daemon=True)
        self._ready: Future[None] = Future()
        self._agent: Any = None
        self._disconnected: type[Exception] | tuple[()] = ()  # NIXL's error for it, once loaded
        self._registrations: dict[int, Any] = {}
        self._next_reg = 0
        self._remotes: set[str] = set()
        # Agents whose connection a transfer or notification found failed (UCX keeps an endpoint in
        # error once an operation on it failed, e.g. a READ of memory the peer deregistered meanwhile:
        # every later READ of that peer's memory then fails): loaded again from scratch the next time
        # a handshake or a ring's metadata loads them, even with the same metadata.
        self._broken: set[str] = set()
        self._remote_md: dict[str, set[bytes]] = {}  # metadata blobs load_remote loaded, per agent
        self._full_md: dict[str, bytes] = {}  # the metadata add_remote last loaded, per agent
        # Bumped whenever what NIXL knows of a remote agent changes: NIXL refuses descriptor lists
        # prepared before ("prepped descriptor lists must be re-created"), so callers key theirs on it.
        self._generations: dict[str, int] = {}
        self._dlist_agents: dict[int, str] = {}
        # write_slot_now's prepared lists: (agent, "" for ours; memory type; descriptor) -> a _dlists key.
        self._write_lists: OrderedDict[tuple[str, str, Desc], int] = OrderedDict()
        # The staged protocol (server/staged_reader.py, staged_source.py): functions run every loop turn on this
        # thread, and notification listeners by message prefix (all of one length).
        self._pollers: list[Poller] = []
        self._parked: set[Poller] = set()
        self._eager: set[Poller] = set()  # pollers of transfers of several chunks (`add_poller`)
        self._listeners: dict[bytes, Callable[[str, bytes], None]] = {}
        self._listen_len = 0
        self._routed: tuple[bytes, ...] = ()  # prefixes of messages that only listeners take
        self.stray_notifs = 0  # routed messages no listener wanted (late ones of a finished transfer)
        self._dlists: dict[int, Any] = {}
        # Transfer handles posted, released, and those NIXL refused to release (left to NIXL's exit).
        self._posted = 0
        self._released = 0
        self._release_failures = 0
        self._lone_polls = 0  # loop turns that waited lone_wait_s (metrics, tests)

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.result(timeout=60)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self._ready.done() and self._ready.exception() is None

    def _run(self) -> None:
        tighten_timer_slack()
        try:
            api = import_nixl()
            self._api = api
            self._disconnected = getattr(getattr(api, "nixlBind", None), "nixlRemoteDisconnectError", ())
            # No NIXL progress thread: it busy-polls a core even when idle, and this
            # thread already drives progress (it spins while transfers are in flight).
            config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self._agent = api.nixl_agent(self.name, config)
            if "UCX" not in self._agent.backends:
                raise TransferError("NIXL has no UCX backend on this machine")
        except Exception as e:  # surfaced to start()
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
        try:
            self._loop()
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while True:
            wait = self._wait_s()
            try:
                item = self._queue.get(timeout=wait) if wait else self._queue.get_nowait()
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item is _WAKE:
                self._last_activity = time.monotonic()
            elif type(item) is _Resume:
                if item.fn in self._parked:
                    self._parked.discard(item.fn)
                    self._pollers.append(item.fn)
                continue
            elif item:
                fn, fut = item
                self._last_activity = time.monotonic()
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self._agent))
                    except Exception as e:
                        fut.set_exception(e)
                # Drain what else is queued before polling, cheaply.
                continue
            self._poll_transfers()
            self._poll_notifs()
            if self._pollers:
                self._run_pollers()

    def _wait_s(self) -> float:
        """How long to sleep before the next poll.

        Transfers in flight (or pollers registered): `busy_wait_s`, tens of
        microseconds (on shared-memory and CUDA transports the initiator's
        progress calls move the bytes). Not a pure spin: a thread looping in
        Python holds the GIL between its C calls, so the sidecar's other
        threads (gRPC handlers, kernel launches, the host executor) wait for
        it, and a staged transfer runs its gathers and scatters beside this
        loop. A timed wait releases the GIL and still wakes at once when work
        is queued. Serving reads to other sidecars: `serving_wait_s`. A READ's
        data needs no progress from its target, but its completion does: NIXL
        ends every transfer with a flush of the endpoint, and once the
        endpoint's TCP lane has carried an active message (any NIXL
        notification), that flush waits for the target's worker to answer,
        i.e. for this loop's next poll (docs/benchmarks.md, "Where a pull's
        time goes"). Recently busy: a short wait, so notifications
        ("consumed") arrive promptly. Quiet for a second: a longer one, so an
        idle sidecar costs ~1 % of a core instead of waking 500 times a second.
        While the only poller is an eager one (a staged transfer of several
        chunks): `lone_wait_s`. Each chunk waits on a few of these polls (its
        gather done, its WRITE done, its notification, the credit back), so a
        lone large pull gains from a shorter period; with several transfers in
        flight it gained nothing and cost the reader CPU (docs/benchmarks.md).
        """
        if self._inflight or self._pollers or self._parked:  # parked: still waiting for notifications
            if self._eager and len(self._pollers) + len(self._parked) == 1:
                self._lone_polls += 1
                return self._lone  # that one poller is an eager one, alone
            return self._busy
        if self._serving():
            return self._serving_wait
        return self._idle if time.monotonic() - self._last_activity < 1.0 else self._quiet

    def wake(self) -> None:
        """Poll now (e.g. a reader is about to READ): its transfers' completion waits for our progress."""
        if self._thread.is_alive():
            self._queue.put(_WAKE)

    def _poll_transfers(self) -> None:
        now = time.monotonic()
        still: list[_Inflight] = []
        for x in self._inflight:
            err: Exception | None = None
            try:
                state = self._agent.check_xfer_state(x.handle)
            except Exception as e:
                state, err = "ERR", e
            if state == "PROC" and (now < x.deadline or not self._cancel_overdue(x, now)):
                still.append(x)
                continue
            self._release(x)
            if state == "DONE":
                x.future.set_result(None)
            elif state == "PROC":
                x.future.set_exception(TimeoutError("NIXL transfer did not finish before its deadline"))
            else:
                if x.agent:
                    self._broken.add(x.agent)
                x.future.set_exception(TransferError(f"NIXL transfer failed: {err or state}"))
        self._inflight = still

    def _cancel_overdue(self, x: _Inflight, now: float) -> bool:
        """Cancel a transfer past its deadline (NIXL cancels an active transfer when its handle is
        released); False while it stays polled. One NIXL cannot cancel is tried again every
        CANCEL_RETRY_S and its future stays pending, so that a done future means that no byte of it can
        still land (`ended`); OVERDUE_GIVE_UP_S past its deadline it is left to NIXL (freed at exit) and
        no longer polled, or this thread would poll it, never idle, for as long as the process lives."""
        if now < x.retry_at:
            return False
        try:
            x.handle.release()
        except Exception:
            if now - x.deadline >= OVERDUE_GIVE_UP_S:
                log.error(
                    "a NIXL transfer %.0f s past its deadline neither ended nor could be cancelled: no "
                    "longer polled (its handle is left to NIXL)",
                    now - x.deadline,
                )
                x.handle = _RELEASED
                return True
            if not x.retry_at:  # once a transfer
                self._release_failures += 1
                log.warning("NIXL could not cancel a transfer past its deadline; waiting for it to end")
            x.retry_at = now + CANCEL_RETRY_S
            return False
        x.handle = _RELEASED
        return True

    def _release(self, x: _Inflight) -> None:
        for h in (x.handle, *x.release):
            try:
                h.release()
            except Exception:  # a failed transfer may not be releasable yet; NIXL frees it at exit
                self._release_failures += 1
                log.debug("could not release NIXL handle", exc_info=True)
        self._released += 1

    def _poll_notifs(self) -> None:
        if self._on_notif is None and not self._routed:
            return
        for agent, msgs in self._agent.get_new_notifs().items():
            if msgs:
                self._last_activity = time.monotonic()
            for msg in msgs:
                if self._routed and msg.startswith(self._routed):
                    listener = self._listeners.get(msg[: self._listen_len])
                    if listener is None:
                        self.stray_notifs += 1
                        log.debug("no listener for notification %r from %s", msg[:64], agent)
                        continue
                    try:
                        listener(agent, msg)
                    except Exception:
                        log.exception("notification listener failed for %r", msg[:64])
                    continue
                if self._on_notif is None:
                    continue
                try:
                    self._on_notif(agent, msg)
                except Exception:
                    log.exception("notification handler failed for %r", msg)

    def _run_pollers(self) -> None:
        keep = []
        for fn in self._pollers:
            try:
                finished = fn(self._agent)
            except Exception:
                log.exception("NIXL poller failed; dropping it")
                finished = True
            if finished == PARK:
                self._parked.add(fn)
            elif not finished:
                keep.append(fn)
            else:
                self._eager.discard(fn)
        self._pollers = keep

    def _shutdown(self) -> None:
        for fn in (*self._pollers, *self._parked):
            try:
                fn(None)  # None: the agent is going away; pollers fail their transfer
            except Exception:
                log.debug("poller failed at shutdown", exc_info=True)
        self._pollers.clear()
        self._parked.clear()
        self._eager.clear()
        for x in self._inflight:
            x.future.set_exception(TransferError("sidecar is shutting down"))
        self._inflight.clear()
        for h in self._dlists.values():
            try:
                h.release()
            except Exception:
                log.debug("could not release dlist", exc_info=True)
        for descs in self._registrations.values():
            try:
                self._agent.deregister_memory(descs)
            except Exception:
                log.debug("could not deregister", exc_info=True)
        for remote in self._remotes:
            try:
                self._agent.remove_remote_agent(remote)
            except Exception:
                log.debug("could not remove remote agent", exc_info=True)
        self._registrations.clear()
        self._agent = None

    def counts(self) -> dict[str, int]:
        """What the agent holds now (read without the driver thread: plain lengths and counters)."""
        return {
            "registrations": len(self._registrations),
            "dlists": len(self._dlists),
            "remote_agents": len(self._remotes),
            "transfers_open": self._posted - self._released,
            "release_failures": self._release_failures,
            "lone_polls": self._lone_polls,
        }

    # -- calls from other threads -------------------------------------------
    def call(self, fn: Callable[[Any], T], timeout: float | None = 60) -> T:
        fut: Future[T] = Future()
        if not self._thread.is_alive():
            raise TransferError("NIXL driver is not running")
        self._queue.put((fn, fut))
        return fut.result(timeout=timeout)

    def metadata(self) -> bytes:
        return self.call(lambda a: a.get_agent_metadata())

    def add_remote(self, metadata: bytes, expected_name: str = "") -> str:
        """Load a peer's full metadata (a handshake's); the same blob again is a no-op. A peer that
        restarted under the same name replaces the old agent, and every descriptor list prepared
        against it is released: `generation(name)` tells callers to prepare theirs again."""

        def add(a: Any) -> str:
            if (
                expected_name
                and expected_name not in self._broken
                and self._full_md.get(expected_name) == metadata
            ):
                return expected_name
            name, replaced = self._load(a, expected_name, metadata)
            if not replaced and name in self._full_md:  # loaded again with more memory: lists are void
                self._invalidate(name)
            self._full_md[name] = metadata
            self._remotes.add(name)
            return name

        return self.call(add)

    def generation(self, agent_name: str) -> int:
        """How many times what NIXL knows of `agent_name` changed (read without the driver thread)."""
        return self._generations.get(agent_name, 0)

    def _load(self, a: Any, name: str, metadata: bytes) -> tuple[str, bool]:
        """On the driver thread: load `metadata` (expected to be agent `name`); the agent's name, and
        whether an old agent of that name was replaced."""
        if name in self._broken and name in self._remotes:
            self._broken.discard(name)
            log.info("NIXL agent %s: its connection failed; loading it again", name)
            return self._replace(a, name, metadata), True
        try:
            return _decoded(a.add_remote_agent(metadata)), False
        except Exception:
            if name not in self._remotes:
                raise
            return self._replace(a, name, metadata), True

    def _replace(self, a: Any, name: str, metadata: bytes) -> str:
        """On the driver thread: NIXL refused new connection info for an agent it knows, so the peer
        restarted under the same name. Drop the old agent and all loaded or prepared against it."""
        log.info("replacing NIXL remote agent %s (the peer restarted)", name)
        a.remove_remote_agent(name)
        self._remotes.discard(name)
        self._remote_md.pop(name, None)
        self._full_md.pop(name, None)
        self._invalidate(name)
        return _decoded(a.add_remote_agent(metadata))

    def _invalidate(self, name: str) -> None:
        """On the driver thread: `name` was loaded again; lists prepared against it are void."""
        self._generations[name] = self._generations.get(name, 0) + 1
        for key in [k for k, agent in self._dlist_agents.items() if agent == name]:
            self._drop_dlist(key)

    def register(self, regions: Sequence[tuple[int, int, int]], mem_type: str = "DRAM") -> int:
        """Register (address, length, device) regions; returns a key for deregister."""

        def reg(a: Any) -> int:
            if mem_type == "VRAM":
                _make_current(regions[0][2])
            descs = a.register_memory([(addr, n, dev, "") for addr, n, dev in regions], mem_type)
            key = self._next_reg
            self._next_reg += 1
            self._registrations[key] = descs
            return key

        return self.call(reg)

    def deregister(self, key: int) -> None:
        def dereg(a: Any) -> None:
            descs = self._registrations.pop(key, None)
            if descs is not None:
                a.deregister_memory(descs)

        self.call(dereg)

    def prep_dlist(self, agent_name: str, descs: np.ndarray, mem_type: str = "DRAM") -> int:
        """Prepare an (N, 3) [addr, len, dev] list once; "" means local. Returns a key."""

        return self.call(lambda a: self._prep(a, agent_name, descs, mem_type))

    def _prep(self, a: Any, agent_name: str, descs: np.ndarray, mem_type: str) -> int:
        """On the driver thread: prepare a list and keep it under a new key (voided if `agent_name`,
        "" for ours, is loaded again)."""
        handle = a.prep_xfer_dlist(agent_name or "NIXL_INIT_AGENT", descs, mem_type)
        key = self._next_reg
        self._next_reg += 1
        self._dlists[key] = handle
        if agent_name:
            self._dlist_agents[key] = agent_name
        return key

    def release_dlist(self, key: int) -> None:
        def rel(a: Any) -> None:
            h = self._dlists.pop(key, None)
            self._dlist_agents.pop(key, None)
            if h is not None:
                h.release()

        self.call(rel)

    def read_prepped(
        self,
        local: int,
        local_idx: np.ndarray,
        remote: int,
        remote_idx: np.ndarray,
        notif: bytes,
        timeout_s: float,
    ) -> Future[None]:
        """READ remote descriptors into local ones, by indices into prepared lists."""
        done: Future[None] = Future()
        agent = self._dlist_agents.get(remote, "")  # fixed for the list: a reload drops the list instead

        def post(a: Any) -> None:
            if remote not in self._dlists:
                raise TransferError(
                    "the peer's NIXL agent was loaded again (it restarted) since this read was planned"
                )
            handle = a.make_prepped_xfer(
                "READ",
                self._dlists[local],
                local_idx.astype(np.int32),
                self._dlists[remote],
                remote_idx.astype(np.int32),
                notif,
            )
            self._post(a, handle, done, timeout_s, agent)

        self._submit_async(post, done, agent)
        return done

    def read(
        self,
        remote_agent: str,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
        timeout_s: float,
        mem_type: str = "DRAM",
    ) -> Future[None]:
        """READ with descriptor lists built for this transfer ((N, 3) arrays)."""
        done: Future[None] = Future()

        def post(a: Any) -> None:
            if mem_type == "VRAM":
                _make_current(int(local[0][2]))
            lo = a.get_xfer_descs(local, mem_type)
            re_ = a.get_xfer_descs(remote, mem_type)
            handle = a.initialize_xfer("READ", lo, re_, remote_agent, notif)
            self._post(a, handle, done, timeout_s, remote_agent)

        self._submit_async(post, done, remote_agent)
        return done

    def cancel(self, done: Future[None]) -> None:
        """Stop the transfer behind `done` (NIXL cancels an active transfer when its handle is
        released). If NIXL cannot cancel it, it stays polled until it ends or hits its deadline."""

        def stop(a: Any) -> None:
            for x in self._inflight:
                if x.future is not done:
                    continue
                try:
                    x.handle.release()
                except Exception:
                    log.warning("NIXL could not cancel a transfer; waiting for it to end")
                    return
                self._inflight.remove(x)
                x.handle = _RELEASED
                self._release(x)
                x.future.set_exception(TransferError("NIXL transfer cancelled"))
                return

        if self._thread.is_alive():
            self.call(stop, timeout=10)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        self.call(lambda a: a.send_notif(remote_agent, msg))

    def notify(self, remote_agent: str, msg: bytes, only_loaded: bool = False) -> Future[None]:
        """send_notif without waiting for it: the caller's answer does not wait for the driver
        thread. A notification that cannot be sent is logged (the peer then times out or expires
        the lease, as if it never came). The future is done once it was sent (or failed to be).

        only_loaded: send only if `remote_agent` was loaded here (add_remote, load_remote), and log a
        failure at debug level: for a courtesy that an agent we never loaded (a reader known only by
        the notifications it sent) goes without, rather than a warning per message."""

        def send(a: Any) -> None:
            if only_loaded and remote_agent not in self._remotes:
                return
            try:
                a.send_notif(remote_agent, msg)
            except Exception as e:
                if isinstance(e, self._disconnected):
                    self._broken.add(remote_agent)
                level = logging.DEBUG if only_loaded else logging.WARNING
                log.log(level, "could not send a NIXL notification to %s: %s", remote_agent, e)

        if not self._thread.is_alive():
            raise TransferError("NIXL driver is not running")
        fut: Future[None] = Future()
        self._queue.put((send, fut))
        return fut

    # -- the staged protocol: pollers, listeners, WRITEs from the driver thread --------
    def add_poller(self, fn: Poller, eager: bool = False) -> None:
        """Run `fn(agent)` on the driver thread every loop turn until it returns True; one that
        returns PARK is not run again until `resume(fn)`. `eager`: while it is the only poller,
        the loop polls every `lone_wait_s` instead of `busy_wait_s`.

        While any poller is registered the loop does not idle-wait, so a poller
        sees CUDA events, completions and notifications within microseconds.
        `fn(None)` means the driver is shutting down. A poller must be quick: it
        shares the thread with every transfer of the sidecar.
        """
        if not self._thread.is_alive():
            raise TransferError("NIXL driver is not running")

        def add(_a: Any) -> None:
            self._pollers.append(fn)
            if eager:
                self._eager.add(fn)

        self._queue.put((add, Future()))

    def resume(self, fn: Poller) -> None:
        """Poll `fn` again from the next loop turn if it parked (any thread; nothing if it did not).
        Its owner calls this after anything that may give it work, and when it closes."""
        if self._thread.is_alive():
            self._queue.put(_Resume(fn))

    def poller_state(self, fn: Poller) -> str:
        """Whether `fn` is "polled", "parked" or "not registered" (read off the driver thread: for error
        messages)."""
        if fn in self._parked:
            return "parked"
        return "polled" if fn in self._pollers else "not registered"

    def route(self, tag: bytes) -> None:
        """Messages starting with `tag` go to listeners only (never to on_notif); unclaimed ones are dropped."""
        if tag not in self._routed:
            self._routed = (*self._routed, tag)

    def listen(self, prefix: bytes, fn: Callable[[str, bytes], None]) -> None:
        """Deliver notifications starting with `prefix` (a routed tag, fixed length) to `fn(agent, msg)`
        on the driver thread, until `unlisten(prefix)`."""
        if not prefix.startswith(self._routed) or (self._listen_len and len(prefix) != self._listen_len):
            raise ValueError(f"listener prefix {prefix!r} is not a routed prefix of the common length")
        self._listen_len = len(prefix)
        self._listeners[prefix] = fn

    def unlisten(self, prefix: bytes) -> None:
        self._listeners.pop(prefix, None)

    def load_remote(self, name: str, metadata: bytes) -> None:
        """Load (or update) agent `name` from `metadata` unless exactly that was loaded already.

        Loading an agent again updates what NIXL knows of it (tested with NIXL
        1.5.1): a peer that registered more memory since is reachable there.
        Partial metadata (one ring each) add up: a peer's rings on several GPUs
        are loaded once each.
        """
        if name not in self._broken and metadata in self._remote_md.get(name, ()):
            return

        def load(a: Any) -> str:
            got, _ = self._load(a, name, metadata)
            self._remotes.add(got)
            blobs = self._remote_md.setdefault(got, set())
            if len(blobs) >= 16:  # one per ring of the peer; more means it restarted: forget the old
                blobs.clear()
            blobs.add(metadata)
            return got

        got = self.call(load)
        if got != name:
            raise TransferError(f"the metadata sent as agent {name!r} describes agent {got!r}")

    def partial_metadata(self, key: int) -> bytes:
        """Connection info plus the one registration `key` (what a peer needs to WRITE into it)."""
        return self.call(lambda a: a.get_partial_agent_metadata(self._registrations[key], True))

    def write_now(
        self,
        a: Any,
        remote_agent: str,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
        timeout_s: float,
        mem_type: str,
    ) -> Future[None]:
        """Post a WRITE from the driver thread itself (a poller): no queue hand-off."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("write_now runs on the driver thread (from a poller)")
        done: Future[None] = Future()
        if mem_type == "VRAM":
            _make_current(int(local[0][2]))
        lo = a.get_xfer_descs(local, mem_type)
        re_ = a.get_xfer_descs(remote, mem_type)
        handle = a.initialize_xfer("WRITE", lo, re_, remote_agent, notif)
        self._post(a, handle, done, timeout_s, remote_agent)
        return done

    def write_slot_now(
        self,
        a: Any,
        remote_agent: str,
        local: Desc,
        remote: Desc,
        notif: bytes,
        timeout_s: float,
        mem_type: str,
    ) -> Future[None]:
        """`write_now` of one region of a ring into one of a reader's ring, from a one-descriptor list
        of each prepared once and kept (a ring's slots live as long as its sidecar): a prepared WRITE
        costs ~15 us of Python, where one whose descriptors are built for it costs ~90 (timed on the
        CPU machine), on the thread that every transfer of the sidecar shares."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("write_slot_now runs on the driver thread (from a poller)")
        lo = self._write_list(a, "", local, mem_type)
        re_ = self._write_list(a, remote_agent, remote, mem_type)
        if lo is None or re_ is None:  # every list kept is in use by a transfer in flight
            lo_descs, re_descs = np.array([local], dtype=np.int64), np.array([remote], dtype=np.int64)
            return self.write_now(a, remote_agent, lo_descs, re_descs, notif, timeout_s, mem_type)
        done: Future[None] = Future()
        if mem_type == "VRAM":
            _make_current(local[2])
        handle = a.make_prepped_xfer("WRITE", lo[1], _FIRST, re_[1], _FIRST, notif)
        self._post(a, handle, done, timeout_s, remote_agent, (lo[0], re_[0]))
        return done

    def _write_list(self, a: Any, agent: str, desc: Desc, mem_type: str) -> tuple[int, Any] | None:
        """On the driver thread: the prepared list of `desc` on `agent` ("": ours) and its key, made
        once. Past WRITE_LISTS_MAX the least recently used list no transfer in flight uses is released;
        None if every one is in use."""
        lists = self._write_lists
        key = lists.get((agent, mem_type, desc))
        if key is not None and key in self._dlists:  # a reload of the agent drops its lists
            lists.move_to_end((agent, mem_type, desc))
            return key, self._dlists[key]
        if len(lists) >= WRITE_LISTS_MAX:
            in_use = {k for x in self._inflight for k in x.lists}
            old = next((d for d, k in lists.items() if k not in in_use), None)
            if old is None:
                return None
            self._drop_dlist(lists.pop(old))
        key = lists[(agent, mem_type, desc)] = self._prep(
            a, agent, np.array([desc], dtype=np.int64), mem_type
        )
        return key, self._dlists[key]

    def _drop_dlist(self, key: int) -> None:
        """On the driver thread: release a prepared list (one voided by its agent's reload, or evicted)."""
        self._dlist_agents.pop(key, None)
        h = self._dlists.pop(key, None)
        if h is not None:
            try:
                h.release()
            except Exception:
                log.debug("could not release a prepared list", exc_info=True)

    def _submit_async(self, fn: Callable[[Any], None], done: Future[None], agent: str = "") -> None:
        if not self._thread.is_alive():
            raise TransferError("NIXL driver is not running")
        carrier: Future[None] = Future()

        def run(a: Any) -> None:
            try:
                fn(a)
            except Exception as e:
                lost = isinstance(e, self._disconnected)
                if lost and agent:
                    self._broken.add(agent)
                kind = AgentDisconnected if lost else TransferError
                done.set_exception(kind(f"could not start NIXL transfer: {e}"))

        self._queue.put((run, carrier))

    def _post(
        self,
        a: Any,
        handle: Any,
        done: Future[None],
        timeout_s: float,
        agent: str = "",
        lists: tuple[int, ...] = (),
    ) -> None:
        now = time.monotonic()
        self._posted += 1
        try:
            state = a.transfer(handle)
        except Exception:
            self._release(_Inflight(handle, done, now, now))  # do not leak the handle
            raise
        if state == "ERR":
            self._release(_Inflight(handle, done, now, now))
            done.set_exception(TransferError("NIXL refused to post the transfer (backend error)"))
            return
        if state == "DONE":  # host memory over shared memory: UCX copied it within the call
            self._release(_Inflight(handle, done, now, now))
            done.set_result(None)
            return
        self._inflight.append(_Inflight(handle, done, now, now + timeout_s, agent=agent, lists=lists))
