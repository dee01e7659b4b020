"""The W4A16 / W8A16 decode GEMV (wna16_gemv.py) against the float64 GEMM of the weight dequantized by plain torch,
for 4 and 8 bits, group sizes (32, 64, 128, channel-wise, ones no K step divides), odd K and N, zero points or the
midpoint, bias, the codebook variant, batches 1..16, one K split or many (summed by the last program to arrive, or
by the reduce kernel); every tile of the bench's sweep grid through a TABLE entry; and against the tensor-core kernel
of wna16_gemm.py within accumulation-order tolerance.
Without CUDA it runs in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.layers.quantization.fp8_ops")
fp8_gemv = importlib.import_module("pagedllm.layers.quantization.fp8_gemv")
pairs = importlib.import_module("pagedllm.layers.quantization.wna16_pairs")
gemv = importlib.import_module("pagedllm.layers.quantization.wna16_gemv")
gemm = importlib.import_module("pagedllm.layers.quantization.wna16_gemm")
if DEVICE.type == "cpu" and type(gemv.wna16_gemv_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on
    fp8_gemv = importlib.reload(fp8_gemv)
    pairs = importlib.reload(pairs)  # (its step: called by the GEMV's kernel)
    gemv = importlib.reload(gemv)
    gemm = importlib.reload(gemm)

from pagedllm.layers.quantization.int_packing import pack_int32  # noqa: E402


def make_case(m, n, k, bits, group, asym, bias, seed, dtype=torch.float32, codebook=False):
    """x [M, K], K-packed qweight, scales / zeros [ceil(K / group), N], bias [N], codebook [2**bits] or None, and the
    float64 reference weight [K, N] from the unpacked values (not from the packing under test)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)  # [K, N] unsigned values
    scales = torch.rand(groups, n, generator=g) / 20 + 1e-3
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).float() if asym else None
    zero = zeros.double() if asym else torch.full((groups, n), float(1 << (bits - 1)), dtype=torch.float64)
    rows = torch.arange(k) // group
    table = torch.randn(1 << bits, generator=g) if codebook else None
    values = table.double()[q] if codebook else q.double() - zero[rows]
    w = values * scales.double()[rows]  # [K, N]
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    qweight = pack_int32(q, bits, dim=0)  # [ceil(K / pack), N]
    tensors = (x, qweight, scales, None if codebook else zeros, b, table)
    return (*(t.to(DEVICE) if t is not None else None for t in tensors), w)


def reference(x, w, bias):
    out = x.double().cpu() @ w
    return out + bias.double().cpu() if bias is not None else out


def assert_close(out, ref, dtype):
    scale = ref.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol * scale)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough for the interpreter (and for several column blocks and K splits on tiny shapes)."""
    monkeypatch.setattr(gemv, "CONFIGS", {bm: (32, 32, 1, 4) for bm in (1, 2, 4, 8)})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "n,k,group", [(17, 64, 32), (70, 256, 64), (40, 130, 128), (33, 96, 96), (48, 200, 40), (24, 40, 8)]
)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_gemv(bits, n, k, group, m, small_tiles):
    asym, bias = (m + n) % 2 == 0, m % 2 == 1
    x, qweight, scales, zeros, b, _, w = make_case(m, n, k, bits, group, asym, bias, seed=m * 1000 + n + k)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, bits, group)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_close(out, reference(x, w, b), torch.float32)


# (the interpreter: two of the four, zero points meet the split sums nowhere; CUDA all four)
SPLIT_K_CASES = [(4, True), (8, False)] + ([(4, False), (8, True)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("bits, asym", SPLIT_K_CASES)
@pytest.mark.parametrize("fused", [True, False])
def test_split_k_reduction(bits, asym, fused, small_tiles, monkeypatch):
    """Many K splits (one program per SM wanted on 64 SMs) summed by the last program to arrive or by the reduce
    kernel: the reference numbers, the same bits on a rerun, and the arrival counters left zeroed."""
    monkeypatch.setattr(gemv, "FUSED_REDUCE", fused)
    monkeypatch.setattr(gemv, "sm_count", lambda device: 64)
    x, qweight, scales, zeros, b, _, w = make_case(5, 70, 512, bits, 64, asym, True, seed=9)
    splits, k_split = gemv.plan_splits(70, 512, 32, 32, 4, 64)
    assert (splits, k_split) == (16, 32)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, bits, 64)
    assert_close(out, reference(x, w, b), torch.float32)
    assert torch.equal(out, gemv.wna16_gemv(x, qweight, scales, zeros, b, bits, 64))
    if fused:
        assert int(gemv._counters[x.device].abs().sum()) == 0


@pytest.mark.parametrize("n,k,group", [(17, 96, 32), (70, 256, 64), (33, 200, 8)])
@pytest.mark.parametrize("m", [1, 5])
def test_codebook(n, k, group, m, small_tiles):
    """bitsandbytes' nf4 / fp4 form: w = codebook[q] * scale."""
    x, qweight, scales, zeros, b, table, w = make_case(m, n, k, 4, group, False, True, seed=n + m, codebook=True)
    out = gemv.wna16_gemv(x, qweight, scales, None, b, 4, group, table)
    assert_close(out, reference(x, w, b), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4])
def test_half_precision_activations(dtype, m, small_tiles):
    x, qweight, scales, zeros, b, _, w = make_case(m, 64, 128, 4, 32, True, True, seed=4, dtype=dtype)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, 32)
    assert out.dtype == dtype
    assert_close(out, reference(x, w, b), dtype)


@pytest.mark.parametrize("bits,group,asym", [(4, 32, True), (4, 128, False), (8, 64, True), (4, 24, True)])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_matches_tensor_core_kernel(bits, group, asym, m, small_tiles):
    """The GEMV and wna16_gemm's kernel: the same numbers up to the order of float32 accumulation."""
    x, qweight, scales, zeros, b, _, _ = make_case(m, 45, 256, bits, group, asym, True, seed=m + group)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, bits, group)
    ref = gemm.wna16_gemm(x, qweight, scales, zeros, b, bits, group)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("m,k", [(1, 64), (3, 70)])
def test_act_order_permutation(m, k, small_tiles):
    """perm: the weight's row k multiplies input feature perm[k], read inside the kernel (no gather launch)."""
    x, qweight, scales, zeros, b, _, w = make_case(m, 24, k, 4, 16, True, True, seed=m + k)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, 16, None, perm.to(DEVICE))
    assert_close(out, reference(x.cpu()[:, perm], w, b), torch.float32)


def test_fused_and_unfused_reductions_agree(small_tiles, monkeypatch):
    """The last program's sum and the reduce kernel's add the same partials in the same order: the same bits."""
    monkeypatch.setattr(gemv, "sm_count", lambda device: 64)
    x, qweight, scales, zeros, b, _, _ = make_case(3, 40, 256, 4, 32, True, True, seed=5)
    fused = gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, 32)
    monkeypatch.setattr(gemv, "FUSED_REDUCE", False)
    assert torch.equal(fused, gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, 32))


def test_block_k_choice():
    """One scale row per K step wherever a step of at least two words divides the group; channel-wise scales take
    the widest step whatever K is."""
    assert gemv.block_k_for(128, 4, 4096, 128) == (128, True)
    assert gemv.block_k_for(32, 4, 4096, 128) == (32, True)
    assert gemv.block_k_for(8, 4, 4096, 128) == (128, False)  # one word per step: the gather instead
    assert gemv.block_k_for(8, 8, 4096, 128) == (8, True)
    assert gemv.block_k_for(4100, 4, 4100, 128) == (128, True)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        gemv.wna16_gemv(*make_case(9, 8, 32, 4, 32, False, False, seed=0)[:5], 4, 32)


def test_linear_routes_decode_batches(monkeypatch):
    """wna16_linear sends batches of at most GEMV_MAX_M rows to the GEMV (on CUDA) and larger ones elsewhere."""
    calls = []
    monkeypatch.setattr(gemm, "wna16_gemv", lambda *a: calls.append(a[0].shape[0]) or gemv.wna16_gemv(*a))
    monkeypatch.setattr(gemm, "gemv_applies", lambda x2, codebook: 0 < x2.shape[0] <= gemv.GEMV_MAX_M)
    for m in (1, gemv.GEMV_MAX_M, gemv.GEMV_MAX_M + 1):
        x, qweight, scales, zeros, b, _, w = make_case(m, 16, 64, 4, 32, True, False, seed=m)
        out = gemm.wna16_linear(x, qweight, scales, zeros, b, None, 4, 32)
        assert_close(out, reference(x, w, b), torch.float32)
    assert calls == [1, gemv.GEMV_MAX_M]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    x, qweight, scales, zeros, b, _, w = make_case(2, 16, 64, 4, 32, True, False, seed=4)
    out = gemm.wna16_linear(x, qweight, scales, zeros, b, perm.to(DEVICE), 4, 32)  # the GEMV applies perm itself
    assert_close(out, reference(x.cpu()[:, perm], w, b), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("group,asym", [(128, False), (32, True), (-1, False)])
def test_llama_shapes_on_gpu(n, k, m, group, asym):
    """Llama-3.1-8B shapes in bfloat16 with the shipped tiles: the reference, and the tensor-core kernel."""
    group = k if group == -1 else group
    x, qweight, scales, zeros, b, _, w = make_case(m, n, k, 4, group, asym, False, seed=m, dtype=torch.bfloat16)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, group)
    assert_close(out, reference(x, w, None), torch.bfloat16)
    assert torch.equal(out, gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, group))  # bit-reproducible
    ref = gemm.wna16_gemm(x, qweight, scales, zeros, None, 4, group)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


# (the interpreter ignores pipelining: stages 4 runs stages 2's code there, so only CUDA runs it)
SWEEP_CASES = [
    (m, tile)
    for m in (1, 2, 3)
    for tile in gemv.sweep_tiles(gemv.block_m_for(m))
    if DEVICE.type == "cuda" or tile[3] != 4
]


@pytest.mark.parametrize("case", range(len(SWEEP_CASES)))
def test_sweep_tiles(case, monkeypatch):
    """Every tile the bench's --sweep may put in TABLE (pipelined or not), through a TABLE entry with K split in two:
    odd N, a K that leaves a masked last step, one group per step or channel-wise scales, zero points or the
    midpoint, act order on or off; the float64 reference."""
    m, (block_n, block_k, warps, stages) = SWEEP_CASES[case]
    n, k = block_n + 37, 3 * block_k + 24  # two column blocks, the last partial; K past whole steps
    group, asym, act_order = [(2 * block_k, True, False), (k, False, True), (8, True, True)][case % 3]
    monkeypatch.setattr(gemv, "TABLE", {(4, gemv.block_m_for(m), n, k, False): (block_n, block_k, warps, 2, stages)})
    x, qweight, scales, zeros, b, _, w = make_case(m, n, k, 4, group, asym, case % 2 == 0, seed=case)
    cfg = gemv.gemv_config(m, n, k, 4, group, act_order, 132)
    assert (cfg.block_n, cfg.warps, cfg.splits, cfg.stages) == (block_n, warps, 2, stages)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(case)) if act_order else None
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, group, None, None if perm is None else perm.to(DEVICE))
    assert_close(out, reference(x.cpu() if perm is None else x.cpu()[:, perm], w, b), torch.float32)


def test_table_lookup(monkeypatch):
    """TABLE's entry for the shape and batch wins over CONFIGS (an act-order shape falls back to its plain entry);
    its splits are a count, capped by K's steps; BLOCK_K halves at 8 bits and shrinks to divide the group."""
    monkeypatch.setattr(gemv, "TABLE", {(4, 1, 6144, 4096, False): (128, 64, 1, 8, 2)})
    assert gemv.gemv_config(1, 6144, 4096, 4, 128, True, 132) == gemv.GemvConfig(1, 128, 64, 1, 8, 512, 2, True)
    assert gemv.gemv_config(1, 6144, 4096, 4, 32, False, 132).block_k == 32
    assert gemv.gemv_config(2, 6144, 4096, 4, 128, False, 132).stages == 1  # no entry: CONFIGS, not pipelined
    monkeypatch.setattr(gemv, "TABLE", {(8, 1, 6144, 4096, False): (128, 64, 1, 1000, 2)})
    assert gemv.gemv_config(1, 6144, 4096, 8, 128, False, 132)[2:6] == (32, 1, 128, 32)
