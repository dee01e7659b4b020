"""The small fused ops of the decoder layers in Triton: RMSNorm (optionally fused with the residual add before it),
SiLU-and-mul (both optionally quantizing their output to fp8 per token for the FP8 linear after them), and
neox-style rotary of q and k in one launch (with Qwen3's per-head RMSNorm before it). Each
rounds where the torch layer code rounds (the residual sum and the normalized activations in the model dtype), so
the two paths agree to the last bit or two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import pdl


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def wait_previous_kernel(USE_PDL: tl.constexpr):
    """A kernel's first step under programmatic dependent launch (kernels/__init__.py: pdl): wait for the kernel
    before it to finish, then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def fp8_scale_of(amax):
    """A row's scale from its float32 amax: max(amax / 448, 1 / (448 * 512)), IEEE-rounded as torch divides."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def fp8_quantize(x, scale):
    """float32 x / scale clamped to the e4m3 range, as fp8 (IEEE division: torch's rounding to fp8)."""
    return tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def store_row(out_ptr, scale_ptr, row, offs, ok, y, QUANT: tl.constexpr):
    """A row of a layer's output y (float32, holding values of out_ptr's dtype) stored as they are, or QUANT: as
    fp8 with the row's scale (scale_ptr [rows]), what the per-token quantization of the stored row would give."""
    if QUANT:
        scale = fp8_scale_of(tl.max(tl.where(ok, tl.abs(y), 0.0), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + offs, fp8_quantize(y, scale), mask=ok)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [num_outer, num_inner, N] (any strides on the two outer dims: a [tokens, heads, dim] view works)
    res_ptr,  # [num_rows, N] residual (HAS_RESIDUAL)
    out_ptr,  # [num_rows, N]
    res_out_ptr,  # [num_rows, N] x + residual (HAS_RESIDUAL)
    w_ptr,  # [N]
    scale_ptr,  # [num_rows] float32: each row's fp8 scale (QUANT: out_ptr is fp8)
    eps,
    num_inner,
    stride_x_outer,
    stride_x_inner,
    stride_res,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x_off = (row // num_inner) * stride_x_outer + (row % num_inner) * stride_x_inner
    x = tl.load(x_ptr + x_off + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the new residual, rounded to the model dtype
        tl.store(res_out_ptr + row * N + offs, x, mask=ok)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    y = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    out = y * w.to(tl.float32)
    if QUANT:  # the value the plain kernel stores (the weight in x's dtype)
        out = out.to(w.dtype).to(tl.float32)
    store_row(out_ptr + row * N, scale_ptr, row, offs, ok, out, QUANT)


def rms_norm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
    quantize: bool = False,
):
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual). quantize (x 2-D, weight in
    x's dtype): the normalized rows as (fp8 [M, N], scale [M, 1] float32), quantized per token as
    fp8_ops.quantize_per_token would quantize the unquantized output: in the same kernel."""
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, n)  # [num_outer, num_inner, N], a view where the strides allow
    num_outer, num_inner = x3.shape[0], x3.shape[1]
    num_rows = num_outer * num_inner
    if quantize and (x.dim() != 2 or weight.dtype != x.dtype):
        raise ValueError(
            f"rms_norm(quantize=True) takes 2-D x with a weight of its dtype: x {tuple(x.shape)} {x.dtype}, "
            f"weight {weight.dtype}"
        )
    out_dtype = torch.float8_e4m3fn if quantize else torch.result_type(x, weight)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # [..., N]
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device) if quantize else out  # [M, 1]
    res_out = res = out
    if residual is not None:
        res = residual.reshape(num_rows, n)
        if res.stride(-1) != 1:
            res = res.contiguous()
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., N]
    if num_rows:
        block = triton.next_power_of_2(n)
        rms_norm_kernel[(num_rows,)](
            x3,
            res,
            out,
            res_out,
            weight,
            scale,
            eps,
            num_inner,
            x3.stride(0),
            x3.stride(1),
            res.stride(0) if residual is not None else 0,
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            QUANT=quantize,
            num_warps=_warps(block),
            **pdl(x),
        )
    if quantize:
        out = (out, scale)
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_mul(x_row, offs, ok, D: tl.constexpr):
    """silu(gate) * up at offs of one row [gate | up] (float32 holding values of x's dtype): F.silu's rounding in
    the model dtype, then the product's."""
    gate = tl.load(x_row + offs, mask=ok, other=0.0)
    up = tl.load(x_row + D + offs, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * D]
    out_ptr,  # [num_rows, D]
    stride_x,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    out = _silu_mul(x_ptr + row * stride_x, offs, ok, D)
    tl.store(out_ptr + row * D + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_chunk(x_ptr, stride_x, D: tl.constexpr, CHUNK: tl.constexpr):
    """The program's (row, chunk) of silu_and_mul's rows (grid: rows, chunks): (row, offs, ok, values)."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < D
    return row, offs, ok, _silu_mul(x_ptr + row * stride_x, offs, ok, D)


@triton.jit
def silu_and_mul_amax_kernel(
    x_ptr,  # [num_rows, 2 * D]
    amax_ptr,  # [num_rows, NUM_CHUNKS] float32: each chunk's amax
    stride_x,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The first pass of quantizing silu_and_mul's rows per token: the amax of each CHUNK values of a row (grid:
    rows, chunks; a program a chunk, so that a batch's rows spread over every SM)."""
    wait_previous_kernel(USE_PDL)
    row, offs, ok, h = _silu_mul_chunk(x_ptr, stride_x, D, CHUNK)
    tl.store(amax_ptr + row * NUM_CHUNKS + tl.program_id(1), tl.max(tl.where(ok, tl.abs(h), 0.0), axis=0))


@triton.jit
def silu_and_mul_quant_kernel(
    x_ptr,  # [num_rows, 2 * D]
    amax_ptr,  # [num_rows, NUM_CHUNKS] float32 (silu_and_mul_amax_kernel)
    out_ptr,  # [num_rows, D] fp8
    scale_ptr,  # [num_rows] float32: each row's fp8 scale
    stride_x,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The second pass: each chunk again (mostly from L2), stored as fp8 with its row's scale (store_row's
    arithmetic), from the row's chunk amaxes; the first chunk's program stores the scale."""
    wait_previous_kernel(USE_PDL)
    row, offs, ok, h = _silu_mul_chunk(x_ptr, stride_x, D, CHUNK)
    cols = tl.arange(0, CHUNKS_PAD)
    amax = tl.max(tl.load(amax_ptr + row * NUM_CHUNKS + cols, mask=cols < NUM_CHUNKS, other=0.0), axis=0)
    scale = fp8_scale_of(amax)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * D + offs, fp8_quantize(h, scale), mask=ok)


QUANT_CHUNK = 1024  # quantize=True: values of a row a program takes


def silu_and_mul(x: torch.Tensor, quantize: bool = False):  # [..., 2 * d] -> [..., d]
    """silu(gate) * up over [gate | up] halves. quantize (x 2-D): the rows as (fp8 [M, d], scale [M, 1] float32),
    quantized per token as fp8_ops.quantize_per_token would quantize the output."""
    d = x.shape[-1] // 2
    if quantize and x.dim() != 2:
        raise ValueError(f"silu_and_mul(quantize=True) takes 2-D x: x {tuple(x.shape)}")
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=torch.float8_e4m3fn if quantize else x.dtype, device=x.device)
    if quantize:
        scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)  # [M, 1]
    if x2.shape[0] and quantize:  # two passes: each chunk's amax, then the fp8 values by the row's scale
        chunk = min(QUANT_CHUNK, triton.next_power_of_2(d))
        num_chunks = triton.cdiv(d, chunk)
        amax = torch.empty((x2.shape[0], num_chunks), dtype=torch.float32, device=x.device)  # [M, chunks]
        grid = (x2.shape[0], num_chunks)  # rows on the grid's first axis: past 65535 of them
        silu_and_mul_amax_kernel[grid](
            x2, amax, x2.stride(0), D=d, CHUNK=chunk, NUM_CHUNKS=num_chunks, num_warps=4, **pdl(x2)
        )  # fmt: skip
        silu_and_mul_quant_kernel[grid](
            x2, amax, out, scale, x2.stride(0), D=d, CHUNK=chunk, NUM_CHUNKS=num_chunks,
            CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=4, **pdl(x2),
        )  # fmt: skip
    elif x2.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), D=d, BLOCK=block, num_warps=4, **pdl(x2)
        )  # fmt: skip
    return (out, scale) if quantize else out


@triton.jit
def rotate_heads(
    x_ptr, stride_head, w_ptr, cos, sin, eps, NUM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr, ok,
):  # fmt: skip
    """(first halves, second halves) [NUM_PAD, HALF_PAD] of one token's heads x [NUM_PAD, 2 * HALF] (head stride
    stride_head; ok masks the real heads and dims), per-head RMS-normalized (HAS_NORM, weight w [2 * HALF]) and
    rotated by cos, sin [1, HALF_PAD] fp32, rounded to x's dtype. The rotary of qk_rotary_kernel and of the attention
    backend's rotary_write_kv_kernel: one arithmetic, the same bits."""
    heads = tl.arange(0, NUM_PAD)
    offs = tl.arange(0, HALF_PAD)
    d_ok = offs < HALF
    x_off = heads[:, None] * stride_head + offs[None, :]  # [NUM_PAD, HALF_PAD]
    x1 = tl.load(x_ptr + x_off, mask=ok, other=0.0)
    x2 = tl.load(x_ptr + x_off + HALF, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:  # as RMSNorm: normalized in fp32, rounded to the model dtype, times the weight, rounded again
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def _norm_rotate_heads(
    x_ptr,  # one token's heads: [num_heads, 2 * HALF] with head stride stride_head
    stride_head,
    out_ptr,  # one token's [num_heads, 2 * HALF], contiguous
    w_ptr,  # [2 * HALF] per-head RMSNorm weight (HAS_NORM)
    cos,  # [1, HALF_PAD] fp32
    sin,  # [1, HALF_PAD] fp32
    eps,
    NUM: tl.constexpr,
    NUM_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    heads = tl.arange(0, NUM_PAD)
    offs = tl.arange(0, HALF_PAD)
    ok = (heads < NUM)[:, None] & (offs < HALF)[None, :]
    first, second = rotate_heads(x_ptr, stride_head, w_ptr, cos, sin, eps, NUM_PAD, HALF, HALF_PAD, HAS_NORM, ok)
    o_off = heads[:, None] * 2 * HALF + offs[None, :]
    tl.store(out_ptr + o_off, first, mask=ok)
    tl.store(out_ptr + o_off + HALF, second, mask=ok)


@triton.jit
def qk_rotary_kernel(
    q_ptr,  # [num_tokens, NUM_Q, head_dim] (any token and head strides: a view of the fused qkv output works)
    k_ptr,  # [num_tokens, NUM_K, head_dim]
    cos_ptr,  # [num_tokens, 1, HALF]
    sin_ptr,  # [num_tokens, 1, HALF]
    q_w_ptr,  # [head_dim] (HAS_NORM)
    k_w_ptr,  # [head_dim] (HAS_NORM)
    q_out_ptr,  # [num_tokens, NUM_Q, head_dim] contiguous
    k_out_ptr,  # [num_tokens, NUM_K, head_dim] contiguous
    eps,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos,
    stride_sin,
    NUM_Q: tl.constexpr,
    NUM_Q_PAD: tl.constexpr,
    NUM_K: tl.constexpr,
    NUM_K_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """One token per program: all its q heads, then all its k heads."""
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    d_ok = offs < HALF
    cos = tl.load(cos_ptr + tok * stride_cos + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + tok * stride_sin + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    head_dim = 2 * HALF
    _norm_rotate_heads(
        q_ptr + tok * stride_q_tok,
        stride_q_head,
        q_out_ptr + tok * NUM_Q * head_dim,
        q_w_ptr,
        cos,
        sin,
        eps,
        NUM_Q,
        NUM_Q_PAD,
        HALF,
        HALF_PAD,
        HAS_NORM,
    )
    _norm_rotate_heads(
        k_ptr + tok * stride_k_tok,
        stride_k_head,
        k_out_ptr + tok * NUM_K * head_dim,
        k_w_ptr,
        cos,
        sin,
        eps,
        NUM_K,
        NUM_K_PAD,
        HALF,
        HALF_PAD,
        HAS_NORM,
    )


def qk_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # per-head RMSNorm weights of q and k
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary of q and k (rotate-half layout), each head RMS-normalized first when norm_weights are given; new
    contiguous tensors, one launch."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    q_w, k_w = norm_weights if norm_weights is not None else (q, k)  # unused without the norm
    if num_tokens:
        qk_rotary_kernel[(num_tokens,)](
            q,
            k,
            cos,
            sin,
            q_w,
            k_w,
            q_out,
            k_out,
            eps,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_Q=num_heads,
            NUM_Q_PAD=triton.next_power_of_2(num_heads),
            NUM_K=num_kv_heads,
            NUM_K_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            HAS_NORM=norm_weights is not None,
            num_warps=4,
        )
    return q_out, k_out
