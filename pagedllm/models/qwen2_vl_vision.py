"""The Qwen2-VL / Qwen2.5-VL vision transformer: flat patches (temporal patch x 14 x 14 pixels each) through a linear
patch embedding, bidirectional blocks with 2D rotary positions (each frame attends within itself; Qwen2.5-VL also
within windows, except in its full-attention blocks) and the patch merger (2x2 neighbouring patches -> one LM token).

The two generations differ in the block (LayerNorm + GELU MLP vs RMSNorm + gated MLP) and the windows; one
item (an image or a video) runs per call.

Under tensor parallelism the blocks and the merger shard as the LM's layers do: qkv column-parallel by heads (the
checkpoint's fused q|k|v cut per rank), proj row-parallel, the MLPs' first linears column- and last row-parallel (one
all-reduce each), so every rank ends with the whole output. The patch embedding is replicated; a tower whose sizes do
not split over the ranks is replicated whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from pagedllm.layers.build_context import sharded_if_divisible
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated in float32 (rotate-half layout); cos/sin [n, head_dim]."""
    y = x.float()
    y1, y2 = y.chunk(2, dim=-1)
    rotated = torch.cat((-y2, y1), dim=-1)
    return (y * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.qkv = QKVParallelLinear(dim, dim // num_heads, num_heads, num_heads, bias=True)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [n, dim]; tokens attend within each segment [cu_seqlens[i], cu_seqlens[i+1])."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        outs = []
        for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            seg = [t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, len, head_dim]
            outs.append(F.scaled_dot_product_attention(*seg)[0].transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, bias=True)
        self.act = ACT2FN[act]
        self.fc2 = RowParallelLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), all with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        # the checkpoint's gate_proj and up_proj in one matmul (loaded as its shards 0 and 1)
        self.gate_up_proj = MergedColumnParallelLinear(dim, [hidden, hidden], bias=True)
        self.down_proj = RowParallelLinear(hidden, dim, bias=True)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [n, this rank's hidden]
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, rms_norm: bool) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(dim) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = VisionRMSNorm(dim) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_patches, C * T * P * P] -> [num_patches, dim] (the conv's one window per patch is a matmul)."""
        return F.linear(x.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge_size: int, rms_norm: bool) -> None:
        super().__init__()
        self.hidden = dim * merge_size**2
        self.ln_q = VisionRMSNorm(dim) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.hidden, self.hidden, bias=True),
            nn.GELU(),
            RowParallelLinear(self.hidden, out_dim, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))  # [num_patches / merge^2, out_dim]


def vision_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(h, w) grid index of each patch [t * h * w, 2], in the processor's order: merge x merge blocks, row-major."""
    hpos = torch.arange(h)[:, None].expand(h, w)
    wpos = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    hpos = hpos.reshape(shape).transpose(1, 2).flatten()
    wpos = wpos.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([hpos, wpos], dim=-1).repeat(t, 1)


def window_index(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the merge units reordered window by window [t * h * w / merge^2], the windows'
    cumulative patch counts). `window` is in merged units per side."""
    lh, lw = h // merge, w // merge
    index = torch.arange(t * lh * lw).reshape(t, lh, lw)
    pad_h, pad_w = window - lh % window, window - lw % window
    nh, nw = (lh + pad_h) // window, (lw + pad_w) // window
    padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
    padded = padded.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, window, window)
    sizes = (padded != -100).sum([2, 3]).reshape(-1)
    flat = padded.reshape(-1)
    cu = [0]
    for size in (sizes * merge**2).tolist():
        if size:
            cu.append(cu[-1] + size)
    return flat[flat != -100], cu


class Qwen2VisionTransformer(nn.Module):
    """config: Qwen2VLVisionConfig or Qwen2_5_VLVisionConfig; out_dim: the LM's hidden size."""

    def __init__(self, config, out_dim: int) -> None:
        super().__init__()
        self.qwen25 = hasattr(config, "fullatt_block_indexes")
        dim = config.hidden_size if self.qwen25 else config.embed_dim
        num_heads = config.num_heads
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config.patch_size, config.temporal_patch_size, config.in_channels, dim)
        if self.qwen25:
            self.full_blocks = set(config.fullatt_block_indexes)
            self.window = config.window_size // self.merge // config.patch_size
        hidden = config.intermediate_size if self.qwen25 else int(dim * config.mlp_ratio)
        mlp_cls = VisionGatedMLP if self.qwen25 else VisionMLP
        out_size = config.out_hidden_size if self.qwen25 else out_dim
        with sharded_if_divisible(num_heads, hidden, dim):  # (the merger's hidden is dim * merge^2)
            mlps = [mlp_cls(dim, hidden, config.hidden_act) for _ in range(config.depth)]
            self.blocks = nn.ModuleList(VisionBlock(dim, num_heads, mlp, self.qwen25) for mlp in mlps)
            self.merger = PatchMerger(out_size, dim, self.merge, self.qwen25)
        head_dim = dim // num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    def _rope(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = vision_positions(t, h, w, self.merge).to(self.inv_freq.device)  # [n, 2]
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [n, head_dim / 2]: h's, then w's
        freqs = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        return freqs.cos(), freqs.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One item's patches [t * h * w, C * T * P * P] -> its LM embeddings [t * h * w / merge^2, out_dim]."""
        t, h, w = grid_thw
        x = self.patch_embed(pixel_values)  # [n, dim]
        cos, sin = self._rope(t, h, w)
        frames = [i * h * w for i in range(t + 1)]  # each frame attends within itself
        order = None
        if self.qwen25:
            order, windows = window_index(t, h, w, self.merge, self.window)
            order = order.to(x.device)
            unit = self.merge**2
            regroup = lambda y: y.view(-1, unit, y.shape[-1])[order].reshape(y.shape)  # noqa: E731
            x, cos, sin = regroup(x), regroup(cos), regroup(sin)
        for i, block in enumerate(self.blocks):
            full = not self.qwen25 or i in self.full_blocks
            x = block(x, frames if full else windows, (cos, sin))
        out = self.merger(x)
        return out if order is None else out[torch.argsort(order)]
