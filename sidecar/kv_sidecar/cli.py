"""`kv-sidecar` command line: one subcommand per module in kv_sidecar.commands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kv_sidecar import __version__

# Imported lazily so that `kv-sidecar plan --help` does not load NIXL or torch.
SUBCOMMANDS = ("serve", "status", "plan", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-sidecar",
        description="Per-node sidecar that moves LLM KV-cache blocks between inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kv-sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"kv_sidecar.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
