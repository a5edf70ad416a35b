"""What the engine's calls return or raise, whichever way (gRPC or the engine lane) they went."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class KVSidecarError(Exception):
    """A sidecar call failed; `code` is the gRPC status code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class PullResult:
    ok: bool
    bytes: int = 0
    duration_s: float = 0.0
    path: str = ""
    error_code: str = ""
    error: str = ""
    unfilled_blocks: list[int] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.duration_s / 1e9 if self.duration_s > 0 else 0.0

    def raise_for_error(self) -> PullResult:
        if not self.ok:
            raise KVSidecarError(self.error_code, self.error)
        return self


def pull_failure(
    code: str, details: str, trailing_metadata: Iterable[tuple[str, str]] | None, block_ids: list[int]
) -> PullResult:
    """A failed Pull as a PullResult; the sidecar names the blocks it did not fill in the trailers
    (a comma list, or "all" of the requested ones when the list would not fit gRPC's header limit)."""
    unfilled = list(block_ids)
    with contextlib.suppress(Exception):
        for key, value in trailing_metadata or ():
            if key == "kvsidecar-unfilled-blocks" and value != "all":
                unfilled = [int(b) for b in value.split(",") if b]
    return PullResult(False, error_code=code, error=details, unfilled_blocks=unfilled)


class PendingBatch(Protocol):
    """A PullBatch call in flight, however it was sent. Over the engine lane each member's outcome
    arrives as it ends; over gRPC, all of them with the call's answer."""

    def member_done(self, index: int) -> bool: ...

    def member_done_at(self, index: int) -> float:
        """time.monotonic() when the member's outcome was seen; 0 before."""
        ...

    def member_result(self, index: int) -> PullResult:
        """The member's outcome (waits if not there). Never raises for a failed transfer."""
        ...

    def cancel(self) -> None: ...


class WholeBatch:
    """PendingBatch's member view of a call whose answer holds every member: each is done with the call."""

    done_at: float

    def done(self) -> bool:
        raise NotImplementedError

    def results(self) -> list[PullResult]:
        raise NotImplementedError

    def member_done(self, index: int) -> bool:
        return self.done()

    def member_done_at(self, index: int) -> float:
        return self.done_at

    def member_result(self, index: int) -> PullResult:
        return self.results()[index]


class BatchMember:
    """One member of a PullBatch in flight, as a PendingPull. `cancel()` gives up the whole batch (the
    members share one call); to stop one member, abort its request."""

    def __init__(self, batch: PendingBatch, index: int) -> None:
        self._batch = batch
        self._index = index

    @property
    def done_at(self) -> float:
        return self._batch.member_done_at(self._index)

    def done(self) -> bool:
        return self._batch.member_done(self._index)

    def cancel(self) -> None:
        self._batch.cancel()

    def result(self) -> PullResult:
        return self._batch.member_result(self._index)


def pull_success(response: Any) -> PullResult:
    """A PullResponse (however it arrived) as the PullResult of a pull that succeeded."""
    return PullResult(True, response.bytes, response.duration_us / 1e6, response.path)


def batch_results(outcomes: Sequence[Any], blocks: list[list[int]]) -> list[PullResult]:
    """A PullBatch answer's outcomes (PullOutcome messages) as PullResults, in order."""
    if len(outcomes) != len(blocks):
        return batch_failed(
            "INTERNAL", f"the sidecar answered {len(outcomes)} of {len(blocks)} pulls", blocks
        )
    out = []
    for o, b in zip(outcomes, blocks, strict=True):
        if o.code:
            out.append(pull_failure(o.code, o.message, o.trailers.items(), b))
        else:
            out.append(pull_success(o.response))
    return out


def batch_failed(code: str, message: str, blocks: list[list[int]]) -> list[PullResult]:
    """A PullBatch call that failed as a whole: every member failed with its error, every block unfilled."""
    return [PullResult(False, error_code=code, error=message, unfilled_blocks=list(b)) for b in blocks]


class PendingPull(Protocol):
    """A pull in flight, however it was sent."""

    @property
    def done_at(self) -> float:
        """time.monotonic() when its answer was seen; 0 before."""
        ...

    def done(self) -> bool: ...

    def cancel(self) -> None:
        """Give up; the sidecar stops the pull and releases the source blocks."""

    def result(self) -> PullResult:
        """The outcome (waits if not done). Never raises for a failed transfer: see PullResult."""
        ...


class EndedPull:
    """A pull that ended before it was sent (its sidecar could not be asked where to send it), as a
    PendingPull: done, with its outcome."""

    def __init__(self, outcome: PullResult) -> None:
        self._outcome = outcome
        self.done_at = time.monotonic()

    def done(self) -> bool:
        return True

    def cancel(self) -> None:
        pass

    def result(self) -> PullResult:
        return self._outcome
