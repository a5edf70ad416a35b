"""The data plane: each device's memory, rings and byte moves, behind plain-data jobs (docs/architecture.md)."""
