"""Settings precedence and validation, peer-security settings, and the serve/status help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kv_sidecar.cli import build_parser
from kv_sidecar.config import ConfigError, Settings, load_settings
from kv_sidecar.security import PeerSecurity

from .e2e.certs import CertAuthority


def test_precedence_flags_env_yaml_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("drain_timeout_s: 7\nlog_format: json\npeer_port: 1\nlease_ms: 5\n")
    env = {"KV_SIDECAR_DRAIN_TIMEOUT_S": "2.5", "KV_SIDECAR_PEER_PORT": "2"}
    s = load_settings({"peer_port": 3, "log_format": None}, str(cfg), env)
    assert (s.peer_port, s.drain_timeout_s, s.log_format, s.lease_ms) == (3, 2.5, "json", 5)
    assert load_settings({}, None, {}).drain_timeout_s == Settings.drain_timeout_s


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("log_format", "xml", "log_format must be one of text, json; got 'xml'"),
        ("tls_client_auth", "optional", "tls_client_auth must be one of require, none"),
        ("drain_timeout_s", "soon", "drain_timeout_s must be a number, got 'soon'"),
        ("engine_lane", "maybe", "engine_lane must be true or false, got 'maybe'"),
        ("device_workers", "sometimes", "device_workers must be one of auto, true, false; got 'sometimes'"),
        ("engine_workers", "4", "engine_workers must be at least 8, got 4"),
        ("nixl_quiet_poll_ms", "0", "nixl_quiet_poll_ms must be at least 1, got 0"),
        ("nixl_lone_poll_us", "-5", "nixl_lone_poll_us must be at least 0, got -5"),
        ("open_answer_wait_us", "-1", "open_answer_wait_us must be at least 0, got -1"),
    ],
)
def test_invalid_values_are_named(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings({}, None, {f"KV_SIDECAR_{key.upper()}": value})


def test_a_bool_setting_reads_true_and_false_from_any_source(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("engine_lane: false\n")
    assert load_settings({}, str(cfg), {}).engine_lane is False  # YAML's own bool
    assert load_settings({}, None, {"KV_SIDECAR_ENGINE_LANE": "0"}).engine_lane is False
    assert load_settings({"engine_lane": "False"}, None, {"KV_SIDECAR_ENGINE_LANE": "0"}).engine_lane is False
    assert load_settings({"engine_lane": "yes"}, str(cfg), {}).engine_lane is True
    assert load_settings({}, None, {}).engine_lane is True


def test_device_workers_reads_auto_or_a_bool_from_any_source(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("device_workers: true\n")
    assert load_settings({}, None, {}).device_workers == "false"
    assert load_settings({}, str(cfg), {}).device_workers == "true"  # YAML's own bool
    assert load_settings({}, None, {"KV_SIDECAR_DEVICE_WORKERS": "0"}).device_workers == "false"
    assert load_settings({"device_workers": "AUTO"}, str(cfg), {}).device_workers == "auto"
    assert load_settings({"device_workers": "on"}, None, {}).device_workers == "true"


def _security(**over: str) -> PeerSecurity:
    return PeerSecurity.from_settings(load_settings(over, None, {}))


def test_peer_security_modes(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path, "unit")
    leaf = ca.issue("leaf", dns=("kv-sidecar-peer",))
    token = tmp_path / "token"
    token.write_text("  t0ken\n")
    tls = {"tls_cert": str(leaf.cert), "tls_key": str(leaf.key)}
    assert _security().describe() == "plaintext"
    assert _security(token_file=str(token)).call_metadata() == (("authorization", "Bearer t0ken"),)
    assert _security(**tls).describe() == "tls"
    assert _security(**tls, tls_ca=str(ca.ca_file)).describe() == "mtls"
    assert _security(**tls, tls_ca=str(ca.ca_file), tls_client_auth="none").describe() == "tls"
    assert _security(**tls, tls_ca=str(ca.ca_file), token_file=str(token)).describe() == "mtls+token"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"tls_cert": "x.crt"}, "tls_cert and tls_key must be set together"),
        ({"tls_ca": "ca.crt"}, "tls_ca needs tls_cert and tls_key"),
        ({"token_file": "/nonexistent/token"}, "cannot read token_file /nonexistent/token"),
        ({"tls_cert": "/nonexistent/c", "tls_key": "/nonexistent/k"}, "cannot read tls_cert"),
    ],
)
def test_peer_security_misconfiguration(over: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _security(**over)


def test_empty_or_multiword_token_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    for text, message in (("\n", "is empty"), ("two words", "one printable ASCII word")):
        token.write_text(text)
        with pytest.raises(ConfigError, match=message):
            _security(token_file=str(token))


def test_serve_refuses_bad_security_settings_before_starting(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kv_sidecar",
            "serve",
            "--engine-socket",
            str(tmp_path / "s.sock"),
            "--tls-ca",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert "tls_ca needs tls_cert and tls_key" in out.stderr
    assert not (tmp_path / "s.sock").exists()


def _help(*argv: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])


def test_help_names_the_new_flags(capsys: pytest.CaptureFixture[str]) -> None:
    _help("serve")
    text = capsys.readouterr().out
    for flag in (
        "--tls-client-auth {require,none}",
        "--tls-server-name",
        "--drain-timeout-s",
        "--log-format {text,json}",
        "--device-workers {auto,true,false}",
    ):
        assert flag in text, flag
    assert "grpc.health.v1" in text and "UNAUTHENTICATED" in text and "drains" in text
    _help("status")
    text = capsys.readouterr().out
    for flag in ("--engine-socket", "--peer HOST:PORT", "--json", "--token-file", "--tls-server-name"):
        assert flag in text, flag
