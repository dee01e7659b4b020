"""The attention layer of a model: hands q/k/v and its own KV cache to the runner's attention backend."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.forward_context import get_attn_metadata
from pagedllm.layers.rotary_embedding import apply_qk_rotary

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# checkpoint name endings of the per-tensor KV-cache scales: `<attention module>.k_scale` (compressed-tensors,
# fp8) and the older `<attention module>.k_proj.output_scale`; -> which scale
KV_SCALE_SUFFIXES = {
    ".k_scale": "k_scale",
    ".v_scale": "v_scale",
    ".k_proj.output_scale": "k_scale",
    ".v_proj.output_scale": "v_scale",
}


class Attention(nn.Module):
    """Causal attention over the paged cache. Options beyond the scale and window: `logits_soft_cap` (scores become
    cap * tanh(scores / cap), Gemma 2) and `alibi_slopes` ([num_heads] float32: score + slope * (key_pos - q_pos),
    Bloom / MPT); they reach the backend as keyword arguments only when set. `k_scale` / `v_scale` are the
    per-tensor scales of an FP8 KV cache (the checkpoint's, else 1.0), passed only when the bound cache is FP8."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.extras: dict = {}
        if logits_soft_cap:
            self.extras["logits_soft_cap"] = float(logits_soft_cap)
        slopes = alibi_slopes.float() if alibi_slopes is not None else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)  # [num_heads] or None
        self.k_scale = self.v_scale = 1.0  # an FP8 cache holds k / k_scale and v / v_scale (set by load_kv_scale)
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, num_kv_heads, head_dim], bound later
        self.backend = None  # module with forward(q, k, v, kv_cache, meta, scale, sliding_window), bound later

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norms: tuple | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim] -> same shape as q.
        rope: (cos, sin) when q and k are not rotated yet (rotate-half over the whole head), qk_norms: the per-head
        (q_norm, k_norm) RMSNorm layers applied before it (Qwen3). A backend with SUPPORTS_FUSED_ROTARY rotates
        while it writes the cache; otherwise apply_qk_rotary runs first."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        extras = self.extras
        if self.alibi_slopes is not None:
            extras = {**extras, "alibi_slopes": self.alibi_slopes}
        if self.kv_cache is not None and self.kv_cache.dtype in FP8_KV_DTYPES:
            extras = {**extras, "k_scale": self.k_scale, "v_scale": self.v_scale}
        if rope is not None:
            if getattr(self.backend, "SUPPORTS_FUSED_ROTARY", False) and rope[0].shape[-1] * 2 == self.head_dim:
                extras = {**extras, "rope": rope}
                if qk_norms is not None:
                    assert qk_norms[0].eps == qk_norms[1].eps, "one epsilon for both norms"
                    extras["qk_norm"] = (qk_norms[0].weight, qk_norms[1].weight, qk_norms[0].eps)
            else:
                q, k = apply_qk_rotary(q, k, rope, qk_norms)
        out = self.backend.forward(
            q,
            k,
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            get_attn_metadata(),
            self.scale,
            self.sliding_window,
            **extras,
        )
        return out.reshape(n, self.num_heads * self.head_dim)


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether `name` is a KV-cache scale (KV_SCALE_SUFFIXES); if so its value goes to the Attention layer in the
    module it names (e.g. model.layers.0.self_attn.k_scale -> the Attention inside model.layers.0.self_attn)."""
    suffix = next((s for s in KV_SCALE_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return False
    try:
        owner = model.get_submodule(name[: -len(suffix)])
    except AttributeError:
        return False
    layers = [m for m in owner.modules() if isinstance(m, Attention)]
    if len(layers) != 1:
        return False
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name!r}: a KV-cache scale must be one per-tensor value, got shape "
            f"{tuple(tensor.shape)}"
        )
    setattr(layers[0], KV_SCALE_SUFFIXES[suffix], float(tensor.float().item()))
    return True


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes [num_heads] (Press et al.; for a head count that is not a power of two, the
    power-of-two sequence followed by every other slope of the next one), as Bloom and MPT compute them."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(min(closest, num_heads - closest))]
    return torch.tensor(slopes, dtype=torch.float32)
