"""The W4A16 / W8A16 Triton GEMMs (wna16_gemm.py) against the float64 GEMM of the weight dequantized by plain torch
(w = (q - zero) * scale per group), for 4 and 8 bits, group sizes (16, 32, 128, channel-wise, one that divides no
step), odd K and N, with and without zero points and bias, batches 1..64 on the fused kernel (split K or not) and
larger ones on the dequantize-then-GEMM path; an act-order permutation of the input features. Without CUDA it runs
in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.layers.quantization.fp8_ops")
gemv = importlib.import_module("pagedllm.layers.quantization.fp8_gemv")
gemm = importlib.import_module("pagedllm.layers.quantization.wna16_gemm")
if DEVICE.type == "cpu" and type(gemm.wna16_gemm_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on
    gemv = importlib.reload(gemv)
    gemm = importlib.reload(gemm)

from pagedllm.layers.quantization.int_packing import pack_int32  # noqa: E402


def make_case(m, n, k, bits, group, asym, bias, seed, dtype=torch.float32):
    """x [M, K], K-packed qweight, scales / zeros [ceil(K / group), N], bias [N] and the float64 reference weight
    [K, N] computed from the unpacked values (not from the packing under test)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)  # [K, N] unsigned values
    scales = (torch.rand(groups, n, generator=g) / 20 + 1e-3).to(dtype)
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).to(dtype) if asym else None
    zero = zeros.double() if asym else torch.full((groups, n), float(1 << (bits - 1)), dtype=torch.float64)
    rows = torch.arange(k) // group
    w = (q.double() - zero[rows]) * scales.double()[rows]  # [K, N]
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    qweight = pack_int32(q, bits, dim=0)  # [ceil(K / pack), N]
    x, qweight, scales, zeros, b = (t.to(DEVICE) if t is not None else None for t in (x, qweight, scales, zeros, b))
    return x, qweight, scales, zeros, b, w


def reference(x, w, bias):
    out = x.double().cpu() @ w
    return out + bias.double().cpu() if bias is not None else out


def assert_close(out, ref, dtype):
    scale = ref.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "n,k,group",
    [(17, 33, 33), (70, 256, 32), (48, 200, 16), (40, 130, 128), (33, 96, 24), (64, 256, 256)],
)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
def test_fused_kernel(bits, n, k, group, m):
    asym, bias = (m + n) % 2 == 0, m % 2 == 1
    x, qweight, scales, zeros, b, w = make_case(m, n, k, bits, group, asym, bias, seed=m * 1000 + n + k)
    out = gemm.wna16_gemm(x, qweight, scales, zeros, b, bits, group)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_close(out, reference(x, w, b), torch.float32)


@pytest.mark.parametrize("splits", ["one", "many"])
def test_split_k(splits, monkeypatch):
    """The K splits summed by the reduce kernel give the same numbers as one split."""
    monkeypatch.setattr(gemm, "PROGRAMS_PER_SM", 1 if splits == "one" else 64)
    monkeypatch.setattr(gemm, "sm_count", lambda device: 1)
    x, qweight, scales, zeros, b, w = make_case(5, 70, 512, 4, 64, True, True, seed=9)
    m_blocks = 1
    assert gemm.plan_splits(70, 512, m_blocks, 64, 1)[0] == (1 if splits == "one" else 8)
    out = gemm.wna16_gemm(x, qweight, scales, zeros, b, 4, 64)
    assert_close(out, reference(x, w, b), torch.float32)


@pytest.mark.parametrize("bits,asym", [(4, True), (8, False)])
@pytest.mark.parametrize("m", [65, 130])
def test_large_batches_dequantize_then_gemm(bits, asym, m):
    x, qweight, scales, zeros, b, w = make_case(m, 37, 100, bits, 32, asym, True, seed=m)
    dense = gemm.wna16_dequantize(qweight, scales, zeros, 100, bits, 32, torch.float32)
    torch.testing.assert_close(dense.double().cpu(), w, rtol=1e-6, atol=1e-7)
    out = gemm.wna16_linear(x, qweight, scales, zeros, b, None, bits, 32)
    assert_close(out, reference(x, w, b), torch.float32)


def test_act_order_permutation():
    """perm: the weight's rows hold input features in perm's order; x's columns are gathered the same way."""
    x, qweight, scales, zeros, b, w = make_case(4, 24, 64, 4, 16, True, False, seed=3)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    out = gemm.wna16_linear(x, qweight, scales, zeros, None, perm.to(DEVICE), 4, 16)
    assert_close(out, x.double().cpu()[:, perm] @ w, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(dtype):
    x, qweight, scales, zeros, b, w = make_case(8, 64, 128, 4, 32, True, True, seed=4, dtype=dtype)
    out = gemm.wna16_gemm(x, qweight, scales, zeros, b, 4, 32)
    assert out.dtype == dtype
    assert_close(out, reference(x, w, b), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_llama_shapes_on_gpu(m):
    """Llama-3.1-8B's down_proj shape (K 14336, N 4096), group 128, bfloat16, both paths."""
    x, qweight, scales, zeros, b, w = make_case(m, 4096, 14336, 4, 128, False, False, seed=m, dtype=torch.bfloat16)
    out = gemm.wna16_linear(x, qweight, scales, zeros, None, None, 4, 128)
    assert_close(out, reference(x, w, None), torch.bfloat16)


def _qkv_layer(config, seed: int, act_orders: tuple[bool, bool, bool]):
    """A GPTQ / AWQ / compressed-tensors QKV layer (hidden 64, 4 heads of 16 over 2 KV heads) loaded with random
    packed tensors, one projection at a time; act_orders: which projections get a shuffled g_idx (one shared
    shuffle)."""
    from pagedllm.layers.build_context import BuildContext, building
    from pagedllm.layers.linear import QKVParallelLinear

    g = torch.Generator().manual_seed(seed)
    with building(BuildContext(tp_rank=0, tp_size=1)):
        layer = QKVParallelLinear(
            64, 16, 4, 2, bias=True, quant_config=config, prefix="model.layers.0.self_attn.qkv_proj"
        )
    shuffle = torch.randperm(64, generator=g)
    for shard, rows, act_order in zip("qkv", (64, 32, 32), act_orders):
        for name, param in layer.named_parameters(recurse=False):
            if name == "bias":
                param.weight_loader(param, torch.randn(rows, generator=g), shard)
            elif name in ("g_idx", "weight_g_idx"):
                groups = torch.arange(64) // 16
                param.weight_loader(param, (groups[torch.argsort(shuffle)] if act_order else groups).int(), shard)
            elif name == "weight_shape":
                param.weight_loader(param, torch.tensor([rows, 64]), shard)
            else:
                shape = list(param.shape)
                shape[param.output_dim] = shape[param.output_dim] * rows // 128
                loaded = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).int()
                if param.dtype == torch.float32:
                    loaded = torch.rand(shape, generator=g) / 20
                param.weight_loader(param, loaded, shard)
    return layer


def _configs():
    from pagedllm.layers.quantization.awq import AWQConfig
    from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
    from pagedllm.layers.quantization.gptq import GPTQConfig

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": False}
    ct = {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
    return {
        "gptq-4": GPTQConfig(4, 16),
        "gptq-8": GPTQConfig(8, 16),
        "awq": AWQConfig(16),
        "ct-asym": CompressedTensorsConfig.from_config(ct),
        "ct-actorder": CompressedTensorsConfig.from_config(
            {**ct, "config_groups": {"g": {"targets": ["Linear"], "weights": {**weights, "actorder": "group"}}}}
        ),
    }


@pytest.mark.parametrize("fmt", ["gptq-4", "gptq-8", "awq", "ct-asym", "ct-actorder"])
@pytest.mark.parametrize("act_orders", [(False, False, False), (True, True, True), (True, False, True)])
def test_layer_kernel_path_matches_its_dense_path(fmt, act_orders, monkeypatch):
    """The same loaded layer processed for the kernels (repacked along K, act order as an input permutation) and for
    the dense path (dequantized) gives the same outputs; projections with different act orders take the dense path."""
    from pagedllm.layers.quantization import wna16

    if any(act_orders) and fmt not in ("gptq-4", "gptq-8", "ct-actorder"):
        pytest.skip("the format has no g_idx")
    config = _configs()[fmt]
    dense = _qkv_layer(config, 7, act_orders)
    dense.process_weights_after_loading()
    monkeypatch.setattr(wna16, "kernel_device", lambda device: True)
    monkeypatch.setattr(wna16, "wna16_linear", gemm.wna16_linear)  # the interpreted kernels
    layer = _qkv_layer(config, 7, act_orders)
    layer.process_weights_after_loading()
    uniform = len(set(act_orders)) == 1
    assert (type(layer.quant_method).__name__ == "WNA16GemmMethod") == uniform
    if uniform:
        assert (layer.wq_perm is not None) == act_orders[0]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,group", [(17, 96, 32), (70, 256, 64), (33, 200, 8)])
@pytest.mark.parametrize("m", [1, 5, 80])
def test_codebook(n, k, group, m):
    """The codebook variant (bitsandbytes nf4 / fp4): w = codebook[q] * scale, on the fused kernel (m <= 64) and the
    dequantize-then-GEMM path (m = 80)."""
    g = torch.Generator().manual_seed(n + k + m)
    q = torch.randint(0, 16, (k, n), generator=g)  # [K, N] codes
    scales = torch.rand(-(-k // group), n, generator=g) + 0.1
    codebook = torch.randn(16, generator=g)
    w = codebook.double()[q] * scales.double()[torch.arange(k) // group]  # [K, N]
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    args = (pack_int32(q, 4, dim=0), scales, None, b, None, 4, group, codebook)
    out = gemm.wna16_linear(x.to(DEVICE), *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    assert_close(out, reference(x, w, b), torch.float32)


def test_bnb_layer_kernel_path(monkeypatch):
    """A merged bitsandbytes 4-bit layer (two projections of a checkpoint's tensors) on the GEMM path: its codes
    repacked K-major, scales transposed, the codebook kept; the same outputs as its dequantized weight."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    bnb = importlib.import_module("pagedllm.layers.quantization.bitsandbytes")
    from pagedllm.layers.linear import MergedColumnParallelLinear
    from pagedllm.layers.quantization.bnb_format import codebook, dequantize_4bit, regroup_4bit, unpack_rows

    monkeypatch.setattr(bnb, "wna16_linear", gemm.wna16_linear)  # the interpreted kernels
    monkeypatch.setattr(bnb, "kernel_device", lambda device: True)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(48, 128, generator=g), torch.randn(24, 128, generator=g)]
    stream = []
    for i, w in enumerate(weights):
        packed, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="fp4", compress_statistics=True)
        stream += [(f"p{i}.weight", packed)] + [(f"p{i}.weight.{k}", v) for k, v in state.as_dict(packed=True).items()]
    decoded = dict(regroup_4bit(stream, torch.uint8, "fp4"))
    config = bnb.BitsAndBytesConfig(4, "fp4")
    layer = MergedColumnParallelLinear(128, [48, 24], bias=False, quant_config=config, prefix="m")
    dense = []
    for i in range(2):
        for name in ("codes", "scales"):
            param = getattr(layer, f"bnb_{name}")
            param.weight_loader(param, decoded[f"p{i}.bnb_{name}"], i)
        codes = unpack_rows(decoded[f"p{i}.bnb_codes"], 128)
        dense.append(dequantize_4bit(codes, decoded[f"p{i}.bnb_scales"], codebook("fp4")))
    layer.process_weights_after_loading()
    assert type(layer.quant_method).__name__ == "Bnb4bitGemmMethod" and layer.wq_packed.shape == (16, 72)
    x = torch.randn(3, 128, generator=g)
    ref = x.double() @ torch.cat(dense).double().t()
    assert_close(layer(x.to(DEVICE)), ref, torch.float32)


@pytest.mark.parametrize("m", [1, 6, 70])
def test_bnb_int8_layer_kernel_path(m, monkeypatch):
    """A bitsandbytes 8-bit layer on the GEMM path: its int8 weight kept 8-bit (offset to the W8A16 midpoint, one
    scale per channel), the input through LLM.int8's rule (outlier columns included); the same outputs as the
    dequantized weight times that input, on the fused kernel (m <= 64) and the dequantize-then-GEMM path."""
    bnb_int8 = importlib.import_module("pagedllm.layers.quantization.bnb_int8")
    from pagedllm.layers.linear import MergedColumnParallelLinear
    from pagedllm.layers.quantization.bitsandbytes import BitsAndBytesConfig

    monkeypatch.setattr(bnb_int8, "wna16_linear", gemm.wna16_linear)  # the interpreted kernels
    monkeypatch.setattr(bnb_int8, "kernel_device", lambda device: True)
    g = torch.Generator().manual_seed(m)
    weight = torch.randint(-127, 128, (40, 72), generator=g, dtype=torch.int8)  # [N, K], two projections
    scb = torch.rand(40, generator=g) + 0.5
    config = BitsAndBytesConfig(8, threshold=6.0)
    layer = MergedColumnParallelLinear(72, [24, 16], bias=True, quant_config=config, prefix="m")
    bias = torch.randn(40, generator=g)
    for i, rows in enumerate((slice(0, 24), slice(24, 40))):
        layer.weight.weight_loader(layer.weight, weight[rows], i)
        layer.SCB.weight_loader(layer.SCB, scb[rows], i)
        layer.bias.weight_loader(layer.bias, bias[rows], i)
    layer.process_weights_after_loading()
    assert type(layer.quant_method).__name__ == "LLMInt8GemmMethod" and layer.wq_packed.shape == (18, 40)
    x = torch.randn(m, 72, generator=g)
    x[0, 5] = 9.0  # an outlier column
    dense = weight.double() * (scb.double() * bnb_int8.WEIGHT_DEQUANT)[:, None]
    ref = bnb_int8.llm_int8_input(x, 6.0).double() @ dense.t() + bias.double()
    assert_close(layer(x.to(DEVICE)), ref, torch.float32)
