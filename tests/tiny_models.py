"""Tiny random-weight HF decoder models saved to disk, shared by the model tests."""

from __future__ import annotations

import zlib

import numpy as np
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

TINY_MLA = dict(  # DeepSeek's multi-head latent attention, 8 routed experts of which 2 per token
    TINY_DECODER,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


def save_tiny_decoder(name: str, config_cls, model_cls, kwargs: dict, tmp_path_factory, random_norms: bool = True):
    """Builds model_cls(config_cls(**kwargs)) seeded by its name, saves it; returns (hf model, its folder).

    random_norms: random biases (DeepSeek-V3's router bias too) and norm weights, so that every parameter matters.
    The model never stops at EOS (pagedllm's side runs with ignore_eos)."""
    torch.manual_seed(zlib.crc32(name.encode()))
    hf = model_cls(config_cls(**kwargs)).eval()
    hf.generation_config.eos_token_id = None
    if random_norms:
        with torch.no_grad():
            for param_name, p in hf.named_parameters():
                if param_name.endswith("bias") or "norm" in param_name:
                    p.normal_(0.0 if param_name.endswith("bias") else 1.0, 0.1)
            for buffer_name, b in hf.named_buffers():  # DeepSeek-V3's router bias is a (saved) buffer
                if buffer_name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.1)
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


def as_internlm2_checkpoint(path: str) -> None:
    """Rewrites a saved HF Llama checkpoint in InternLM2's layout (its names, q/k/v fused per KV group in wqkv):
    the same model, so HF's Llama stays the oracle for an architecture transformers does not ship."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    weights = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for name, tensor in weights.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            q = tensor.reshape(kv_heads, heads // kv_heads, head_dim, -1)
            k = weights[name.replace("q_proj", "k_proj")].reshape(kv_heads, 1, head_dim, -1)
            v = weights[name.replace("q_proj", "v_proj")].reshape(kv_heads, 1, head_dim, -1)
            tensor = torch.cat([q, k, v], dim=1).reshape(-1, tensor.shape[-1])  # [kv_head, (q..., k, v), head_dim]
            name = name.replace(".self_attn.q_proj.", ".attention.wqkv.")
        for llama, internlm2 in (
            ("model.embed_tokens.", "model.tok_embeddings."),
            (".self_attn.o_proj.", ".attention.wo."),
            (".mlp.gate_proj.", ".feed_forward.w1."),
            (".mlp.up_proj.", ".feed_forward.w3."),
            (".mlp.down_proj.", ".feed_forward.w2."),
            (".input_layernorm.", ".attention_norm."),
            (".post_attention_layernorm.", ".ffn_norm."),
            ("lm_head.", "output."),
        ):
            name = name.replace(llama, internlm2)
        out[name] = tensor.contiguous()
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.update(architectures=["InternLM2ForCausalLM"], bias=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def our_logits(llm, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through pagedllm's model and the runner's attention backend."""
    from pagedllm.attention.common import BatchLayout
    from pagedllm.forward_context import forward_context

    runner = llm.llm_engine.core.executor.runner
    n = len(ids)
    num_blocks = -(-n // runner.block_size)
    table = np.arange(num_blocks, dtype=np.int64)[None, :]
    dev = runner.device
    layout = BatchLayout(np.array([0, n]), np.array([n]), table, torch.arange(n, device=dev), runner.block_size, dev)
    with torch.inference_mode(), forward_context(runner.backend.build_metadata(layout)):
        hidden = runner.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev))
        return runner.model.compute_logits(hidden).cpu()


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and each one's logprob (float32 log-softmax of the step's logits)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs
