"""The SigLIP vision tower (as Gemma 3 uses it): patch embeddings with learned positions (no class token), the
bidirectional encoder layers CLIP has too, and a final LayerNorm. It returns the last hidden state; SigLIP's
attention-pooling head (`head.*`, for the pooled output) is not built."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [batch, hidden, g, g]
        x = patches.flatten(2).transpose(1, 2)  # [batch, num_patches, hidden]
        return x + self.position_embedding.weight[: x.shape[1]]


class SiglipVisionTower(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config, config.num_hidden_layers)  # SigLIP's encoder layer is CLIP's
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [batch, 3, image_size, image_size] -> last hidden state [batch, num_patches, hidden]."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
