"""Attention backends: `torch_backend` (the reference, runs anywhere)."""
