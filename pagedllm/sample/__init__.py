"""Token sampling: one vectorized pass over the batch with per-request parameters."""
