"""The two listeners a sidecar opens, and a front door of control shards too: the engine socket and
the peer port (server/adapters/servers.py, shards/front_door.py)."""

from __future__ import annotations

import os

import grpc

from kv_sidecar.security import PeerSecurity


def listen_engine_socket(server: grpc.Server, path: str) -> None:
    """The engine API on the unix socket `path`, in place of a stale one from a previous run."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    server.add_insecure_port(f"unix:{path}")


def listen_peer_port(server: grpc.Server, host: str, port: int, security: PeerSecurity) -> int:
    """The peer port, with TLS where configured; the port (the one given for 0). OSError if taken."""
    address = f"{host}:{port}"
    creds = security.server_credentials()
    bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound
