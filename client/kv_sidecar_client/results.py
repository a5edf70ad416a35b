"""What the engine's calls return or raise, whichever way (gRPC or the engine lane) they went."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


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


class PendingPull(Protocol):
    """A pull in flight, however it was sent."""

    done_at: float  # time.monotonic() when its answer was seen; 0 before

    def done(self) -> bool: ...

    def cancel(self) -> None:
        """Give up; the sidecar stops the pull and releases the source blocks."""

    def result(self) -> PullResult:
        """The outcome (waits if not done). Never raises for a failed transfer: see PullResult."""
        ...
