"""Publish and Pull, the engine calls on a request's critical path, with no transport around them.

EngineServicer (gRPC) and EngineLane (a plain unix socket) are thin adapters over these; both map a
raised SidecarError to their own status.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_sidecar.plan.blocks import check_block_ids
from kv_sidecar.server.errors import Code, SidecarError, check_id
from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2, engine_pb2

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

log = logging.getLogger(__name__)

# Registers what to run when the engine goes away mid-call (the gRPC call ends, the lane closes).
OnHangup = Callable[[Callable[[], None]], None]
# Work a call leaves for after its answer is sent (a pull's log record, "consumed" events).
Later = list[Callable[[], None]]


def run_later(later: Later) -> None:
    """Run what a call left for after its answer; one failure neither stops the rest nor the caller."""
    for fn in later:
        try:
            fn()
        except Exception:
            log.exception("work after an answer failed")
    later.clear()


def publish(sc: Sidecar, request: engine_pb2.PublishRequest) -> engine_pb2.PublishResponse:
    check_id("engine_id", request.engine_id)
    check_id("request_id", request.request_id)
    spec = sc.engines.spec(request.engine_id)
    if request.num_tokens <= 0:
        raise SidecarError(Code.INVALID_ARGUMENT, "num_tokens must be positive")
    need = math.ceil(request.num_tokens / spec.block_size)
    if len(request.block_ids) != need:
        raise SidecarError(
            Code.INVALID_ARGUMENT,
            f"{request.num_tokens} tokens at block size {spec.block_size} need {need} blocks, "
            f"got {len(request.block_ids)}",
        )
    check_block_ids("prefill", request.block_ids, spec.num_blocks)
    sc.membership.check_publish(request.engine_id, spec.tp_size)
    lease_ms = request.lease_ms or sc.settings.lease_ms
    item = sc.published.publish(
        request.engine_id,
        request.request_id,
        list(request.block_ids),
        request.num_tokens,
        lease_ms / 1000,
        ranks=sc.membership.held_here(request.engine_id),
    )
    try:  # a multi-node engine: hold it on the member sidecars too
        sc.membership.publish_on_members(
            request.engine_id, request.request_id, request.block_ids, request.num_tokens, lease_ms
        )
    except BaseException:
        sc.published.abort(request.engine_id, request.request_id)
        raise
    sc.gpu_staging.expect_read(item, sc.engines.engine_ranks(request.engine_id))
    params = common_pb2.TransferParams(
        engine_id=request.engine_id,
        sidecar_address=sc.peer_address,
        sidecar_id=sc.sidecar_id,
        request_id=request.request_id,
        block_ids=request.block_ids,
        num_tokens=request.num_tokens,
        lease_deadline_unix_ms=item.deadline_unix_ms(),
    )
    return engine_pb2.PublishResponse(params=params)


def pull(
    sc: Sidecar, request: engine_pb2.PullRequest, on_hangup: OnHangup, later: Later | None = None
) -> engine_pb2.PullResponse:
    """`later`: where the pull leaves work for after its answer (the caller runs it once the answer is
    out, then `run_later`); None: it runs before this returns."""
    check_id("engine_id", request.engine_id)
    check_id("params.request_id", request.params.request_id)
    check_id("params.engine_id", request.params.engine_id)
    # Pulls of one request into different ranks run side by side (a TP engine's workers each pull
    # their own rank); no ranks means every rank registered now.
    ranks = list(request.ranks) or sc.engines.ranks_of(request.engine_id)
    ticket = sc.pulls.begin(request.engine_id, request.params.request_id, ranks)
    # The engine went away (or gave up the call): stop, and let the source free its blocks.
    on_hangup(lambda: ticket.stop("the engine's call ended", release_source=True))
    try:
        return sc.puller.pull(request, ticket, later)
    finally:
        sc.pulls.end(ticket)
