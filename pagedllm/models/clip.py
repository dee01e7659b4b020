"""The CLIP vision tower (as LLaVA uses it): patch + class embeddings, pre-norm, bidirectional encoder layers. It
returns the hidden states after a chosen number of layers (LLaVA reads the second to last).

Under tensor parallelism the encoder layers shard as the LM's do: q/k/v column-parallel (one matmul, each rank its
heads), out_proj row-parallel, fc1 column- and fc2 row-parallel (one all-reduce each), so every rank ends with the
whole hidden states. A tower whose sizes do not split over the ranks is replicated instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from pagedllm.layers.build_context import sharded_if_divisible
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

CLIP_STACKED = [(".qkv_proj.", f".{p}_proj.", p) for p in "qkv"]  # the checkpoint's q/k/v -> qkv_proj's shards


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=False
        )
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [batch, num_patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1)  # [batch, 1 + num_patches, hidden]
        return x + self.position_embedding.weight[: x.shape[1]]


class CLIPAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        # the checkpoint's q_proj, k_proj and v_proj in one matmul (loaded as its shards "q", "k", "v")
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, -1, self.head_dim).transpose(1, 2)  # [batch, heads of this rank, n, head_dim]

        size = self.qkv_proj.q_size
        q, k, v = self.qkv_proj(x).split([size, size, size], dim=-1)  # each [batch, n, this rank's heads * head_dim]
        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Only the layers whose outputs are read are built (num_layers <= the config's); no post-norm (LLaVA reads
    hidden states, not the pooled output)."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # (HF's spelling)
        with sharded_if_divisible(config.num_attention_heads, config.hidden_size, config.intermediate_size):
            self.encoder = CLIPEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states after each count of layers in `layers` (0: the embeddings), [batch, tokens, hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, 1):
            x = layer(x)
            states[i] = x
        return [states[n] for n in layers]
