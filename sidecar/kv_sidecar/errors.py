"""The sidecar's errors: one exception type carrying a status `Code`, and the checks of ids and addresses.

Raised by the control core (server/) and the data plane (dataplane/) alike. `Code` has gRPC's status
names and numbers (they are what engines and peers see), but this module does not import grpc:
`server/adapters/grpc_status.py` maps a `Code` to a gRPC status at the edge, in one place.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable, Iterable

from kv_sidecar.memory.shm import HandleError
from kv_sidecar.plan.spec import PlanError

log = logging.getLogger(__name__)


class Code(enum.IntEnum):
    """Status codes, as gRPC numbers them (google.rpc.Code)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class SidecarError(Exception):
    def __init__(self, code: Code, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


def waited_for(e: SidecarError, what: str | Callable[[], str]) -> SidecarError:
    """`e` with what its operation was waiting for, if it ran out of time or was stopped while waiting:
    a stalled transfer's error says where it stalled. Subclasses, which callers tell apart, are kept.
    `what` may be a function, asked only then (a description can cost a round trip to a worker)."""
    if type(e) is not SidecarError or e.code not in (Code.DEADLINE_EXCEEDED, Code.CANCELLED):
        return e
    return SidecarError(e.code, f"{e.message} ({what if isinstance(what, str) else what()})", e.metadata)


def as_sidecar_error(e: Exception) -> SidecarError:
    if isinstance(e, SidecarError):
        return e
    if isinstance(e, PlanError):
        return SidecarError(getattr(Code, e.code, Code.INVALID_ARGUMENT), str(e))
    if isinstance(e, HandleError):
        return SidecarError(Code.INVALID_ARGUMENT, str(e))
    return SidecarError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def handler_error(e: Exception) -> SidecarError:
    """What a handler's exception tells the caller; an internal error is logged with its stack."""
    err = as_sidecar_error(e)
    if err.code is Code.INTERNAL:
        log.exception("internal error in handler")
    return err


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as a message names them: sorted, bracketed."""
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


_MAX_ID = 256
# A control character anywhere; a regex, since every call checks ids and a loop over them in Python
# cost a pull ~0.05 ms.
_CONTROL = re.compile(r"[\x00-\x1f]")


def check_id(kind: str, value: str) -> str:
    if not value:
        raise SidecarError(Code.INVALID_ARGUMENT, f"{kind} must not be empty")
    if len(value) > _MAX_ID or _CONTROL.search(value):
        raise SidecarError(Code.INVALID_ARGUMENT, f"{kind} must be at most {_MAX_ID} printable characters")
    return value


# host:port, host a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}$")


def check_address(kind: str, value: str) -> str:
    """A peer address gRPC can dial; anything else would fail later, less clearly."""
    if not _ADDRESS.match(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise SidecarError(Code.INVALID_ARGUMENT, f"{kind} {value[:100]!r} is not a host:port address")
    return value
