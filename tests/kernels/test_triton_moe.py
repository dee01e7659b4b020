"""The Triton grouped-GEMM experts against the per-expert torch experts (FusedMoE's CPU path): without CUDA in
Triton's interpreter on tiny shapes (float32, 1e-5), over token counts, expert counts, top-k and tile sizes, with
uneven routing and idle experts; on a GPU in bfloat16 at real MoE shapes (marked gpu)."""

from __future__ import annotations

import importlib

import pytest
import torch

from pagedllm.layers.fused_moe import fused_experts_torch, select_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

moe = importlib.import_module("pagedllm.layers.fused_moe.triton_moe")
if DEVICE.type == "cpu" and type(moe.moe_gemm_kernel).__name__ != "InterpretedFunction":
    moe = importlib.reload(moe)  # imported before the interpreter was switched on

SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)


def make_experts(e, hidden, inter, seed=0):
    """w13 [e, 2 * inter, hidden], w2 [e, hidden, inter] in float32 on DEVICE, scaled for outputs of order 1."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g, device=DEVICE) * hidden**-0.5
    w2 = torch.randn(e, hidden, inter, generator=g, device=DEVICE) * inter**-0.5
    return w13, w2


def make_tokens(n, e, k, hidden, skew=True, seed=0):
    """x [n, hidden] and routed (weights, ids); with skew, expert 0 takes most tokens and the last expert none."""
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(n, hidden, generator=g, device=DEVICE)
    logits = torch.randn(n, e, generator=g, device=DEVICE)
    if skew:
        logits[: (2 * n) // 3, 0] += 8.0
        logits[:, e - 1] -= 100.0 if k < e else 0.0
    return (x, *select_experts(logits, k, True))


def make_case(n, e, k, hidden, inter, skew=True, seed=0):
    x, weights, ids = make_tokens(n, e, k, hidden, skew, seed)
    return (x, *make_experts(e, hidden, inter, seed), weights, ids)


@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (1, 8, 2), (3, 8, 2), (17, 4, 2), (40, 8, 3), (5, 3, 3), (70, 16, 4)])
def test_align_by_expert_groups_pairs_in_blocks(n, e, k):
    ids = make_case(n, e, k, 4, 4)[4]
    for block_m in (16, 32):
        sorted_ids, block_expert, num_padded = moe.align_by_expert(ids, e, block_m)
        used = int(num_padded)
        assert used % block_m == 0 and used <= sorted_ids.numel()
        pairs = sorted_ids[:used].view(-1, block_m).long()
        flat = ids.reshape(-1).long()
        for block, expert in zip(pairs, block_expert[: used // block_m].tolist()):
            real = block[block < n * k]
            assert len(real) > 0 and bool((flat[real] == expert).all())
        assert sorted(sorted_ids[sorted_ids < n * k].tolist()) == list(range(n * k))  # every pair exactly once


@pytest.mark.parametrize(
    "n,e,k",
    [(1, 4, 1), (1, 8, 2), (2, 4, 4), (3, 8, 2), (9, 4, 2), (16, 8, 1), (23, 6, 3), (40, 8, 2), (33, 16, 6)],
)
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_triton_experts_match_torch(n, e, k, tiles):
    x, w13, w2, weights, ids = make_case(n, e, k, hidden=32, inter=24, seed=n + e + k)
    config = SMALL_TILES if tiles == "small" else None
    out = moe.fused_experts_triton(x, w13, w2, weights, ids, config)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_experts_wide_tiles_and_no_tokens():
    x, w13, w2, weights, ids = make_case(130, 4, 2, hidden=40, inter=20, skew=False)
    tiles = dict(SMALL_TILES, BLOCK_M=64, BLOCK_N=32)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe.fused_experts_triton(x, w13, w2, weights, ids, tiles), ref, atol=1e-5, rtol=1e-5)
    empty = moe.fused_experts_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 40)


@pytest.mark.parametrize("n,e,k", [(1, 4, 2), (19, 8, 2)])
def test_triton_experts_bfloat16(n, e, k):
    """bf16 in and out, float32 inside: within bf16 rounding of the float32 experts."""
    x, w13, w2, weights, ids = make_case(n, e, k, hidden=32, inter=16, seed=5)
    out = moe.fused_experts_triton(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "e,k,hidden,inter",
    [(8, 2, 4096, 14336), (64, 6, 2048, 1408), (64, 8, 2048, 768)],
    ids=["mixtral-8x7b", "qwen2-moe", "e64-k8"],
)
def test_gpu_bf16_experts_real_shapes(e, k, hidden, inter):
    """The kernel's error against float32 experts stays within that of the bf16 torch experts (x1.5 + a floor),
    at every token count from a decode step to a 4096-token prefill chunk."""
    w13, w2 = make_experts(e, hidden, inter)
    w13_bf, w2_bf = w13.bfloat16(), w2.bfloat16()
    for n in (1, 2, 3, 5, 8, 16, 31, 64, 100, 256, 511, 1024, 2048, 4096):
        x, weights, ids = make_tokens(n, e, k, hidden, seed=n)
        exact = fused_experts_torch(x, w13, w2, weights, ids)
        ours = moe.fused_experts_triton(x.bfloat16(), w13_bf, w2_bf, weights, ids)
        torch_bf16 = fused_experts_torch(x.bfloat16(), w13_bf, w2_bf, weights, ids)
        assert ours.dtype == torch.bfloat16 and bool(torch.isfinite(ours).all())
        err, torch_err = (ours.float() - exact).abs().max().item(), (torch_bf16.float() - exact).abs().max().item()
        assert err <= 1.5 * torch_err + 1e-3, f"n={n}: triton {err:.4g} vs torch bf16 {torch_err:.4g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8, 32])
def test_gpu_moe_layer_replays_in_a_cuda_graph(n):
    """FusedMoE.forward on CUDA (routing, expert alignment, both GEMMs) has no host sync: captured once, a replay
    on new tokens gives what an eager call gives on them."""
    from pagedllm.layers.fused_moe import FusedMoE

    layer = FusedMoE(16, 4, 256, 128, True, scoring_func="sigmoid", num_expert_group=4, topk_group=2)
    w13, w2 = make_experts(16, 256, 128)
    layer.w13_weight.data, layer.w2_weight.data = w13.bfloat16(), w2.bfloat16()
    x, logits = torch.zeros(n, 256, device=DEVICE, dtype=torch.bfloat16), torch.zeros(n, 16, device=DEVICE)
    with torch.inference_mode():
        layer(x, logits)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        fresh_x, _, _ = make_tokens(n, 16, 4, 256, seed=7)
        fresh_logits = torch.randn(n, 16, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(3))
        x.copy_(fresh_x)
        logits.copy_(fresh_logits)
        graph.replay()
        torch.testing.assert_close(out, layer(x, logits), atol=0, rtol=0)
