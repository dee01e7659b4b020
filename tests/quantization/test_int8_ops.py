"""The W8A8 INT8 matmul (int8.int8_linear: per-token activation quantization, torch._int_mm, scales) against float64
sums of the same int8 operands, for batches below and above the int8 GEMM's 17-row minimum (padding), static and
dynamic activation scales, with and without bias; and the CPU method's emulation (activations rounded to int8 before
the dequantized weight's matmul) against the same. torch._int_mm runs on CPU too, so this checks the CUDA method's
arithmetic here."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.quantization.int8 import fake_quantize_int8, int8_linear, quantize_int8


def _case(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(m, 40, generator=g)
    weight = torch.randint(-128, 128, (24, 40), generator=g, dtype=torch.int8)
    weight_scale = torch.rand(24, generator=g) / 100 + 1e-3
    bias = torch.randn(24, generator=g)
    return x, weight, weight_scale, bias


def _reference(x, weight, weight_scale, static, bias):
    """Plain rule: scale = amax / 127 per token (or the static one), q = clamp(round(x / scale), -128, 127)."""
    s = x.abs().amax(dim=1, keepdim=True) / 127.0 if static is None else torch.full((x.shape[0], 1), static)
    q = torch.round(x / s).clamp(-128, 127)
    out = (q.double() @ weight.double().T) * s.double() * weight_scale.double()[None, :]
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("static", [None, 0.02])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_linear(m, static, with_bias):
    x, weight, weight_scale, bias = _case(m, m)
    bias = bias if with_bias else None
    input_scale = torch.tensor(static) if static is not None else None
    ref = _reference(x, weight, weight_scale, static, bias)
    out = int8_linear(x, weight, weight_scale, input_scale, bias)
    assert out.shape == (m, 24) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dense = (weight.float() * weight_scale[:, None]).T  # the CPU method: dequantized weight, rounded activations
    emulated = fake_quantize_int8(x, input_scale) @ dense + (bias if bias is not None else 0)
    torch.testing.assert_close(emulated.double(), ref, rtol=1e-5, atol=1e-5)


def test_rounding_and_clamping():
    """Half to even, the static scale's clamp to [-128, 127], an all-zero row."""
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, 127.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_int8(x, torch.tensor(1.0))
    assert q[0].tolist() == [0, 2, 2, 0, 127]
    q, s = quantize_int8(torch.tensor([[300.0, -300.0]]), torch.tensor(1.0))
    assert q.tolist() == [[127, -128]]
    q, s = quantize_int8(x, None)
    assert q[1].tolist() == [0] * 5 and torch.isfinite(s).all()
