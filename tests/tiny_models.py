"""Tiny random-weight HF decoder models saved to disk, shared by the model tests."""

from __future__ import annotations

import zlib

import torch

TINY_DECODER = dict(  # small enough for CPU tests, with GQA (4 query heads over 2 KV heads)
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
)


def save_tiny_decoder(name: str, config_cls, model_cls, kwargs: dict, tmp_path_factory, random_norms: bool = True):
    """Builds model_cls(config_cls(**kwargs)) seeded by its name, saves it; returns (hf model, its folder).

    random_norms: random biases and norm weights, so that every parameter matters. The model never stops at EOS
    (pagedllm's side runs with ignore_eos)."""
    torch.manual_seed(zlib.crc32(name.encode()))
    hf = model_cls(config_cls(**kwargs)).eval()
    hf.generation_config.eos_token_id = None
    if random_norms:
        with torch.no_grad():
            for param_name, p in hf.named_parameters():
                if param_name.endswith("bias") or "norm" in param_name:
                    p.normal_(0.0 if param_name.endswith("bias") else 1.0, 0.1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return hf, str(path)


TINY_OPT = dict(  # OPT's own field names
    hidden_size=64,
    ffn_dim=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=320,
    max_position_embeddings=256,
    word_embed_proj_dim=64,
)

TINY_GPT2 = dict(n_embd=64, n_inner=96, n_layer=2, n_head=4, vocab_size=320, n_positions=256)

TINY_MHA = {k: v for k, v in TINY_DECODER.items() if k != "num_key_value_heads"}  # families without GQA

TINY_BLOOM = dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=320)

TINY_FALCON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320, ffn_hidden_size=96)
