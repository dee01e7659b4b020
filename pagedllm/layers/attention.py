"""The attention layer of a model: hands q/k/v and its own KV cache to the runner's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.forward_context import get_attn_metadata


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, num_kv_heads, head_dim], bound later
        self.backend = None  # module with forward(q, k, v, kv_cache, meta, scale, sliding_window), bound later

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim] -> same shape as q."""
        n = q.shape[0]
        out = self.backend.forward(
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            get_attn_metadata(),
            self.scale,
            self.sliding_window,
        )
        return out.reshape(n, self.num_heads * self.head_dim)
