"""Who this sidecar is to engines and peers: fixed by the composition root before anything serves."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from kv_sidecar.config import Settings

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class Identity:
    sidecar_id: str  # also the name of its NIXL agent
    peer_address: str  # host:port that peers (and a multi-node engine's members) dial

    def is_me(self, address: str) -> bool:
        """Whether `address` dials this sidecar: its advertised address, or a loopback address on its
        peer port (sidecars of one node name each other so, e.g. an engine's leader with a sidecar
        per GPU, docs/vllm.md)."""
        if address == self.peer_address:
            return True
        host, _, port = address.rpartition(":")
        return port == self.peer_address.rpartition(":")[2] and host.strip("[]") in _LOOPBACK


def sidecar_id(settings: Settings) -> str:
    return settings.sidecar_id or f"kvs-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def advertised_address(settings: Settings, peer_port: int) -> str:
    """advertise_address as given, or with our peer port where it is a bare host (e.g. the pod IP
    from the downward API); without it, the host we listen on (its name for a wildcard)."""
    adv = settings.advertise_address
    if ":" in adv.strip("[]") or (adv.startswith("[") and "]:" in adv):
        return adv
    host = settings.peer_host if settings.peer_host not in ("0.0.0.0", "::", "") else socket.gethostname()
    return f"{adv or host}:{peer_port}"
