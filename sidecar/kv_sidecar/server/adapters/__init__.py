"""The adapters layer: all gRPC code (docs/architecture.md). Only the composition root wires it."""
