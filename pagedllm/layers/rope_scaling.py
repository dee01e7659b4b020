"""RoPE frequency scaling: each rope_type's inverse frequencies and cos/sin scale, as transformers'
ROPE_INIT_FUNCTIONS compute them (dynamic NTK excepted: see _dynamic_ntk_base), and the check of a user's
`rope_scaling` dict."""

from __future__ import annotations

import math
from numbers import Real

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_NEEDS_FACTOR = ("linear", "dynamic", "yarn", "llama3")


def rope_type_of(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if kind == "su" else kind


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def check_rope_scaling(value, field: str = "rope_scaling") -> dict | None:
    """A copy of a user's rope scaling dict with `rope_type` set (vLLM's legacy `type` and "su" read too), or None.
    ValueError naming the field for a non-dict, an unknown rope_type, a factor <= 0 or a malformed option."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"{field}={value!r} must be a dict such as {{'rope_type': 'yarn', 'factor': 4.0, "
            "'original_max_position_embeddings': 32768}, or None"
        )
    kind = value.get("rope_type", value.get("type"))
    if "rope_type" in value and "type" in value and value["type"] != value["rope_type"]:
        raise ValueError(f"{field}: 'type'={value['type']!r} and 'rope_type'={value['rope_type']!r} differ: give one")
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_TYPES:
        raise ValueError(f"{field}['rope_type']={kind!r} is not supported: allowed {list(ROPE_TYPES)}")
    scaling = {k: v for k, v in value.items() if k != "type"}
    scaling["rope_type"] = kind
    factor = scaling.get("factor")
    if kind in _NEEDS_FACTOR and "factor" not in scaling:
        raise ValueError(f"{field}: rope_type {kind!r} needs 'factor' (a number > 0)")
    if factor is not None and (not _is_number(factor) or factor <= 0):
        raise ValueError(f"{field}['factor']={factor!r} is out of range: a number > 0")
    for key in ("attention_factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"):
        v = scaling.get(key)
        if v is not None and (not _is_number(v) or v <= 0):
            raise ValueError(f"{field}[{key!r}]={v!r} is out of range: a number > 0")
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        v = scaling.get(key)
        if v is not None and not _is_number(v):
            raise ValueError(f"{field}[{key!r}]={v!r} must be a number")
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        raise ValueError(f"{field}['truncate']={scaling['truncate']!r} must be true or false")
    if kind == "longrope" and not all(isinstance(scaling.get(k), list) for k in ("short_factor", "long_factor")):
        raise ValueError(f"{field}: rope_type 'longrope' needs 'short_factor' and 'long_factor' lists")
    if kind == "llama3" and "original_max_position_embeddings" not in scaling:
        raise ValueError(f"{field}: rope_type 'llama3' needs 'original_max_position_embeddings'")
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) >= scaling.get("high_freq_factor", 4.0):
        raise ValueError(f"{field}: llama3's 'low_freq_factor' must be below its 'high_freq_factor'")
    return scaling


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(scaling: dict | None, scale: float) -> float:
    """DeepSeek's attention softmax scale: `scale` (head_dim ** -0.5) times yarn_get_mscale(factor, mscale_all_dim)
    squared when the rope is scaled and mscale_all_dim is set (transformers' yarn_apply_mscale)."""
    if rope_type_of(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return scale
    mscale = yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return scale * mscale * mscale


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


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


def _dynamic_ntk_base(dim: int, theta: float, scaling: dict) -> float:
    """Dynamic NTK's base, fixed as vLLM fixes it: transformers' formula at seq_len = max_position_embeddings *
    factor. transformers instead recomputes the base every forward from that forward's longest sequence (plain
    theta up to max_position_embeddings), which a batch mixing requests of different lengths cannot reproduce;
    the two agree only on a forward whose longest sequence is exactly max_position_embeddings * factor tokens."""
    factor, max_pos = scaling["factor"], scaling.get("max_position_embeddings")
    if not max_pos:
        raise ValueError("rope_type 'dynamic' needs the config's max_position_embeddings")
    seq_len = max_pos * factor
    return theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def _yarn_inv_freq(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated (divided by factor) below the beta_slow rotation count, extrapolated (kept) above
    beta_fast, a linear ramp in between; cos/sin scaled by attention_factor, else 0.1 ln(factor) + 1 (DeepSeek: the
    ratio of yarn_get_mscale at mscale and at mscale_all_dim)."""
    original = scaling.get("original_max_position_embeddings") or scaling["max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dim whose wavelength fits num_rotations times
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim/2]
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def rope_inv_freq_and_mscale(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], the scale of cos and sin) of a rope scaling dict (None: plain RoPE). The
    dict may carry the config's `max_position_embeddings` (rope_parameters() adds it): dynamic NTK needs it, YaRN
    falls back on it. LongRoPE has two tables: see longrope_inv_freqs."""
    kind = rope_type_of(scaling)
    if kind == "default":
        return default_inv_freq(dim, theta), 1.0
    if kind == "linear":
        return default_inv_freq(dim, theta) / scaling["factor"], 1.0
    if kind == "dynamic":
        return default_inv_freq(dim, _dynamic_ntk_base(dim, theta, scaling)), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(default_inv_freq(dim, theta), scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")


def longrope_inv_freqs(head_dim: int, theta: float, scaling: dict) -> tuple[list[torch.Tensor], float, int]:
    """LongRoPE (Phi-3): ([short, long] inverse frequencies, the cos/sin scale, original_max_position_embeddings).
    `factor` defaults to max_position_embeddings / original_max_position_embeddings, as HF derives it."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling.get("max_position_embeddings", original) / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [head_dim/2]
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != base.numel():
            raise ValueError(
                f"rope_scaling[{key!r}] has {len(scaling[key])} factors: longrope needs one per rotary frequency "
                f"({base.numel()} = rotary dim {head_dim} / 2)"
            )
    inv = [1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * base) for key in ("short_factor", "long_factor")]
    return inv, float(mscale), original
