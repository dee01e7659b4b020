"""Linear layers on GGUF-quantized weights kept packed (cpu_quant.c): 4-bit groups (Q4_0 / Q4_1) and 8-bit ones
(Q8_0), float32 or bfloat16 activations, float32 sums. Small batches are bound by the bytes of the weights: these read
about 0.63 (4-bit) or 1.13 (8-bit) bytes a weight, against 2 for a bfloat16 copy and 4 for a float32 one."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagedllm.kernels import cpu_kernels

GROUP, PAIR = 32, 64
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass
class QuantWeight:
    """A packed weight [n, k] in cpu_quant.c's layout: `blob` uint8 [ceil(n / 4), kp / 64, block bytes] (k padded to
    kp, whole pairs of groups), each block a quad of rows' bytes for one pair of groups, then their float32 factors."""

    blob: torch.Tensor
    n: int
    k: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def kp(self) -> int:
        return self.blob.shape[1] * PAIR


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = cpu_kernels.compiled()
    if lib is None:
        return None
    lib.quant_linear.argtypes = [_int, _ptr, _i64, _ptr, _ptr, _ptr, *[_i64] * 4, _int, _int, _int]
    lib.quant_linear.restype = _int
    lib.quant_int16.argtypes = []
    lib.quant_int16.restype = _int
    return lib


def available() -> bool:
    return _lib() is not None


@functools.cache
def _int16() -> bool:
    return bool(_lib().quant_int16())


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [n, c] with zeros to [rows, cols]."""
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _blob(pair_bytes: torch.Tensor, factors: list[torch.Tensor], n: int) -> torch.Tensor:
    """pair_bytes [n4, pairs, b] uint8 and per-group factors, each [n4, 2 * pairs] float32 -> the quad blocks
    [n4 / 4, pairs, 4 * b + 4 * 4 * len(factors)] uint8."""
    n4, pairs, b = pair_bytes.shape
    f = torch.stack([t.reshape(n4, pairs, 2) for t in factors], dim=2).reshape(n4, pairs, -1)  # d0, d1 (, c0, c1)
    q = pair_bytes.reshape(n4 // 4, 4, pairs, b).transpose(1, 2).reshape(n4 // 4, pairs, 4 * b)
    f = f.reshape(n4 // 4, 4, pairs, -1).transpose(1, 2).reshape(n4 // 4, pairs, -1).contiguous()
    return torch.cat([q, f.view(torch.uint8)], dim=2).contiguous()


def pack_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantWeight:
    """q [n, k] uint8 in 0..15 with w = (q - 8) * scale + zero (scale, zero [n, k / 32]) as a 4-bit QuantWeight."""
    n, k = q.shape
    n4, kp = -(-n // 4) * 4, -(-k // PAIR) * PAIR
    halves = _padded(q, n4, kp).reshape(n4, kp // GROUP, 2, 16)  # [n4, groups, inputs 0-15 | 16-31, 16]
    nibbles = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [n4, groups, 16] GGUF's bytes
    # pair layout: [n4, pairs, group, t, 2] -> [n4, pairs, t, group, 2]
    packed = nibbles.reshape(n4, kp // PAIR, 2, 8, 2).permute(0, 1, 3, 2, 4).reshape(n4, kp // PAIR, 32)
    d = _padded(scale.float(), n4, kp // GROUP)
    c = _padded(zero.float() - 8 * scale.float(), n4, kp // GROUP)
    return QuantWeight(_blob(packed, [d, c], n), n, k, 4)


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
    """q [n, k] int8 with w = q * scale (scale [n, k / 32]) as an 8-bit QuantWeight."""
    n, k = q.shape
    n4, kp = -(-n // 4) * 4, -(-k // PAIR) * PAIR
    # [n4, pairs, group, h, t, 2] -> [n4, pairs, h, t, group, 2]
    packed = _padded(q, n4, kp).reshape(n4, kp // PAIR, 2, 2, 8, 2).permute(0, 1, 3, 4, 2, 5)
    packed = packed.reshape(n4, kp // PAIR, 64).view(torch.uint8)
    return QuantWeight(_blob(packed, [_padded(scale.float(), n4, kp // GROUP)], n), n, k, 8)


def runs(x: torch.Tensor) -> bool:
    """Whether quant_linear takes x: a float32 or bfloat16 CPU tensor, and a built library."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and available()


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] times the packed weight [n, k], plus bias [n] float32 (or None): [..., n] in x's dtype. bfloat16 x
    takes the int16 kernel where it is built (see cpu_quant.c), float32 x the float one."""
    n, k = w.n, w.k
    if x.shape[-1] != k or not runs(x):
        raise ValueError(f"quant_linear takes a float32 or bfloat16 CPU input [..., {k}], got {x.dtype} {x.shape}")
    x2 = cpu_kernels.contiguous_rows(x)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    done = _lib().quant_linear(
        w.bits, x2.data_ptr(), x2.stride(0), w.blob.data_ptr(), bias.data_ptr() if bias is not None else None,
        out.data_ptr(), x2.shape[0], n, k, w.kp, int(bf16), int(bf16 and _int16()), torch.get_num_threads(),
    )  # fmt: skip
    if not done:
        raise MemoryError("quant_linear: out of memory for the copy of x")
    return out
