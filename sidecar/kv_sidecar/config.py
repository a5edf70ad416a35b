"""Sidecar settings. Precedence: command-line flags > KV_SIDECAR_* env > YAML file > defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import yaml

ENV_PREFIX = "KV_SIDECAR_"


@dataclass(frozen=True)
class Settings:
    engine_socket: str = "/run/kv-sidecar/engine.sock"
    engine_lane: bool = True
    peer_host: str = "0.0.0.0"
    peer_port: int = 50061
    metrics_port: int = 9464
    metrics_host: str = ""  # default: peer_host
    advertise_address: str = ""  # host:port peers dial; default <hostname>:<peer_port>
    staging_bytes: int = 256 << 20
    gpu_staging_bytes: int = 640 << 20
    gpu_staging_slots: int = 5
    gpu_staging_reserve: int = 1
    host_transfer: str = "read"
    host_read_merge: bool = False
    device_workers: str = "false"
    staged_workers: bool = False
    nixl_busy_poll_us: int = 20
    nixl_lone_poll_us: int = 5
    nixl_quiet_poll_ms: int = 50
    push_notifications: bool = True
    open_answer_wait_us: int = 2000
    reader_probe_ms: int = 500
    lease_ms: int = 30_000
    leader_wait_ms: int = 10_000
    member_refresh_ms: int = 2_000
    pull_timeout_ms: int = 30_000
    max_message_bytes: int = 64 << 20
    engine_workers: int = 256
    max_pull_batch: int = 256
    staged_group_reads: int = 64
    staged_batch_reads: bool = True
    log_level: str = "INFO"
    sidecar_id: str = ""  # default: a random id per process
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    token_file: str = ""
    tls_client_auth: str = "require"
    tls_server_name: str = ""
    drain_timeout_s: float = 25.0
    log_format: str = "text"
    transfer_log: str = "failed"
    control_shards: int = 1
    control_shard_gpus: str = ""  # default: contiguous groups
    control_shard_ranks: str = "whole"

    HELP = {
        "engine_socket": "unix socket path of the engine API",
        "engine_lane": "also serve Publish and Pull on <engine_socket>.lane, a plain unix socket that "
        "spares the engine a gRPC call's ~0.45 ms (clients use it when it is there)",
        "peer_host": "address the peer API listens on",
        "peer_port": "TCP port of the peer API (0 picks a free port)",
        "metrics_port": "Prometheus /metrics HTTP port (0 picks a free port, -1 disables)",
        "metrics_host": "address the /metrics endpoint listens on (empty: peer_host); a front door of "
        "control_shards gives its shards 127.0.0.1, where only it reads them",
        "advertise_address": "host or host:port other sidecars use to reach this one (bare host: the peer port is added)",
        "staging_bytes": "bytes of sidecar-owned host staging memory for layout/TP conversions",
        "gpu_staging_bytes": "bytes of GPU staging memory per GPU for cross-sidecar transfers "
        "(half a send ring, half a receive ring; allocated when the first GPU rank registers)",
        "gpu_staging_slots": "slots per staging ring, shared by every transfer on that GPU; a slot holds one "
        "chunk (gather, wire and scatter overlap across slots), so slot size = gpu_staging_bytes / 2 / slots",
        "gpu_staging_reserve": "slots of each staging ring that no one peer sidecar may hold: they stay free for "
        "the others, so that a peer that hangs or dies holding slots (until the pull's deadline, or 10 s "
        "after it was lost) does not stop every other peer's transfers; 0 lets one peer take the whole ring",
        "host_transfer": "host-memory pulls from another sidecar: read (NIXL READs into the engine or into "
        "host staging, converted here) or ring (the GPU staged protocol through host rings sized like the GPU "
        "ones; what CI uses to run it without GPUs)",
        "host_read_merge": "host-nixl READs post one descriptor per layer tensor for each run of block ids "
        "consecutive on both sides (lists built per pull), as vLLM's NixlConnector does, where that at least "
        "halves them; off: per-block descriptors from lists prepared once. Off by default: on one CPU host "
        "(UCX over shared memory) merged pulls measured slower (docs/benchmarks.md); for RDMA, unmeasured",
        "device_workers": "run each device's local copies (host-direct, gpu-direct) in a worker process of "
        "its own, so that one device's copies do not wait for the sidecar's one interpreter (GIL); a worker "
        "that dies fails its copies (UNAVAILABLE, naming the blocks) and is restarted. Staged and NIXL "
        "paths still run in the sidecar. true: every device's copies; auto: the GPU copies, where the "
        "sidecar sees at least 4 GPUs (two GPU pairs: 1.3-1.7x the GB/s at 64 MiB and 1.0-1.2x the "
        "pulls/s at 2 MiB of batches, while one pair alone loses 6-24 %). auto is for a sidecar that "
        "serves a node's engines: one that sees every GPU of the node but serves one pod's engine "
        "(deploy/k8s/base) would start a worker, ~1 GiB of GPU memory, per engine GPU for copies it never "
        'makes (docs/gpu.md, "Node scaling")',
        "staged_workers": "run each device's staged transfers (gpu-staged, host-ring: its rings, gathers, "
        "scatters, NIXL WRITEs and credits) in a worker process of its own with its own NIXL agent "
        "(<sidecar_id>/gpu<N>, <sidecar_id>/host), so that GPUs stop queuing on the sidecar's one "
        "interpreter; the sidecar keeps the control (checks, plans, Pushes, answers). Peers handshake the "
        "workers' agents; with a peer from before workers the transfer runs in the sidecar. A worker that "
        "dies fails its transfers (UNAVAILABLE, naming the blocks) and is restarted",
        "nixl_busy_poll_us": "while NIXL transfers are in flight, the NIXL thread polls them every this many "
        "microseconds, sleeping in between so that the sidecar's other threads get the GIL (0: spin)",
        "nixl_lone_poll_us": "while the NIXL thread's only staged transfer is one of several chunks (a large "
        "pull alone), it polls every this many microseconds instead of nixl_busy_poll_us: each chunk's "
        "hand-offs (gather done, WRITE done, its notification, the credit back) are heard sooner, at more "
        "of a core while it runs (0: spin)",
        "nixl_quiet_poll_ms": "once the NIXL thread has had nothing to do for a second, it polls every this many "
        "milliseconds (at least 1): an idle sidecar's CPU against how late it hears a notification nothing "
        "announced. A Publish while readers are about, a reader's Handshake or OpenRead, and a served read wake "
        "it at once",
        "push_notifications": "let readers send a staged Push, and an OpenRead, as a NIXL notification "
        "too, signed with a key given over an authenticated Handshake or Push call: a transfer starts "
        "~0.5 ms sooner, an open is answered by notification; while readers are recent (1 s) the NIXL "
        "thread then polls every 100 us (false: gRPC only, polls as before)",
        "open_answer_wait_us": "how long a reader waits for the answer to an OpenRead sent as a notification "
        "before it makes the call too and takes whichever answer comes first: longer spares the source "
        "duplicate opens where notifications are slow (a loaded host), shorter bounds what a lost one costs",
        "reader_probe_ms": "when an engine asks for a request that another engine's read holds, and that "
        "read did not fail here, how long this sidecar waits to learn whether the other reader's sidecar "
        "still runs, dialing its peer address (only where it resolves to the one host that reader's calls "
        "came from): a port that refuses, or another sidecar answering there, "
        "proves it gone and the asking engine takes the request over (a decode sidecar that died mid-read "
        "over host_transfer: read, whose one-sided READs the source never sees fail); no answer in time "
        "proves nothing. 0: never ask (a request stays its reader's until its lease ends). Set 0 where a "
        "firewall between sidecars rejects connections rather than dropping them",
        "lease_ms": "default lease of published blocks, in milliseconds",
        "leader_wait_ms": "how long a rank registering here under another sidecar's lead waits for that leader "
        "to hold a rank of the engine (an engine's ranks start together; the leader's may register second)",
        "member_refresh_ms": "how often a member sidecar of a multi-node engine reports its ranks to the "
        "engine's leader again unasked: a leader that forgot its map (it or its engine restarted) has it back "
        "within this time. A member reports at once whatever changes here (a rank, a worker replaced or ready)",
        "pull_timeout_ms": "default timeout of one pull, in milliseconds",
        "max_message_bytes": "largest gRPC message accepted or sent",
        "engine_workers": "threads serving the engine API (started on demand). Each open event stream (one "
        "per registered rank) holds one for its whole life; a quarter (at least 4) is kept for the other "
        "calls (register, publish, pull), so more streams than that are refused with RESOURCE_EXHAUSTED",
        "max_pull_batch": "most pulls one PullBatch call may carry (a decode engine's pulls of one step); "
        "its pulls from other sidecars wait side by side on up to engine_workers threads",
        "staged_group_reads": "most reads of other requests between the same two ranks that one staged "
        "transfer carries (gpu-staged, host-ring): those that wait while two such transfers run go as one "
        "next, their tokens concatenated; 1: every read its own transfer",
        "staged_batch_reads": "run a PullBatch's members as one unit on the call's thread where they wait "
        "for nothing but their bytes (copies on this node; one staged read from a sidecar already "
        "handshaken with): each member's checks and plan, then their moves together (copies launched "
        "together with one wait; staged reads one transfer per rank pair, one thread per pair), then "
        "their answers, instead of a thread per member (docs/gpu.md, Node scaling); off: members from "
        "other sidecars each on its own pool thread, copies one after another",
        "log_level": "log verbosity",
        "sidecar_id": "stable id of this sidecar (default: random per process)",
        "tls_cert": "PEM certificate chain of this sidecar: served on the peer port (enables TLS) "
        "and presented as client certificate to other sidecars",
        "tls_key": "PEM private key for tls_cert",
        "tls_ca": "PEM CA bundle that peers' certificates must chain to (empty: gRPC's default roots); "
        "with tls_client_auth=require the peer port demands client certificates (mutual TLS)",
        "token_file": "file holding the shared peer token: sent on every call to other sidecars, "
        "required on every peer call here except grpc.health.v1",
        "tls_client_auth": "require (mutual TLS when tls_ca is set) or none (server-side TLS only)",
        "tls_server_name": "name expected in peers' certificates (default: the host part of the dialed "
        "address); set it when every sidecar shares one certificate",
        "drain_timeout_s": "on SIGTERM, how long in-flight pulls and served reads may finish before exit",
        "log_format": "text (key=value) or json (one object per line)",
        "transfer_log": "which finished transfers get a log record (logger kv_sidecar.transfer): failed (those "
        "that did not succeed, at WARNING) or all (each pull and served read, at INFO when it succeeded). A "
        "busy node finishes thousands a second, which its metrics count; formatting a record each cost a "
        "loaded sidecar up to 1.25x the CPU a pull (docs/operations.md, 10)",
        "control_shards": "run the sidecar as this many sidecar processes (shards), each with its own "
        "interpreter, NIXL agent, engine socket (<engine_socket>.shard<K>) and peer port (peer_port+1+K; "
        "free ports for 0), behind a front door on engine_socket, peer_port (health) and metrics_port (every "
        "shard's metrics, labelled shard). An engine goes whole (unless control_shard_ranks spreads it) to "
        "one shard: that of its rank 0's GPU (the visible GPUs split into contiguous groups, or as "
        "control_shard_gpus says), a host engine by its client's placement key or else its engine id. Pulls "
        "between engines on one shard stay "
        "gpu-direct/host-direct; between shards they are staged. One process serves 3,000-6,000 pulls/s of "
        '2 MiB at most (a core): shards let a node past that (docs/operations.md, "Control shards"). 1: one '
        "process",
        "control_shard_gpus": "with control_shards: each shard's GPUs, by ordinal as this sidecar sees them, "
        "groups separated by ';' and GPUs by ',' (e.g. '0,4;1,5;2,6;3,7': each prefill GPU on a shard with "
        "the decode GPU it feeds, so that their pulls stay gpu-direct). One group per shard, every GPU in "
        "one. Empty: the GPUs in order, split into contiguous groups",
        "control_shard_ranks": "with control_shards: whole (an engine's ranks all on its rank 0's shard) or "
        "spread (each rank on its own GPU's shard, a host rank round robin from its rank 0's: a TP engine's "
        "ranks then pull and serve in processes of their own, as an engine across nodes, led by its rank 0's "
        "shard). Between engines of one node sidecar a decode rank copies the prefill ranks its shard holds "
        "and reads the others from their shards",
    }

    # Below these the sidecar cannot work: event streams would starve the engine API's other calls, an
    # idle NIXL thread would spin, a wait would be negative.
    MINIMA = {
        "engine_workers": 8,
        "max_pull_batch": 1,
        "staged_group_reads": 1,
        "nixl_quiet_poll_ms": 1,
        "nixl_busy_poll_us": 0,
        "nixl_lone_poll_us": 0,
        "open_answer_wait_us": 0,
        "reader_probe_ms": 0,
        "leader_wait_ms": 0,
        "member_refresh_ms": 100,
        "gpu_staging_reserve": 0,
        "control_shards": 1,
    }

    CHOICES = {
        "device_workers": ("auto", "true", "false"),
        "host_transfer": ("read", "ring"),
        "tls_client_auth": ("require", "none"),
        "log_format": ("text", "json"),
        "transfer_log": ("failed", "all"),
        "control_shard_ranks": ("whole", "spread"),
        "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    }

    def __post_init__(self) -> None:
        for name, least in self.MINIMA.items():
            if getattr(self, name) < least:
                raise ConfigError(f"{name} must be at least {least}, got {getattr(self, name)}")
        if self.control_shard_gpus.strip():
            from kv_sidecar.shards.placement import gpu_groups

            try:  # which GPUs there are is known only where it runs (shards/run.py checks that)
                gpu_groups(self.control_shard_gpus, self.control_shards)
            except ValueError as e:
                raise ConfigError(str(e)) from None


class ConfigError(ValueError):
    pass


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_SWITCHES = {"device_workers"}  # on, off or auto: written as a bool is, or "auto"


def _coerce(name: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in _TRUE | _FALSE:
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return text in _TRUE
    if kind is int:
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if kind is float:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
    text = str(value)
    if name in _SWITCHES:  # true or false as a bool takes, or auto
        text = text.strip().lower()
        if text in _TRUE | _FALSE:
            return "true" if text in _TRUE else "false"
    choices = Settings.CHOICES.get(name)
    if choices and text.upper() not in {c.upper() for c in choices}:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {text!r}")
    return text


def load_settings(
    flags: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    env = os.environ if env is None else env
    types = {f.name: type(f.default) for f in fields(Settings)}
    merged: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file) as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {config_file}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {config_file} must hold a mapping")
        unknown = sorted(set(data) - set(types))
        if unknown:
            raise ConfigError(f"unknown keys {unknown} in {config_file}; known: {sorted(types)}")
        merged.update(data)
    for name in types:
        if ENV_PREFIX + name.upper() in env:
            merged[name] = env[ENV_PREFIX + name.upper()]
    for name, value in (flags or {}).items():
        if value is not None and name in types:
            merged[name] = value
    return Settings(**{k: _coerce(k, v, types[k]) for k, v in merged.items()})
