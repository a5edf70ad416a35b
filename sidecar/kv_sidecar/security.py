"""Peer API security: TLS / mutual TLS through grpc credentials, and a shared token.

Importable without torch or NIXL (`kv-sidecar status` uses it to reach a peer port).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kv_sidecar.config import ConfigError, Settings

log = logging.getLogger(__name__)

TOKEN_KEY = "authorization"  # metadata key; value "Bearer <token>"
# Kubernetes gRPC probes send no metadata, so health is answered without the token.
TOKEN_EXEMPT = ("/grpc.health.v1.Health/",)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class PeerSecurity:
    """What the peer port demands and what this sidecar presents to other sidecars."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    client_auth: bool = False
    server_name: str = ""
    token: bytes | None = None

    @classmethod
    def from_settings(cls, s: Settings) -> PeerSecurity:
        if bool(s.tls_cert) != bool(s.tls_key):
            raise ConfigError("tls_cert and tls_key must be set together")
        if s.tls_ca and not s.tls_cert:
            raise ConfigError("tls_ca needs tls_cert and tls_key: every sidecar is a TLS server too")
        token = None
        if s.token_file:
            token = _read(s.token_file, "token_file").strip()
            if not token:
                raise ConfigError(f"token_file {s.token_file} is empty")
            if any(b < 0x21 or b > 0x7E for b in token):
                raise ConfigError(f"token_file {s.token_file} must hold one printable ASCII word")
        if not s.tls_cert:
            return cls(token=token, server_name=s.tls_server_name)
        return cls(
            cert=_read(s.tls_cert, "tls_cert"),
            key=_read(s.tls_key, "tls_key"),
            ca=_read(s.tls_ca, "tls_ca") if s.tls_ca else None,
            client_auth=bool(s.tls_ca) and s.tls_client_auth.lower() == "require",
            server_name=s.tls_server_name,
            token=token,
        )

    @property
    def tls(self) -> bool:
        return self.cert is not None

    def describe(self) -> str:
        mode = "mtls" if self.client_auth else "tls" if self.tls else "plaintext"
        return mode + ("+token" if self.token else "")

    # -- server side ----------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        assert self.key is not None and self.cert is not None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if self.client_auth else None,
            require_client_auth=self.client_auth,
        )

    def interceptors(self, on_refused: Callable[[str, str, str], None]) -> list[grpc.ServerInterceptor]:
        return [TokenCheck(self.token, on_refused)] if self.token else []

    # -- client side (this sidecar calling another) ----------------------------
    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(address, creds, options=options)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_KEY, "Bearer " + self.token.decode()),) if self.token else ()


def _digest(value: bytes) -> bytes:
    # Comparing fixed-length digests keeps the token's length out of the timing too.
    return hashlib.sha256(value).digest()


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every peer call without the shared token with UNAUTHENTICATED (health is exempt)."""

    def __init__(self, token: bytes, on_refused: Callable[[str, str, str], None]) -> None:
        self._expected = _digest(token)
        self._on_refused = on_refused  # (method, peer, reason) -> None

    def _reason(self, metadata: Any) -> str | None:
        values = [v for k, v in metadata or () if k == TOKEN_KEY]
        if not values:
            return "missing"
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        scheme, _, supplied = value.partition(" ")
        ok = hmac.compare_digest(_digest(supplied.encode()), self._expected)
        return None if ok and scheme == "Bearer" and len(values) == 1 else "wrong"

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(TOKEN_EXEMPT):
            return handler
        reason = self._reason(details.invocation_metadata)
        if reason is None:
            return handler
        method = details.method

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            self._on_refused(method, context.peer(), reason)
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"peer token {reason}: this sidecar requires the shared peer token "
                "(token_file) on every call",
            )

        return refusing_handler(handler, refuse)


def refusing_handler(handler: grpc.RpcMethodHandler, refuse: Callable[[Any, Any], Any]) -> Any:
    """A handler of the same kind as `handler` whose behaviour is `refuse(request, context)`."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)
