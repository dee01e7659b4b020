"""The one-row (M = 1) step of the W4A16 GEMV (wna16_gemv.py) for bfloat16 activations: two 4-bit values per
instruction in bf16x2 arithmetic (PTX fma.rn.bf16x2: sm_80 and later).

It takes the calls with M = 1, 4 bits, one group per K step, no codebook, no act-order permutation, x bfloat16 and
K % 8 == 0 (pairs_apply); everything else keeps the float32 path. Per packed word w (values 0..7 of input features
8r..8r+7 at bits [4j, 4j + 4)), one inline-asm block:
- 3 shifts (w >> 4, w >> 8, w >> 12) and 4 lop3 (t_i = ((w >> 4i) & 0x000F000F) | 0x43004300): lane lo of t_i
  holds the bfloat16 128 + value i, lane hi 128 + value i + 4 (exact: a bfloat16 at exponent 2**7 has ulp 1);
- 4 fma.rn.bf16x2 t_i * 1 + NZ, NZ the bfloat16 -(128 + zero) in both lanes: the integers v - zero, exact for an
  integer zero point of magnitude up to 127 (128 + zero then fits bfloat16's 8 bits). The checkpoints' zero points
  are such integers (AWQ and compressed-tensors 0..15, GPTQ 1..16 with its offset); any other zero point would be
  truncated to bfloat16 here (a wrong result), so the float32 path is the one for those;
- 4 fma.rn.bf16x2 acc = t_i * XP_i + acc (the first onto zero), XP_i the activations x[8r + i] (lo) and
  x[8r + i + 4] (hi) as a bf16x2 pair, built once per K row outside the asm (shared by every column);
- the two lanes of acc to float32 (a shift and a mask) and added: the word's unscaled dot with its 8 activations.
The words' dots are summed over the step's rows in float32 and multiplied by the group's scale once per step, as
the float32 path does.

Rounding: the products and the 4-term lane sums round to bfloat16 (round to nearest even; 8 significant bits, so
each rounding moves a value by at most 2**-8 of it: half an ulp, on average about 2**-10); a word's dot carries 4
such roundings per lane (the first product and the 3 fma), every later sum is float32. So against the float32 path
a K-long dot moves by at most about 4 * 2**-8 * sum_k |x_k * (q_k - zero)| * scale (2**-6 of the dot's absolute
sum), in practice (independent errors of random signs) far less: tests/kernels/test_triton_wna16_pairs.py.

Where inline asm cannot run (Triton's CPU interpreter, non-CUDA devices), pair_dots_emulated computes the same
rounding points in float32 arithmetic: each product is exact in float32 (an integer below 2**8 times a bfloat16), the
add onto the bfloat16 accumulator is an exact two-sum (float32 sum and its error), and the rounding to bfloat16 is
round-to-nearest-even on the bits, the error breaking ties as a fused operation would: it rounds as fma.rn.bf16x2
does (bitwise, unless subnormal bfloat16 values arise), so at worst within one bfloat16 ulp of it per fma."""

from __future__ import annotations

import torch

from pagedllm.kernels import interpreting
from pagedllm.layers.quantization.fp8_ops import triton

FORCE_EMULATION = False  # tests: the emulated step on CUDA too (it should match the asm bit for bit)


def pairs_apply(x2: torch.Tensor, bits: int, one_group: bool, codebook=None, perm=None) -> bool:
    """Whether the GEMV call of x2 [M, K] may take the bf16x2 step: one bfloat16 row, 4 bits, one group per K step,
    no codebook, no act-order permutation, whole packed words of K (and x 4-byte aligned: its pairs load as int32)."""
    m, k = x2.shape
    return (
        m == 1 and bits == 4 and one_group and codebook is None and perm is None and x2.dtype == torch.bfloat16
        and k % 8 == 0 and x2.data_ptr() % 4 == 0
    )  # fmt: skip


def pairs_mode(x2: torch.Tensor) -> int:
    """The kernel's PAIRS constexpr for a call pairs_apply admits: 1 the inline asm, 2 its emulation (no CUDA, or
    Triton's interpreter, or FORCE_EMULATION)."""
    return 2 if FORCE_EMULATION or not x2.is_cuda or interpreting() else 1


if triton is not None:
    import triton.language as tl

    # bf16x2 constants: -(128 + 8) in both lanes (no zero points: the 4-bit midpoint); the lane masks of values i
    # and i + 4; 128.0 in both lanes
    NZ_MIDPOINT_X2 = tl.constexpr(-1022835960)  # 0xC308C308 as int32
    LOW_NIBBLES, BIAS_128 = tl.constexpr(0x000F000F), tl.constexpr(0x43004300)
    # $0: the word's dot (float32); $1: the word; $2..$5: XP_0..XP_3; $6: NZ (bf16x2 -(128 + zero) in both lanes)
    PAIR_DOTS_PTX = tl.constexpr("""{
    .reg .b32 s1, s2, s3, t0, t1, t2, t3, one, acc, lo, hi;
    shr.u32 s1, $1, 4;
    shr.u32 s2, $1, 8;
    shr.u32 s3, $1, 12;
    lop3.b32 t0, $1, 0x000F000F, 0x43004300, 0xEA;
    lop3.b32 t1, s1, 0x000F000F, 0x43004300, 0xEA;
    lop3.b32 t2, s2, 0x000F000F, 0x43004300, 0xEA;
    lop3.b32 t3, s3, 0x000F000F, 0x43004300, 0xEA;
    mov.b32 one, 0x3F803F80;
    fma.rn.bf16x2 t0, t0, one, $6;
    fma.rn.bf16x2 t1, t1, one, $6;
    fma.rn.bf16x2 t2, t2, one, $6;
    fma.rn.bf16x2 t3, t3, one, $6;
    mov.b32 acc, 0;
    fma.rn.bf16x2 acc, t0, $2, acc;
    fma.rn.bf16x2 acc, t1, $3, acc;
    fma.rn.bf16x2 acc, t2, $4, acc;
    fma.rn.bf16x2 acc, t3, $5, acc;
    shl.b32 lo, acc, 16;
    and.b32 hi, acc, 0xFFFF0000;
    add.f32 $0, lo, hi;
    }""")

    @triton.jit
    def pair_dots(w, xp0, xp1, xp2, xp3, nz):
        """Per packed word w (int32, any shape; the other operands broadcast to it): sum over i < 8 of
        x[i] * (value i - zero) as float32, in bf16x2 (the module's docstring)."""
        return tl.inline_asm_elementwise(
            PAIR_DOTS_PTX, "=r,r,r,r,r,r,r", [w, xp0, xp1, xp2, xp3, nz], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def lane_lo(v):
        """The low bfloat16 lane of int32 v as float32 (exact)."""
        return (v << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def lane_hi(v):
        """The high bfloat16 lane of int32 v as float32 (exact)."""
        return (v & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def bf16_fma(a, b, c):
        """fma.rn.bf16x2 on one lane, all float32 holding bfloat16 values, a * b exact in float32 (a a small integer):
        the exact a * b + c rounded once to bfloat16 (nearest even) as float32. The two-sum's error e decides the
        float32 sums that fall on a bfloat16 tie (the exact sum lies off it, on e's side)."""
        p = a * b
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)
        bits = s.to(tl.int32, bitcast=True)
        nearest = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        away = (bits + 0x8000) & -65536  # a tie rounded away from zero
        toward = bits & -65536
        off_tie = ((bits & 0xFFFF) == 0x8000) & (e != 0.0)
        r = tl.where(off_tie, tl.where((e > 0.0) == (s > 0.0), away, toward), nearest)
        return r.to(tl.float32, bitcast=True)

    @triton.jit
    def pair_dots_emulated(w, xp0, xp1, xp2, xp3, nz):
        """pair_dots in float32 arithmetic (no inline asm: the interpreter, CPU) with the same rounding points."""
        nz_lo, nz_hi = lane_lo(nz), lane_hi(nz)
        acc_lo = tl.zeros(w.shape, tl.float32)
        acc_hi = acc_lo
        for i in tl.static_range(4):
            t = ((w >> (4 * i)) & LOW_NIBBLES) | BIAS_128  # lanes: 128 + value i, 128 + value i + 4 (bfloat16)
            if i == 0:
                xp = xp0
            elif i == 1:
                xp = xp1
            elif i == 2:
                xp = xp2
            else:
                xp = xp3
            acc_lo = bf16_fma(lane_lo(t) + nz_lo, lane_lo(xp), acc_lo)  # (128 + v) - (128 + zero): exact
            acc_hi = bf16_fma(lane_hi(t) + nz_hi, lane_hi(xp), acc_hi)
        return acc_lo + acc_hi

    @triton.jit
    def activation_pairs(x_ptr, start, offs_r, K, MASKED: tl.constexpr):
        """x[start + 8r + i] (lo) and x[start + 8r + i + 4] (hi) as int32 bf16x2 pairs XP_0..XP_3 [ROWS], from x
        read as int32 words (two activations each; zeros past K when MASKED)."""
        xw = x_ptr.to(tl.pointer_type(tl.int32)) + (start // 2 + offs_r * 4)
        if MASKED:
            in_k = start + offs_r * 8 < K
            a, b = tl.load(xw, mask=in_k, other=0), tl.load(xw + 1, mask=in_k, other=0)
            c, d = tl.load(xw + 2, mask=in_k, other=0), tl.load(xw + 3, mask=in_k, other=0)
        else:
            a, b, c, d = tl.load(xw), tl.load(xw + 1), tl.load(xw + 2), tl.load(xw + 3)  # x 0-1, 2-3, 4-5, 6-7
        xp0 = (a & 0xFFFF) | (c << 16)
        xp1 = ((a >> 16) & 0xFFFF) | (c & -65536)
        xp2 = (b & 0xFFFF) | (d << 16)
        xp3 = ((b >> 16) & 0xFFFF) | (d & -65536)
        return xp0, xp1, xp2, xp3

    @triton.jit
    def pairs_step(
        x_ptr, qw_ptr, z_ptr, start, offs_n, mask_n, N, K, group_size,
        HAS_ZP: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EMULATE: tl.constexpr,
    ):  # fmt: skip
        """gemv_step for one bfloat16 row of 4-bit weights, one group per step: sum over k in [start, start + BLOCK_K)
        of x[k] * (q[k, n] - zero[n]) -> [BLOCK_N] float32 (unscaled). MASKED: the step may pass K (a multiple of 8:
        rows are whole or out). EMULATE: pair_dots_emulated instead of the inline asm."""
        ROWS: tl.constexpr = BLOCK_K // 8
        offs_r = tl.arange(0, ROWS)
        w_ptrs = qw_ptr + (start // 8) * N + (offs_r[:, None] * N + offs_n[None, :])  # [ROWS, BLOCK_N]
        if MASKED:
            words = tl.load(w_ptrs, mask=(start + offs_r * 8 < K)[:, None] & mask_n[None, :], other=0)
        else:
            words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
        xp0, xp1, xp2, xp3 = activation_pairs(x_ptr, start, offs_r, K, MASKED)
        if HAS_ZP:  # -(128 + zero) is exact in bfloat16 (an integer zero point): its float32 bits' upper half
            z = tl.load(z_ptr + (start // group_size) * N + offs_n, mask=mask_n, other=0.0)
            nz = (-128.0 - z).to(tl.int32, bitcast=True) & -65536
            nz = nz | ((nz >> 16) & 0xFFFF)  # [BLOCK_N] in both lanes
        else:
            nz = tl.full((BLOCK_N,), NZ_MIDPOINT_X2, tl.int32)
        if EMULATE:
            d = pair_dots_emulated(words, xp0[:, None], xp1[:, None], xp2[:, None], xp3[:, None], nz[None, :])
        else:
            d = pair_dots(words, xp0[:, None], xp1[:, None], xp2[:, None], xp3[:, None], nz[None, :])
        return tl.sum(d, axis=0)
