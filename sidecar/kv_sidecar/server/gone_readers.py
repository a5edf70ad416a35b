"""Whether a reader's sidecars are gone: what lets another engine take a request over from a reader whose
sidecar died mid-read where the source sees no transfer fail (`host_transfer: read`: one-sided NIXL
READs, which the reader's sidecar posts; its engine reads nothing itself).

A sidecar is asked only at the address it sent, and only where that address is where its calls came
from (the address of a Service in front of several sidecars, or a stale name, would have a live reader
judged by another sidecar's port). It is proven gone when that address refuses connections (nothing
listens there: the process that held the port exited, and its NIXL agent with it; the sidecar closes
that port only after its data plane stopped, server/sidecar.py `stop`), or when another sidecar
answers there (the port is another process's now). A sidecar that does not answer in time (hung,
stopped, cut off) proves nothing: it may still READ blocks that the new reader's "consumed" event lets
the prefill engine reuse. The probe itself (a TCP connect, then the peer Status call) is an adapter's:
adapters/peer_client.py `probe_sidecar`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

# A verdict that a sidecar answers (or did not answer) is asked again after this long: a reader's
# retries, and every engine that asks for the request meanwhile, probe once per interval, not per open.
RECHECK_S = 1.0
# Sidecars remembered as gone (a sidecar id is one process's: gone is final).
_GONE_KEPT = 4096


class Seen(enum.Enum):
    RUNS = "runs"  # it answers there, as that sidecar
    GONE = "gone"  # proven: its port refuses, or another sidecar answers there
    UNKNOWN = "unknown"  # no answer in time, or no way to ask


class ReaderSidecar(NamedTuple):
    """Where one sidecar of a reader said it answers, and where its calls to this sidecar came from."""

    address: str  # its peer address ("" where it sent none: a reader from before reader_address)
    calls_from: str  # the transport's name for the other end of its open (a gRPC peer: "ipv4:10.0.0.5:43120")


class Probed(NamedTuple):
    seen: Seen
    detail: str  # what was seen, for the log and the refusal's message


# (sidecar id, where it answers and calls from, timeout in seconds) -> what a probe saw.
Probe = Callable[[str, ReaderSidecar, float], Probed]


class GoneReaders:
    """Probes a reader's sidecars, remembering what it saw (gone for good, the rest for RECHECK_S)."""

    def __init__(self, probe: Probe | None, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        """probe None, or timeout_s 0: never probe (no reader is ever proven gone)."""
        self._probe = probe if timeout_s > 0 else None
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._gone: OrderedDict[str, str] = OrderedDict()  # sidecar id -> how it was proven gone
        self._recent: dict[str, tuple[float, Probed]] = {}  # sidecar id -> (when, what was seen)

    def verdict(self, sidecars: dict[str, ReaderSidecar], probe: bool = True) -> Probed | None:
        """GONE where every one of `sidecars` (sidecar id -> where) is proven gone, its detail
        naming each; else what stops it (one that runs or did not answer, or no address to ask at).
        probe False: only what is known without asking a sidecar now; None where that is not enough."""
        if self._probe is None:
            return Probed(Seen.UNKNOWN, "this sidecar does not probe readers (reader_probe_ms 0)")
        if not sidecars:
            return Probed(Seen.UNKNOWN, "no sidecar of the reader is known")
        gone: list[str] = []
        for sidecar_id, where in sidecars.items():
            if not where.address:
                return Probed(Seen.UNKNOWN, f"its sidecar {sidecar_id} sent no address to ask it at")
            probed = self._seen(sidecar_id, where, probe)
            if probed is None:
                return None
            if probed.seen is not Seen.GONE:
                return Probed(probed.seen, f"its sidecar {sidecar_id} at {where.address}: {probed.detail}")
            gone.append(f"{sidecar_id} at {where.address} ({probed.detail})")
        return Probed(Seen.GONE, "whose sidecar is gone: " + "; ".join(gone))

    def _seen(self, sidecar_id: str, where: ReaderSidecar, probe: bool) -> Probed | None:
        now = self._clock()
        with self._lock:
            why = self._gone.get(sidecar_id)
            if why is not None:
                return Probed(Seen.GONE, why)
            recent = self._recent.get(sidecar_id)
            if recent is not None and now - recent[0] < RECHECK_S:
                return recent[1]
        if not probe:
            return None
        assert self._probe is not None
        probed = self._probe(sidecar_id, where, self._timeout_s)
        with self._lock:
            if probed.seen is Seen.GONE:
                self._recent.pop(sidecar_id, None)
                self._gone[sidecar_id] = probed.detail
                while len(self._gone) > _GONE_KEPT:
                    self._gone.popitem(last=False)
            else:
                # Dropped once stale, so that the map holds only the sidecars asked about lately.
                self._recent = {k: v for k, v in self._recent.items() if now - v[0] < RECHECK_S}
                self._recent[sidecar_id] = (self._clock(), probed)
        return probed
