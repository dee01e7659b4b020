"""The experts in plain torch (the CPU path and the GPU kernel's reference): token-expert pairs sorted by expert,
one gate/up matmul and one down matmul per active expert over its tokens, then a weighted scatter-add."""

from __future__ import annotations

import torch

from pagedllm.layers.activation import activation_fn


def fused_experts_torch(
    x: torch.Tensor,  # [n, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k] float32
    topk_ids: torch.Tensor,  # [n, k]
    activation: str = "silu",
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ act_and_mul(w13[e] @ x[t]) with e = topk_ids[t, j]; [n, H] in x.dtype,
    summed in float32."""
    n, k = topk_ids.shape
    act = activation_fn(activation)
    flat = topk_ids.reshape(-1).long()  # [n * k] expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k  # [n * k] token of each sorted pair
    weights = topk_weights.reshape(-1)[order]  # [n * k]
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        h = x[rows] @ w13[expert].t()  # [count, 2 * I]
        h = act(h[:, :inter]) * h[:, inter:]  # [count, I]
        y = (h @ w2[expert].t()).float() * weights[start : start + count, None]  # [count, H]
        out.index_add_(0, rows, y)
        start += count
    return out.to(x.dtype)
