"""`kv-sidecar` subcommands; each module has `add_parser(subparsers)` setting `func`."""
