"""The element-wise C kernels of the CPU path against the torch layer code they replace (itself HF's formulas):
bit-equal or within a unit in the last place of the model dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_qk_rotary

# float32: a few ulps (summation order); bfloat16: one bfloat16 ulp where a float32 sum lands on a rounding edge
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


@pytest.fixture(autouse=True)
def built(c_build):
    """Each test runs on the kernels as built here and as built without AVX-512 (vectors of 8 floats)."""


def torch_path(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "runs", lambda x: False)
        return fn()


def mostly_equal(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Close; in bfloat16 also bit-equal but for rare values where the float32 sums round differently."""
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])
    if dtype == torch.bfloat16:
        assert (a == b).float().mean() > 0.99, "more than 1% of values differ from the torch path"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 2500])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(monkeypatch, dtype, dim, with_residual):
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, eps=1e-5)
    norm.weight.data = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    wide = (torch.randn(7, dim + 32, generator=g) * 3).to(dtype)
    x = wide[:, 16 : 16 + dim]  # strided rows, as a projection's slice would be
    residual = torch.randn(7, dim, generator=g).to(dtype) if with_residual else None
    ours = norm(x, residual)
    ref = torch_path(monkeypatch, lambda: norm(x, residual))
    if with_residual:
        assert torch.equal(ours[1], ref[1]), "the residual sum is rounded once, as torch rounds it"
        ours, ref = ours[0], ref[0]
    mostly_equal(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 1536, 1100])
def test_silu_and_mul(dtype, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(5, 2 * d + 8, generator=g) * 8).to(dtype)[:, 8:]  # strided rows
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -90.0]).to(dtype)
    ours = cpu_kernels.silu_and_mul(x)
    ref = (F.silu(x[:, :d]) * x[:, d:]).to(dtype)
    mostly_equal(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norms,head_dim", [(False, 64), (True, 64), (True, 128)])
def test_qk_rotary(monkeypatch, dtype, with_norms, head_dim):
    g = torch.Generator().manual_seed(3)
    num_tokens, num_heads, num_kv_heads = 6, 4, 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)(torch.tensor([0, 1, 7, 100, 2000, 4095]), dtype)
    norms = None
    if with_norms:  # each norm with its own epsilon (large enough to show in the result)
        norms = (RMSNorm(head_dim, 1e-2), RMSNorm(head_dim, 0.5))
        for n in norms:
            n.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    ours = apply_qk_rotary(q, k, rope, norms)
    ref = torch_path(monkeypatch, lambda: apply_qk_rotary(q, k, rope, norms))
    for a, b in zip(ours, ref):
        mostly_equal(a, b, dtype)
