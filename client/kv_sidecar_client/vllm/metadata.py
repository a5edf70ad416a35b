"""What the scheduler-side connector tells the workers each step (pickled to worker processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PullOrder:
    """Decode: fill local blocks from a published prefill request."""

    params: dict[str, Any]  # the prefill's TransferParams as JSON (kv_transfer_params["kv_sidecar"])
    block_ids: list[int]  # local blocks for tokens [start_token, params.num_tokens)
    # Tokens not pulled (a multiple of the block size): those the local prefix cache holds, and, for a
    # sliding-window request, those before its first in-window block.
    start_token: int
    # A sliding-window request (its block table starts with null blocks): if the pull fails, vLLM
    # must compute the request from its start, not from the first unfilled block.
    restart_on_failure: bool = False
    error: str = ""  # set: do not pull; the load failed for this reason (vLLM recomputes the request)
    # A hybrid model's KV cache group this pull fills (None: a model of one group). The sidecar needs it
    # where it converts a Mamba group's state between TP sizes (PullRequest.group).
    group: int | None = None


@dataclass
class StepOrders:
    """One step's work for the workers: pulls to start, published requests to hold until released."""

    pulls: dict[str, PullOrder] = field(default_factory=dict)  # by local request id
    published: list[str] = field(default_factory=list)  # request ids whose blocks wait for the sidecar
    # Hybrid models (groups.py): a request's pulls, one per KV cache group, by local request id; and
    # published requests' sidecar records, one per group, all of which must be released to free it.
    group_pulls: dict[str, list[PullOrder]] = field(default_factory=dict)
    parts: dict[str, list[str]] = field(default_factory=dict)
