"""`kv-sidecar serve`: run one sidecar until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import signal
import sys
from dataclasses import fields
from typing import Any

from kv_sidecar.commands.signals import ShutdownSignals
from kv_sidecar.config import ENV_PREFIX, ConfigError, Settings, load_settings
from kv_sidecar.logs import configure_logging


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the sidecar",
        description="Run the sidecar: engine API on a unix socket, peer API on TCP, Prometheus metrics over HTTP. "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> in the environment or as a key in --config; "
        "precedence: flags > environment > config file > defaults.",
        epilog="Peer security: --tls-cert/--tls-key turn on TLS on the peer port and for calls to other "
        "sidecars; adding --tls-ca makes it mutual TLS (client certificates required and verified against "
        "the CA; --tls-client-auth none keeps server-side TLS only); --token-file requires a shared token on "
        "every peer call except grpc.health.v1 (Kubernetes gRPC probes cannot send one). Peers without "
        "the right token get UNAUTHENTICATED; certificate failures end the TLS handshake. "
        "Shutdown: the first SIGTERM/SIGINT drains (health NOT_SERVING, new RegisterRank/Publish/Pull and "
        "peer Handshake/OpenRead get UNAVAILABLE, in-flight pulls and served reads finish for up to "
        "--drain-timeout-s), then the sidecar exits 0 and removes its socket; a second signal skips the "
        "rest of the drain. SIGUSR1 prints every thread's stack to stderr and changes nothing else.",
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML file of settings (keys as the flags, with underscores)"
    )
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        choices = ("true", "false") if kind is bool else Settings.CHOICES.get(f.name)
        p.add_argument(
            flag,
            dest=f.name,
            type=str if kind is bool else kind,  # load_settings parses true/false
            default=None,
            metavar="{" + ",".join(choices) + "}" if choices else f.name.upper(),
            help=f"{Settings.HELP[f.name].replace('%', '%%')} (default: {f.default!r})",  # argparse formats it
        )
    p.set_defaults(func=run)


def freeze_startup_objects() -> int:
    """Take what the sidecar holds for its whole life (the imported modules: torch, NIXL, gRPC, ~180k
    objects) out of the garbage collector's full collections, which walk every object they track with
    the interpreter held: ~100 ms each, a pause for every pull in flight, once in a while under load
    (docs/benchmarks.md, 2026-11-28, "... the collector's pauses"). Frozen objects are still freed when
    nothing refers to them; only a cycle among them would never be, and at start-up there is no
    garbage to keep (a collection there finds none). Returns how many objects were frozen."""
    gc.freeze()
    return gc.get_freeze_count()


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings({f.name: getattr(args, f.name) for f in fields(Settings)}, args.config)
    except ConfigError as e:
        print(f"kv-sidecar: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, settings.transfer_log)
    from kv_sidecar.shards.children import die_with_front_door

    if not die_with_front_door():
        logging.getLogger("kv_sidecar").error("the front door that started this shard is gone: not starting")
        return 1
    if settings.control_shards > 1:  # a front door and its shards, each shard a sidecar of its own
        from kv_sidecar.shards.run import run_front_door

        return run_front_door(settings)
    from kv_sidecar.server.sidecar import Sidecar  # heavy imports (torch, NIXL) only when serving

    try:
        sidecar = Sidecar(settings)
    except ConfigError as e:
        print(f"kv-sidecar: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the engine socket or the peer port cannot be bound
        logging.getLogger("kv_sidecar").error("could not start: %s", e)
        return 1
    signals = ShutdownSignals(on_again=sidecar.drain.cut_short)  # a second signal: do not wait for the drain
    signals.install()
    # `kill -USR1`: every thread's stack to stderr, the sidecar going on. Written from the signal
    # handler itself, so it answers even while a C call holds the GIL (a hang is then diagnosable).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        sidecar.start()
    except Exception as e:
        logging.getLogger("kv_sidecar").error("could not start: %s", e)
        sidecar.stop(0)
        return 1
    frozen = freeze_startup_objects()
    logging.getLogger("kv_sidecar").info("%d start-up objects frozen out of full garbage collections", frozen)
    # Machine-readable line for supervisors and tests that start us with port 0.
    print(
        f"kv-sidecar ready id={sidecar.sidecar_id} engine_socket={settings.engine_socket} "
        f"peer={sidecar.peer_address} metrics_port={sidecar.metrics_port}",
        flush=True,
    )
    signals.wait()
    sidecar.drain_in_flight(settings.drain_timeout_s)
    # The drain already waited for the work that matters; what is left (event streams) gets 1 s.
    sidecar.stop(grace_s=1.0)
    return 0
