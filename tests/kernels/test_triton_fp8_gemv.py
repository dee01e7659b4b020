"""The small-M FP8 skinny GEMM against the float32 GEMM of its dequantized operands (the activations quantized per
token by the torch rule, bit-checked against the Triton quantization the kernel path uses), split-K or not, per-channel
and per-tensor weight scales, static and dynamic activation scales, with and without bias; and, on a GPU, against
torch._scaled_mm on the same quantized inputs at Llama-3.1-8B shapes. The fused kernel (float activations quantized
inside it) against quantizing first: bit for bit, M 1..16, per-token and static scales. Without CUDA it
runs in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.layers.quantization.fp8_ops")
gemv = importlib.import_module("pagedllm.layers.quantization.fp8_gemv")
if DEVICE.type == "cpu" and type(gemv.fp8_gemv_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on
    gemv = importlib.reload(gemv)

FP8 = torch.float8_e4m3fn


def quantize_reference(x: torch.Tensor, static: float | None):
    """The per-token rule: scale = max(row amax / 448, 1 / (448 * 512)) (or the static one), q = fp8(x / scale)."""
    x = x.float()
    if static is None:
        scale = torch.maximum(x.abs().amax(dim=1, keepdim=True) / 448.0, torch.tensor(1.0 / (448.0 * 512.0)))
    else:
        scale = torch.full((x.shape[0], 1), static)
    return (x / scale).clamp(-448.0, 448.0).to(FP8), scale


def make_case(m, n, k, per_tensor, seed):
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    ws = torch.full((n,), 0.004) if per_tensor else torch.rand(n, generator=g) / 100 + 1e-3
    qw = (w / ws[:, None]).clamp(-448, 448).to(FP8)
    bias = torch.randn(n, generator=g)
    return x, qw, ws, bias


def gemm_reference(qx, sx, qw, ws, bias):
    """float64 (qx @ qw.T) * sx * ws + bias: exact sums, so the kernel differs by its float32 rounding only (on a
    CPU); `.magnitude` holds (|qx| @ |qw|.T) * sx * ws, the sum of the products' sizes."""
    out = (qx.double() @ qw.double().T) * sx.double() * ws.double()[None, :]
    magnitude = (qx.double().abs() @ qw.double().abs().T) * sx.double() * ws.double()[None, :]
    out = out if bias is None else out + bias.double()
    out.magnitude = magnitude
    return out


def assert_float32_close(out, ref):
    """Float32 sums of exact fp8 products. On a GPU the fp8 MMA (Hopper) adds its products with a short mantissa
    (about 13 bits) before each fold into the float32 sum, so each element may differ by a few 2^-13 of the sum of
    its products' sizes (2^-10 allowed); a wrong row, column or scale is off by the size of the products themselves."""
    scale = ref.abs().max().item()
    atol = 1e-5 * scale
    if DEVICE.type == "cuda":
        atol = atol + 2.0**-10 * ref.magnitude
    err = (out.double() - ref).abs()
    bound = atol + 1e-5 * ref.abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, worst over bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("m", [1, 2, 3, 8, 13, 16])
@pytest.mark.parametrize("n,k", [(17, 33), (70, 300), (130, 520)])
@pytest.mark.parametrize("split", [True, False])
def test_gemv_dynamic_per_channel(m, n, k, split, monkeypatch):
    """Odd N and K (partial tiles both ways): 16-row tiles with every K chunk its own split, or 64-row tiles, one
    program over all of K."""
    if not split:
        monkeypatch.setattr(gemv, "PROGRAMS_PER_SM", 0)  # 64-row tiles, one program per n-block
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=m * n + k)
    x[0, :5] = 0.0
    ref_q, ref_s = quantize_reference(x, None)
    xq, xs = ops.quantize_per_token_triton(x.to(DEVICE))  # the kernel path's quantization
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    out = gemv.fp8_gemv(xq, xs, qw.to(DEVICE), ws.to(DEVICE), bias.to(DEVICE), torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_float32_close(out.cpu(), gemm_reference(ref_q, xs.cpu(), qw, ws, bias))


@pytest.mark.parametrize("static", [None, 0.03])
@pytest.mark.parametrize("per_tensor", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gemv_linear_scales_and_bias(static, per_tensor, with_bias, m):
    """fp8_gemv_linear: static or dynamic activation scale, per-tensor or per-channel weight scale, bias or none."""
    n, k = 45, 272
    x, qw, ws, bias = make_case(m, n, k, per_tensor, seed=m + 7 * with_bias + 3 * per_tensor)
    bias = bias if with_bias else None
    ref_q, ref_s = quantize_reference(x, static)
    static_t = None if static is None else torch.tensor(static, device=DEVICE)
    out = gemv.fp8_gemv_linear(
        x.to(DEVICE), qw.to(DEVICE), ws.to(DEVICE), static_t, None if bias is None else bias.to(DEVICE)
    )
    assert_float32_close(out.cpu(), gemm_reference(ref_q, ref_s, qw, ws, bias))


def test_gemv_bfloat16_output():
    """bfloat16 activations: the result is rounded once, from the float32 sum, to bfloat16."""
    m, n, k = 4, 40, 96
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=11)
    x = x.to(torch.bfloat16)
    ref_q, ref_s = quantize_reference(x, None)
    out = gemv.fp8_gemv_linear(x.to(DEVICE), qw.to(DEVICE), ws.to(DEVICE), None, bias.to(torch.bfloat16).to(DEVICE))
    assert out.dtype == torch.bfloat16
    ref = gemm_reference(ref_q, ref_s, qw, ws, bias.to(torch.bfloat16)).float().to(torch.bfloat16)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-2, atol=1e-2 * ref.float().abs().max().item())


def test_plan_fills_the_gpu():
    """64-row tiles; K split (in whole chunks, never into empty splits) until every SM has a program."""
    assert gemv.plan(28672, 4096, 132) == (64, 1, 4096)
    assert gemv.plan(6144, 4096, 132) == (64, 2, 2048)
    assert gemv.plan(4096, 14336, 132) == (64, 3, 4864)
    assert gemv.plan(1024, 4096, 132) == (64, 8, 512)
    for n, k in [(4096, 4096), (1024, 4096), (1024, 300), (17, 33), (130, 520)]:
        block_n, splits, k_split = gemv.plan(n, k, 132)
        assert k_split % gemv.BLOCK_K == 0 and (splits - 1) * k_split < k <= splits * k_split


@pytest.mark.parametrize(
    "entry,splits", [((32, 128, 4, 3, 3, 1, 0), 3), ((64, 256, 4, 4, 2, 0, 1), 2), ((128, 128, 4, 2, 1, 0, 0), 1)]
)
@pytest.mark.parametrize("m", [1, 3])
def test_table_entries(entry, splits, m, monkeypatch):
    """A TABLE entry for the shape (one row, or 2..16 rows) sets the tiles, the K splits (capped by K's chunks), how
    split K is summed and TMA reads; the result is the float64 GEMM of the quantized operands."""
    n, k = 130, 520
    monkeypatch.setattr(gemv, "TABLE", {(1 if m == 1 else 16, n, k): entry})
    cfg = gemv.gemv_config(m, n, k, 132)
    assert (*cfg[:4], cfg.splits, cfg.split_in_kernel, cfg.w_tma) == (*entry[:4], splits, *map(bool, entry[5:]))
    assert gemv.gemv_config(m, n, k + 1, 132).block_k == gemv.BLOCK_K  # another shape: the module settings
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=m + splits)
    ref_q, ref_s = quantize_reference(x, None)
    out = gemv.fp8_gemv_linear(x.to(DEVICE), qw.to(DEVICE), ws.to(DEVICE), None, bias.to(DEVICE))
    assert_float32_close(out.cpu(), gemm_reference(ref_q, ref_s, qw, ws, bias))


def test_gemv_applies_only_to_small_cuda_batches():
    w = torch.zeros(8, 32, dtype=FP8)
    assert not gemv.gemv_applies(torch.zeros(1, 32), w)  # CPU: the dense path
    if torch.cuda.is_available():
        assert gemv.gemv_applies(torch.zeros(16, 32, device="cuda"), w.cuda())
        assert not gemv.gemv_applies(torch.zeros(17, 32, device="cuda"), w.cuda())
        assert not gemv.gemv_applies(torch.zeros(0, 32, device="cuda"), w.cuda())


LLAMA_8B = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", LLAMA_8B + [(11008, 4096)])  # the last: 32-row tiles
def test_gemv_matches_scaled_mm(m, n, k):
    """Llama-3.1-8B projection shapes: the kernel against cuBLASLt's row-wise scaled GEMM on the same fp8 inputs
    (both end in bfloat16), and against the float64 GEMM of the operands."""
    torch.manual_seed(m + n + k)
    x = 4 * torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = torch.rand(n, device="cuda") / 100 + 1e-3
    qw = (torch.randn(n, k, device="cuda") / ws[:, None]).clamp(-448, 448).to(FP8)
    xq, xs = ops.quantize_per_token_triton(x)
    out = gemv.fp8_gemv(xq, xs, qw, ws, None, torch.bfloat16)
    ref = torch._scaled_mm(xq, qw.t(), scale_a=xs, scale_b=ws.reshape(1, n), out_dtype=torch.bfloat16)
    exact = gemm_reference(xq, xs, qw, ws, None)
    atol = 1e-2 * exact.abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=atol)
    torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=atol / 4)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17])
def test_scaled_mm_method_dispatch(m):
    """The CUDA FP8 linear method: M <= 16 through the skinny kernel, larger M through _scaled_mm, same results."""
    from pagedllm.layers.quantization.fp8 import Fp8ScaledMMMethod

    n, k = 1024, 4096
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=m)
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale = qw.cuda(), ws.cuda()
    layer.input_scale, layer.bias = None, bias.cuda().to(torch.bfloat16)
    x = x.cuda().to(torch.bfloat16).reshape(1, m, k)
    out = Fp8ScaledMMMethod().apply(layer, x)
    ref = ops.fp8_linear(x, layer.weight, layer.weight_scale, None, layer.bias)
    assert out.shape == (1, m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("split_in_kernel", [False, True])
def test_gemv_in_cuda_graph(split_in_kernel, monkeypatch):
    """Captured once, replayed on new activations: no host sync, no allocation that changes between calls."""
    monkeypatch.setattr(gemv, "SPLIT_IN_KERNEL", split_in_kernel)
    n, k = 1024, 4096  # split K: the partials buffer and the reduce kernel are captured too
    _, qw, ws, bias = make_case(4, n, k, per_tensor=False, seed=3)
    qw, ws, bias = qw.cuda(), ws.cuda(), bias.cuda().to(torch.bfloat16)
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    gemv.fp8_gemv_linear(x, qw, ws, None, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.fp8_gemv_linear(x, qw, ws, None, bias)
    for scale in (3, -2):  # twice: each replay leaves the split-K counters ready for the next
        x.copy_(scale * torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, gemv.fp8_gemv_linear(x, qw, ws, None, bias), rtol=0, atol=0)


# The fused kernel: float activations quantized inside the GEMV. "Unfused" is the path it replaces: the per-token
# Triton quantization kernel (or, per batch, the scale computed by torch first), then the kernel on fp8 activations.
SCALE_MODES = ("token", "static")  # (a per-batch dynamic scale is computed by torch, then the kernel on fp8)


def unfused(x, qw, ws, bias, mode):
    static = torch.tensor(0.03, device=x.device) if mode == "static" else None
    xq, xs = ops.quantize_activations(x, static, mode == "batch")
    ref_q, ref_s = ops.quantize_per_token_torch(x.cpu(), None if static is None else static.cpu())
    if mode != "batch":  # the kernel path's quantization is torch's rule, bit for bit
        assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(xs.cpu(), ref_s)
    return gemv.fp8_gemv(xq, xs, qw, ws, bias, x.dtype), static


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("m", range(1, 17))
def test_fused_equals_unfused_bit_for_bit(m, mode):
    """Every batch size 1..16, odd N and K (K split into 3 programs), bfloat16 activations (a zero row: the scale
    floor), per-channel weight scales for odd M, per-tensor for even M, bias on every other M: the same bits."""
    n, k = 37, 261
    x, qw, ws, bias = make_case(m, n, k, per_tensor=m % 2 == 0, seed=100 + m)
    x = x.to(torch.bfloat16).to(DEVICE)
    x[m // 2] = 0.0
    bias = bias.to(torch.bfloat16).to(DEVICE) if m % 3 else None
    qw, ws = qw.to(DEVICE), ws.to(DEVICE)
    want, static = unfused(x, qw, ws, bias, mode)
    out = gemv.fp8_gemv_fused(x, qw, ws, static, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("m", [1, 6])
def test_fused_float32_one_program_over_k(m, mode, monkeypatch):
    """float32 activations and output (every bit of the sum visible), one program over all of K, K past several
    amax steps and a partial weight tile: the same bits as quantizing first."""
    monkeypatch.setattr(gemv, "PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(gemv, "AMAX_COLS", 64)  # amax steps: 64 columns for M > 1, 1024 for M = 1
    monkeypatch.setattr(gemv, "AMAX_ROW", 1024)
    n, k = 70, 1100
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=7 * m)
    x[:, k - 1] = 300.0  # the amax: the last column, in the last, partial step
    x, qw, ws, bias = x.to(DEVICE), qw.to(DEVICE), ws.to(DEVICE), bias.to(DEVICE)
    want, static = unfused(x, qw, ws, bias, mode)
    out = gemv.fp8_gemv_fused(x, qw, ws, static, bias)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def test_gemv_linear_skips_the_quantization_launch(monkeypatch):
    """fp8_gemv_linear quantizes separately only for batches over FUSE_MAX_M rows."""
    calls = []
    real = gemv.quantize_activations
    monkeypatch.setattr(gemv, "quantize_activations", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x, qw, ws, bias = make_case(3, 20, 48, per_tensor=False, seed=5)
    x, qw, ws = x.to(DEVICE), qw.to(DEVICE), ws.to(DEVICE)
    monkeypatch.setattr(gemv, "FUSE_MAX_M", 3)
    fused = gemv.fp8_gemv_linear(x, qw, ws, None, None)
    assert calls == []
    monkeypatch.setattr(gemv, "FUSE_MAX_M", 2)
    assert torch.equal(gemv.fp8_gemv_linear(x, qw, ws, None, None), fused) and calls == [3]


def test_fused_reads_strided_rows():
    """A [M, K] view with a row stride past K (a slice of a wider activation): the rows, not the padding."""
    wide = 4 * torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    x = wide[:, :150]
    _, qw, ws, _ = make_case(4, 24, 150, per_tensor=False, seed=9)
    x, qw, ws = x.to(DEVICE), qw.to(DEVICE), ws.to(DEVICE)
    want, _ = unfused(x.contiguous(), qw, ws, None, "token")
    assert torch.equal(gemv.fp8_gemv_fused(x, qw, ws, None, None), want)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 70, 300), (5, 130, 520), (16, 37, 261)])
def test_split_k_summed_by_the_last_program(m, n, k, with_bias, monkeypatch):
    """SPLIT_IN_KERNEL: each n-block's last program sums the split-K partials (no reduce launch): the same bits as
    the reduce kernel, twice in a row (the counters are left zeroed), fused or on fp8 activations."""
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=n + k)
    x, qw, ws = x.to(torch.bfloat16).to(DEVICE), qw.to(DEVICE), ws.to(DEVICE)
    bias = bias.to(torch.bfloat16).to(DEVICE) if with_bias else None
    assert gemv.plan(n, k, 132)[1] > 1  # K split
    xq, xs = ops.quantize_per_token_triton(x)
    want = gemv.fp8_gemv_fused(x, qw, ws, None, bias)
    want_q = gemv.fp8_gemv(xq, xs, qw, ws, bias, torch.float32)
    monkeypatch.setattr(gemv, "SPLIT_IN_KERNEL", True)
    for _ in range(2):
        assert torch.equal(gemv.fp8_gemv_fused(x, qw, ws, None, bias).view(torch.int16), want.view(torch.int16))
        assert torch.equal(gemv.fp8_gemv(xq, xs, qw, ws, bias, torch.float32), want_q)
        assert not gemv._counters[x.device].any()


@pytest.mark.parametrize("m,n,k", [(1, 70, 304), (5, 130, 512), (16, 37, 272)])
def test_weight_tiles_through_tma(m, n, k, monkeypatch):
    """W_TMA: the weight read through a tensor descriptor (zeros past N and K) gives the same bits, split or not."""
    x, qw, ws, bias = make_case(m, n, k, per_tensor=False, seed=m + k)
    x, qw, ws, bias = x.to(torch.bfloat16).to(DEVICE), qw.to(DEVICE), ws.to(DEVICE), bias.to(DEVICE)
    for programs_per_sm in (1, 0):  # K split, one program over K
        monkeypatch.setattr(gemv, "PROGRAMS_PER_SM", programs_per_sm)
        monkeypatch.setattr(gemv, "W_TMA", False)
        want = gemv.fp8_gemv_fused(x, qw, ws, None, bias)
        monkeypatch.setattr(gemv, "W_TMA", True)
        assert torch.equal(gemv.fp8_gemv_fused(x, qw, ws, None, bias).view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("w_tma", [False, True])
@pytest.mark.parametrize("split_in_kernel", [False, True])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", LLAMA_8B)
def test_fused_variants_llama_shapes(n, k, m, split_in_kernel, w_tma, monkeypatch):
    """The tuning variants (split K summed in the kernel, weight tiles through TMA) at Llama-3.1-8B shapes: the
    same bits as the plain kernel after the quantization launch."""
    torch.manual_seed(m * n + k)
    x = 4 * torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = torch.rand(n, device="cuda") / 100 + 1e-3
    qw = (torch.randn(n, k, device="cuda") / ws[:, None]).clamp(-448, 448).to(FP8)
    want, _ = unfused(x, qw, ws, None, "token")
    monkeypatch.setattr(gemv, "SPLIT_IN_KERNEL", split_in_kernel)
    monkeypatch.setattr(gemv, "W_TMA", w_tma)
    assert torch.equal(gemv.fp8_gemv_fused(x, qw, ws, None, None).view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("split_in_kernel", [False, True])
@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("n,k", LLAMA_8B)
def test_fused_equals_unfused_llama_shapes(n, k, m, mode, split_in_kernel, monkeypatch):
    """Llama-3.1-8B shapes on the GPU: the fused kernel against the Triton quantization kernel plus the GEMV (whose
    split K the reduce kernel sums), the fused kernel's split K summed by the reduce kernel or in the kernel."""
    torch.manual_seed(m + n + k)
    x = 4 * torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = torch.rand(n, device="cuda") / 100 + 1e-3
    qw = (torch.randn(n, k, device="cuda") / ws[:, None]).clamp(-448, 448).to(FP8)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want, static = unfused(x, qw, ws, bias, mode)
    monkeypatch.setattr(gemv, "SPLIT_IN_KERNEL", split_in_kernel)
    out = gemv.fp8_gemv_fused(x, qw, ws, static, bias)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
