"""The scheduler side of the connector: one per engine, in vLLM's scheduler loop.

Prefill (the request's kv_transfer_params say `do_remote_decode`): when the
request finishes, publish its blocks through the sidecar, hold them (vLLM
frees them only when every worker reports the sidecar released them) and
return the sidecar's transfer params for the router to hand to the decode
engine unchanged: `{"do_remote_prefill": true, "kv_sidecar": {...}}`.

Decode (`do_remote_prefill` with `kv_sidecar` params): report the prompt
tokens the prefill holds beyond the local prefix cache as loadable
asynchronously; once vLLM has allocated blocks, order the workers to pull
exactly the missing tail. While a request waits in the queue its lease is
renewed (KeepAlive); if it is aborted before its pull finishes, or its pull
fails (vLLM then computes what was not loaded and never reads those blocks
again), the prefill side is told to free its blocks now (Abort). A release the
local sidecar cannot take (it is down or restarting) is tried again each
keep-alive interval, for up to RELEASE_RETRY_S.

Sliding-window models (window.py): the prefill stops a request a little
short of its prompt (the decode engine computes the rest) and publishes only
the blocks that hold the window, from `first_token` on; vLLM has freed the
blocks before and put its null block in their place, which is never published.
The decode engine pads its own out-of-window blocks with null blocks and pulls
only its in-window ones. A failed pull of such a request makes vLLM recompute
it from its start: its blocks before the first unfilled one no longer hold the
window that token would need.

Mamba/SSM hybrids (mamba_state.py): the prefill stops one token short of the prompt and publishes
each Mamba group's one state block as its own record; the decode engine pulls it into its request's
state block and computes the last prompt token from it. A published state of every prompt token is
not loaded (the request is computed here).

Malformed params on a decode request: the request is computed locally (a
warning names the request and what was wrong); the prefill's blocks are then
freed by their lease.

A Publish runs in vLLM's scheduler loop, which waits for it. A sidecar that
does not answer within `publish_timeout_s` (hung, or stopped) is not asked
again until a probe off the loop hears it answer: meanwhile finishing prefill
requests return no transfer params at once, and their decode engines compute
them. A sidecar that is gone refuses at once and needs no pause.

No vLLM import; requests and block lists are duck-typed (request_id,
kv_transfer_params, prompt_token_ids, num_computed_tokens, status name).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kv_sidecar_client.client import (
    KVSidecarError,
    SidecarClient,
    TransferParams,
    params_from_json,
    params_to_json,
)
from kv_sidecar_client.session import reconnect_options
from kv_sidecar_client.vllm.config import CONFIG_KEY, ConnectorConfig, ConnectorConfigError, wait_for_sidecar
from kv_sidecar_client.vllm.groups import (
    GROUPS_KEY,
    KVGroup,
    common_window,
    mismatch,
    sub_request_id,
    token_group,
)
from kv_sidecar_client.vllm.mamba_state import UnsupportedMambaState, state_block
from kv_sidecar_client.vllm.mamba_state import prefill_tokens as state_prefill_tokens
from kv_sidecar_client.vllm.metadata import PullOrder, StepOrders
from kv_sidecar_client.vllm.window import (
    NULL_BLOCK_ID,
    first_kept_token,
    leading_nulls,
    prefill_tokens,
)

log = logging.getLogger(__name__)

PARAMS_KEY = "kv_sidecar"  # our TransferParams inside vLLM's kv_transfer_params
PUBLISHED_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
PROBE_INTERVAL_S = 0.5  # how often a paused scheduler asks a silent sidecar whether it answers again
WITHDRAW_TRIES = 3
# How long a release refused because the local sidecar is unavailable (down, restarting) is tried again:
# past the leases the connector's keep-alive could have extended, which free the blocks anyway.
RELEASE_RETRY_S = 60.0


class BadParams(ValueError):
    pass


def remote_params(kv_transfer_params: dict[str, Any] | None) -> TransferParams | None:
    """The prefill's TransferParams of a decode request, None if it is not one; BadParams if malformed."""
    if not kv_transfer_params or not kv_transfer_params.get("do_remote_prefill"):
        return None
    raw = kv_transfer_params.get(PARAMS_KEY)
    if raw is None:
        raise BadParams(f"do_remote_prefill is set but {PARAMS_KEY!r} is missing")
    try:
        params = params_from_json(raw if isinstance(raw, (str, dict)) else json.dumps(raw))
    except Exception as e:
        raise BadParams(f"{PARAMS_KEY!r} is not kv-sidecar transfer params: {e}") from None
    missing = [f for f in ("engine_id", "sidecar_address", "request_id") if not getattr(params, f)]
    if missing or params.num_tokens <= 0 or not params.block_ids:
        raise BadParams(f"{PARAMS_KEY!r} lacks {missing or 'tokens or blocks'}")
    return params


def group_params(kv_transfer_params: dict[str, Any] | None) -> list[tuple[KVGroup, TransferParams]] | None:
    """A hybrid prefill's groups and each group's params (groups.py), None if it published one group;
    BadParams if malformed."""
    raw = (kv_transfer_params or {}).get(GROUPS_KEY)
    if raw is None:
        return None
    try:
        out = [(KVGroup.from_json(g), params_from_json(g["params"])) for g in raw]
    except Exception as e:
        raise BadParams(f"{GROUPS_KEY!r} is not a list of kv-sidecar groups: {e}") from None
    if not out or any(p.num_tokens <= 0 or not p.block_ids or not p.request_id for _, p in out):
        raise BadParams(f"{GROUPS_KEY!r} has a group without tokens, blocks or request id")
    # One request: every attention group holds the same tokens (a Mamba group's record is one state block).
    tokens = [p.num_tokens for g, p in out if not g.state]
    if len(set(tokens)) > 1:
        raise BadParams(f"{GROUPS_KEY!r} holds {tokens} tokens in its groups")
    if any(g.state and len(p.block_ids) != 1 for g, p in out):
        raise BadParams(f"{GROUPS_KEY!r} has a Mamba group of other than one state block")
    return out


class SidecarScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        engine_id: str,
        block_size: int,
        window: int | None = None,
        groups: Sequence[KVGroup] | None = None,
    ) -> None:
        """`window`: a sliding-window model's window in tokens (with any tokens vLLM retains beyond it),
        None for full attention. `groups`: the model's KV cache groups (groups.py); with more than one
        (a hybrid model) `window` is ignored for their common window."""
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.groups = list(groups) if groups and len(groups) > 1 else None
        # This engine's groups as a prefill's are checked against (a model of one group: its layers).
        self._own = list(groups) if groups else [KVGroup((), window)]
        self.window = common_window(self.groups) if self.groups else window
        # Each group's window: what the decode side checks a published group's first token against.
        self._windows = [g.window for g in self.groups] if self.groups else [window]
        # Mamba groups (mamba_state.py): the prefill stops one token short, each publishes one state block.
        self._has_state = any(g.state for g in self.groups or ())
        self._tokens_of = token_group(self.groups) if self.groups else 0
        self.alignment = config.window_alignment or block_size
        if self.alignment % block_size:
            raise ConnectorConfigError(
                f"{CONFIG_KEY}.window_alignment ({self.alignment}) must be a multiple of the engine's "
                f"block size ({block_size})"
            )
        self._misaligned: set[str] = set()  # prefill engines whose windows this engine cannot take: warned
        # Rank 0's sidecar: the engine's leader, where its Publishes go (the only one unless each rank
        # has a sidecar of its own).
        self.socket = config.socket_for(0)
        # Reconnecting as the workers' sessions do: publishes and retried releases reach a restarted sidecar
        # within a second, not after gRPC's default reconnect backoff.
        self.client = SidecarClient(
            self.socket,
            timeout_s=config.pull_timeout_s,
            channel_options=reconnect_options(),
            placement=config.shard_placement,
        )
        wait_for_sidecar(self.client, config, self.socket)
        self._lock = threading.Lock()
        self._orders = StepOrders()
        self._handled: set[str] = set()  # decode requests whose pull (or release) is decided
        self._bad: set[str] = set()  # decode requests computed locally for malformed params
        # Decode requests' params, one per KV cache group (one for a model of one group).
        self._waiting: dict[str, list[TransferParams]] = {}  # queued decode requests: kept alive
        self._loading: dict[str, list[TransferParams]] = {}  # pulls ordered, not yet finished
        self._loading_blocks: dict[str, set[int]] = {}  # the local blocks their pulls fill
        self._load_failed: set[str] = set()  # loading requests with a block vLLM recomputes
        # Releases the local sidecar could not take: (params, why, give up at monotonic time).
        self._retry: list[tuple[TransferParams, str, float]] = []
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="kvs-sched")
        self._stop = threading.Event()
        # Set while the sidecar has left a Publish unanswered and not answered a probe since.
        self._silent = threading.Event()
        self.unpublished = 0  # requests not published because the sidecar was silent or refused
        self._unanswered: list[str] = []  # Publishes that timed out, withdrawn once the sidecar answers
        self._keepalive = threading.Thread(target=self._keep_alive_loop, name="kvs-keepalive", daemon=True)
        self._keepalive.start()

    # -- decode ------------------------------------------------------------------------
    def _params(self, request: Any) -> list[TransferParams] | None:
        """A decode request's prefill params, one per KV cache group; None if it is computed here."""
        req_id = request.request_id
        if req_id in self._handled or req_id in self._bad:
            return None
        try:
            params = remote_params(request.kv_transfer_params)
            groups = None if params is None else group_params(request.kv_transfer_params)
        except BadParams as e:
            self._bad.add(req_id)
            log.warning("KVSidecarConnector: request %s is computed locally: %s", req_id, e)
            return None
        if params is not None and params.num_tokens > len(request.prompt_token_ids or ()):
            self._bad.add(req_id)
            log.warning(
                "KVSidecarConnector: request %s is computed locally: the prefill holds %d tokens but the "
                "prompt has %d (params of another request?)",
                req_id,
                params.num_tokens,
                len(request.prompt_token_ids or ()),
            )
            return None
        if params is None:
            return None
        plist = self._corresponding(request, params, groups)
        if (
            plist is not None
            and self._has_state
            and plist[self._tokens_of].num_tokens >= len(request.prompt_token_ids or ())
        ):
            # The state holds every prompt token: vLLM would compute the last one again from it (it always
            # computes one), advancing the state twice. A prefill through this connector stops short.
            self._bad.add(req_id)
            log.warning(
                "KVSidecarConnector: request %s is computed locally: the prefill published the Mamba state of "
                "all %d prompt tokens; the decode engine must compute the last one from the state before it",
                req_id,
                plist[self._tokens_of].num_tokens,
            )
            for p in plist:
                self._release(p, "Mamba state of the whole prompt")
            return None
        return plist

    def _corresponding(
        self, request: Any, params: TransferParams, groups: list[tuple[KVGroup, TransferParams]] | None
    ) -> list[TransferParams] | None:
        """Each group's params if the prefill's KV cache groups correspond to ours layer for layer;
        otherwise the request is computed here (a warning names the layer) and the prefill's blocks
        are freed at once."""
        if groups is None:  # a prefill of one group
            if self.groups is None:
                return [params]
            why = mismatch([KVGroup((), None)], self.groups)
            published = [params]
        else:
            why = mismatch([g for g, _ in groups], self._own)
            published = [p for _, p in groups]
            if why is None and self.groups is None:
                why = "the prefill engine is hybrid and this one has one KV cache group"
        if why is None:
            return published
        self._bad.add(request.request_id)
        log.warning(
            "KVSidecarConnector: request %s is computed locally: the KV cache groups of the two engines do "
            "not correspond: %s",
            request.request_id,
            why,
        )
        for p in published:
            self._release(p, "KV cache groups do not correspond")
        return None

    def on_new_request(self, request: Any) -> None:
        params = self._params(request)
        if params is not None:
            with self._lock:
                self._waiting[request.request_id] = params

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        plist = self._params(request)
        if plist is None:
            return 0, False
        for params, window in zip(plist, self._windows, strict=True):
            if not self._window_fits(request, plist, params, window, num_computed_tokens):
                return 0, False
        count = plist[self._tokens_of].num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _window_fits(
        self,
        request: Any,
        plist: list[TransferParams],
        params: TransferParams,
        window: int | None,
        num_computed_tokens: int,
    ) -> bool:
        """Whether the first block this engine would pull into, once it loads the published tokens (its
        first in-window block, or the first after its local prefix hit), starts inside the published
        range of this group (`params`); if not, the request is computed here and the prefill's blocks
        (every group's, `plist`) are freed."""
        if not params.first_token:
            return True
        if window is not None:
            kept = first_kept_token(params.num_tokens, window, self.block_size)
            if max(kept, num_computed_tokens) >= params.first_token:
                return True
            why = (
                f"its window is published from token {params.first_token}, but this engine's first "
                f"in-window block starts at token {kept}: set window_alignment on the prefill engine "
                f"{params.engine_id!r} to a multiple of this engine's block size ({self.block_size})"
            )
        else:
            why = "it is a sliding-window request and this engine's model has no sliding window"
        self._bad.add(request.request_id)
        with self._lock:  # no longer kept alive, nor released again when it finishes
            self._waiting.pop(request.request_id, None)
        for p in plist:
            self._release(p, "computed by the decode engine")
        if params.engine_id not in self._misaligned:
            self._misaligned.add(params.engine_id)
            log.warning("KVSidecarConnector: request %s is computed locally: %s", request.request_id, why)
        return False

    def after_alloc(
        self,
        request: Any,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_external: int,
        num_null_blocks: int = 0,
    ) -> None:
        """`block_ids`: every block of the request: first `num_null_blocks` null blocks (vLLM's padding of
        the blocks before a sliding window), then `num_cached_blocks` holding the local prefix hit."""
        self.after_alloc_groups(
            request, [(list(block_ids), num_cached_blocks, num_null_blocks)], num_external
        )

    def after_alloc_groups(
        self, request: Any, tables: Sequence[tuple[list[int], int, int]], num_external: int
    ) -> None:
        """Per KV cache group, (block ids, local prefix-cache hit, leading null blocks) as after_alloc
        takes them: each group is pulled from the prefill's record of the same group into its own
        blocks. A model of one group passes one table."""
        plist = self._params(request)
        if plist is None:
            return
        req_id = request.request_id
        self._handled.add(req_id)
        with self._lock:
            self._waiting.pop(req_id, None)
        if num_external <= 0:
            # The local prefix cache holds it all: nothing to pull, let the prefill free its blocks.
            for p in plist:
                self._release(p, "served from the decode prefix cache")
            return
        orders = []
        groups: Sequence[KVGroup | None] = self.groups or [None] * len(plist)
        for g, (group, params, (block_ids, num_cached_blocks, num_null_blocks)) in enumerate(
            zip(groups, plist, tables, strict=True)
        ):
            if group is not None and group.state:
                orders.append(self._state_order(request, g, group, params, block_ids))
                continue
            first = num_null_blocks + num_cached_blocks
            need = -(-params.num_tokens // self.block_size) - first
            blocks = list(block_ids[first : first + need])
            error = ""
            if NULL_BLOCK_ID in blocks:  # no pull may write into the null block; vLLM recomputes the request
                error = f"vLLM gave the request a null block among those to fill ({blocks})"
            orders.append(
                PullOrder(
                    json.loads(params_to_json(params)),
                    blocks,
                    first * self.block_size,
                    # A sliding-window group, or any group of a hybrid model (whose other groups' windows
                    # a partial recompute would miss): a failed pull computes the request from its start.
                    restart_on_failure=num_null_blocks > 0 or len(plist) > 1,
                    error=error,
                    group=g if group is not None else None,
                )
            )
        with self._lock:
            self._loading[req_id] = plist
            self._loading_blocks[req_id] = {b for o in orders for b in o.block_ids}
            if len(orders) == 1:
                self._orders.pulls[req_id] = orders[0]
            else:
                self._orders.group_pulls[req_id] = orders

    def _state_order(
        self, request: Any, g: int, group: KVGroup, params: TransferParams, block_ids: Sequence[int]
    ) -> PullOrder:
        """A Mamba group (group `g`): the prefill's state block into this request's one state block (whole,
        or converted by the sidecar between TP sizes)."""
        error = ""
        try:
            blocks = [state_block(request.request_id, group.layers[0], block_ids, NULL_BLOCK_ID)]
        except UnsupportedMambaState as e:
            blocks, error = [], str(e)
        return PullOrder(
            json.loads(params_to_json(params)), blocks, 0, restart_on_failure=True, error=error, group=g
        )

    def finished_loading(
        self, req_ids: Sequence[str], failed: Collection[str] = (), invalid_blocks: Collection[int] = ()
    ) -> None:
        """Pulls ended (vLLM's finished_recving); `failed`: requests vLLM computes from their start
        (failed_recving), `invalid_blocks`: blocks it recomputes (a partly failed pull). The prefill's
        records of a failed load are released now: nobody will read them, and else the prefill engine
        would hold their blocks until the lease ends."""
        invalid = set(invalid_blocks)
        gave_up = []
        with self._lock:
            if invalid:  # with TP, a rank's unfilled blocks may come steps before the request finishes
                self._load_failed |= {r for r, blocks in self._loading_blocks.items() if blocks & invalid}
            for req_id in req_ids:
                plist = self._loading.pop(req_id, None)
                self._loading_blocks.pop(req_id, None)
                if plist and (req_id in failed or req_id in self._load_failed):
                    gave_up.append(plist)
                self._load_failed.discard(req_id)
        for plist in gave_up:
            for params in plist:
                self._release(params, "its pull failed; the decode engine computes it")

    # -- either side ---------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        kvp = request.kv_transfer_params or {}
        self._bad.discard(req_id)
        if kvp.get("do_remote_decode"):
            return self._publish(request, block_ids)
        handled = req_id in self._handled
        self._handled.discard(req_id)
        with self._lock:
            plist = self._waiting.pop(req_id, None) or self._loading.pop(req_id, None)
            self._loading_blocks.pop(req_id, None)
            self._load_failed.discard(req_id)
        if plist is None and not handled and kvp.get("do_remote_prefill"):
            try:  # aborted before vLLM ever asked about its tokens
                params = remote_params(kvp)
                groups = group_params(kvp)
                plist = [p for _, p in groups] if groups else [params] if params else None
            except BadParams:
                plist = None
        for params in plist or ():
            # Given up before its pull finished: stop the pull and let the prefill free its blocks now.
            self._release(params, "aborted")
        return False, None

    def request_finished_groups(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """request_finished for a hybrid model: `block_ids` holds one list per KV cache group."""
        kvp = request.kv_transfer_params or {}
        if not kvp.get("do_remote_decode"):
            return self.request_finished(request, block_ids[0])  # the decode side uses no block ids
        self._bad.discard(request.request_id)
        return self._publish_groups(request, block_ids)

    def prefill_length(self, request: Any) -> int | None:
        """Prefill of a sliding-window request (window.prefill_tokens) or of a Mamba hybrid's (all but the
        last token: mamba_state.prefill_tokens): how many of its prompt tokens to compute and publish; the
        decode engine computes the rest. None: the whole prompt."""
        kvp = request.kv_transfer_params or {}
        if not kvp.get("do_remote_decode") or (self.window is None and not self._has_state):
            return None
        n = int(request.num_prompt_tokens)
        if self.window is None:  # Mamba state: the decode engine computes the last prompt token from h(n - 1)
            return state_prefill_tokens(n)
        return prefill_tokens(n, self.window, self.alignment)

    def _publish(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        status = _status(request)
        # The prompt's KV, even if the request generated more than the router's one token: the decode
        # request carries the same prompt and computes the rest itself.
        tokens = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
        if status not in PUBLISHED_STATUSES or tokens <= 0 or not block_ids:
            return False, None
        # A sliding-window request: vLLM freed the blocks before the window and put its null block in
        # their place. Only the blocks that hold data are published, from the first one's first token.
        skipped = leading_nulls(block_ids)
        blocks = list(block_ids[skipped : -(-tokens // self.block_size)])
        if not blocks or NULL_BLOCK_ID in blocks:
            self.unpublished += 1
            log.error(
                "KVSidecarConnector: cannot publish request %s: its blocks for %d tokens are %s, with "
                "vLLM's null block (%d) where data should be; the decode engine must compute it",
                request.request_id,
                tokens,
                list(block_ids),
                NULL_BLOCK_ID,
            )
            return False, None
        if self._silent.is_set():
            self.unpublished += 1
            return False, None
        try:
            params = self.client.publish(
                self.engine_id,
                request.request_id,
                blocks,
                tokens,
                self.config.lease_ms,
                timeout_s=self.config.publish_timeout_s,
                first_token=skipped * self.block_size,
            )
        except KVSidecarError as e:
            self.unpublished += 1
            log.error(
                "KVSidecarConnector: cannot publish request %s to kv-sidecar (%s); its blocks are freed and "
                "the decode engine must compute it",
                request.request_id,
                e,
            )
            if e.code == "DEADLINE_EXCEEDED":
                self._went_silent(request.request_id)
            return False, None
        with self._lock:
            self._orders.published.append(request.request_id)
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: json.loads(params_to_json(params)),
        }
        return True, out

    def _publish_groups(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Publish each KV cache group of a hybrid model's request as its own sidecar record
        (groups.py): a sliding-window group its window, a full-attention group every block."""
        assert self.groups is not None
        status = _status(request)
        tokens = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
        if status not in PUBLISHED_STATUSES or tokens <= 0 or not any(block_ids):
            return False, None
        parts: list[tuple[str, list[int], int, int]] = []
        for g, ids in enumerate(block_ids):
            if self.groups[g].state:  # its one state block, as that block's tokens (mamba_state.py)
                try:
                    state = state_block(request.request_id, self.groups[g].layers[0], ids, NULL_BLOCK_ID)
                except UnsupportedMambaState as e:
                    self.unpublished += 1
                    log.error("KVSidecarConnector: cannot publish %s; the decode engine must compute it", e)
                    return False, None
                parts.append((sub_request_id(request.request_id, g), [state], 0, self.block_size))
                continue
            skipped = leading_nulls(ids) if self.groups[g].window is not None else 0
            blocks = list(ids[skipped : -(-tokens // self.block_size)])
            if not blocks or NULL_BLOCK_ID in blocks:
                self.unpublished += 1
                log.error(
                    "KVSidecarConnector: cannot publish request %s: the blocks of its KV cache group %d (%s, "
                    "layer %s) for %d tokens are %s, with vLLM's null block (%d) where data should be; the "
                    "decode engine must compute it",
                    request.request_id,
                    g,
                    self.groups[g].kind,
                    self.groups[g].layers[0] if self.groups[g].layers else "?",
                    tokens,
                    list(ids),
                    NULL_BLOCK_ID,
                )
                return False, None
            parts.append((sub_request_id(request.request_id, g), blocks, skipped * self.block_size, tokens))
        if self._silent.is_set():
            self.unpublished += 1
            return False, None
        published: list[TransferParams] = []
        for sub_id, blocks, first_token, count in parts:
            try:
                published.append(
                    self.client.publish(
                        self.engine_id,
                        sub_id,
                        blocks,
                        count,
                        self.config.lease_ms,
                        timeout_s=self.config.publish_timeout_s,
                        first_token=first_token,
                    )
                )
            except KVSidecarError as e:
                self.unpublished += 1
                log.error(
                    "KVSidecarConnector: cannot publish request %s to kv-sidecar (%s: %s); its blocks are "
                    "freed and the decode engine must compute it",
                    request.request_id,
                    sub_id,
                    e,
                )
                for done in published:  # the groups already published: their blocks are freed now
                    self._release(done, "another group could not be published")
                if e.code == "DEADLINE_EXCEEDED":
                    self._went_silent(sub_id)
                return False, None
        with self._lock:
            self._orders.parts[request.request_id] = [sub_id for sub_id, *_ in parts]
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: json.loads(params_to_json(published[self._tokens_of])),
            GROUPS_KEY: [
                {"params": json.loads(params_to_json(p)), **group.to_json()}
                for p, group in zip(published, self.groups, strict=True)
            ],
        }
        return True, out

    @property
    def publishing_paused(self) -> bool:
        """Whether publishes wait for a silent sidecar to answer again (they are skipped meanwhile)."""
        return self._silent.is_set()

    def _went_silent(self, request_id: str) -> None:
        """Stop publishing until the sidecar answers a probe; then withdraw the unanswered Publish, which
        the sidecar may still carry out when it wakes (no reader can know it: its params never left)."""
        with self._lock:
            self._unanswered.append(request_id)
        if self._silent.is_set():
            return
        self._silent.set()
        log.error(
            "KVSidecarConnector: kv-sidecar at %s did not answer a Publish within %.1f s; finishing prefill "
            "requests are not published (their decode engines compute them) until it answers again",
            self.socket,
            self.config.publish_timeout_s,
        )
        threading.Thread(target=self._probe, name="kvs-probe", daemon=True).start()

    def _probe(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                self.client.status(timeout_s=self.config.publish_timeout_s)
            except KVSidecarError:
                continue
            with self._lock:
                unanswered, self._unanswered = self._unanswered, []
            for request_id in unanswered:
                self._withdraw(request_id)
            self._silent.clear()
            log.warning(
                "KVSidecarConnector: kv-sidecar answers again after %.1f s; publishing resumes",
                time.monotonic() - t0,
            )
            return

    def _withdraw(self, request_id: str) -> None:
        """End a Publish that timed out, if the sidecar carried it out. Its frame may still be on its way
        through the waking sidecar: look a few times. Whatever is missed, its lease ends."""
        for attempt in range(WITHDRAW_TRIES):
            if attempt:
                time.sleep(PROBE_INTERVAL_S)
            try:
                if self.client.abort(self.engine_id, request_id):
                    return
            except KVSidecarError:
                return

    def _release(self, params: TransferParams, why: str, give_up_at: float | None = None) -> None:
        """Abort `params` through the local sidecar, which releases them at the prefill's; `give_up_at`
        set: a retry of one the sidecar could not take."""

        def call() -> None:
            try:
                self.client.abort(self.engine_id, params.request_id, params)
            except KVSidecarError as e:
                # Our sidecar is down or restarting: a restarted one takes it (the prefill's sidecar
                # still holds the blocks). Otherwise, or for too long, the lease frees them anyway.
                until = give_up_at if give_up_at is not None else time.monotonic() + RELEASE_RETRY_S
                retry = e.code == "UNAVAILABLE" and time.monotonic() < until and not self._stop.is_set()
                if retry:
                    with self._lock:
                        self._retry.append((params, why, until))
                    if give_up_at is not None:
                        return  # said once, at the first try
                log.warning(
                    "KVSidecarConnector: could not release request %s (%s): %s%s",
                    params.request_id,
                    why,
                    e,
                    "; trying again each keep-alive interval" if retry else "",
                )

        self._calls.submit(call)

    # -- each step -------------------------------------------------------------------------
    def take_orders(self) -> StepOrders:
        with self._lock:
            orders, self._orders = self._orders, StepOrders()
        return orders

    def _keep_alive_loop(self) -> None:
        while not self._stop.wait(self.config.keepalive_interval_s):
            with self._lock:
                alive = [p for plist in (*self._waiting.values(), *self._loading.values()) for p in plist]
                retry, self._retry = self._retry, []
            for params, why, until in retry:
                try:
                    self._release(params, why, until)
                except RuntimeError:  # shutting down: the executor takes no more calls
                    return
            by_peer: dict[str, list[TransferParams]] = defaultdict(list)
            for p in alive:
                by_peer[p.sidecar_address].append(p)
            for address, batch in by_peer.items():  # one dead prefill sidecar must not stall the others
                try:
                    self.client.keep_alive(batch, self.engine_id)
                except KVSidecarError as e:
                    log.warning(
                        "KVSidecarConnector: keep-alive of %d request(s) at %s failed: %s",
                        len(batch),
                        address,
                        e,
                    )

    def shutdown(self) -> None:
        self._stop.set()
        self._calls.shutdown(wait=True)
        self.client.close()


def _status(request: Any) -> str:
    status = getattr(request, "status", "")
    return getattr(status, "name", str(status))
