"""FP8 (e4m3) activation quantization and the scaled matmul of the CUDA FP8 method.

Activations are quantized per token (row) with a scale of amax(|row|) / FP8_MAX computed on the fly, or with one
static scale from the checkpoint; on CUDA by a small Triton kernel, elsewhere by the torch code below (the same
rule; on CPU the activations are rounded to their fp8 values before the dense matmul). The matmul is cuBLASLt's
row-wise scaled FP8 GEMM (torch._scaled_mm) where its shape rules allow, else the dequantized operands through
F.linear."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still gets a finite scale (vLLM's floor)
SCALED_MM_ALIGN = 16  # cuBLASLt's FP8 GEMM needs K and N divisible by 16
ONE_PASS_MAX = 16384  # the quantization keeps rows of up to this many features in registers (read once)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs without Triton
    triton = None

if triton is not None:
    from pagedllm.kernels.fused_ops import fp8_quantize, fp8_scale_of

    @triton.jit
    def per_token_quant_kernel(
        x_ptr, q_ptr, scale_ptr, static_ptr, K, stride_x, stride_q, HAS_STATIC: tl.constexpr, BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr,
    ):  # fmt: skip
        """One program per row: x [M, K] -> q [M, K] fp8, scale [M] float32 (amax / FP8_MAX, or the static one).
        ONE_PASS (K <= BLOCK): the row is read once, kept in registers between the amax and the division."""
        row = tl.program_id(0)
        x_row = x_ptr + row * stride_x
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            if HAS_STATIC:
                scale = tl.load(static_ptr).to(tl.float32)
            else:
                scale = fp8_scale_of(tl.max(tl.abs(x), axis=0))
            tl.store(scale_ptr + row, scale)
            tl.store(q_ptr + row * stride_q + cols, fp8_quantize(x, scale), mask=cols < K)
        else:
            if HAS_STATIC:
                scale = tl.load(static_ptr).to(tl.float32)
            else:
                amax = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, K, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(x))
                scale = fp8_scale_of(tl.max(amax, axis=0))
            tl.store(scale_ptr + row, scale)
            for start in range(0, K, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                tl.store(q_ptr + row * stride_q + cols, fp8_quantize(x, scale), mask=cols < K)


class QuantizedActivations(NamedTuple):
    """A linear layer's input quantized per token by the kernel that made it (fused_ops' RMSNorm or SiLU-and-mul):
    what the layer's own dynamic per-token quantization would make of the unquantized rows (FP8 methods with
    `takes_fp8_input`)."""

    q: torch.Tensor  # [M, K] fp8
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the unquantized rows' dtype (the layer's output dtype)


def as_quantized(out: tuple, dtype: torch.dtype):
    """A fused kernel's (fp8 rows, scales) as QuantizedActivations of `dtype` rows; with a residual, its
    ((fp8 rows, scales), residual) as (QuantizedActivations, residual)."""
    if isinstance(out[0], tuple):
        return QuantizedActivations(*out[0], dtype), out[1]
    return QuantizedActivations(*out, dtype)


def quantize_per_token_torch(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """x [M, K] -> (q [M, K] fp8 e4m3, scale [M, 1] float32) with x ~= q * scale."""
    xf = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def quantize_per_token_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """The Triton kernel's version of quantize_per_token_torch (x on the kernel's device, last dim contiguous)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)  # [M, K]
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)  # [M, 1]
    if m == 0:
        return q, scale
    static = static_scale.float().reshape(1) if static_scale is not None else scale
    block = triton.next_power_of_2(max(k, 16))
    block = block if block <= ONE_PASS_MAX else 1024  # a row of up to ONE_PASS_MAX read once, else twice
    warps = max(1, min(16, block // 512))  # 16 values a thread per pass
    per_token_quant_kernel[(m,)](
        x, q, scale, static, k, x.stride(0), q.stride(0), HAS_STATIC=static_scale is not None, BLOCK=block,
        ONE_PASS=k <= block, num_warps=warps,
    )  # fmt: skip
    return q, scale


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    if x.is_cuda and triton is not None:
        return quantize_per_token_triton(x, static_scale)
    return quantize_per_token_torch(x, static_scale)


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] in any float dtype -> (fp8 [N, K], scale [N] float32), one scale per output row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)  # [N]
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [N, K] with scale [N] (per row) or [N, K] (blocks expanded) float32 -> [N, K] in dtype."""
    scale = scale.float()
    return (weight.float() * (scale[:, None] if scale.dim() == 1 else scale)).to(dtype)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None, per_tensor_dynamic: bool = False):
    """x [M, K] -> (q [M, K] fp8, scale [M, 1] float32): per token, with the static input_scale, or with one scale
    for the whole batch (per_tensor_dynamic)."""
    if per_tensor_dynamic and input_scale is None and x.numel():
        input_scale = (x.abs().amax().float() / FP8_MAX).clamp_min(MIN_SCALE)
    return quantize_per_token(x, input_scale)


def fake_quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None, per_tensor_dynamic: bool = False, group: int | None = None
) -> torch.Tensor:
    """x [..., K] rounded to what its fp8 quantization represents, in x's dtype (the dense matmul then sees the
    activations the FP8 GEMM would). `group`: one scale per token and run of `group` features (zero-padded)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    if group is not None:
        x2 = F.pad(x2, (0, -k % group)).reshape(-1, group)  # [M * ceil(K / group), group]
    q, scale = quantize_activations(x2, input_scale, per_tensor_dynamic)
    return (q.float() * scale).to(x.dtype).reshape(m, -1)[:, :k].reshape(x.shape)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    per_tensor_dynamic: bool = False,
) -> torch.Tensor:
    """x [..., K] (activation dtype) @ (weight [N, K] fp8 * weight_scale [N]).T + bias -> [..., N] in x's dtype,
    the activations quantized to fp8 per token (or with input_scale, or one dynamic scale for the whole batch)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    xq, xs = quantize_activations(x2, input_scale, per_tensor_dynamic)  # [M, K] fp8, [M, 1]
    return fp8_matmul(xq, xs, weight, weight_scale, bias, x.dtype).reshape(*x.shape[:-1], n)


def fp8_matmul(
    xq: torch.Tensor,  # [M, K] fp8
    xs: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[M, N] in dtype: cuBLASLt's row-wise scaled FP8 GEMM where its shape rules allow, else the dequantized
    operands through F.linear."""
    n, k = weight.shape
    if xq.is_cuda and k % SCALED_MM_ALIGN == 0 and n % SCALED_MM_ALIGN == 0 and xq.shape[0] > 0:
        out = torch._scaled_mm(
            xq, weight.t(), scale_a=xs, scale_b=weight_scale.float().reshape(1, n), out_dtype=torch.bfloat16
        ).to(dtype)  # row-wise scaling writes bfloat16
    else:
        out = F.linear((xq.float() * xs).to(dtype), dequantize_weight(weight, weight_scale, dtype))
    if bias is not None:
        out = out + bias
    return out
