"""`kv-sidecar serve`: run one sidecar until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import fields
from typing import Any

from kv_sidecar.config import ENV_PREFIX, ConfigError, Settings, load_settings


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the sidecar",
        description="Run the sidecar: engine API on a unix socket, peer API on TCP, Prometheus metrics over HTTP. "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> in the environment or as a key in --config; "
        "precedence: flags > environment > config file > defaults.",
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML file of settings (keys as the flags, with underscores)"
    )
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(
            flag,
            dest=f.name,
            type=type(f.default),
            default=None,
            metavar=f.name.upper(),
            help=f"{Settings.HELP[f.name]} (default: {f.default!r})",
        )
    p.set_defaults(func=run)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings({f.name: getattr(args, f.name) for f in fields(Settings)}, args.config)
    except ConfigError as e:
        print(f"kv-sidecar: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    from kv_sidecar.server.sidecar import Sidecar  # heavy imports (torch, NIXL) only when serving

    sidecar = Sidecar(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        sidecar.start()
    except Exception as e:
        logging.getLogger("kv_sidecar").error("could not start: %s", e)
        sidecar.stop(0)
        return 1
    # Machine-readable line for supervisors and tests that start us with port 0.
    print(
        f"kv-sidecar ready id={sidecar.sidecar_id} engine_socket={settings.engine_socket} "
        f"peer={sidecar.peer_address} metrics_port={sidecar.metrics_port}",
        flush=True,
    )
    stop.wait()
    sidecar.stop()
    return 0
