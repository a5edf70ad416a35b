"""The connector's settings: `kv_connector_extra_config` of vLLM's `--kv-transfer-config`.

Parsed once at engine start, in every process that builds a connector, so that
a typo or a wrong type stops the engine with a message naming the key instead
of surfacing as a failed transfer later. No vLLM import: testable anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kv_sidecar_client.client import DEFAULT_SOCKET, KVSidecarError, SidecarClient

CONFIG_KEY = "kv_connector_extra_config"


class ConnectorConfigError(ValueError):
    """A key of kv_connector_extra_config is unknown, missing or malformed."""


# In sidecar_socket: the TP rank, where each rank (GPU) has a sidecar of its own.
RANK_FIELD = "{rank}"


@dataclass(frozen=True)
class ConnectorConfig:
    # The sidecar's engine socket on this node (a unix socket path or a gRPC target).
    sidecar_socket: str = DEFAULT_SOCKET
    # The id this engine registers under; empty: vLLM's kv_transfer_config.engine_id.
    engine_id: str = ""
    # A node sidecar of control shards: host (CPU) engines that name the same key go to the same shard,
    # e.g. a P/D pair of one node, whose pulls are then copies; empty: by engine id. GPU engines go by
    # their GPU (control_shard_gpus).
    shard_placement: str = ""
    # Peer address (host:port) of the engine's leader sidecar when its TP ranks span nodes.
    leader_address: str = ""
    # How long published blocks are held for a reader (0: the sidecar's default lease).
    lease_ms: int = 0
    # Decode: how often a request waiting in the queue renews the prefill side's lease.
    keepalive_interval_s: float = 5.0
    # Decode: a pull that has not finished by then fails, and vLLM recomputes its blocks.
    pull_timeout_s: float = 30.0
    # How long engine start waits for the sidecar's socket before failing.
    connect_timeout_s: float = 10.0
    # Prefill: how long vLLM's scheduler waits for a Publish (its loop waits with it). A sidecar that
    # has not answered by then gets no publishes until it answers again; those requests return no
    # transfer params and their decode engines compute them.
    publish_timeout_s: float = 2.0
    # Prefill of a sliding-window model: the window start of a published request is a multiple of this
    # many tokens (0: the engine's block size), so that a decode engine whose block size divides it
    # fills only whole blocks; that engine computes up to this many prompt tokens itself. Set it to a
    # multiple of every decode block size this engine serves (docs/vllm.md, "Sliding-window models").
    window_alignment: int = 0
    # Decode: send a step's pulls in PullBatch calls over the engine lane instead of one Pull call each.
    # Each still fails alone and is done when its own outcome arrives. Under load on 4x H100, staged
    # pulls 1.4-2.3x the pulls/s and same-node pulls 1.4-1.9x (docs/benchmarks.md, "Issue 32:
    # PullBatch", "a PullBatch's staged members as one unit"); through vLLM on the CPU machine (host-nixl)
    # the same as single pulls.
    pull_batch: bool = True
    # The most pulls in one PullBatch call: a larger step goes in several. The decode sidecar's
    # max_pull_batch (256 by default) must be at least this.
    pull_batch_max: int = 64

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConnectorConfigError(
                f"{CONFIG_KEY}: unknown key(s) {unknown} for KVSidecarConnector; known keys are {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            values[name] = _coerce(name, value, type(default))
        config = cls(**values)
        config.validate()
        return config

    def socket_for(self, rank: int) -> str:
        """TP rank `rank`'s sidecar socket: `sidecar_socket`, with `{rank}` filled in where each rank has
        a sidecar of its own (docs/vllm.md). The scheduler's is rank 0's: the engine's leader sidecar."""
        return self.sidecar_socket.replace(RANK_FIELD, str(rank))

    def validate(self) -> None:
        if not self.sidecar_socket:
            raise ConnectorConfigError(f"{CONFIG_KEY}.sidecar_socket must not be empty")
        if RANK_FIELD in self.sidecar_socket and not self.leader_address:
            raise ConnectorConfigError(
                f"{CONFIG_KEY}.sidecar_socket {self.sidecar_socket!r} gives each TP rank a sidecar of its own, "
                f"which needs {CONFIG_KEY}.leader_address: the peer address (host:port) of rank 0's sidecar, "
                "which the other ranks' sidecars report to (docs/multinode.md)"
            )
        for name in ("keepalive_interval_s", "pull_timeout_s", "connect_timeout_s", "publish_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConnectorConfigError(f"{CONFIG_KEY}.{name} must be positive, got {getattr(self, name)}")
        if self.window_alignment < 0:
            raise ConnectorConfigError(
                f"{CONFIG_KEY}.window_alignment must be >= 0, got {self.window_alignment}"
            )
        if self.lease_ms < 0:
            raise ConnectorConfigError(f"{CONFIG_KEY}.lease_ms must be >= 0, got {self.lease_ms}")
        if self.lease_ms and self.keepalive_interval_s * 1000 >= self.lease_ms:
            raise ConnectorConfigError(
                f"{CONFIG_KEY}.keepalive_interval_s ({self.keepalive_interval_s}) must be shorter than "
                f"lease_ms ({self.lease_ms} ms), or waiting requests lose their blocks"
            )
        if self.leader_address and ":" not in self.leader_address:
            raise ConnectorConfigError(
                f"{CONFIG_KEY}.leader_address must be host:port, got {self.leader_address!r}"
            )


def _coerce(name: str, value: Any, want: type) -> Any:
    """JSON gives ints for floats and nothing else; anything further off is a mistake worth naming."""
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, want) and not (want is int and isinstance(value, bool)):
        return value
    raise ConnectorConfigError(
        f"{CONFIG_KEY}.{name} must be a {want.__name__}, got {type(value).__name__} {value!r}"
    )


def wait_for_sidecar(client: SidecarClient, config: ConnectorConfig, socket: str) -> None:
    """Return once the sidecar answers on `client` (connected to `socket`); otherwise close it and fail the
    engine's start with a message naming the socket (the scheduler's and each worker's connection)."""
    try:
        client.wait_ready(config.connect_timeout_s)
    except KVSidecarError:
        client.close()
        raise RuntimeError(
            f"KVSidecarConnector: no kv-sidecar answers on {socket!r} "
            f"(waited {config.connect_timeout_s:g} s). Start `kv-sidecar serve --engine-socket "
            f"{socket}` on this node first, or set kv_connector_extra_config.sidecar_socket."
        ) from None
