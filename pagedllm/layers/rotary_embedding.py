"""Rotary position embedding (neox / HF rotate-half layout, or GPT-J's interleaved pairs) with the frequency
scalings of rope_scaling.py: default, linear, dynamic NTK, YaRN, llama3 and LongRoPE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels import cpu_kernels, use_triton
from pagedllm.layers.rope_config import rope_parameters as rope_parameters  # re-exported for the models
from pagedllm.layers.rope_scaling import longrope_inv_freqs, rope_inv_freq_and_mscale, rope_type_of


class RotaryEmbedding(nn.Module):
    """One per model: the cos/sin tables (times the scaling's cos/sin scale: YaRN, LongRoPE), looked up once per
    forward and shared by every layer. Dynamic NTK uses one fixed base for every length, as vLLM does (see
    rope_scaling._dynamic_ntk_base for where that differs from transformers).

    LongRoPE keeps two tables one after the other (short factors, then long ones); a forward whose positions all
    lie within original_max_position_embeddings reads the short table, else every token reads the long one (as
    HF picks per forward), chosen on the device without a host sync."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.long_offset, self.original_max = 0, 0
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type_of(scaling) == "longrope":
            inv_freqs, mscale, self.original_max = longrope_inv_freqs(head_dim, theta, scaling)
            freqs = torch.cat([torch.outer(positions, inv) for inv in inv_freqs])  # [2 * max_pos, head_dim/2]
            self.long_offset = max_position
        else:
            inv_freq, mscale = rope_inv_freq_and_mscale(head_dim, theta, scaling)  # [head_dim/2]
            freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim/2]
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
