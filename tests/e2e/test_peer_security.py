"""Peer API security with real sidecar processes: TLS, mutual TLS, the shared token, message size limits.

Certificates are generated here (tests/e2e/certs.py). The mutual-TLS sidecars
share one certificate whose only name is `kv-sidecar-peer` and dial each other
by IP with --tls-server-name, as the Kubernetes component does.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess, together
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client._proto.kvsidecar.v1 import peer_pb2, peer_pb2_grpc, status_pb2

from .certs import CertAuthority, Issued
from .conftest import logged, metric, spec_dict

SPEC = EngineSpec.from_dict(spec_dict())
SERVER_NAME = "kv-sidecar-peer"
MAX_MESSAGE = 256 << 10
_ids = itertools.count()


@dataclass(frozen=True)
class Pki:
    ca: CertAuthority
    rogue_ca: CertAuthority
    local: Issued  # names 127.0.0.1: verified without a server-name override
    shared: Issued  # names only kv-sidecar-peer
    rogue: Issued  # same name, signed by another CA
    token: Path
    wrong_token: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = CertAuthority(d, "good"), CertAuthority(d, "rogue")
    token, wrong = d / "token", d / "wrong-token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    wrong.write_text("0123456789abcdef0123456789abcdeX\n")
    return Pki(
        ca=ca,
        rogue_ca=rogue_ca,
        local=ca.issue("local", dns=("localhost",), ips=("127.0.0.1",)),
        shared=ca.issue("shared", dns=(SERVER_NAME,)),
        rogue=rogue_ca.issue("rogue", dns=(SERVER_NAME,)),
        token=token,
        wrong_token=wrong,
    )


def _tls_flags(leaf: Issued, ca: Path, *extra: str) -> list[str]:
    return ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), "--tls-ca", str(ca), *extra]


def _stop_all(*sidecars: SidecarProcess) -> None:
    codes = [s.stop() for s in sidecars]
    assert codes == [0] * len(sidecars), codes


@pytest.fixture(scope="module")
def tls_pair(pki: Pki) -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    """Server-side TLS only (no client certificates), and a small message size limit."""
    flags = _tls_flags(pki.local, pki.ca.ca_file, "--tls-client-auth", "none")
    flags += ["--max-message-bytes", str(MAX_MESSAGE)]
    a, b = together(
        lambda: SidecarProcess("tls-prefill", extra=flags), lambda: SidecarProcess("tls-decode", extra=flags)
    )
    yield a, b
    _stop_all(a, b)


@dataclass
class MtlsGroup:
    prefill: SidecarProcess  # mutual TLS + token
    decode: SidecarProcess  # same credentials
    wrong_token: SidecarProcess  # valid certificate, wrong token
    rogue: SidecarProcess  # right token, certificate and trust from another CA


@pytest.fixture(scope="module")
def mtls(pki: Pki) -> Iterator[MtlsGroup]:
    good = _tls_flags(pki.shared, pki.ca.ca_file, "--tls-server-name", SERVER_NAME)
    rogue = _tls_flags(pki.rogue, pki.rogue_ca.ca_file, "--tls-server-name", SERVER_NAME)
    group = MtlsGroup(
        *together(
            lambda: SidecarProcess("mtls-prefill", extra=[*good, "--token-file", str(pki.token)]),
            lambda: SidecarProcess("mtls-decode", extra=[*good, "--token-file", str(pki.token)]),
            lambda: SidecarProcess("mtls-wrong-token", extra=[*good, "--token-file", str(pki.wrong_token)]),
            lambda: SidecarProcess("mtls-rogue", extra=[*rogue, "--token-file", str(pki.token)]),
        )
    )
    yield group
    _stop_all(group.prefill, group.decode, group.wrong_token, group.rogue)


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start EngineProcesses on demand; all are stopped after the test."""
    started: list[EngineProcess] = []

    def start(sidecar: SidecarProcess, name: str) -> EngineProcess:
        e = EngineProcess(sidecar.socket, f"{name}-{next(_ids)}", SPEC)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def _publish(prefill: EngineProcess, src: list[int], tokens: int) -> dict[str, Any]:
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": f"sec-{next(_ids)}",
            "block_ids": src,
            "num_tokens": tokens,
            "seed": 5,
        }
    )
    assert pub["ok"], pub
    return pub["params"]


def _pull(decode: EngineProcess, params: dict[str, Any], dst: list[int]) -> dict[str, Any]:
    return decode.send({"cmd": "pull", "params": params, "block_ids": dst, "seed": 5})


def _assert_transfers(prefill: EngineProcess, decode: EngineProcess) -> None:
    res = _pull(decode, _publish(prefill, [3, 9, 4], 40), [20, 2, 33])
    assert res["ok"], res
    assert res["verified"], res["errors"]
    assert res["path"] == "host-nixl"
    assert res["bytes"] == 3 * 2 * 2 * 16 * 4 * 16 * 2  # blocks x layers x K/V x tokens x heads x dim x fp16


def _channel(
    sidecar: SidecarProcess, creds: grpc.ChannelCredentials | None, server_name: str = SERVER_NAME
) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(sidecar.peer_address)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(sidecar.peer_address, creds, options=options)


def _creds(ca: Path, leaf: Issued | None = None) -> grpc.ChannelCredentials:
    key, cert = (leaf.key.read_bytes(), leaf.cert.read_bytes()) if leaf else (None, None)
    return grpc.ssl_channel_credentials(ca.read_bytes(), private_key=key, certificate_chain=cert)


def _health(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _peer_status(ch: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> status_pb2.StatusResponse:
    return peer_pb2_grpc.PeerServiceStub(ch).Status(status_pb2.StatusRequest(), timeout=10, metadata=metadata)


def _rpc_error(fn: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# --------------------------------------------------------------------------- TLS only


def test_tls_pair_transfers_bytes(tls_pair: tuple[SidecarProcess, SidecarProcess], pki: Pki, engines) -> None:
    a, b = tls_pair
    _assert_transfers(engines(a, "tls-p"), engines(b, "tls-d"))
    # Server-side TLS only: a client without a certificate is served; plaintext is not.
    with _channel(a, _creds(pki.ca.ca_file), server_name="") as ch:
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        assert _peer_status(ch).peer_security == "tls"
    with _channel(a, None) as ch:
        assert _rpc_error(lambda: _health(ch)).code() == grpc.StatusCode.UNAVAILABLE


def test_message_over_the_limit_is_resource_exhausted(
    tls_pair: tuple[SidecarProcess, SidecarProcess], pki: Pki, engines
) -> None:
    a, b = tls_pair
    too_many = list(range(MAX_MESSAGE // 2))  # > 2 bytes per packed varint: over the limit
    with SidecarClient(a.socket) as client:
        with pytest.raises(KVSidecarError) as info:
            client.publish("any-engine", "huge", too_many, len(too_many))
        assert info.value.code == "RESOURCE_EXHAUSTED", info.value
        assert str(MAX_MESSAGE) in info.value.message
    with _channel(a, _creds(pki.ca.ca_file), server_name="") as ch:
        err = _rpc_error(
            lambda: peer_pb2_grpc.PeerServiceStub(ch).OpenRead(
                peer_pb2.OpenReadRequest(engine_id="x", request_id="y", reader_ranks=too_many), timeout=10
            )
        )
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
    _assert_transfers(engines(a, "size-p"), engines(b, "size-d"))  # still serving


# --------------------------------------------------------------------------- mutual TLS + token


def test_mtls_pair_with_the_right_token_transfers(mtls: MtlsGroup, pki: Pki, engines) -> None:
    _assert_transfers(engines(mtls.prefill, "mtls-p"), engines(mtls.decode, "mtls-d"))
    with _channel(mtls.prefill, _creds(pki.ca.ca_file, pki.shared)) as ch:
        token = pki.token.read_text().strip()
        st = _peer_status(ch, (("authorization", f"Bearer {token}"),))
    assert st.peer_security == "mtls+token"
    assert any(p.direction == "incoming" and p.sidecar_id == mtls.decode.sidecar_id for p in st.peers)


def test_client_without_a_valid_certificate_is_refused(mtls: MtlsGroup, pki: Pki) -> None:
    p = mtls.prefill
    cases = {
        "plaintext": None,
        "no client certificate": _creds(pki.ca.ca_file),
        "certificate from another CA": _creds(pki.ca.ca_file, pki.rogue),
        "server not trusted": _creds(pki.rogue_ca.ca_file, pki.shared),
    }
    for what, creds in cases.items():
        with _channel(p, creds) as ch:
            err = _rpc_error(lambda ch=ch: _health(ch))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (what, err)
    # The TLS layer refuses before any RPC exists; grpc core logs it on the server's stderr.
    log = "\n".join(p.stderr_tail)
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log and "CERTIFICATE_VERIFY_FAILED" in log, log[-3000:]


def test_missing_or_wrong_token_is_unauthenticated_but_health_is_open(mtls: MtlsGroup, pki: Pki) -> None:
    p = mtls.prefill
    labels = '{reason="peer_token_%s"}'
    before = {r: metric(p.metrics_port, "kvsidecar_failures_total", labels % r) for r in ("missing", "wrong")}
    with _channel(p, _creds(pki.ca.ca_file, pki.shared)) as ch:
        # Kubernetes gRPC probes cannot send metadata: health needs no token.
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        for metadata, reason in (
            ((), "missing"),
            ((("authorization", "Bearer not-the-token"),), "wrong"),
            ((("authorization", pki.token.read_text().strip()),), "wrong"),  # no Bearer scheme
        ):
            err = _rpc_error(lambda md=metadata: _peer_status(ch, md))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            assert f"peer token {reason}" in err.details()
        err = _rpc_error(
            lambda: peer_pb2_grpc.PeerServiceStub(ch).Handshake(peer_pb2.HandshakeRequest(), timeout=10)
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    after = {r: metric(p.metrics_port, "kvsidecar_failures_total", labels % r) for r in ("missing", "wrong")}
    assert after["missing"] == before["missing"] + 2  # Status and Handshake
    assert after["wrong"] == before["wrong"] + 2
    assert logged(p, "refused /kvsidecar.v1.PeerService/Handshake"), "\n".join(p.stderr_tail)


def test_pull_through_a_sidecar_with_the_wrong_token_fails_clearly(mtls: MtlsGroup, engines) -> None:
    prefill = engines(mtls.prefill, "tok-p")
    decode = engines(mtls.wrong_token, "tok-d")
    res = _pull(decode, _publish(prefill, [1, 2], 20), [7, 8])
    assert (res["ok"], res["error_code"]) == (False, "UNAUTHENTICATED"), res
    assert f"peer sidecar {mtls.prefill.peer_address} refused the handshake" in res["error"]
    assert "peer token wrong" in res["error"]
    assert res["unfilled_blocks"] == [7, 8]
    assert res["verified"], res["errors"]  # nothing outside was touched


def test_pull_through_a_sidecar_with_a_foreign_ca_fails_clearly(mtls: MtlsGroup, engines) -> None:
    prefill = engines(mtls.prefill, "ca-p")
    decode = engines(mtls.rogue, "ca-d")
    res = _pull(decode, _publish(prefill, [5], 10), [6])
    assert (res["ok"], res["error_code"]) == (False, "UNAUTHENTICATED"), res
    assert f"TLS handshake with peer sidecar {mtls.prefill.peer_address} failed" in res["error"]
    assert "CERTIFICATE_VERIFY_FAILED" in res["error"]


def test_status_command_through_a_secured_peer_port(mtls: MtlsGroup, pki: Pki) -> None:
    def status(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kv_sidecar", "status", "--peer", mtls.prefill.peer_address, "--json"]
        argv += ["--tls-cert", str(pki.shared.cert), "--tls-key", str(pki.shared.key)]
        argv += ["--tls-ca", str(pki.ca.ca_file), "--tls-server-name", SERVER_NAME, *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KV_SIDECAR_")}
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)

    out = status("--token-file", str(pki.token))
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert (st["sidecar_id"], st["peer_security"]) == (mtls.prefill.sidecar_id, "mtls+token")
    out = status()
    assert out.returncode == 1 and "UNAUTHENTICATED: peer token missing" in out.stderr, out
