"""The Triton per-token FP8 quantization kernel against a plain torch rule (scale = max(row amax / 448, floor),
q = round-to-nearest fp8 of x / scale, clamped to +-448), dynamic and with a static scale. Without CUDA it runs in
Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.layers.quantization.fp8_ops")
if DEVICE.type == "cpu" and type(ops.per_token_quant_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on

FP8 = torch.float8_e4m3fn


def reference(x: torch.Tensor, static: float | None):
    x = x.float()
    if static is None:
        scale = torch.maximum(x.abs().amax(dim=1, keepdim=True) / 448.0, torch.tensor(1.0 / (448.0 * 512.0)))
    else:
        scale = torch.full((x.shape[0], 1), static)
    return (x / scale).clamp(-448.0, 448.0).to(FP8), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 16), (3, 33), (5, 1500), (2, 7), (2, 16500)])  # the last: two passes
@pytest.mark.parametrize("static", [None, 0.05])
def test_per_token_quant(dtype, shape, static):
    g = torch.Generator().manual_seed(shape[0] * shape[1])
    x = (4 * torch.randn(*shape, generator=g)).to(dtype)
    x[0, 0] = 0.0
    if shape[0] > 2:
        x[2] = 0.0  # an all-zero row: the floor scale, zeros out
    ref_q, ref_s = reference(x, static)
    static_t = None if static is None else torch.tensor(static, device=DEVICE)
    q, s = ops.quantize_per_token_triton(x.to(DEVICE), static_t)
    assert q.dtype == FP8 and q.shape == shape and s.shape == (shape[0], 1)
    torch.testing.assert_close(s.cpu(), ref_s, rtol=1e-6, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    static_cpu = None if static_t is None else static_t.cpu()  # the torch rule runs on the host tensor
    torch.testing.assert_close(ops.quantize_per_token_torch(x, static_cpu)[1], ref_s, rtol=1e-6, atol=0)


def test_no_rows():
    q, s = ops.quantize_per_token_triton(torch.empty(0, 32, device=DEVICE))
    assert q.shape == (0, 32) and s.shape == (0, 1)


blk = importlib.import_module("pagedllm.layers.quantization.fp8_block")
if DEVICE.type == "cpu" and type(blk.block_fp8_matmul_kernel).__name__ != "InterpretedFunction":
    blk = importlib.reload(blk)


def block_case(m, n, k, bn, bk, seed=0):
    """(x [m, k], fp8 weight [n, k], block scales, the float32 reference of the block GEMM on them)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = 3 * torch.randn(m, k, generator=g)
    gn, gk = -(-n // bn), -(-k // bk)
    scales = torch.rand(gn, gk, generator=g) / 100 + 1e-3
    full = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(FP8)
    xq = torch.empty(m, k)
    for j in range(0, k, bk):  # per token and group of bk features
        part = x[:, j : j + bk]
        s = (part.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1 / (448 * 512))
        xq[:, j : j + bk] = (part / s).clamp(-448, 448).to(FP8).float() * s
    return x, q, scales, xq @ (q.float() * full).T


@pytest.mark.parametrize(
    "m,n,k,bn,bk", [(1, 64, 64, 32, 32), (5, 80, 48, 16, 16), (17, 40, 72, 16, 32), (3, 8, 16, 8, 16)]
)
def test_block_fp8_gemm(m, n, k, bn, bk):
    """Odd M, N not a multiple of the tile or the block, K not a multiple of the group."""
    if not blk.block_gemm_supported(DEVICE, (bn, bk)) and DEVICE.type == "cuda":
        pytest.skip("compiled fp8 tl.dot takes k-groups of 32+: the layer keeps the dense path for smaller ones")
    x, q, scales, ref = block_case(m, n, k, bn, bk, seed=m + n + k)
    bias = torch.randn(n)
    out = blk.block_fp8_linear(x.to(DEVICE), q.to(DEVICE), scales.to(DEVICE), (bn, bk), bias.to(DEVICE))
    # Hopper's fp8 tensor cores keep about 14 bits of each k-group's running sum (a 72-feature case measured 1.6e-4
    # of the output's size); the interpreter sums in float32
    atol = 2**-11 * ref.abs().max().item() if DEVICE.type == "cuda" else 1e-3
    torch.testing.assert_close(out.cpu(), ref + bias, atol=atol, rtol=1e-4)


def test_block_fp8_gemm_leading_dims_and_no_rows():
    x, q, scales, ref = block_case(6, 32, 64, 16, 32)
    out = blk.block_fp8_linear(x.reshape(2, 3, 64).to(DEVICE), q.to(DEVICE), scales.to(DEVICE), (16, 32), None)
    torch.testing.assert_close(out.cpu(), ref.reshape(2, 3, 32), atol=1e-3, rtol=1e-4)
    empty = blk.block_fp8_linear(torch.empty(0, 64, device=DEVICE), q.to(DEVICE), scales.to(DEVICE), (16, 32), None)
    assert empty.shape == (0, 32)


fused = importlib.import_module("pagedllm.kernels.fused_ops")
if DEVICE.type == "cpu" and type(fused.rms_norm_kernel).__name__ != "InterpretedFunction":
    fused = importlib.reload(fused)


def same_fp8(got, want, exact=True):
    """(fp8 rows, scales) pairs bit for bit; not exact: the scales within float32 rounding and each value within one
    fp8 step (a row's amax may differ in its last bit)."""
    assert got[0].dtype == FP8 and got[0].shape == want[0].shape and got[1].shape == want[1].shape
    if exact:
        assert torch.equal(got[0].cpu().view(torch.uint8), want[0].cpu().view(torch.uint8))
        assert torch.equal(got[1].cpu(), want[1].cpu())
        return
    torch.testing.assert_close(got[1].cpu(), want[1].cpu(), rtol=2**-20, atol=0)
    values, ref = (p[0].cpu().float() * p[1].cpu() for p in (got, want))
    torch.testing.assert_close(values, ref, rtol=2**-3, atol=2**-9 * want[1].cpu().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [96, 1000])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quantizes_as_the_per_token_kernel(dtype, n, residual):
    """RMSNorm's kernel writing fp8 rows and scales: bit-identical to its plain output quantized per token, the
    residual sum identical too (an all-zero row included: the floor scale)."""
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(5, n, generator=g)).to(dtype).to(DEVICE)
    x[1] = 0.0
    res = (torch.randn(5, n, generator=g)).to(dtype).to(DEVICE) if residual else None
    if residual:
        res[1] = 0.0
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    plain = fused.rms_norm(x, w, 1e-5, res)
    got = fused.rms_norm(x, w, 1e-5, res, quantize=True)
    if residual:
        assert torch.equal(got[1], plain[1])
        plain, got = plain[0], got[0]
    # compiled float32 kernels: the two variants' rstd may round differently in its last bit (a 1000-feature row
    # on an H200), and float32 outputs keep that bit; bfloat16 rounds it away, and the interpreter computes alike
    same_fp8(got, ops.quantize_per_token_triton(plain), exact=dtype == torch.bfloat16 or DEVICE.type == "cpu")
    with pytest.raises(ValueError, match="weight of its dtype"):
        fused.rms_norm(x, w.float() if dtype != torch.float32 else w.bfloat16(), 1e-5, quantize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [48, 1500, 5000])  # 5000: five chunks of the row, the last one ragged
def test_silu_and_mul_quantizes_as_the_per_token_kernel(dtype, d):
    g = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(4, 2 * d, generator=g)).to(dtype).to(DEVICE)
    x[2] = 0.0
    same_fp8(fused.silu_and_mul(x, quantize=True), ops.quantize_per_token_triton(fused.silu_and_mul(x)))
    assert fused.silu_and_mul(x[:0], quantize=True)[0].shape == (0, d)
