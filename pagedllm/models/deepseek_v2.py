"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and a mixture of experts with shared experts.

MLA: q from the hidden state (directly, or through the q_lora_rank bottleneck q_a_proj -> q_a_layernorm -> q_b_proj);
kv_a_proj_with_mqa gives a kv latent (kv_lora_rank) and one rotary key part shared by all heads (qk_rope_head_dim);
kv_b_proj expands the normed latent into each head's k_nope and v. Rotary acts on the rope parts only, in DeepSeek's
interleaved pairing (x0, x1), (x2, x3), ...; both q and k are rotated in a de-interleaved order, which leaves every
q . k product unchanged. YaRN scaling multiplies cos/sin by its attention factor and the softmax scale by
mscale(factor, mscale_all_dim)^2, as HF does.

The paged cache holds the decompressed per-head K (qk_nope + qk_rope dims) and V, zero-padded to one head dim
(`mla_cache_dims`), through the ordinary `Attention` layer; the attention output is cut back to v_head_dim. The
latent-cache (weight-absorbed) form of MLA, which caches kv_lora_rank + qk_rope_head_dim values per token, is not
implemented.

MoE layers (from first_k_dense_replace on, every moe_layer_freq-th): a router in float32 over n_routed_experts
(V2: softmax, greedy or group_limited_greedy; V3: sigmoid plus e_score_correction_bias, grouped by the top-2 sum),
top num_experts_per_tok (V3: renormalized when norm_topk_prob; V2 never, as in transformers), times
routed_scaling_factor, plus n_shared_experts always-on experts as one gated MLP."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.build_context import current_build_context, divide
from pagedllm.layers.fused_moe import FusedMoE, expert_stacked_params
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedReplicatedLinear,
    ReplicatedLinear,
    RowParallelLinear,
    new_param,
)
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rope_scaling import rope_inv_freq_and_mscale, yarn_softmax_scale
from pagedllm.layers.rotary_embedding import apply_qk_rotary, rope_parameters
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedllm.models.utils import STACKED_PARAMS, join_prefix, load_weights, tied_ignore

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm keep RMSNorm's default epsilon in HF, not rms_norm_eps
# checkpoint names -> merged parameters: q_a / kv_a into one matmul (with q_lora_rank), the MLPs' gate / up
_QKV_A_STACKED = [(".fused_qkv_a_proj.", ".q_a_proj.", 0), (".fused_qkv_a_proj.", ".kv_a_proj_with_mqa.", 1)]
_MLP_STACKED = [entry for entry in STACKED_PARAMS if entry[0] == ".gate_up_proj."]  # q_proj stays its own
# experts stored fused per layer (transformers' in-memory layout) -> the stacked expert parameters
_FUSED_EXPERTS = ((".experts.gate_up_proj", ".experts.w13_weight"), (".experts.down_proj", ".experts.w2_weight"))


def mla_cache_dims(config) -> tuple[int, int]:
    """(KV heads, head dim) of the paged cache: every query head's own decompressed K and V, both padded to
    max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim)."""
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    return int(config.num_attention_heads), int(max(qk, config.v_head_dim))


def _rope_scaling(config) -> tuple[float, dict | None]:
    theta, scaling = rope_parameters(config)
    rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if rope_type not in (None, "yarn"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported for DeepSeek; supported: default, yarn")
    return theta, scaling


def softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    _, scaling = _rope_scaling(config)
    return yarn_softmax_scale(scaling, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)


class DeepseekRotaryEmbedding(nn.Module):
    """cos/sin tables of the rope part (qk_rope_head_dim), plain or YaRN; forward as RotaryEmbedding's."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        dim = config.qk_rope_head_dim
        theta, scaling = _rope_scaling(config)
        inv_freq, factor = rope_inv_freq_and_mscale(dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, dim/2]
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, 1, dim/2]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (rotate-half layout), contiguous."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


class DeepseekV2Attention(nn.Module):
    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads = divide(config.num_attention_heads, current_build_context().tp_size, "num_attention_heads")
        total_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        q_out = total_heads * (self.nope + self.rope)
        kv_a = self.kv_lora_rank + self.rope
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, False, quant_config, join_prefix(prefix, "q_proj"))
            self.kv_a_proj_with_mqa = ReplicatedLinear(
                hidden, kv_a, bias, quant_config, join_prefix(prefix, "kv_a_proj_with_mqa")
            )
        else:  # q_a_proj and kv_a_proj_with_mqa read the same input: one matmul
            self.fused_qkv_a_proj = MergedReplicatedLinear(
                hidden, [self.q_lora_rank, kv_a], bias, quant_config, join_prefix(prefix, "fused_qkv_a_proj")
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_out, False, quant_config, join_prefix(prefix, "q_b_proj")
            )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            total_heads * (self.nope + self.v_dim),
            False,
            quant_config,
            join_prefix(prefix, "kv_b_proj"),
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.v_dim, hidden, bias, quant_config, join_prefix(prefix, "o_proj")
        )
        _, self.cache_dim = mla_cache_dims(config)
        self.attn = Attention(self.num_heads, self.cache_dim, softmax_scale(config), self.num_heads)

    def _q_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (q [n, heads * (nope + rope)], kv_a [n, kv_lora_rank + rope])."""
        if self.q_lora_rank is None:
            return self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_a, kv_a = self.fused_qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope], dim=-1)
        return self.q_b_proj(self.q_a_layernorm(q_a.contiguous())), kv_a

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, self.cache_dim - t.shape[-1])) if t.shape[-1] < self.cache_dim else t

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        q, kv_a = self._q_and_latent(x)
        q_nope, q_pe = q.view(n, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(n, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe, k_pe = q_pe.contiguous(), k_pe.reshape(n, 1, self.rope)  # k_pe [n, 1, rope]: shared by all heads
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = apply_qk_rotary(q_pe, k_pe.contiguous(), rope)
        q = self._pad(torch.cat([q_nope, q_pe], dim=-1))  # [n, heads, cache_dim]
        k = self._pad(torch.cat([k_nope, k_pe.expand(n, h, self.rope)], dim=-1))  # [n, heads, cache_dim]
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), self._pad(v).reshape(n, -1))
        out = out.view(n, h, self.cache_dim)[..., : self.v_dim]  # [n, heads, v_head_dim]
        return self.o_proj(out.reshape(n, h * self.v_dim))


class DeepseekRouter(nn.Module):
    """The router's weight [E, H] (and V3's e_score_correction_bias [E]) in float32, as HF keeps them."""

    def __init__(self, config, num_experts: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = new_param(num_experts, config.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = new_param(num_experts, dtype=torch.float32) if with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # [n, E] float32


class DeepseekV2MoE(nn.Module):
    """Routed experts plus the shared experts (one gated MLP of n_shared_experts * moe_intermediate_size)."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        v3 = getattr(config, "model_type", "") == "deepseek_v3" or getattr(config, "topk_method", "") == "noaux_tc"
        scoring = getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
        grouped = v3 or getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        self.gate = DeepseekRouter(config, num_experts, with_bias=v3)
        top_k = config.num_experts_per_tok
        self.experts = FusedMoE(
            num_experts,
            top_k,
            config.hidden_size,
            config.moe_intermediate_size,
            v3 and bool(getattr(config, "norm_topk_prob", False)),  # transformers' V2 never renormalizes
            quant_config,
            join_prefix(prefix, "experts"),
            activation=getattr(config, "hidden_act", "silu"),
            scoring_func=scoring,
            num_expert_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            e_score_correction_bias=self.gate.e_score_correction_bias,
        )
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = None
        if shared:
            inter = config.moe_intermediate_size * shared
            self.shared_experts = LlamaMLP(
                config.hidden_size, inter, False, quant_config, join_prefix(prefix, "shared_experts")
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # [n, H]
        return out if self.shared_experts is None else out + self.shared_experts(x)


def is_moe_layer(config, layer_idx: int) -> bool:
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return (
        bool(getattr(config, "n_routed_experts", None))
        and layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)
        and layer_idx % freq == 0
    )


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV2Attention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        self.sparse = is_moe_layer(config, layer_idx)  # read by make_mlp during the base constructor
        super().__init__(config, layer_idx, quant_config, prefix)

    def make_mlp(self, config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        if self.sparse:
            return DeepseekV2MoE(config, quant_config, prefix)
        act = getattr(config, "hidden_act", "silu")
        bias = bool(getattr(config, "mlp_bias", False))
        return LlamaMLP(config.hidden_size, config.intermediate_size, bias, quant_config, prefix, act)


class DeepseekV2Model(LlamaModel):
    layer_cls = DeepseekV2DecoderLayer

    def make_rotary(self, config, max_position: int) -> nn.Module:
        return DeepseekRotaryEmbedding(config, max_position)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV2Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert (or HF's fused) expert tensors onto the stacked experts; the layers past num_hidden_layers
        (V3's multi-token-prediction module) are skipped."""
        num_layers = self.config.num_hidden_layers
        layer_re = re.compile(r"^model\.layers\.(\d+)\.")
        stacked = expert_stacked_params(self.config.n_routed_experts or 0) + _MLP_STACKED
        if self.config.q_lora_rank is not None:
            stacked += _QKV_A_STACKED

        def rename(name: str) -> str:
            for theirs, ours in _FUSED_EXPERTS:
                name = name.replace(theirs, ours)
            return name

        def kept(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                match = layer_re.match(name)
                if match is None or int(match.group(1)) < num_layers:
                    yield name, tensor

        return load_weights(self, kept(weights), stacked, rename, tied_ignore(self.tied))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: sigmoid router scores with e_score_correction_bias, groups ranked by their top-2 sum."""
