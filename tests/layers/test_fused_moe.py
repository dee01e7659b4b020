"""FusedMoE's routing, experts and weight loading against plain re-implementations: HF's routers (Mixtral's
softmax top-k, DeepSeek-V2's group-limited greedy, DeepSeek-V3's sigmoid with correction bias), a token-by-token
loop over the chosen experts, and per-expert checkpoint tensors loaded by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.fused_moe import FusedMoE, expert_stacked_params, fused_experts_torch, select_experts
from pagedllm.models.utils import STACKED_PARAMS, load_weights


def loop_reference(x, w13, w2, weights, ids, act=F.silu):
    """Each token, each of its slots, one expert at a time, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter].double() @ x[t].double(), w13[e, inter:].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (act(gate) * up))
    return out


def _sorted_pairs(weights, ids):
    """(weights, ids) of each row ordered by expert id, so that two top-k orders compare."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def mixtral_router(logits, k, renormalize):
    probs = logits.float().softmax(-1)
    w, i = probs.topk(k, -1)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), i


def deepseek_v2_router(logits, k, groups, topk_group, scale):
    scores = logits.softmax(-1, dtype=torch.float32)
    group_scores = scores.view(-1, groups, scores.shape[1] // groups).max(-1).values
    group_idx = group_scores.topk(topk_group, -1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, groups, scores.shape[1] // groups).reshape(scores.shape)
    w, i = scores.masked_fill(~mask.bool(), 0.0).topk(k, -1)
    return w * scale, i


def deepseek_v3_router(logits, k, groups, topk_group, scale, bias):
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, groups, scores.shape[1] // groups).topk(2, -1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, -1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, groups, scores.shape[1] // groups).reshape(scores.shape)
    i = choice.masked_fill(~mask.bool(), 0.0).topk(k, -1)[1]
    w = scores.gather(1, i)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, i


@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (7, 8, 2), (33, 16, 4), (5, 6, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_mixtral_router(n, e, k, renormalize):
    logits = torch.randn(n, e, generator=torch.Generator().manual_seed(n * e + k))
    w, i = select_experts(logits, k, renormalize)
    assert w.dtype == torch.float32 and i.dtype == torch.int32 and w.shape == i.shape == (n, k)
    rw, ri = mixtral_router(logits, k, renormalize)
    torch.testing.assert_close(_sorted_pairs(w, i), _sorted_pairs(rw, ri))


def test_grouped_softmax_matches_deepseek_v2_router():
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    w, i = select_experts(logits, 3, False, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    torch.testing.assert_close(_sorted_pairs(w, i), _sorted_pairs(*deepseek_v2_router(logits, 3, 4, 2, 2.5)))
    assert all(len(set((row // 4).tolist())) <= 2 for row in i.long())  # at most topk_group groups per token


def test_sigmoid_bias_grouped_matches_deepseek_v3_router():
    gen = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(50, 32, generator=gen), torch.randn(32, generator=gen) * 0.5
    w, i = select_experts(logits, 4, True, "sigmoid", 8, 3, 2.5, bias)
    torch.testing.assert_close(_sorted_pairs(w, i), _sorted_pairs(*deepseek_v3_router(logits, 4, 8, 3, 2.5, bias)))
    plain = select_experts(logits, 4, True, "sigmoid", 8, 3, 2.5)[1]
    assert not torch.equal(plain, i)  # the bias moves the choice (so the test above depends on it)


@pytest.mark.parametrize(
    "bad,field",
    [
        (dict(top_k=9), "top_k"),
        (dict(scoring_func="tanh"), "scoring_func"),
        (dict(num_expert_group=3, topk_group=1), "num_expert_group"),
        (dict(num_expert_group=4, topk_group=5), "topk_group"),
        (dict(quant_config=object()), "quantized"),
        (dict(activation="nope"), "activation"),
    ],
)
def test_bad_setup_is_refused(bad, field):
    kwargs = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, renormalize=True) | bad
    with pytest.raises(ValueError, match=field):
        FusedMoE(**kwargs)


def _random_layer(e, k, h, inter, dtype=torch.float32, **kw):
    torch.manual_seed(e * 100 + k)
    moe = FusedMoE(e, k, h, inter, True, **kw).to(dtype)
    with torch.no_grad():
        moe.w13_weight.normal_(0, h**-0.5)
        moe.w2_weight.normal_(0, inter**-0.5)
    return moe


@pytest.mark.parametrize("n,e,k", [(1, 4, 2), (9, 8, 2), (40, 16, 4), (3, 5, 5), (64, 8, 1)])
def test_forward_matches_token_loop(n, e, k):
    moe = _random_layer(e, k, 24, 40)
    x, logits = torch.randn(n, 24), torch.randn(n, e) * 3
    logits[: n // 2, 0] += 10  # uneven routing: expert 0 takes half of the tokens
    out = moe(x, logits)
    w, i = select_experts(logits, k, True)
    ref = loop_reference(x, moe.w13_weight.data, moe.w2_weight.data, w, i)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_gelu_experts_and_bfloat16():
    moe = _random_layer(6, 2, 32, 16, activation="gelu")
    x, logits = torch.randn(11, 32), torch.randn(11, 6)
    w, i = select_experts(logits, 2, True)
    ref = loop_reference(x, moe.w13_weight.data, moe.w2_weight.data, w, i, act=F.gelu)
    torch.testing.assert_close(moe(x, logits).double(), ref, atol=1e-5, rtol=1e-5)
    out16 = fused_experts_torch(x.bfloat16(), moe.w13_weight.bfloat16(), moe.w2_weight.bfloat16(), w, i, "gelu")
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), ref, atol=3e-2, rtol=3e-2)


class _Block(torch.nn.Module):
    """A model fragment named like a checkpoint: experts plus a dense gated projection beside them."""

    def __init__(self, e):
        super().__init__()
        self.experts = FusedMoE(e, 2, 8, 6, True)
        self.shared = torch.nn.Module()
        self.shared.gate_up_proj = torch.nn.Linear(8, 12, bias=False)


@pytest.mark.parametrize("names", [("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")])
def test_per_expert_checkpoint_names_load_into_stacked_params(names):
    e = 12  # two-digit ids: experts.1 must not take experts.11's tensors
    block = _Block(e)
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for x in range(e):
        for name, shape in zip(names, [(6, 8), (6, 8), (8, 6)]):
            tensors[f"layer.experts.{x}.{name}.weight"] = torch.randn(shape, generator=gen)
    model = torch.nn.Module()
    model.layer = block
    stacked = expert_stacked_params(e, names) + STACKED_PARAMS
    loaded = load_weights(model, tensors.items(), stacked)
    assert loaded == {"layer.experts.w13_weight", "layer.experts.w2_weight"}
    gate, up, down = names
    for x in range(e):
        w13, w2 = block.experts.w13_weight[x], block.experts.w2_weight[x]
        assert torch.equal(w13[:6], tensors[f"layer.experts.{x}.{gate}.weight"])
        assert torch.equal(w13[6:], tensors[f"layer.experts.{x}.{up}.weight"])
        assert torch.equal(w2, tensors[f"layer.experts.{x}.{down}.weight"])


def test_mixtral_loads_transformers_fused_expert_tensors():
    """transformers keeps a layer's experts fused in memory (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); its state_dict loads into the stacked parameters as they are."""
    import transformers
    from tiny_models import TINY_DECODER

    from pagedllm.models.mixtral import MixtralForCausalLM

    config = transformers.MixtralConfig(**TINY_DECODER, num_local_experts=4)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config)
    ours = MixtralForCausalLM(config, max_position=256)
    state = hf.state_dict()
    loaded = ours.load_weights(state.items())
    assert {"model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"} <= loaded
    layer = ours.model.layers[1].mlp.experts
    w13 = next(v for k, v in state.items() if "layers.1." in k and k.endswith("experts.gate_up_proj"))
    w2 = next(v for k, v in state.items() if "layers.1." in k and k.endswith("experts.down_proj"))
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)


def test_correction_bias_stays_the_routers_parameter():
    """A router's bias parameter handed to FusedMoE is read at forward time and keeps the router's name."""
    block = torch.nn.Module()
    bias = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    block.experts = FusedMoE(8, 2, 16, 8, True, scoring_func="sigmoid", e_score_correction_bias=bias)
    block.gate = torch.nn.Module()
    block.gate.e_score_correction_bias = bias
    assert "gate.e_score_correction_bias" in dict(block.named_parameters())
    assert "experts.e_score_correction_bias" not in dict(block.named_parameters(remove_duplicate=False))
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        bias[7] = 10.0  # loaded after construction: expert 7 now always chosen
    assert bool((block.experts.select_experts(logits)[1] == 7).any(dim=-1).all())
