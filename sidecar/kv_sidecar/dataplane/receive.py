"""The reader's end of a staged transfer, on the data plane: receive slots, the scatter of each chunk
as its notification arrives, and the credits that give slots back (docs/gpu.md says how the protocol
flows). The control side (server/staged_reader.py) asks the source to send, through the Push, and
drives `Reception.wait` until the request is complete.

A chunk's scatter into GPU memory is launched on the NIXL thread, in the notification's listener, not
handed to the thread that waits: there, each credit waited for the NIXL thread to get the interpreter
between that thread's launches, while the source waited for it to WRITE again (a staged PullBatch of
16 x 64 MiB took 0.89x the time on the NIXL thread: docs/benchmarks.md, thirty-first session). A scatter
into host memory is a copy that takes the time of its bytes, so it stays on the waiting thread: on the
NIXL thread it would hold every other transfer's polls and run one at a time.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.chunk_copies import GpuCopies, HostCopies
from kv_sidecar.dataplane.jobs import QUARANTINE_S, Halt, Receive, ReceiveSlots
from kv_sidecar.dataplane.ranks import MappedRanks
from kv_sidecar.dataplane.rings import Ring
from kv_sidecar.errors import Code, SidecarError, waited_for
from kv_sidecar.execute import gpu
from kv_sidecar.mailbox import Mailbox
from kv_sidecar.metrics import Metrics
from kv_sidecar.transport.nixl_driver import PARK, NixlDriver, Poller

log = logging.getLogger(__name__)

_POKE = object()  # inbox marker: something the control side waits for happened (its Push call ended)
_COMPLETE = object()  # inbox marker: the last chunk's scatter is launched


class _Credits:
    """Driver-thread poller of a reader: as each scatter's marker completes, give its slot back
    to the source (credit notification) or to our pool (the chunks to come fit the credits)."""

    def __init__(
        self,
        state: sp.RecvState,
        ready: Callable[[Any], bool],
        ring: Ring,
        ring_slots: list[int],
        agent: str,
        transfer_id: str,
        inbox: Mailbox[Any],
        resume: Callable[[Poller], None],
    ) -> None:
        self.state = state
        self.ready = ready
        self.ring = ring
        self.ring_slots = ring_slots  # wire slot (position in the Push) -> our ring slot
        self.agent = agent
        self.tid = transfer_id
        self.inbox = inbox
        self.pending: deque[tuple[Any, int]] = deque()
        self.lock = threading.Lock()
        self.closed = False
        self._resume = resume

    def add(self, marker: Any, slot: int) -> None:
        with self.lock:
            self.pending.append((marker, slot))
        self._resume(self.poll)

    def poll(self, a: Any) -> bool | str:
        with self.lock:
            if self.closed:
                return True
            try:
                if a is None:
                    raise SidecarError(Code.UNAVAILABLE, "the sidecar is shutting down")
                while self.pending and self.ready(self.pending[0][0]):
                    _, slot = self.pending.popleft()
                    if self.state.scattered(slot):
                        self._credit(a, slot)
                    else:
                        self.ring.pool.release([self.ring_slots[slot]])
            except Exception as e:  # tell the reader's thread; it stops the transfer
                self.closed = True
                self.inbox.put(e)
                return True
            return False if self.pending else PARK  # parked until the next scatter (`add`)

    def _credit(self, a: Any, slot: int) -> None:
        try:
            a.send_notif(self.agent, sp.credit_notif(self.tid, slot))
        except Exception as e:
            # Where UCX notices a dead peer at once, this send can fail before the Push call does: the
            # source is gone, which is not an internal error of ours.
            raise SidecarError(
                Code.UNAVAILABLE, f"the source sidecar (NIXL agent {self.agent}) is not reachable: {e}"
            ) from None

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self._resume(self.poll)  # a parked poller must run once more to be dropped


class Reception:
    """One staged transfer into a rank here, from its receive slots to its last scatter.

    Built by `DataPlane.receive` (slots taken, the transfer's notifications listened for, the rank's
    mapping held); then `slots` goes into the Push, `prepare` readies the scatters while the source
    gathers, `wait` scatters chunk after chunk, and `close` gives everything back.
    """

    def __init__(
        self, ranks: MappedRanks, ring: Ring, nixl: NixlDriver, metrics: Metrics, job: Receive, halt: Halt
    ) -> None:
        self._ranks, self._ring, self._nixl, self._metrics, self._job = ranks, ring, nixl, metrics, job
        self._per_block = gpu.staging_bytes(job.spec, 1)
        self._blocks_per_slot = ring.slot_bytes // self._per_block
        self._held = contextlib.ExitStack()
        self._copies: GpuCopies | HostCopies | None = None
        self._credits: _Credits | None = None
        # Put from the NIXL thread: a Mailbox is a few C calls a hand-off, no Python Condition.
        self._inbox: Mailbox[Any] = Mailbox()
        self.nbytes = 0
        # GPU scatters are launched on the NIXL thread (`_heard`); held while one is, so that `close`
        # knows none is launched after it returns. `_early`: chunks heard before `prepare` made the copies.
        self._lock = threading.Lock()
        self._ended = False  # closed, or a chunk failed: no scatter is launched any more
        self._early: list[tuple[str, bytes]] = []
        self._on_nixl_thread = False  # set by `prepare`: launches that only enqueue (GPU) are made there
        self._synchronized = False
        t = job.tokens
        try:
            self._chunks = -(-len(t.dst_blocks) // self._blocks_per_slot)  # as our slots hold them
            self._slots = ring.pool.acquire(self._chunks, halt.remaining, sp.peer_of(job.source_agent))
        except SidecarError as e:
            raise waited_for(e, f"waiting for a receive slot: {ring.pool.describe()}") from None
        per_block = self._per_block
        self._state = sp.RecvState(
            t.start_token,
            t.num_tokens,
            job.spec.block_size,
            dict.fromkeys(range(len(self._slots)), ring.slot_bytes),
            lambda k: k * per_block,  # staging bytes are linear in blocks (tested)
        )
        self._prefix = sp.prefix(job.transfer_id)
        self._nixl.listen(self._prefix, self._heard)
        try:
            rank = ranks.gpu(job.dst) if ranks.is_gpu(job.dst) else ranks.host(job.dst)
            self._held.enter_context(rank.in_use())  # its memory stays until the last scatter ends
        except BaseException:
            self._nixl.unlisten(self._prefix)
            ring.pool.release(self._slots)
            raise

    @property
    def slots(self) -> ReceiveSlots:
        r = self._ring
        return ReceiveSlots(
            tuple(r.slot_address(s) for s in self._slots),
            r.slot_bytes,
            r.metadata,
            r.mem_type,
            r.nixl_device,
            self._nixl.name,
        )

    @property
    def chunks(self) -> int | None:
        """How many chunks the source said it sends (None until its first arrived)."""
        return self._state.count

    def describe(self) -> str:
        """How far the transfer got, for an error that ends it."""
        count = "?" if self._state.count is None else str(self._state.count)
        pending = 0 if self._credits is None else len(self._credits.pending)
        return f"{self._state.arrived} of {count} chunks arrived, {pending} scatters not yet done"

    def prepare(self) -> None:
        """Validate and upload the scatters' ids and start the credits, while the source gathers its
        first chunk."""
        job, t, ring = self._job, self._job.tokens, self._ring
        if self._ranks.is_gpu(job.dst):
            dst = self._ranks.gpu(job.dst)
            staged = gpu.StagedCopies(
                dst.view(dst.device),
                job.spec,
                job.dst.rank,
                job.heads,
                t.dst_blocks,
                t.num_tokens,
                t.start_token,
                into_staging=False,
            )
            # The first chunk's launch template and kernel, before its notification (the NIXL thread
            # launches the scatters: a compile there would hold every transfer's polls): it lands in
            # the first slot offered, as large as a slot holds (a source with smaller slots sends
            # smaller chunks, whose template is then computed on arrival; their kernel is the same).
            t1 = min(t.num_tokens, t.start_token + self._blocks_per_slot * job.spec.block_size)
            staged.prepare(t.start_token, t1, ring.slot_address(self._slots[0]))
            copies: GpuCopies | HostCopies = GpuCopies(staged)
        else:
            host = HostCopies(
                self._ranks.host(job.dst).view, job.spec, job.dst.rank, job.heads, t.dst_blocks, ring, False
            )
            host.first = t.start_token // job.spec.block_size
            copies = host
        credits = _Credits(
            self._state,
            copies.ready,
            ring,
            self._slots,
            job.source_agent,
            job.transfer_id,
            self._inbox,
            self._nixl.resume,
        )
        self._nixl.add_poller(credits.poll, eager=self._chunks > 1)
        with self._lock:
            self._copies, self._credits = copies, credits
            self._on_nixl_thread = copies.enqueues
            early, self._early = self._early, []
            for sender, msg in early:  # heard while the copies were being made: taken now
                self._take_locked(sender, msg)

    def _heard(self, sender: str, msg: bytes) -> None:
        """A chunk's notification (the NIXL thread): taken now, or once `prepare` is done."""
        with self._lock:
            if self._ended:
                return
            if self._copies is None:
                self._early.append((sender, msg))
                return
            self._take_locked(sender, msg)

    def _take_locked(self, sender: str, msg: bytes) -> None:
        """Scatter a chunk here (GPU: a launch), or hand it to `wait` (host: a copy); with `_lock` held.
        Here, what fails the transfer goes to `wait`."""
        if not self._on_nixl_thread:
            self._inbox.put((sender, msg))
            return
        try:
            if self._scatter(sender, msg):
                self._inbox.put(_COMPLETE)
        except BaseException as e:
            self._inbox.put(e)

    def _scatter(self, sender: str, msg: bytes) -> bool:
        """Scatter a chunk and hand its slot to the credits; True once the last one is. On the NIXL
        thread with `_lock` held, or on the waiting thread (host copies). What it raises ends the
        transfer: no later chunk is scattered."""
        copies, credits, state = self._copies, self._credits, self._state
        assert copies is not None and credits is not None
        try:
            parsed = sp.parse_notif(msg)
            if sender != self._job.source_agent or parsed is None or parsed[1] != sp.CHUNK:
                raise sp.ProtocolError(f"unexpected notification {msg[:64]!r} from {sender}")
            index, count, slot, t0, t1 = parsed[2]
            state.arrive(index, count, slot, t0, t1)
            marker, moved = copies.launch(t0, t1, self._ring.slot_address(self._slots[slot]))
            self.nbytes += moved
            credits.add(marker, slot)
            return state.complete
        except BaseException:
            self._ended = True
            raise

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the transfer to complete (GPU: its chunks are scattered as they
        arrive; host: the next chunk that arrives is copied here); True once every chunk is in the
        engine's blocks. Returns early (False) when poked, when the time is up or after a host chunk
        that is not the last; raises what broke the transfer."""
        copies = self._copies
        assert copies is not None and self._credits is not None, "prepare() first"
        if self._synchronized:
            return True
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return False
        if item is _POKE:
            return False
        if isinstance(item, BaseException):
            raise item
        if item is not _COMPLETE and not self._scatter(*item):  # a host chunk, copied on this thread
            return False
        copies.synchronize()  # every byte is in the engine's blocks before the pull answers
        self._synchronized = True
        return True

    def poke(self) -> None:
        """Wake a `wait` (any thread)."""
        self._inbox.put(_POKE)

    def stop_credits(self) -> None:
        """Give no slot back any more (the transfer is ending)."""
        if self._credits is not None:
            self._credits.close()

    def stop_source(self) -> None:
        """Give no slot back any more and ask the source to stop writing (a notification; the Push call
        confirms when it has)."""
        self.stop_credits()
        with contextlib.suppress(Exception):
            self._nixl.send_notif(self._job.source_agent, sp.stop_notif(self._job.transfer_id))

    def close(self, quiet: bool, settles: Callable[[Callable[[bool], None]], None] | None = None) -> None:
        """Stop scattering (no scatter of ours writes into the rank once this returns) and give the slots
        back: now if the source has nothing in flight (`quiet`). Else once `settles` calls the function it
        is given: at once with True (the source's Push call answered that nothing is in flight), after
        QUARANTINE_S with False; with no `settles` (nothing will say), QUARANTINE_S from now. So a
        transfer given up while its source hangs ends at once, its slots held back meanwhile."""
        try:
            with self._lock:  # a scatter being launched on the NIXL thread is launched when this returns
                self._ended = True
            if self._credits is not None:
                self._credits.close()
            if self._copies is not None and not self._synchronized:
                self._copies.synchronize()  # no scatter of ours may still write after a failed pull returns
        finally:
            self._held.close()
            self._nixl.unlisten(self._prefix)
            held = [self._slots[s] for s in self._state.release_all()]
            if quiet:
                self._ring.pool.release(held)
            elif settles is None:
                self._unconfirmed(len(held))
                self._ring.pool.release_later(held, QUARANTINE_S)
            else:
                self._ring.pool.release_when(
                    held, QUARANTINE_S, settles, lambda: self._unconfirmed(len(held))
                )

    def _unconfirmed(self, slots: int) -> None:
        self._metrics.failures.labels("staging_quarantined").inc()
        log.warning(
            "source agent %s did not confirm that transfer %s ended: %d receive slots rejoin the ring in %g s",
            self._job.source_agent,
            self._job.transfer_id,
            slots,
            QUARANTINE_S,
        )
