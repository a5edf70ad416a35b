"""The gRPC services and the state behind them."""
