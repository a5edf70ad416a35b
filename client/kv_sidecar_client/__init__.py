"""Thin engine-side client for kv-sidecar. Needs grpcio and protobuf only."""

from kv_sidecar_client.client import (
    DEFAULT_SOCKET,
    BatchPull,
    EngineSpec,
    Event,
    EventStream,
    KVSidecarError,
    PullResult,
    SidecarClient,
    TensorHandle,
    TransferParams,
    params_from_json,
    params_to_json,
)
from kv_sidecar_client.session import Backoff, EngineSession

__all__ = [
    "DEFAULT_SOCKET",
    "Backoff",
    "BatchPull",
    "EngineSession",
    "EngineSpec",
    "Event",
    "EventStream",
    "KVSidecarError",
    "PullResult",
    "SidecarClient",
    "TensorHandle",
    "TransferParams",
    "params_from_json",
    "params_to_json",
]
__version__ = "0.1.0"
