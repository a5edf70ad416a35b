"""The source's end of a staged transfer, on the data plane: send slots, the gathers of the request's
chunks (already in the reader's layout) and the NIXL WRITE of each into a receive slot the reader
granted, as credits allow (docs/gpu.md says how the protocol flows). The control side
(server/staged_source.py) checks the Push, opens the request, and runs `Transmission.run`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.chunk_copies import GpuCopies, HostCopies, block_size_of
from kv_sidecar.dataplane.jobs import CANCEL_WAIT_S, QUARANTINE_S, Halt, Send, Sent
from kv_sidecar.dataplane.ranks import MappedRanks
from kv_sidecar.dataplane.rings import Ring
from kv_sidecar.errors import Code, SidecarError, waited_for
from kv_sidecar.execute import gpu
from kv_sidecar.metrics import Metrics
from kv_sidecar.transport.nixl_driver import PARK, NixlDriver, ended, ucx_emulation_disabled

log = logging.getLogger(__name__)


class _Pump:
    """Driver-thread poller of a source: WRITE each gathered chunk as soon as its gather is done and
    the reader has a slot free, with the notification that tells the reader which chunk it is."""

    def __init__(
        self,
        nixl: NixlDriver,
        metrics: Metrics,
        state: sp.SendState,
        copies: GpuCopies | HostCopies,
        ring: Ring,
        job: Send,
        deadline: float,
        block_bytes: int,
    ) -> None:
        self.nixl = nixl
        self.metrics = metrics
        self.state = state
        self.copies = copies
        self.ring = ring
        self.job = job
        self.deadline = deadline
        self.block_bytes = block_bytes
        self.block_size = block_size_of(copies)
        self.lock = threading.Lock()
        self.closed = False

    def poll(self, a: Any) -> bool | str:
        with self.lock:
            if self.closed:
                return True
            if a is None:
                self.state.fail(SidecarError(Code.UNAVAILABLE, "the sidecar is shutting down"))
                return True
            st, job, n = self.state, self.job, len(self.state.chunks)
            try:
                while (w := st.next_write(self.copies.ready)) is not None:
                    t0, t1 = st.chunks[w.index]
                    length = sp.blocks_in(self.block_size, t0, t1) * self.block_bytes
                    notif = sp.chunk_notif(job.transfer_id, w.index, n, w.recv_slot, t0, t1)
                    w.future = self.nixl.write_slot_now(
                        a,
                        job.reader_agent,
                        (self.ring.slot_address(w.send_slot), length, self.ring.nixl_device),
                        (job.reader_slots[w.recv_slot][0], length, job.reader_device),
                        notif,
                        max(0.001, self.deadline - time.monotonic()),
                        self.ring.mem_type,
                    )
                    self.metrics.nixl_descriptors.observe(1)
                    w.future.add_done_callback(functools.partial(self._written, w.index))
            except Exception as e:
                st.fail(self._write_error(e))
            # Parked until a gather is launched or a credit comes back (SendState.on_writable).
            return False if st.may_write() else PARK

    def _written(self, index: int, fut: Future[None]) -> None:
        err = fut.exception()
        if err is None:
            self.state.write_done(index)
        else:
            self.state.fail(self._write_error(err))

    def _write_error(self, e: BaseException) -> SidecarError:
        if isinstance(e, SidecarError):
            return e
        if self.ring.mem_type == "VRAM" and ucx_emulation_disabled():
            # With UCX_PROTO_EMULATION_ENABLE=n a VRAM WRITE UCX cannot do natively fails here
            # instead of crawling over TCP; we cannot tell that from other causes. With emulation
            # allowed such a WRITE crawls instead of failing, so a failure there is something else.
            self.metrics.ucx_emulation.inc()
            log.error(
                "GPU WRITE to %s failed: if UCX has no native path for VRAM here (cuda_ipc on a node, "
                "GPUDirect RDMA across nodes), it refused to emulate over TCP: see docs/operations.md "
                "section 5.1",
                self.job.reader_agent,
            )
        return SidecarError(
            Code.UNAVAILABLE, f"transfer from peer failed: NIXL WRITE into the reader's ring failed: {e}"
        )

    def wake(self) -> None:
        self.nixl.resume(self.poll)

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.wake()  # a parked poller must run once more to be dropped


def _quiesce(nixl: NixlDriver, state: sp.SendState) -> bool:
    """Cancel the WRITEs still in flight and wait for them to end; False if one would not."""
    posted = [w.future for w in state.in_flight() if w.future is not None]  # None: never posted
    for f in posted:
        if not f.done():
            with contextlib.suppress(Exception):
                nixl.cancel(f)
    # Ended however it ended (done, failed, cancelled, or past its own deadline): nothing is in flight.
    return ended(posted, CANCEL_WAIT_S)


class Transmission:
    """One staged transfer out of a rank here. `run` moves it; `stop` (any thread) ends it early;
    `quiet` says whether nothing of it is in flight any more (the reader may then reuse its slots)."""

    def __init__(
        self,
        ranks: MappedRanks,
        ring: Ring,
        nixl: NixlDriver,
        metrics: Metrics,
        job: Send,
        uploaded_ids: Any,
    ) -> None:
        self._ranks, self._ring, self._nixl, self._metrics, self._job = ranks, ring, nixl, metrics, job
        self._uploaded = uploaded_ids  # the ids on the GPU, uploaded at Publish (None: upload them here)
        self._lock = threading.Lock()
        self._state: sp.SendState | None = None
        self._stopped: str | None = None
        self.quiet = True

    def stop(self, reason: str) -> None:
        with self._lock:
            self._stopped = self._stopped or reason
            state = self._state
        if state is not None:
            state.stop(reason)

    def run(self, halt: Halt) -> Sent:
        """Gather, WRITE and wait until every chunk is written; raises `sp.Stopped` if stopped first."""
        job, ring = self._job, self._ring
        per_block = gpu.staging_bytes(job.reader_spec, 1)
        chunks = list(job.chunks)
        if not chunks:
            return Sent(0, 0)
        self._nixl.load_remote(job.reader_agent, job.reader_metadata)
        try:
            send_slots = ring.pool.acquire(
                min(len(chunks), len(job.reader_slots) + 1), halt.remaining, sp.peer_of(job.reader_agent)
            )
        except SidecarError as e:
            raise waited_for(e, f"waiting for a send slot: {ring.pool.describe()}") from None
        state = sp.SendState(chunks, send_slots, list(range(len(job.reader_slots))))
        with self._lock:
            self._state = state
            stopped = self._stopped
        if stopped is not None:
            state.stop(stopped)
        prefix = sp.prefix(job.transfer_id)
        self._nixl.listen(prefix, functools.partial(self._on_notif, state))
        pump: _Pump | None = None
        try:
            with contextlib.ExitStack() as held:
                on_gpu = self._ranks.is_gpu(job.src)
                copies: GpuCopies | HostCopies
                if on_gpu:
                    src = self._ranks.gpu(job.src)
                    held.enter_context(src.in_use())
                    copies = GpuCopies(
                        gpu.StagedCopies(
                            src.view(src.device),
                            job.reader_spec,
                            job.reader_rank,
                            job.heads,
                            job.block_ids,
                            job.num_tokens,
                            job.start_token,
                            into_staging=True,
                            uploaded_ids=self._uploaded,
                        )
                    )
                else:
                    ids = np.asarray(job.block_ids, dtype=np.int64)
                    host = self._ranks.host(job.src)
                    held.enter_context(host.in_use())  # its engine may die meanwhile
                    copies = HostCopies(
                        host.view, job.reader_spec, job.reader_rank, job.heads, ids, ring, True
                    )
                pump = _Pump(self._nixl, self._metrics, state, copies, ring, job, job.deadline, per_block)
                state.on_writable = pump.wake
                self.quiet = False
                self._nixl.add_poller(pump.poll, eager=len(chunks) > 1)
                try:
                    nbytes = 0
                    while (g := state.next_gather(halt.remaining)) is not None:
                        index, slot = g
                        t0, t1 = chunks[index]
                        marker, moved = copies.launch(t0, t1, ring.slot_address(slot))
                        nbytes += moved
                        state.gathered(index, slot, marker)
                    state.wait_finished(halt.remaining)
                    self.quiet = True
                    return Sent(len(chunks), nbytes)
                except SidecarError as e:
                    where = f"{state.describe()}; its pump {self._nixl.poller_state(pump.poll)}"
                    raise waited_for(e, where) from None
                finally:
                    if not self.quiet:
                        state.fail(sp.Stopped("the push failed"))
                        pump.close()  # no WRITE starts after this
                        self.quiet = _quiesce(self._nixl, state)
                        copies.synchronize()  # our gathers are done before the send slots are reused
        finally:
            if pump is not None:
                pump.close()
            self._nixl.unlisten(prefix)
            if self.quiet:
                ring.pool.release(send_slots)
            else:
                log.warning(
                    "transfer %s: WRITEs did not end; send slots rejoin the ring in %g s",
                    job.transfer_id,
                    QUARANTINE_S,
                )
                ring.pool.release_later(send_slots, QUARANTINE_S)

    def _on_notif(self, state: sp.SendState, agent: str, msg: bytes) -> None:  # NIXL driver thread
        job = self._job
        parsed = sp.parse_notif(msg)
        try:
            if agent != job.reader_agent or parsed is None or parsed[1] == sp.CHUNK:
                raise sp.ProtocolError(f"unexpected notification {msg[:64]!r} from {agent}")
            if parsed[1] == sp.STOP:
                state.stop("the reader stopped the transfer")
            elif not 0 <= parsed[2][0] < len(job.reader_slots):
                raise sp.ProtocolError(f"credit for slot {parsed[2][0]} of {len(job.reader_slots)}")
            else:
                state.credit(parsed[2][0])
        except sp.ProtocolError as e:
            state.fail(SidecarError(Code.INVALID_ARGUMENT, f"the reader broke the staged protocol: {e}"))
