"""LongRoPE's tables against HF's: the short factors while every position is within
original_max_position_embeddings, the long ones for the whole forward once one position is beyond."""

from __future__ import annotations

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.layers.rotary_embedding import RotaryEmbedding


def test_longrope_short_and_long_tables():
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.25 * i for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)],
    }
    config = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=32,
        rope_scaling=scaling,
        pad_token_id=0,
    )
    params = dict(config.rope_parameters)
    params.setdefault("original_max_position_embeddings", 32)
    params["max_position_embeddings"] = 256
    rope = RotaryEmbedding(16, 256, float(params["rope_theta"]), params)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    for positions, seq_len in ((torch.arange(0, 20), 20), (torch.tensor([3, 31, 40]), 41)):
        inv_freq, scale = init(config, None, seq_len=seq_len)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [n, 8]
        cos, sin = rope(positions, torch.float32)
        torch.testing.assert_close(cos[:, 0], freqs.cos() * scale)
        torch.testing.assert_close(sin[:, 0], freqs.sin() * scale)
    assert scale > 1.0  # the attention factor is in play
