"""DeepSeek-V2/V3 specifics beyond the parity rows: the MLA cache shape, refused rope types, V2's router rules."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import TINY_MLA

from pagedllm.config import ModelConfig
from pagedllm.models.deepseek_v2 import DeepseekRotaryEmbedding, DeepseekV2MoE, mla_cache_dims, softmax_scale


def _config(**kwargs):
    return transformers.DeepseekV2Config(**dict(TINY_MLA, **kwargs))


@pytest.mark.parametrize(("v_head_dim", "dims"), [(16, (4, 32)), (24, (4, 32)), (40, (4, 40))])
def test_cache_dims_hold_the_decompressed_heads(v_head_dim, dims):
    """Every query head caches its own K (nope + rope) and V, padded to the larger; HF's head_dim is the rope dim."""
    config = _config(v_head_dim=v_head_dim)
    assert config.head_dim == 16
    assert mla_cache_dims(config) == dims
    model_config = ModelConfig("m", "m", None, config, "DeepseekV2ForCausalLM", torch.float32, 64)
    assert (model_config.num_kv_heads, model_config.head_dim) == dims


def test_unsupported_rope_scaling_is_refused():
    config = _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic' is not supported for DeepSeek; supported: default, yarn"):
        DeepseekRotaryEmbedding(config, 64)


def test_yarn_scale_squares_mscale_all_dim():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 1.0}
    mscale = 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert softmax_scale(_config(rope_scaling=rope)) == pytest.approx(32**-0.5 * mscale**2)
    assert softmax_scale(_config()) == pytest.approx(32**-0.5)


def test_v2_router_follows_transformers():
    """V2: softmax, no renormalization even with norm_topk_prob (as transformers), grouping only when asked."""
    moe = DeepseekV2MoE(_config(norm_topk_prob=True, topk_method="group_limited_greedy", n_group=4, topk_group=2))
    assert (moe.experts.scoring_func, moe.experts.renormalize) == ("softmax", False)
    assert (moe.experts.num_expert_group, moe.experts.topk_group) == (4, 2)
    assert moe.gate.e_score_correction_bias is None and moe.gate.weight.dtype == torch.float32
    assert DeepseekV2MoE(_config(n_group=4, topk_group=2)).experts.num_expert_group is None


def test_v3_router_matches_transformers_with_negative_bias():
    """Experts outside the chosen groups never win, even where score + correction bias is below 0."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        **dict(TINY_MLA, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    )
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ref.weight.normal_(0.0, 0.5)
        ref.e_score_correction_bias.normal_(-1.0, 0.3)
    moe = DeepseekV2MoE(config)
    moe.gate.weight.data.copy_(ref.weight.data)
    moe.gate.e_score_correction_bias.data.copy_(ref.e_score_correction_bias)
    x = torch.randn(64, config.hidden_size)
    with torch.no_grad():
        _, ref_weights, ref_ids = ref(x)
    weights, ids = moe.experts.select_experts(moe.gate(x))
    dense = torch.zeros(64, 8).scatter_(1, ids.long(), weights)  # [n, E]: each token's weight per expert
    torch.testing.assert_close(dense, torch.zeros(64, 8).scatter_(1, ref_ids, ref_weights))
