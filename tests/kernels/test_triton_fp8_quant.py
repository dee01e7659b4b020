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
@pytest.mark.parametrize("shape", [(1, 16), (3, 33), (5, 1500), (2, 7)])
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
    torch.testing.assert_close(ops.quantize_per_token_torch(x, static_t)[1].cpu(), ref_s, rtol=1e-6, atol=0)


def test_no_rows():
    q, s = ops.quantize_per_token_triton(torch.empty(0, 32, device=DEVICE))
    assert q.shape == (0, 32) and s.shape == (0, 1)
