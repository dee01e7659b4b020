"""Mixture-of-experts: the FusedMoE layer, expert selection, and the checkpoint-name mapping of per-expert weights."""

from pagedllm.layers.fused_moe.layer import FusedMoE, expert_stacked_params
from pagedllm.layers.fused_moe.routing import select_experts
from pagedllm.layers.fused_moe.torch_moe import fused_experts_torch

__all__ = ["FusedMoE", "expert_stacked_params", "fused_experts_torch", "select_experts"]
