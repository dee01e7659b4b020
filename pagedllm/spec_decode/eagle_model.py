"""EAGLE draft heads in the checkpoint layouts of the EAGLE project, as vLLM loads them.

EAGLE (EAGLE-1/2, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` [H, 2H] (with an optional bias) over
concat(embed(token), target hidden), then Llama decoder layers (`layers.N.*`; layer 0 without its input norm) and no
final norm; the output feeds the target's LM head and, as the hidden state, the next draft step. The target's
embed_tokens and lm_head are shared (the checkpoint's copies, if any, are not used).

EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` [H, 3 * target H] over three of the target's hidden states
(the residual stream entering layers `eagle_aux_hidden_state_layer_ids`, default (2, L // 2, L - 3)), one decoder
layer `midlayer` whose attention reads concat(input_layernorm(embed), hidden_norm(hidden)) [2H], a final `norm`, its
own `lm_head` over a reduced draft vocabulary and `d2t`: target id = draft id + d2t[draft id]. The normed output
gives the logits, the output before the norm feeds the next draft step. embed_tokens is the target's unless the
checkpoint has its own."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.kernels import greedy_tokens
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.llama import LlamaDecoderLayer
from pagedllm.models.utils import head_dim_of, load_weights, norm_eps_of


def aux_layer_ids(draft_config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states an EAGLE-3 head reads (vLLM's rule and config keys)."""
    eagle_config = getattr(draft_config, "eagle_config", None) or {}
    ids = getattr(draft_config, "eagle_aux_hidden_state_layer_ids", None) or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"speculative_config model: eagle_aux_hidden_state_layer_ids={list(ids)} must be 3 different layers "
            f"of the target's {num_target_layers} (set them in the head's config.json for a shallow target)"
        )
    return ids


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """The EAGLE-3 layer: attention over concat(input_layernorm(embeds), hidden_norm(hidden)) [n, 2H]; the residual
    is the hidden state before (or, with norm_before_residual, after) hidden_norm."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        attn = self.self_attn
        bias = bool(getattr(config, "attention_bias", False))
        heads, kv_heads = attn.qkv_proj.total_num_heads, attn.qkv_proj.total_num_kv_heads
        attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, attn.head_dim, heads, kv_heads, bias)
        self.hidden_norm = RMSNorm(config.hidden_size, norm_eps_of(config))
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, rope, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(rope, torch.cat([self.input_layernorm(embeds), normed], dim=-1))  # [n, H]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    """forward(input_ids [n], positions [n], hidden [n, H]) -> (hidden for the logits [n, H], hidden for the next
    step [n, H]); combine(target features) -> hidden [n, H]; draft_tokens(hidden [n, H]) -> target token ids [n]."""

    def __init__(self, config, eagle3: bool, target_hidden_size: int, max_position: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.config, self.eagle3 = config, eagle3
        self.embed_tokens: nn.Module | None = None  # the target's, or (EAGLE-3) the checkpoint's when it has one
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), max_position, *rope_parameters(config))
        if eagle3:
            self.fc = ReplicatedLinear(3 * target_hidden_size, h, bias=False)
            self.layers = nn.ModuleList(
                [Eagle3DecoderLayer(config, 0)]
                + [LlamaDecoderLayer(config, i) for i in range(1, config.num_hidden_layers)]
            )
            self.norm = RMSNorm(h, norm_eps_of(config))
            self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head = ParallelLMHead(self.draft_vocab_size, h)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))  # [draft vocab]
        else:
            self.fc = ReplicatedLinear(2 * h, h, bias=True)  # (EAGLE-1 checkpoints have the bias, vLLM's none: 0)
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.layers[0].input_layernorm = nn.Identity()
            self.lm_head = None  # the target's

    def share(self, target_embedding: nn.Module, target_head: nn.Module) -> None:
        """The target's embed_tokens (unless the checkpoint had one, EAGLE-3) and lm_head (EAGLE: always)."""
        if self.embed_tokens is None:
            self.embed_tokens = target_embedding
        if self.lm_head is None:
            self.lm_head = target_head

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features for this head: EAGLE-3's three hidden states [n, 3 * target H] through fc; EAGLE's
        last hidden state [n, H] as it is."""
        return self.fc(features) if self.eagle3 else features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
        embeds = self.embed_tokens(input_ids)  # [n, H]
        rope = self.rotary_emb(positions, embeds.dtype)
        if self.eagle3:
            x, residual = self.layers[0](rope, embeds, hidden)
            for layer in self.layers[1:]:
                x, residual = layer(rope, x, residual)
            return self.norm(x, residual)
        x, residual = self.fc(torch.cat([embeds, hidden], dim=-1)), None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        x = x + residual
        return x, x

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) [n] from hidden [n, H]."""
        best = greedy_tokens(self.lm_head.compute_logits(hidden))
        return best + self.d2t[best] if self.eagle3 else best

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        eagle1_ignore = ("embed_tokens.", "lm_head.", "layers.0.input_layernorm.")  # the target's / none
        ignore = ("t2d", "rotary_emb.inv_freq") + (() if self.eagle3 else eagle1_ignore)
        loaded = load_weights(self, self._renamed(weights), ignore=ignore)
        if not self.eagle3 and "fc.bias" not in loaded:
            self.fc.bias.data.zero_()  # vLLM's layout: no bias
            loaded.add("fc.bias")
        if self.eagle3 and "lm_head.weight" not in loaded and self.draft_vocab_size == self.config.vocab_size:
            self.lm_head, loaded = None, loaded | {"lm_head.weight"}  # the target's
        return loaded | ({"embed_tokens.weight"} if self.embed_tokens is not None else set())

    def _renamed(self, weights):
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "d2t":
                self.d2t.copy_(tensor)
                continue
            if name == "embed_tokens.weight" and self.eagle3:  # its own embedding
                weight = self.fc.weight
                embedding = VocabParallelEmbedding(self.config.vocab_size, self.config.hidden_size, parallel=False)
                self.embed_tokens = embedding.to(device=weight.device, dtype=weight.dtype)
                self.embed_tokens.weight.data.copy_(tensor)
                continue
            yield name, tensor
