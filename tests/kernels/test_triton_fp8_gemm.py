"""The row-wise scaled FP8 GEMM of fp8_gemm.py against the float32 GEMM of its dequantized operands: K split over
programs (partials summed by the last program of a tile) or not, ragged M and N, reproducible bits; on a GPU against
torch._scaled_mm on the same quantized inputs at Llama-3.1-8B shapes for every swept tile. Without CUDA it runs in
Triton's interpreter (see conftest.py), the fp8 tiles widened to bfloat16 (exact) for the dot."""

from __future__ import annotations

import importlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.layers.quantization.fp8_ops")
gemm = importlib.import_module("pagedllm.layers.quantization.fp8_gemm")
if DEVICE.type == "cpu" and type(gemm.fp8_rowwise_mm_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on
    gemm = importlib.reload(gemm)

FP8 = torch.float8_e4m3fn


def make_case(m, n, k, seed=0):
    """(xq [M, K] fp8, xs [M, 1], w [N, K] fp8, ws [N], the float32 reference [M, N])."""
    g = torch.Generator().manual_seed(seed)
    xq = (torch.randn(m, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    xs = torch.rand(m, 1, generator=g) * 0.01 + 1e-3
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3
    ref = (xq.float() * xs) @ (w.float() * ws[:, None]).T
    return xq.to(DEVICE), xs.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), ref


@pytest.mark.parametrize("m,n", [(1, 48), (7, 80), (40, 48)])
@pytest.mark.parametrize("per_sm", [0, 64])  # 0: no split; 64 programs an SM: 4 splits (16 steps of 32)
def test_rowwise_mm_matches_dequantized_reference(m, n, per_sm):
    xq, xs, w, ws, ref = make_case(m, n, 512, seed=m + n)
    config = (16, 32, 32, 4, 2, per_sm)
    splits, _ = gemm.plan(m, n, 512, 16, 32, 32, per_sm, gemm.sm_count(xq.device))
    assert (splits > 1) == (per_sm == 64) or DEVICE.type == "cuda"
    out = gemm.fp8_rowwise_mm(xq, xs, w, ws, torch.float32, config).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    again = gemm.fp8_rowwise_mm(xq, xs, w, ws, torch.float32, config).cpu()
    assert torch.equal(out, again), "the split sums must come out the same every time"


def test_bfloat16_output_and_k_check():
    xq, xs, w, ws, ref = make_case(5, 32, 128, seed=3)
    out = gemm.fp8_rowwise_mm(xq, xs, w, ws, torch.bfloat16, (16, 32, 32, 4, 2, 1)).cpu()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
    with pytest.raises(ValueError, match="BLOCK_K"):
        gemm.fp8_rowwise_mm(xq, xs, w, ws, torch.bfloat16, (16, 32, 96, 4, 2, 1))


def test_applies_only_to_table_buckets(monkeypatch):
    w = torch.empty(64, 256, dtype=FP8, device=DEVICE)
    monkeypatch.setattr(gemm, "TABLE", {64: (64, 64, 128, 4, 4, 1)})
    assert gemm.bucket(33) == 64 and gemm.bucket(1) == 16 and gemm.bucket(64) == 64
    assert gemm.gemm_applies(torch.empty(40, 256, device=DEVICE), w) == (DEVICE.type == "cuda")
    assert not gemm.gemm_applies(torch.empty(65, 256, device=DEVICE), w)  # bucket 128: no entry
    assert not gemm.gemm_applies(torch.empty(40, 192, device=DEVICE), w[:, :192])  # K not a multiple of 128


def test_shape_entries_come_before_the_bucket_entry(monkeypatch):
    """A measured shape takes SHAPE_TABLE's entry for (rows key, N, K), torch._scaled_mm without one; other shapes
    take TABLE's entry for the batch's power-of-two bucket, and a bucket in neither keeps torch._scaled_mm."""
    shaped, bucketed = (64, 64, 128, 4, 4, 2), (64, 128, 128, 4, 4, 1)
    assert [gemm.rows_key(m) for m in (1, 16, 17, 40, 100, 256, 257, 600)] == [16, 16, 32, 48, 112, 256, 512, 1024]
    monkeypatch.setattr(gemm, "MEASURED_SHAPES", ((64, 256),))
    monkeypatch.setattr(gemm, "SHAPE_TABLE", {(112, 64, 256): shaped, (48, 64, 256): shaped})
    monkeypatch.setattr(gemm, "TABLE", {64: bucketed})
    assert gemm.table_config(100, 64, 256) == shaped and gemm.table_config(40, 64, 256) == shaped
    assert gemm.table_config(60, 64, 256) is None  # a measured shape: cuBLASLt, though TABLE has the bucket
    assert gemm.table_config(40, 96, 256) == bucketed and gemm.table_config(40, 64, 512) == bucketed
    assert gemm.table_config(120, 64, 256) is None and gemm.table_config(300, 64, 256) is None
    w = torch.empty(64, 256, dtype=FP8, device=DEVICE)
    assert gemm.gemm_applies(torch.empty(100, 256, device=DEVICE), w) == (DEVICE.type == "cuda")
    assert not gemm.gemm_applies(torch.empty(60, 256, device=DEVICE), w)
    assert not gemm.gemm_applies(torch.empty(100, 256, device=DEVICE), torch.empty(96, 256, dtype=FP8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FP8 tensor-core tiles need CUDA")
@pytest.mark.parametrize("m", [33, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_against_scaled_mm_llama_shapes(m, n, k):
    """Every swept tile (split or not) against cuBLASLt on the same inputs: both sum exact fp8 products in float32
    and round once to bfloat16, so they differ by the order of the sums: within 2 bf16 ulps of the output."""
    xq, xs, w, ws, _ = make_case(m, n, k, seed=1)
    want = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.reshape(1, n), out_dtype=torch.bfloat16).float()
    for tile in gemm.SWEEP:
        for per_sm in (1, 4):
            got = gemm.fp8_rowwise_mm(xq, xs, w, ws, torch.bfloat16, (*tile, per_sm)).float()
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
