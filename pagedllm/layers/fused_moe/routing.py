"""Expert selection: the router's logits -> each token's top-k experts and their weights (softmax or sigmoid
scores, DeepSeek's grouped top-k and score-correction bias, renormalization, routed scaling)."""

from __future__ import annotations

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


def check_routing(
    num_experts: int, top_k: int, scoring_func: str, num_expert_group: int | None, topk_group: int | None
) -> None:
    """ValueError naming the field for a routing setup that cannot work."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func!r} must be one of {SCORING_FUNCS}")
    if num_expert_group is None:
        return
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group={num_expert_group} must divide num_experts={num_experts}")
    if topk_group is None or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")


def _group_mask(choice: torch.Tensor, num_groups: int, topk_group: int, with_bias: bool) -> torch.Tensor:
    """[n, E] bool: the experts of each token's `topk_group` best groups. A group scores by its best expert (its
    two best, summed, when a correction bias is in play, as DeepSeek-V3 does)."""
    n, num_experts = choice.shape
    grouped = choice.view(n, num_groups, num_experts // num_groups)  # [n, groups, experts per group]
    if with_bias:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values  # [n, groups]
    group_ids = group_scores.topk(topk_group, dim=-1)[1]  # [n, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(n, num_experts)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [n, E] -> (weights [n, top_k] float32, expert ids [n, top_k] int32).

    Scores are softmax or sigmoid of the logits in float32. Experts are chosen by score (+ the correction bias
    when given; outside the best `topk_group` of `num_expert_group` groups when grouped), weighted by their plain
    score, renormalized to sum 1 when asked, then multiplied by routed_scaling_factor."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()  # [n, E]
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        mask = _group_mask(choice, num_expert_group, topk_group, e_score_correction_bias is not None)
        choice = choice.masked_fill(~mask, float("-inf"))  # not 0: a biased choice score may be negative
    if e_score_correction_bias is None and num_expert_group is None:
        weights, ids = choice.topk(top_k, dim=-1)  # [n, top_k]
    else:
        ids = choice.topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)
