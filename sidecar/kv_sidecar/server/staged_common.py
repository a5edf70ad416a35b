"""What the two control ends of the staged protocol share (server/staged_reader.py, the reader's;
server/staged_source.py, the source's): path labels, the heads a read moves, the slot limit."""

from __future__ import annotations

import json
import re

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.plan.pair import PairPlan

PATH_STAGED = "gpu-staged"
PATH_HOST_RING = "host-ring"
MAX_SLOTS = 4096  # receive slots one Push may offer
# The most requests one staged transfer carries (PushRequest.members): a reader's staged_group_reads
# above it groups no more, a Push with more is refused.
MAX_PUSH_MEMBERS = 1024


def read_heads(plan: PairPlan, decode_rank: int, prefill_rank: int) -> tuple[int, int] | None:
    for read in plan.decode_ranks[decode_rank].reads:
        if read.prefill_rank == prefill_rank:
            return read.heads
    raise SidecarError(
        Code.INVALID_ARGUMENT,
        f"decode rank {decode_rank} reads nothing from prefill rank {prefill_rank} under this plan",
    )


def member_refusal(index: int, e: SidecarError) -> SidecarError:
    """A Push of several requests refused for one of them: its index leads the message, which the
    reader reads back (`refused_member`) to fail that read alone and send the others again as one."""
    return SidecarError(e.code, f"members[{index}]: {e.message}", e.metadata)


_MEMBER = re.compile(r"members\[(\d+)\]: ")
# Trailing metadata of a group's refusal: every member refused, as JSON [[index, code, message], ..],
# so that the reader drops them all in one go (the message names the first only, for readers that
# know no more). Whole entries up to REFUSALS_BYTES: gRPC refuses trailers past 8 KiB by default, and
# members left out are refused again in the next round.
REFUSALS_KEY = "kvsidecar-refused-members"
REFUSALS_BYTES = 4096


def member_refusals(refusals: list[tuple[int, SidecarError]]) -> SidecarError:
    """A Push of several requests refused for one or more of them (in index order): the first leads the
    message (`member_refusal`), and all that fit are listed in the trailer REFUSALS_KEY."""
    index, first = refusals[0]
    listed: list[str] = []
    size = 1  # "[" and "]", and a "," after every entry but the last
    for i, e in refusals:
        entry = json.dumps([i, e.code.name, e.message], separators=(",", ":"))  # ASCII: a valid header
        size += len(entry) + 1
        if size > REFUSALS_BYTES:
            break
        listed.append(entry)
    err = member_refusal(index, first)
    if len(listed) < 2:
        return err
    return SidecarError(err.code, err.message, (*err.metadata, (REFUSALS_KEY, f"[{','.join(listed)}]")))


def refused_members(trailers: tuple[tuple[str, str], ...]) -> dict[int, tuple[Code, str]]:
    """The members a refusal lists in its trailer (`member_refusals`), each with the code and words a
    Push of it alone gets; empty if it lists none (one refused, or a source that names only the first)."""
    for key, value in trailers:
        if key != REFUSALS_KEY:
            continue
        try:
            return {int(i): (Code[code], str(msg)) for i, code, msg in json.loads(value)}
        except (ValueError, KeyError, TypeError):
            return {}  # not ours to trust: the message still names the first
    return {}


def refused_member(details: str) -> tuple[int, str] | None:
    """The member a Push of several requests was refused for, and the refusal of it alone (as a Push
    of that request alone gets it); None for a refusal of the whole Push."""
    m = _MEMBER.match(details)
    return None if m is None else (int(m.group(1)), details[m.end() :])
