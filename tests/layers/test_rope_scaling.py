"""RoPE scaling math against transformers' ROPE_INIT_FUNCTIONS (inverse frequencies and the cos/sin scale), dynamic
NTK against a plain re-implementation of vLLM's fixed-base rule, DeepSeek's softmax-scale correction, and the
check of a user's rope_scaling dict."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale as hf_yarn_get_mscale

from pagedllm.layers.rope_scaling import (
    check_rope_scaling,
    default_inv_freq,
    rope_inv_freq_and_mscale,
    yarn_get_mscale,
    yarn_softmax_scale,
)
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": YARN,
    "yarn-no-original": {"rope_type": "yarn", "factor": 2.0},  # original_max_position_embeddings from the config
    "yarn-betas-untruncated": dict(YARN, beta_fast=8, beta_slow=2, truncate=False),
    "yarn-attention-factor": dict(YARN, attention_factor=0.75),
    "yarn-deepseek-mscale": dict(YARN, factor=40.0, mscale=1.0, mscale_all_dim=0.5),
    "yarn-deepseek-equal-mscale": dict(YARN, factor=40.0, mscale=0.707, mscale_all_dim=0.707),
    "yarn-mscale-only": dict(YARN, mscale=0.5),  # transformers ignores mscale without mscale_all_dim
}


def _config(scaling: dict, theta: float = 5000.0, **kwargs) -> transformers.LlamaConfig:
    kwargs = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 128, **kwargs}
    return transformers.LlamaConfig(rope_parameters={**scaling, "rope_theta": theta}, **kwargs)


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_inv_freq_and_attention_scale_match_transformers(name, partial):
    config = _config(SCALINGS[name], partial_rotary_factor=partial)
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config, None)
    theta, scaling = rope_parameters(config)
    inv_freq, scale = rope_inv_freq_and_mscale(int(32 * partial), theta, scaling)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)
    if name.startswith("yarn"):  # the scaling really moves the frequencies
        assert not torch.allclose(inv_freq, default_inv_freq(int(32 * partial), theta))


def test_yarn_attention_scales():
    """The cos/sin scale: 0.1 ln(factor) + 1, the given attention_factor, DeepSeek's ratio of two mscales."""
    assert rope_inv_freq_and_mscale(32, 1e4, YARN)[1] == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope_inv_freq_and_mscale(32, 1e4, SCALINGS["yarn-attention-factor"])[1] == 0.75
    ratio = (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1)
    assert rope_inv_freq_and_mscale(32, 1e4, SCALINGS["yarn-deepseek-mscale"])[1] == pytest.approx(ratio)


def test_rotary_tables_match_transformers_rotary_embedding():
    """RotaryEmbedding's cos/sin (YaRN, scaled) against HF Llama's rotary module at the same positions."""
    config = _config(dict(YARN, beta_fast=16))
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 31, 32, 77, 127])
    ref_cos, ref_sin = hf(torch.zeros(1, 6, 32), positions[None])  # [1, 6, head_dim], halves repeated
    rope = RotaryEmbedding(32, 128, *rope_parameters(config))
    cos, sin = rope(positions, torch.float32)  # [6, 1, 16]
    torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :16], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin[0, :, :16], rtol=1e-5, atol=1e-6)


def _vllm_dynamic_ntk_cos_sin(base: float, rotary_dim: int, max_position: int, factor: float):
    """vLLM's DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache, re-implemented plainly."""
    max_len = max_position * factor
    base = base * ((factor * max_len / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(max_len, dtype=torch.float), inv_freq)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("factor", [2.0, 3.5])
def test_dynamic_ntk_follows_vllms_fixed_base(factor):
    config = _config({"rope_type": "dynamic", "factor": factor}, max_position_embeddings=64)
    length = int(64 * factor)
    ref_cos, ref_sin = _vllm_dynamic_ntk_cos_sin(5000.0, 32, 64, factor)
    rope = RotaryEmbedding(32, length, *rope_parameters(config))
    cos, sin = rope(torch.arange(length), torch.float32)
    torch.testing.assert_close(cos[:, 0], ref_cos, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(sin[:, 0], ref_sin, rtol=1e-5, atol=2e-5)


def test_dynamic_ntk_agrees_with_transformers_only_at_max_position_times_factor():
    """transformers recomputes the base per forward from its longest sequence: equal to the fixed base at exactly
    max_position_embeddings * factor tokens, plain theta up to max_position_embeddings."""
    config = _config({"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
    ours, scale = rope_inv_freq_and_mscale(32, *rope_parameters(config))
    at_full, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=128)
    torch.testing.assert_close(ours, at_full, rtol=1e-6, atol=0)
    assert scale == 1.0
    for seq_len in (None, 100, 129):
        other, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=seq_len)
        assert not torch.allclose(ours, other, rtol=1e-4, atol=0), seq_len


def test_deepseek_softmax_scale_helpers_match_transformers():
    for scale, mscale in ((1.0, 1.0), (0.5, 0.707), (40.0, 0.707), (4.0, 1.0)):
        assert yarn_get_mscale(scale, mscale) == pytest.approx(hf_yarn_get_mscale(scale, mscale))
    params = dict(YARN, factor=40.0, mscale=0.707, mscale_all_dim=0.707)
    for p in (params, dict(params, mscale_all_dim=0), {"rope_type": "default"}):
        assert yarn_softmax_scale(p, 192**-0.5) == pytest.approx(yarn_apply_mscale(p, 192**-0.5))
    assert yarn_softmax_scale(params, 1.0) == pytest.approx((0.1 * 0.707 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize(
    "value, match",
    [
        ("yarn", r"rope_scaling='yarn' must be a dict"),
        ([("rope_type", "linear")], r"must be a dict"),
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, r"rope_scaling\['rope_type'\]='ntk-by-parts' is not supp"),
        ({"factor": 2.0}, r"rope_scaling\['rope_type'\]=None is not supported: allowed \['default', 'linear'"),
        ({"rope_type": "linear", "factor": 0}, r"rope_scaling\['factor'\]=0 is out of range: a number > 0"),
        ({"rope_type": "dynamic", "factor": -2.0}, r"rope_scaling\['factor'\]=-2.0 is out of range"),
        ({"rope_type": "yarn", "factor": True}, r"rope_scaling\['factor'\]=True is out of range"),
        ({"rope_type": "yarn", "factor": "4"}, r"rope_scaling\['factor'\]='4' is out of range"),
        ({"rope_type": "linear"}, r"rope_type 'linear' needs 'factor'"),
        ({"rope_type": "yarn", "factor": 2.0, "beta_fast": "x"}, r"rope_scaling\['beta_fast'\]='x' must be a number"),
        ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.0}, r"\['attention_factor'\]=0.0 is out of"),
        ({"rope_type": "yarn", "factor": 2.0, "truncate": 1}, r"rope_scaling\['truncate'\]=1 must be true or false"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, r"needs 'short_factor' and 'long_factor' lists"),
        ({"type": "linear", "rope_type": "yarn", "factor": 2.0}, r"'type'='linear' and 'rope_type'='yarn' differ"),
        ({"rope_type": "llama3", "factor": 8.0}, r"rope_type 'llama3' needs 'original_max_position_embeddings'"),
    ],
)
def test_bad_rope_scaling_is_a_value_error_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        check_rope_scaling(value)


def test_rope_scaling_legacy_type_key_is_read():
    assert check_rope_scaling({"type": "linear", "factor": 2.0}) == {"rope_type": "linear", "factor": 2.0}
    assert check_rope_scaling({"type": "su", "short_factor": [1.0], "long_factor": [2.0]})["rope_type"] == "longrope"
    assert check_rope_scaling(None) is None


def test_longrope_factor_lists_must_cover_every_frequency():
    from pagedllm.layers.rope_scaling import longrope_inv_freqs

    scaling = {"original_max_position_embeddings": 16, "short_factor": [1.0], "long_factor": [2.0] * 4}
    with pytest.raises(ValueError, match=r"rope_scaling\['short_factor'\] has 1 factors: .* \(4 = rotary dim 8"):
        longrope_inv_freqs(8, 10000.0, scaling)
