"""The source side of a read: open a published request for one reader.

OpenRead does this, as a gRPC call or as a NIXL notification (server/notified_opens.py),
and so does a staged Push that carries the open (which saves the pull a round
trip). Either way the request is fixed to one reader engine, its lease is held
for at least a pull's length, and a served read is tracked until every reader
rank that depends on a rank held here has sent its completion notification.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_sidecar.plan.pair import PairPlan
from kv_sidecar.server.engines import spec_from_proto
from kv_sidecar.server.errors import Code, SidecarError
from kv_sidecar.server.peers import cached_plan
from kv_sidecar.server.published import Published
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar


class ReadPlans:
    """The (source, reader) plans agreed in handshakes here, by hash: what an open names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, PairPlan] = {}

    def add(self, plan: PairPlan) -> None:
        with self._lock:
            self._plans[plan.hash()] = plan

    def resolve(self, sc: Sidecar, request: peer_pb2.OpenReadRequest) -> PairPlan:
        with self._lock:
            plan = self._plans.get(request.plan_hash)
        if plan is None and request.HasField("reader_spec"):
            # A member of a multi-node engine: the reader handshook with the leader, not with us.
            plan = cached_plan(sc.engines.spec(request.engine_id), spec_from_proto(request.reader_spec))
            if plan.hash() != request.plan_hash:
                raise SidecarError(
                    Code.FAILED_PRECONDITION,
                    f"plan mismatch: ours {plan.hash()}, the reader's {request.plan_hash} "
                    f"(different kv-sidecar versions, or engine {request.engine_id!r} changed; handshake again)",
                )
        if plan is None:
            raise SidecarError(
                Code.FAILED_PRECONDITION, f"unknown plan {request.plan_hash!r}: handshake before reading"
            )
        return plan


def open_read(sc: Sidecar, request: peer_pb2.OpenReadRequest, peer: str) -> peer_pb2.OpenReadResponse:
    """OpenRead, however it came: the plan it names, the open, and what the reader is told."""
    plan = sc.read_plans.resolve(sc, request)
    path = "host-nixl" if plan.is_identity() else "host-nixl-staged"
    item = open_for_reader(sc, request, plan, peer, path)
    return peer_pb2.OpenReadResponse(
        block_ids=item.block_ids,
        num_tokens=item.num_tokens,
        lease_deadline_unix_ms=item.deadline_unix_ms(),
    )


def open_for_reader(
    sc: Sidecar, request: peer_pb2.OpenReadRequest, plan: PairPlan, peer: str, path: str
) -> Published:
    """`plan`: the (source, reader) plan named by request.plan_hash, already resolved by the caller."""
    if sc.engines.spec(request.engine_id) != plan.prefill:
        raise SidecarError(
            Code.FAILED_PRECONDITION,
            f"engine {request.engine_id!r} changed since the handshake; handshake again",
        )
    item = sc.published.open_read(
        request.engine_id,
        request.request_id,
        request.reader_engine_id,
        plan,
        list(request.reader_ranks),
        sc.settings.pull_timeout_ms / 1000,
    )
    served = item.readers_here(plan, list(request.reader_ranks))
    if served:
        sc.transfers.begin_serve(
            request.engine_id,
            request.request_id,
            request.reader_engine_id,
            peer,
            served,
            opened_bytes(plan, served, len(item.block_ids)),
            path,
        )
    sc.nixl.wake()  # the reader's READs complete only once our NIXL worker answers their flush
    return item


def opened_bytes(plan: PairPlan, reader_ranks: Sequence[int], num_blocks: int) -> int:
    """Bytes of the source blocks the reader ranks may read: whole blocks of every prefill rank they read."""
    block_bytes = plan.prefill.rank_bytes() // plan.prefill.num_blocks
    reads = sum(len(plan.decode_ranks[r].reads) for r in reader_ranks if 0 <= r < len(plan.decode_ranks))
    return reads * num_blocks * block_bytes
