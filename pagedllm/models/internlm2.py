"""InternLM2: the Llama architecture under other names (tok_embeddings, attention.wqkv/wo, feed_forward.w1/w3/w2,
attention_norm/ffn_norm, output) with q/k/v fused per KV group in wqkv ([kv_head, (q x group, k, v), head_dim]
rows: regrouped to q, k, v on load) and `bias` on wqkv and wo."""

from __future__ import annotations

import torch

from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.models.utils import head_dim_of, num_kv_heads_of

_RENAMES = [  # (InternLM2 fragment, Llama fragment)
    ("model.tok_embeddings.", "model.embed_tokens."),
    (".attention.wqkv.", ".self_attn.qkv_proj."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
]


def _rename(name: str) -> str:
    if name.startswith("output."):
        return "lm_head." + name[len("output.") :]
    for theirs, ours in _RENAMES:
        name = name.replace(theirs, ours)
    return name


class InternLM2Attention(LlamaAttention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "bias", False))
        return bias, bias


class InternLM2DecoderLayer(LlamaDecoderLayer):
    attention_cls = InternLM2Attention


class InternLM2Model(LlamaModel):
    layer_cls = InternLM2DecoderLayer


class InternLM2ForCausalLM(LlamaForCausalLM):
    model_cls = InternLM2Model
    rename = staticmethod(_rename)

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".self_attn.qkv_proj." not in name:
            return tensor
        config, rest = self.config, tensor.shape[1:]
        num_heads, num_kv = config.num_attention_heads, num_kv_heads_of(config)
        grouped = tensor.reshape(num_kv, num_heads // num_kv + 2, head_dim_of(config), *rest)
        q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
        return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])
