"""The bf16x2 step of the W4A16 GEMV (wna16_pairs.py: one bfloat16 row, 4 bits, one group per K step) against the
float32 step and the float64 reference: exact on integer activations (every bfloat16 product and 4-term sum exact),
within the bfloat16 rounding bound on random ones, taken only where pairs_apply admits the call. Without CUDA the
kernel runs in Triton's interpreter with the step's emulation (pair_dots_emulated); on a GPU with the inline PTX,
also checked bit for bit against the emulation compiled.

The tolerance: bfloat16 has 8 significant bits, so each rounding moves a value by at most 2**-8 of it (unit roundoff
u = 2**-8: half an ulp of 2**-7 at 1.0). A lane of a word sums 4 products x_i * (q_i - zero) with 4 roundings (the
first product, then 3 fma), each at most u times the sum of the |products| so far, so a word's dot is off by at most
4u * sum_i |x_i * (q_i - zero)|; the float32 sums after it and the scale add about 2**-24 each. So the output is off
the float64 reference by at most 4u * (|x| @ |W|)[n] plus the output's own rounding to bfloat16, u * |out|."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_triton_wna16_gemv import DEVICE, gemv, make_case, reference  # (tests/kernels: conftest's interpreter)

from pagedllm.layers.quantization.fp8_ops import triton
from pagedllm.layers.quantization.int_packing import pack_int32

pairs = importlib.import_module("pagedllm.layers.quantization.wna16_pairs")
if triton is not None:
    import triton.language as tl
U = 2.0**-8  # bfloat16's unit roundoff


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough for the interpreter, several column blocks and K splits on tiny shapes."""
    monkeypatch.setattr(gemv, "CONFIGS", {bm: (32, 32, 1, 4) for bm in (1, 2, 4, 8)})


@pytest.fixture
def taken(monkeypatch):
    """The list of pairs_apply's answers for the GEMV calls of the test (spied on where wna16_gemv calls it)."""
    answers = []

    def spy(*args, **kwargs):
        answers.append(pairs.pairs_apply(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(gemv, "pairs_apply", spy)
    return answers


def float32_step(monkeypatch, *args):
    """wna16_gemv(*args) with the bf16x2 step off."""
    with monkeypatch.context() as m:
        m.setattr(gemv, "PAIRS", False)
        return gemv.wna16_gemv(*args)


def integer_case(n, k, group, zero, seed):
    """x [1, K] bfloat16 small integers (|x| <= 4), q [K, N] random 4-bit, zeros [groups, N] all `zero` (None: the
    kernel's midpoint 8; "random": 0..15), scales powers of two: every product (at most 60 in magnitude), lane sum
    (at most 240) and dot is an integer bfloat16 and float32 hold exactly. Returns the kernel's inputs and the float64
    weight [K, N]."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=g)
    if zero is None:
        zeros, zero_of = None, torch.full((groups, n), 8.0)
    else:
        zeros = (
            torch.randint(0, 16, (groups, n), generator=g).float()
            if zero == "random"
            else torch.full((groups, n), float(zero))
        )
        zero_of = zeros
    scales = 2.0 ** torch.randint(-3, 2, (groups, n), generator=g).float()
    rows = torch.arange(k) // group
    w = (q.double() - zero_of.double()[rows]) * scales.double()[rows]
    x = torch.randint(-4, 5, (1, k), generator=g).to(torch.bfloat16)
    tensors = (x, pack_int32(q, 4, dim=0), scales, zeros)
    return (*(t.to(DEVICE) if t is not None else None for t in tensors), w)


@pytest.mark.parametrize("zero", [None, 0, 8, 15, "random"])
@pytest.mark.parametrize("n,k,group", [(40, 128, 32), (33, 72, 72)])
def test_integer_activations_exact(zero, n, k, group, small_tiles, taken, monkeypatch):
    """Integer activations and power-of-two scales: the bf16x2 step's result is exact, so the output is the float64
    reference rounded to bfloat16, bit for bit the float32 step's. (72: a masked last K step; 40 / 33: a partial
    column block.)"""
    x, qweight, scales, zeros, w = integer_case(n, k, group, zero, seed=k + n)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, group)
    assert taken == [True]
    assert torch.equal(out.cpu(), reference(x, w, None).to(torch.bfloat16))
    assert torch.equal(out, float32_step(monkeypatch, x, qweight, scales, zeros, None, 4, group))


def within_bound(out, x, w, bias=None):
    """out against the float64 reference within the bfloat16 bound of the module docstring (plus 1e-6 of the largest
    |x| @ |W| for the float32 sums); returns the largest error as a fraction of its bound."""
    ref = reference(x, w, bias)
    absdot = x.double().abs().cpu() @ w.abs()
    bound = 4 * U * absdot + U * ref.abs() + 1e-6 * absdot.max()
    err = (out.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"off the bound by up to {(err / bound).max().item():.3g}x"
    return (err / bound).max().item()


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("n,k,group", [(64, 256, 64), (37, 96, 32)])
def test_random_activations(asym, n, k, group, small_tiles, taken, monkeypatch):
    """bfloat16 random activations: the reference within the bound (module docstring); the bf16x2 step ran."""
    x, qweight, scales, zeros, b, _, w = make_case(1, n, k, 4, group, asym, True, seed=n + k, dtype=torch.bfloat16)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, group)
    assert taken == [True] and out.dtype == torch.bfloat16
    within_bound(out, x, w, b)
    within_bound(float32_step(monkeypatch, x, qweight, scales, zeros, b, 4, group), x, w, b)
    assert taken == [True]  # PAIRS off: not asked


def test_pairs_apply(small_tiles, taken, monkeypatch):
    """Only one bfloat16 row of 4-bit weights with one group per step, no codebook nor permutation, K % 8 == 0."""
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert pairs.pairs_apply(x, 4, True)
    assert not pairs.pairs_apply(x.half(), 4, True)
    assert not pairs.pairs_apply(torch.randn(2, 64).to(torch.bfloat16), 4, True)
    assert not pairs.pairs_apply(x, 8, True)
    assert not pairs.pairs_apply(x, 4, False)
    assert not pairs.pairs_apply(x, 4, True, codebook=torch.zeros(16))
    assert not pairs.pairs_apply(x, 4, True, perm=torch.arange(64))
    assert not pairs.pairs_apply(torch.randn(1, 68).to(torch.bfloat16), 4, True)
    assert not pairs.pairs_apply(torch.randn(1, 65).to(torch.bfloat16)[:, 1:], 4, True)  # x not 4-byte aligned
    # through the GEMV: float16, two rows, a K of odd words, a group no step divides, the codebook, act order
    for m, k, group, dtype in [(1, 64, 32, torch.float16), (2, 64, 32, torch.bfloat16), (1, 60, 60, torch.bfloat16)]:
        x, qweight, scales, zeros, b, _, w = make_case(m, 16, k, 4, group, True, False, seed=k, dtype=dtype)
        gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, group)
    x, qweight, scales, _, b, table, w = make_case(1, 16, 64, 4, 32, False, False, seed=1, codebook=True)
    gemv.wna16_gemv(x.to(torch.bfloat16), qweight, scales, None, b, 4, 32, table)
    x, qweight, scales, zeros, b, _, w = make_case(1, 16, 64, 4, 32, True, False, seed=2, dtype=torch.bfloat16)
    gemv.wna16_gemv(x, qweight, scales, zeros, b, 4, 32, None, torch.randperm(64).to(DEVICE))
    assert taken == [False] * 5
    monkeypatch.setattr(pairs, "interpreting", lambda: False)
    assert pairs.pairs_mode(x) == (1 if x.is_cuda else 2)  # the inline asm on CUDA, else its emulation


if triton is not None:

    @triton.jit
    def dots_kernel(w_ptr, xp_ptr, nz_ptr, out_ptr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        """out[j] = pair_dots(w[j], xp[j, 0..3], nz[j]) (or its emulation)."""
        offs = tl.arange(0, BLOCK)
        w, nz = tl.load(w_ptr + offs), tl.load(nz_ptr + offs)
        xp0, xp1 = tl.load(xp_ptr + 4 * offs), tl.load(xp_ptr + 4 * offs + 1)
        xp2, xp3 = tl.load(xp_ptr + 4 * offs + 2), tl.load(xp_ptr + 4 * offs + 3)
        if EMULATE:
            d = pairs.pair_dots_emulated(w, xp0, xp1, xp2, xp3, nz)
        else:
            d = pairs.pair_dots(w, xp0, xp1, xp2, xp3, nz)
        tl.store(out_ptr + offs, d)


def bf16_round(t):
    """float64 -> the nearest bfloat16 value (ties to even) as float64, in one rounding (torch's float64 ->
    bfloat16 cast goes through float32: two)."""
    m, e = torch.frexp(t)  # t = m * 2**e, 0.5 <= |m| < 1
    return torch.ldexp(torch.round(m * 256.0), e - 8)  # 8 significant bits; torch.round: half to even


def lanes_of(x, j):
    """int32 words [W] with the bfloat16 x[:, j] (lo) and x[:, j + 4] (hi) of x [W, 8]."""
    bits = x.view(torch.int16).int() & 0xFFFF
    return bits[:, j] | (bits[:, j + 4] << 16)


@pytest.mark.parametrize("emulate", [True, False])
def test_pair_dots_rounding(emulate):
    """pair_dots per word against a float64 model: per lane acc = bf16(acc + x_i * (v_i - zero)) rounded once
    (ties to even) after each of the 4 fma, then float32(lo + hi). Activations whose products and sums fall on and
    near bfloat16 midpoints over a wide exponent range (2**-16..2**16: float64 sums stay exact, float32 ones do not),
    so float32-then-bfloat16 double rounding would differ somewhere (asserted). The inline PTX on a GPU only."""
    if not emulate and DEVICE.type != "cuda":
        pytest.skip("inline PTX needs a CUDA GPU")
    g = torch.Generator().manual_seed(7)
    words_n = 4096
    q = torch.randint(0, 16, (words_n, 8), generator=g)
    zero = torch.randint(0, 16, (words_n,), generator=g).double()
    mant = 1 + torch.randint(0, 128, (words_n, 8), generator=g) / 128
    x = (mant * torch.where(torch.rand(words_n, 8, generator=g) < 0.5, -1.0, 1.0)
         * 2.0 ** torch.randint(-16, 16, (words_n, 8), generator=g)).to(torch.bfloat16)  # fmt: skip
    w = (q.long() << (4 * torch.arange(8))).sum(1)
    w = torch.where(w >= 1 << 31, w - (1 << 32), w).int()
    xp = torch.stack([lanes_of(x, j) for j in range(4)], 1).contiguous()  # [W, 4]
    nz_bits = (-(128.0 + zero)).float().view(torch.int32) >> 16 & 0xFFFF
    nz = (nz_bits | (nz_bits << 16)).int()
    out = torch.empty(words_n, dtype=torch.float32, device=DEVICE)
    dots_kernel[(1,)](w.to(DEVICE), xp.to(DEVICE), nz.to(DEVICE), out, BLOCK=words_n, EMULATE=emulate)
    d = q.double() - zero[:, None]  # [W, 8]
    xs = x.double()
    acc = torch.zeros(words_n, 2, dtype=torch.float64)  # lanes lo (values 0..3), hi (values 4..7)
    twice = acc.clone()  # the same with float32 then bfloat16 rounding
    for i in range(4):
        p = torch.stack([xs[:, i] * d[:, i], xs[:, i + 4] * d[:, i + 4]], 1)
        acc = bf16_round(acc + p)
        twice = (twice + p).float().to(torch.bfloat16).double()
    expected = acc[:, 0].float() + acc[:, 1].float()  # float32 add.f32 (float64 could round first)
    assert torch.equal(out.cpu(), expected)
    assert not torch.equal(acc, twice)  # the inputs reach the cases that tell single from double rounding


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("asym", [False, True])
def test_llama_shapes_on_gpu(n, k, asym, taken, monkeypatch):
    """Llama-3.1-8B's qkv and down projections, group 128, shipped tiles: the reference within the bound, the float32
    step within twice it, the same bits on a rerun, and the inline PTX bit for bit its compiled emulation."""
    x, qweight, scales, zeros, _, _, w = make_case(1, n, k, 4, 128, asym, False, seed=n + k, dtype=torch.bfloat16)
    out = gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, 128)
    assert taken == [True] and pairs.pairs_mode(x) == 1
    within_bound(out, x, w)
    assert torch.equal(out, gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, 128))
    f32 = float32_step(monkeypatch, x, qweight, scales, zeros, None, 4, 128)
    absdot = x.double().abs().cpu() @ w.abs()
    diff, f32 = (out.double() - f32.double()).abs().cpu(), f32.double().cpu()
    assert bool((diff <= 4 * U * absdot + 2 * U * f32.abs() + 1e-6 * absdot.max()).all())
    monkeypatch.setattr(pairs, "FORCE_EMULATION", True)
    assert torch.equal(out, gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("zero", [None, 0, 8, 15, "random"])
def test_ptx_matches_emulation_on_gpu(zero, taken, monkeypatch):
    """The inline PTX and pair_dots_emulated compiled, on random and integer activations: the same bits."""
    for seed, dtype_case in enumerate(("integer", "random")):
        x, qweight, scales, zeros, w = integer_case(4096, 4096, 128, zero, seed=seed)
        if dtype_case == "random":
            x = torch.randn(1, 4096, device=DEVICE).to(torch.bfloat16) * 3
        out = gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, 128)
        with monkeypatch.context() as m:
            m.setattr(pairs, "FORCE_EMULATION", True)
            emulated = gemv.wna16_gemv(x, qweight, scales, zeros, None, 4, 128)
        assert torch.equal(out, emulated), dtype_case
        within_bound(out, x, w)
    assert taken == [True] * 4
