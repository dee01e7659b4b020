"""Vectorized torch dequantization of GGUF (GGML) tensor data.

Every torch kernel here reproduces `gguf.quants.dequantize` bit for bit: the same float32
operations are applied in the same order (e.g. ``d * q + m`` as a multiply followed by an add,
never a fused multiply-add). Types without a torch kernel fall back to the numpy reference.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.layers.q4_linear import GROUP

QK_K = gguf.QK_K  # super-block size of the k-quants (256)
_T = gguf.GGMLQuantizationType

_NIBBLE_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8)
_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _as_torch_bytes(data: np.ndarray) -> torch.Tensor:
    """Flat uint8 torch view of `data` (no copy for contiguous arrays; read-only memmaps are never written)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _f16(block_bytes: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian halves -> (n, 1) float32 (exact conversion)."""
    return block_bytes.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes into 4-bit values: for each run of `group` bytes, all low nibbles then all high nibbles.

    qs: (n, k * group) uint8 -> (n, k * 2 * group) uint8
    """
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)  # (n, k, 2, group)
    return q.bitwise_and_(0x0F).reshape(n, -1)


def _low_bits(qh: torch.Tensor) -> torch.Tensor:
    """Little-endian bit unpacking: (n, b) uint8 -> (n, 8 * b) uint8 of 0/1, bit j of byte i at 8 * i + j."""
    n = qh.shape[0]
    bits = qh.reshape(n, -1, 1) >> _BIT_SHIFTS.reshape(1, 1, 8)  # (n, b, 8)
    return bits.bitwise_and_(1).reshape(n, -1)


def _dq_f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32).clone()


def _dq_f16(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float16).float()


def _dq_bf16(b: torch.Tensor) -> torch.Tensor:
    return (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 34)  # (n, 2 + 32)
    d = _f16(blocks[:, :2])  # (n, 1)
    qs = blocks[:, 2:].contiguous().view(torch.int8)  # (n, 32)
    return torch.mul(qs, d)  # int8 -> float32 is exact


def _dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 18)  # (n, 2 + 16)
    d = _f16(blocks[:, :2])  # (n, 1)
    q = _nibbles(blocks[:, 2:], 16).view(torch.int8) - 8  # (n, 32) int8
    return torch.mul(d, q)


def _dq_q4_1(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 20)  # (n, 2 + 2 + 16)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1) each
    out = torch.mul(d, _nibbles(blocks[:, 4:], 16))  # (n, 32) float32
    return out.add_(m)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """qh: (n, 4) high bits, qs: (n, 16) nibbles -> (n, 32) uint8 5-bit values."""
    return _nibbles(qs, 16) | (_low_bits(qh) << 4)


def _dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 22)  # (n, 2 + 4 + 16)
    d = _f16(blocks[:, :2])  # (n, 1)
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8) - 16  # (n, 32) int8
    return torch.mul(d, q)


def _dq_q5_1(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 24)  # (n, 2 + 2 + 4 + 16)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1) each
    out = torch.mul(d, _q5_values(blocks[:, 4:8], blocks[:, 8:]))  # (n, 32) float32
    return out.add_(m)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K: (n, 12) uint8 -> two (n, 8) uint8."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # (n, 8)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)  # (n, 8)
    return sc, mn


def _k_sub_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block scale and offset of Q4_K/Q5_K: (n, >=16) bytes -> two (n, 8, 1) float32."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1) each
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 144)  # (n, 2 + 2 + 12 + 128)
    n = blocks.shape[0]
    d, dm = _k_sub_scales(blocks)  # (n, 8, 1) each
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)  # (n, 8, 32) uint8
    return torch.mul(d, q).sub_(dm).reshape(n, QK_K)


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 176)  # (n, 2 + 2 + 12 + 32 + 128)
    n = blocks.shape[0]
    d, dm = _k_sub_scales(blocks)  # (n, 8, 1) each
    ql = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)  # (n, 8, 32)
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> _BIT_SHIFTS.reshape(1, 8, 1)  # (n, 8, 32): bit j -> sub-block j
    q = ql | ((qh & 1) << 4)
    return torch.mul(d, q).sub_(dm).reshape(n, QK_K)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    blocks = b.reshape(-1, 210)  # (n, 128 ql + 64 qh + 16 scales + 2 d)
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8)  # (n, 16)
    d = (_f16(blocks[:, 208:]) * scales).reshape(n, 16, 1)  # (n, 16, 1) float32
    ql = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)  # (n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.reshape(1, 1, 4, 1)  # (n, 2, 4, 32)
    q = (ql | ((qh.reshape(n, 8, 32) & 0x03) << 4)).view(torch.int8) - 32  # (n, 8, 32) int8
    return torch.mul(d, q.reshape(n, 16, 16)).reshape(n, QK_K)


_KERNELS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.F32: _dq_f32,
    _T.F16: _dq_f16,
    _T.BF16: _dq_bf16,
    _T.Q8_0: _dq_q8_0,
    _T.Q4_0: _dq_q4_0,
    _T.Q4_1: _dq_q4_1,
    _T.Q5_0: _dq_q5_0,
    _T.Q5_1: _dq_q5_1,
    _T.Q4_K: _dq_q4_k,
    _T.Q5_K: _dq_q5_k,
    _T.Q6_K: _dq_q6_k,
}

TORCH_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(_KERNELS)


def _numpy_fallback(raw: np.ndarray, ggml_type: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rows = raw.reshape(-1, shape[-1] // block_size * type_size)  # (rows, bytes per row)
    values = gguf.quants.dequantize(rows, ggml_type)  # (rows, shape[-1]) float32
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def dequantize(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize GGUF tensor data to a new float32 tensor.

    data: the tensor's raw block bytes (any numpy dtype/shape, e.g. ``ReaderTensor.data``).
    shape: the logical shape in torch order (row-major, last dimension innermost), i.e. the
        reverse of GGUF's ``ReaderTensor.shape``; for a linear weight (out_features, in_features).
    Bit-identical to ``gguf.quants.dequantize``.
    """
    ggml_type = gguf.GGMLQuantizationType(ggml_type)
    shape = tuple(int(s) for s in shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_elements = math.prod(shape)
    if not shape or shape[-1] % block_size:
        raise ValueError(f"{ggml_type.name}: last dimension of {shape} is not a multiple of {block_size}")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != n_elements // block_size * type_size:
        raise ValueError(f"{ggml_type.name}: {raw.size} bytes do not hold a tensor of shape {shape}")
    kernel = _KERNELS.get(ggml_type)
    if kernel is None:
        return _numpy_fallback(raw, ggml_type, shape)
    return kernel(_as_torch_bytes(raw)).reshape(shape)


PACKABLE_Q4 = (_T.Q4_0, _T.Q4_1)


def unpack_q4(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType, shape: tuple[int, int]):
    """Q4_0 / Q4_1 blocks of a 2-D tensor, kept 4-bit: (q, scale, zero) with w = (q - 8) * scale + zero.

    q: uint8 [rows, cols] in 0..15; scale, zero: float32 [rows, cols / 32] (exact from the blocks' f16 values)."""
    ggml_type = gguf.GGMLQuantizationType(ggml_type)
    rows, cols = shape
    raw = _as_torch_bytes(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if ggml_type == _T.Q4_0:
        blocks = raw.reshape(-1, 18)  # (n, 2 + 16)
        scale, zero = _f16(blocks[:, :2]), torch.zeros(blocks.shape[0], 1)
        q = _nibbles(blocks[:, 2:], 16)
    elif ggml_type == _T.Q4_1:
        blocks = raw.reshape(-1, 20)  # (n, 2 + 2 + 16): w = d * q + m = (q - 8) * d + (m + 8 d)
        scale, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        zero = m + 8 * scale
        q = _nibbles(blocks[:, 4:], 16)
    else:
        raise ValueError(f"{ggml_type.name} cannot be kept packed as 4-bit groups")
    groups = cols // GROUP
    return q.reshape(rows, cols), scale.reshape(rows, groups), zero.reshape(rows, groups)


def unpack_q8(data: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks of a 2-D tensor, kept 8-bit: (q int8 [rows, cols], scale float32 [rows, cols / 32]), w = q * d."""
    rows, cols = shape
    blocks = _as_torch_bytes(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).reshape(-1, 34)  # (n, 2 + 32)
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return q.reshape(rows, cols), _f16(blocks[:, :2]).reshape(rows, cols // 32)
