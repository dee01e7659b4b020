"""The fused Triton ops against the torch layer code they replace on CUDA (RMSNorm with and without the residual
add, SiLU-and-mul, rotary of q and k with and without their per-head norms). Without CUDA they run in
Triton's interpreter (see conftest.py); the reference is always the layer's torch code on CPU tensors (on CUDA
tensors the layers would call the Triton op itself).

Tolerances: float32 1e-5; bfloat16 one or two ulps (2e-2 relative; the torch code rounds after every elementwise op,
the kernels compute in fp32 and round where the layer rounds the intermediate it keeps); float16 2e-3."""

from __future__ import annotations

import importlib

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_qk_rotary, apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.kernels.fused_ops")
if DEVICE.type == "cpu" and type(ops.rms_norm_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16]


def close(out, ref, dtype):
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def rms_case(shape, dtype, residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(shape[-1], generator=g))
    norm = norm.to(dtype)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)  # [..., hidden]
    res = torch.randn(*shape, generator=g).to(dtype) if residual else None
    ref = norm(x, res)  # the torch code on CPU
    out = ops.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps, None if res is None else res.to(DEVICE))
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 96), (1, 7)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, shape, residual):
    out, ref = rms_case(shape, dtype, residual)
    if residual:
        close(out[0], ref[0], dtype)
        assert torch.equal(out[1].cpu(), ref[1]), "the new residual is x + residual rounded once"
    else:
        close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_strided_view(dtype):
    """Qwen3's q/k norm: [tokens, heads, head_dim] views of the wider qkv projection output."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 5 * 32, generator=g).to(dtype)  # [num_tokens, (heads + 2 kv heads) * head_dim]
    q = qkv[:, : 3 * 32].view(6, 3, 32)  # [num_tokens, 3 heads, 32], token stride 160
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    norm = norm.to(dtype)
    out = ops.rms_norm(q.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    close(out, norm(q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2 * 48), (2, 3, 2 * 16), (1, 2 * 1500)])
def test_silu_and_mul(dtype, shape):
    x = (2 * torch.randn(*shape, generator=torch.Generator().manual_seed(2))).to(dtype)
    close(ops.silu_and_mul(x.to(DEVICE)), SiluAndMul()(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(4, 32), (3, 80), (1, 64)])
def test_rotary(dtype, heads, head_dim):
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])  # [num_tokens]
    cos, sin = rope(positions, dtype)  # [num_tokens, 1, head_dim / 2] each
    wide = torch.randn(len(positions), (heads + 2) * head_dim, generator=g).to(dtype)
    x = wide[:, : heads * head_dim].view(len(positions), heads, head_dim)  # a strided view, as the models pass it
    out, _ = ops.qk_rotary(x.to(DEVICE), x[:, :1].to(DEVICE), cos.to(DEVICE), sin.to(DEVICE))
    close(out, apply_rotary(x, (cos, sin)), dtype)


def qk_case(dtype, heads, kv_heads, head_dim, with_norm, num_tokens=6, seed=4):
    """q and k as strided views of one fused qkv row, as the models pass them; the reference is the torch layer
    code (per-head RMSNorm, then rotary of each) on CPU."""
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0, None)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    cos, sin = rope(positions, dtype)  # [num_tokens, 1, head_dim / 2] each
    qkv = (2 * torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    norms = None
    if with_norm:
        norms = (RMSNorm(head_dim, eps=1e-6), RMSNorm(head_dim, eps=1e-6))
        with torch.no_grad():
            for norm in norms:
                norm.weight.copy_(1 + 0.3 * torch.randn(head_dim, generator=g))
        norms = tuple(n.to(dtype) for n in norms)
    ref_q, ref_k = (norms[0](q), norms[1](k)) if with_norm else (q, k)
    ref = apply_rotary(ref_q, (cos, sin)), apply_rotary(ref_k, (cos, sin))
    weights = (norms[0].weight.to(DEVICE), norms[1].weight.to(DEVICE)) if with_norm else None
    out = ops.qk_rotary(q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), weights, 1e-6)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24), (2, 2, 8)])
def test_qk_rotary(dtype, with_norm, heads, kv_heads, head_dim):
    (q, k), (ref_q, ref_k) = qk_case(dtype, heads, kv_heads, head_dim, with_norm)
    assert q.shape == ref_q.shape and k.shape == ref_k.shape and q.is_contiguous() and k.is_contiguous()
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)


# -- realistic shapes, compiled on the GPU --------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_realistic(dtype):
    for residual in (False, True):
        out, ref = rms_case((2048, 4096), dtype, residual, seed=4)
        close(out[0] if residual else out, ref[0] if residual else ref, dtype)
    x = torch.randn(2048, 2 * 11008, generator=torch.Generator().manual_seed(5)).to(dtype)
    close(ops.silu_and_mul(x.to(DEVICE)), SiluAndMul()(x), dtype)
    rope = RotaryEmbedding(128, 8192, 1_000_000.0, None)
    positions = torch.randint(0, 8192, (2048,), generator=torch.Generator().manual_seed(6))
    cos, sin = rope(positions, dtype)
    q = torch.randn(2048, 32, 128, generator=torch.Generator().manual_seed(7)).to(dtype)
    close(
        ops.qk_rotary(q.to(DEVICE), q[:, :8].to(DEVICE), cos.to(DEVICE), sin.to(DEVICE))[0],
        apply_rotary(q, (cos, sin)),
        dtype,
    )
    for with_norm in (False, True):  # Qwen3-0.6B's attention: 16 q heads, 8 kv heads, head_dim 128
        (q, k), (ref_q, ref_k) = qk_case(dtype, 16, 8, 128, with_norm, num_tokens=512, seed=8)
        close(q, ref_q, dtype)
        close(k, ref_k, dtype)


@pytest.mark.gpu
def test_gpu_layers_dispatch_to_triton(monkeypatch):
    """On CUDA the layers call the fused ops (and give the same numbers as their CPU torch code)."""
    calls = []
    for name in ("rms_norm", "silu_and_mul", "qk_rotary"):
        fn = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    norm = RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    close(norm.to(DEVICE)(x.to(DEVICE)), norm.cpu()(x), torch.bfloat16)
    close(SiluAndMul()(x.to(DEVICE)), SiluAndMul()(x), torch.bfloat16)
    cos, sin = RotaryEmbedding(16, 64, 10000.0, None)(torch.arange(4), torch.bfloat16)
    xr = x.view(4, 4, 16)
    q, k = apply_qk_rotary(xr.to(DEVICE), xr[:, :2].to(DEVICE), (cos.to(DEVICE), sin.to(DEVICE)))
    close(q, apply_rotary(xr, (cos, sin)), torch.bfloat16)
    close(k, apply_rotary(xr[:, :2], (cos, sin)), torch.bfloat16)
    assert calls == ["rms_norm", "silu_and_mul", "qk_rotary"]
