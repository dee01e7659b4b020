"""Rotary position embedding (neox / HF rotate-half layout) with default, linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import cpu_kernels, use_triton


def rope_parameters(config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a transformers config of either generation (4.x or 5.x)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
        return theta, scaling
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(getattr(config, "rope_theta", 10000.0)), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [head_dim/2]
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3")


def _longrope_inv_freqs(head_dim: int, theta: float, scaling: dict) -> tuple[list[torch.Tensor], float, int]:
    """LongRoPE (Phi-3): ([short, long] inverse frequencies, the cos/sin scale, original_max_position_embeddings).
    `factor` defaults to max_position_embeddings / original_max_position_embeddings, as HF derives it."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling.get("max_position_embeddings", original) / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [head_dim/2]
    inv = [1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * base) for key in ("short_factor", "long_factor")]
    return inv, float(mscale), original


class RotaryEmbedding(nn.Module):
    """One per model: the cos/sin tables, looked up once per forward and shared by every layer.

    LongRoPE keeps two tables one after the other (short factors, then long ones); a forward whose positions all
    lie within original_max_position_embeddings reads the short table, else every token reads the long one (as
    HF picks per forward), chosen on the device without a host sync."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.long_offset, self.original_max = 0, 0
        rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "longrope":
            inv_freqs, mscale, self.original_max = _longrope_inv_freqs(head_dim, theta, scaling)
            freqs = torch.cat([torch.outer(positions, inv) for inv in inv_freqs])  # [2 * max_pos, head_dim/2]
            self.long_offset = max_position
        else:
            freqs = torch.outer(positions, compute_inv_freq(head_dim, theta, scaling))  # [max_pos, head_dim/2]
            mscale = 1.0
        self.register_buffer("cos", freqs.cos() * mscale, persistent=False)
        self.register_buffer("sin", freqs.sin() * mscale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, 1, head_dim/2] in `dtype`, for the tokens at `positions`."""
        if self.long_offset:
            positions = positions + (positions >= self.original_max).any() * self.long_offset
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates [num_tokens, num_heads, head_dim] in HF's rotate-half layout (torch; on CUDA the models rotate q
    and k together through apply_qk_rotary's kernel)."""
    cos, sin = cos_sin
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_qk_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    norms: tuple | None = None,  # (q_norm, k_norm) RMSNorm layers applied per head first (Qwen3)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary of q and k, after their per-head norms when given. On CUDA one fused Triton kernel for all of it, on
    CPU one C kernel."""
    if use_triton(q):
        from pagedllm.kernels.fused_ops import qk_rotary

        if norms is None:
            return qk_rotary(q, k, *cos_sin)
        q_norm, k_norm = norms
        assert q_norm.eps == k_norm.eps, "one epsilon for both norms"
        return qk_rotary(q, k, *cos_sin, (q_norm.weight, k_norm.weight), q_norm.eps)
    if cpu_kernels.runs(q) and q.shape[-1] <= cpu_kernels.MAX_DIM:  # CPU: one C pass
        if norms is None:
            return cpu_kernels.qk_rotary(q, k, *cos_sin)
        return cpu_kernels.qk_rotary(q, k, *cos_sin, (norms[0].weight, norms[1].weight), (norms[0].eps, norms[1].eps))
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)


def partial_rotary_dim(config: Any, head_dim: int) -> int:
    """How many leading dims of each head rotate: head_dim times the config's partial rotary factor (transformers
    5's rope_parameters, or partial_rotary_factor / rotary_pct as older configs name it), or its rotary_dim."""
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None)
    if factor is None and getattr(config, "rotary_dim", None):
        return int(config.rotary_dim)
    return int(head_dim * (1.0 if factor is None else factor))


def apply_rotary_interleaved(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates [num_tokens, num_heads, dim] in GPT-J's layout: pairs (x[2i], x[2i+1]) by frequency i."""
    cos, sin = cos_sin
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def apply_partial_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [num_tokens, 1, rot_dim / 2]
    rot_dim: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary of the first rot_dim dims of each head (rotate-half layout, or GPT-J's interleaved pairs); the rest
    pass through."""
    if rot_dim == q.shape[-1] and not interleaved:
        return apply_qk_rotary(q, k, cos_sin)
    rotate = apply_rotary_interleaved if interleaved else apply_rotary
    q = torch.cat((rotate(q[..., :rot_dim], cos_sin), q[..., rot_dim:]), dim=-1)
    k = torch.cat((rotate(k[..., :rot_dim], cos_sin), k[..., rot_dim:]), dim=-1)
    return q, k
