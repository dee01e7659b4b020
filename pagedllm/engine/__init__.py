"""The engine: request state, scheduling, KV-cache blocks, the core step loop and output processing."""
