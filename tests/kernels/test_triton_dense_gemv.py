"""The skinny kernel's dense mode (bfloat16/float16 weights and activations, no scales: fp8_gemv.dense_gemv) against
the float64 product of the same values, split-K or not, with and without bias; which batches take it; and, on a
GPU, the dense linear layers' one-row path against F.linear (cuBLAS) at Llama-3.1-8B shapes, in a CUDA graph.
Without CUDA it runs in Triton's interpreter (see conftest.py).

Tolerance: the kernel sums in float32 and rounds once to the output dtype, so each output is within half an ulp of
that dtype (2**-9 relative for bfloat16, 2**-12 for float16) of the exact sum, plus float32 summation error."""

from __future__ import annotations

import importlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

gemv = importlib.import_module("pagedllm.layers.quantization.fp8_gemv")
if DEVICE.type == "cpu" and type(gemv.fp8_gemv_kernel).__name__ != "InterpretedFunction":
    importlib.reload(importlib.import_module("pagedllm.layers.quantization.fp8_ops"))
    gemv = importlib.reload(gemv)

RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, w, bias


def check(out, x, w, bias):
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=RTOL[x.dtype], atol=1e-5 * scale)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(17, 33), (70, 300), (40, 700)])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv(m, n, k, split, dtype, monkeypatch):
    """Odd N and K (partial tiles both ways); K split over the SMs (several 128-column chunks: summed by the last
    program), or 64-row tiles, one program over all of K."""
    if not split:
        monkeypatch.setattr(gemv, "PROGRAMS_PER_SM", 0)
    x, w, bias = case(m, n, k, dtype, seed=m * n + k)
    with_bias = bias if m != 3 else None
    out = gemv.dense_gemv(x.to(DEVICE), w.to(DEVICE), None if with_bias is None else with_bias.to(DEVICE))
    assert out.shape == (m, n) and out.dtype == dtype
    check(out, x, w, with_bias)


def test_dense_gemv_splits_k_in_the_tests():
    """The split cases above do split K (a test of the split path that never splits could not fail there)."""
    assert gemv.gemv_config(1, 40, 700, gemv.sm_count(DEVICE), fp8=False).splits > 1


def test_dense_gemv_plan_splits_k():
    """A small weight is split along K over the SMs, and the split sums are taken by the kernel's last programs."""
    cfg = gemv.gemv_config(1, 4096, 4096, 132, fp8=False)
    assert cfg.splits > 1 and cfg.split_in_kernel and not cfg.w_tma
    assert gemv.gemv_config(1, 4096, 4096, 132) == gemv.gemv_config(1, 4096, 4096, 132, fp8=True)  # fp8: TABLE


def test_dense_gemv_applies():
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(32, 64, dtype=torch.bfloat16, device=DEVICE)
    assert gemv.dense_gemv_applies(x, w) == (DEVICE.type == "cuda")
    assert not gemv.dense_gemv_applies(x.float(), w.float())  # float32: cuBLAS (tl.dot would use TF32)
    assert not gemv.dense_gemv_applies(torch.zeros(gemv.DENSE_MAX_M + 1, 64, dtype=x.dtype, device=DEVICE), w)
    assert not gemv.dense_gemv_applies(x, w.to(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 4096)])
def test_linear_one_row_in_cuda_graph(n, k, monkeypatch):
    """A dense layer on the GPU takes the kernel for one row (captured in a CUDA graph) and F.linear for more."""
    from pagedllm.layers import linear as L

    layer = L.ColumnParallelLinear(k, n, True).to(DEVICE, torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    torch.nn.init.normal_(layer.bias)
    layer.process_weights_after_loading()
    assert layer.quant_method is L.GEMV
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    layer(x)  # warm: compiles and takes the split counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16))
    graph.replay()
    check(out, x.cpu(), layer.weight.cpu(), layer.bias.cpu())
    calls, kernel = [], L.dense_gemv
    monkeypatch.setattr(L, "dense_gemv", lambda *a: calls.append(tuple(a[0].shape)) or kernel(*a))
    layer(x)
    layer(torch.randn(5, k, device=DEVICE, dtype=torch.bfloat16))  # more rows: F.linear
    assert calls == [(1, k)]
