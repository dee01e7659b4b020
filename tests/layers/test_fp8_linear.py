"""The FP8 linear method on single layers against a dequantized float32 reference: fp8 weights with per-tensor
(one scale per merged projection) or per-channel scales, or float weights quantized per channel at load; activations
static, per token or per batch. Odd shapes, batches of 1 to 512 tokens; the CUDA GEMM path on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import linear as L
from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from pagedllm.layers.quantization.fp8_ops import fp8_linear

FP8 = torch.float8_e4m3fn


class OneMethod:
    def __init__(self, method):
        self.method = method

    def get_linear_method(self, layer, prefix):
        return self.method


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def ref_activations(x: torch.Tensor, activations: str | None, static: float | None) -> torch.Tensor:
    if activations is None:
        return x
    if activations == "static":
        return fake_quant(x, torch.tensor(static))
    if activations == "dynamic-tensor":
        return fake_quant(x, x.abs().amax() / 448)
    return fake_quant(x, (x.abs().amax(dim=-1, keepdim=True) / 448).clamp_min(1 / (448 * 512)))


def quantized(w: torch.Tensor, per_row: bool):
    amax = w.abs().amax(dim=1) if per_row else w.abs().amax()
    scale = amax / 448
    s = scale[:, None] if per_row else scale
    return (w / s).clamp(-448, 448).to(FP8), scale


def build_qkv(strategy: str, activations: str | None, hidden: int, head_dim: int):
    """A QKV layer (4 q heads, 2 kv heads) loaded with fp8 q/k/v of different scales; (layer, dequantized W, bias)."""
    method = Fp8LinearMethod(strategy, activations, serialized=True)
    layer = L.QKVParallelLinear(hidden, head_dim, 4, 2, True, OneMethod(method), "model.layers.0.self_attn.qkv_proj")
    g = torch.Generator().manual_seed(hidden * head_dim)
    parts = []
    for shard, heads, mag in (("q", 4, 1.0), ("k", 2, 5.0), ("v", 2, 0.2)):
        w = mag * torch.randn(heads * head_dim, hidden, generator=g)
        q, scale = quantized(w, strategy == "channel")
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, scale.reshape(-1, 1) if scale.dim() else scale, shard)
        if activations == "static":
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor([0.01 * mag]), shard)
        parts.append(q.float() * (scale[:, None] if scale.dim() else scale))
    bias = torch.randn(layer.output_size, generator=g)
    layer.bias.data.copy_(bias)
    layer.process_weights_after_loading()
    return layer, torch.cat(parts), bias


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("activations", ["dynamic", "static", "dynamic-tensor", None])
@pytest.mark.parametrize("hidden,head_dim", [(32, 8), (33, 5)])
def test_merged_layer_against_dequantized(strategy, activations, hidden, head_dim):
    layer, w, bias = build_qkv(strategy, activations, hidden, head_dim)
    for rows in (1, 3, 64, 65, 512):
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        ref = F.linear(ref_activations(x, activations, 0.05), w, bias)  # static: the largest of q/k/v's scales
        torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)


def block_reference(w: torch.Tensor, bn: int, bk: int):
    """(fp8 [N, K], scales [ceil(N / bn), ceil(K / bk)], dequantized float32 [N, K]) with one scale per block."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    deq = torch.empty(n, k)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            block = w[i : i + bn, j : j + bk]
            s = block.abs().amax() / 448
            scales[i // bn, j // bk] = s
            q[i : i + bn, j : j + bk] = (block / s).clamp(-448, 448).to(FP8)
            deq[i : i + bn, j : j + bk] = q[i : i + bn, j : j + bk].float() * s
    return q, scales, deq


def group_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    out = torch.empty_like(x)
    for j in range(0, x.shape[-1], group):
        out[..., j : j + group] = ref_activations(x[..., j : j + group], "dynamic", None)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hidden,bk", [(40, 16), (64, 32), (8, 16), (100, 32)])
def test_block_wise_merged_layer(hidden, bk, device):
    """QKV of 32 / 16 / 16 rows in blocks of 8 rows x bk features (a short last block where bk does not divide K);
    activations quantized per token and run of bk features (on CUDA: the Triton block GEMM for bk >= 32, else the
    dequantized weight)."""
    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [8, bk]})
    with torch.device(device):
        layer = L.QKVParallelLinear(hidden, 8, 4, 2, False, config, "model.layers.0.self_attn.qkv_proj")
    g = torch.Generator().manual_seed(hidden)
    parts = []
    for shard, heads in (("q", 4), ("k", 2), ("v", 2)):
        w = torch.randn(heads * 8, hidden, generator=g) * torch.rand(heads * 8, 1, generator=g) * 10
        q, scales, deq = block_reference(w, 8, bk)
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scales, shard)
        parts.append(deq)
    layer.process_weights_after_loading()
    gemm = device == "cuda" and bk >= 32
    assert type(layer.quant_method).__name__ == ("Fp8BlockGemmMethod" if gemm else "Fp8EmulatedMethod")
    for rows in (1, 5, 130):
        x = torch.randn(rows, hidden, generator=g)
        ref = F.linear(group_fake_quant(x, bk), torch.cat(parts))
        # the GEMM sums each k-group on fp8 tensor cores, whose accumulator keeps fewer mantissa bits than float32
        # (measured on H100/H200: up to 1.3e-4 of the largest output): a tolerance relative to the output's scale
        atol = 2e-4 * ref.abs().max().item() if gemm else 1e-4
        torch.testing.assert_close(layer(x.to(device)).cpu(), ref, atol=atol, rtol=1e-4)


def test_block_rows_must_not_split_merged_projections():
    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(
        ValueError, match=r"qkv_proj: merged projections of \[32, 16, 16\] rows split fp8 blocks of 128"
    ):
        L.QKVParallelLinear(64, 8, 4, 2, False, config, "model.layers.0.self_attn.qkv_proj")
    layer = L.QKVParallelLinear(
        64, 8, 4, 2, False, Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16]}), "qkv"
    )
    with pytest.raises(ValueError, match=r"block scale of shape \(3, 4\) does not fit \(1, 4\)"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(3, 4), "k")


@pytest.mark.parametrize("n,k", [(17, 33), (48, 64), (1, 7)])
def test_float_weights_quantized_per_channel_at_load(n, k):
    layer = L.ColumnParallelLinear(k, n, False, Fp8Config.dynamic(), "proj")
    assert layer.weight.dtype == torch.float32
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    w[0] *= 100  # a row far larger than the rest: per-channel scales keep the others precise
    layer.weight.weight_loader(layer.weight, w)
    layer.process_weights_after_loading()
    q, scale = quantized(w, per_row=True)
    x = torch.randn(9, k)
    ref = F.linear(ref_activations(x, "dynamic", None), q.float() * scale[:, None])
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_dtype_of_the_dequantized_weight(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = L.RowParallelLinear(32, 16, False, OneMethod(Fp8LinearMethod("tensor", "dynamic")), "o_proj")
    finally:
        torch.set_default_dtype(previous)
    q, scale = quantized(torch.randn(16, 32), per_row=False)
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale.weight_loader(layer.weight_scale, scale.reshape(1))
    layer.process_weights_after_loading()
    x = torch.randn(4, 32).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    ref = F.linear(ref_activations(x.float(), "dynamic", None), q.float() * scale)
    torch.testing.assert_close(out.float(), ref, atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2)


def test_fp8_linear_fallback_matches_reference():
    """fp8_linear off CUDA (and on CUDA for shapes the GEMM refuses): the dequantized operands, any leading dims."""
    q, scale = quantized(torch.randn(17, 33), per_row=True)
    x = torch.randn(2, 5, 33)
    ref = F.linear(ref_activations(x, "dynamic", None), q.float() * scale[:, None])
    torch.testing.assert_close(fp8_linear(x, q, scale, None, None), ref, atol=1e-4, rtol=1e-4)
    assert fp8_linear(torch.empty(0, 33), q, scale, None, None).shape == (0, 17)


def test_unprocessed_layer_refuses_to_run():
    layer = L.ColumnParallelLinear(16, 16, False, OneMethod(Fp8LinearMethod()), "proj")
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(torch.randn(2, 16))


def test_a_per_tensor_scale_has_one_element():
    layer = L.ColumnParallelLinear(16, 16, False, OneMethod(Fp8LinearMethod()), "proj")
    with pytest.raises(ValueError, match=r"proj: a per-tensor scale has one element, got shape \(2,\)"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.ones(2))


def test_ignored_layers_stay_dense():
    config = Fp8Config("dynamic", ignored=["model.layers.0.mlp.down_proj"])
    kept = L.RowParallelLinear(16, 16, False, config, "model.layers.0.mlp.down_proj")
    other = L.RowParallelLinear(16, 16, False, config, "model.layers.1.mlp.down_proj")
    assert kept.quant_method is L.DENSE and isinstance(other.quant_method, Fp8LinearMethod)


def test_a_merged_layer_half_ignored_is_refused():
    config = CompressedTensorsConfig.from_config(ct_config(ignore=["re:.*k_proj$"]))
    ok = L.ColumnParallelLinear(16, 16, False, config, "model.layers.0.self_attn.o_proj")
    assert isinstance(ok.quant_method, Fp8LinearMethod)
    with pytest.raises(ValueError, match=r"ignore=.*qkv_proj merges projections quantized differently"):
        L.QKVParallelLinear(16, 4, 4, 2, False, config, "model.layers.0.self_attn.qkv_proj")


def ct_config(weights=None, acts="default", fmt="float-quantized", **top):
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    a = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    group = {"targets": ["Linear"], "weights": {**w, **(weights or {})}, "input_activations": a}
    if acts != "default":
        group["input_activations"] = acts
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, **top}


@pytest.mark.parametrize(
    "config,match",
    [
        (ct_config(weights={"num_bits": 4, "type": "int"}), r"int weights with float activations are not supported"),
        (ct_config(weights={"strategy": "block"}), r"weights.block_structure=None must be two positive integers"),
        (ct_config(weights={"strategy": "block", "block_structure": [16, 32]}), r"group_size=32"),
        (ct_config(weights={"strategy": "group"}), r"weights.strategy='group'"),
        (ct_config(weights={"symmetric": False}), r"symmetric=False"),
        (ct_config(acts={"num_bits": 8, "type": "float", "strategy": "token"}), r"strategy='token' dynamic=False"),
        (ct_config(acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), r"type='int'"),
        (ct_config(fmt="pack-quantized"), r"format='pack-quantized' is not supported"),
        (ct_config(kv_cache_scheme={"num_bits": 4, "type": "int"}), r"kv_cache_scheme=.*not supported.*FP8 KV"),
        (ct_config(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "head"}), r"strategy='tensor'"),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, r"config_groups=\{\} must name"),
        (  # NVFP4: 4-bit float weights
            ct_config(weights={"num_bits": 4, "strategy": "tensor_group", "group_size": 16}),
            r"weights: num_bits=4 type='float' is not supported \(supported: num_bits=8 type='float', FP8 e4m3\)",
        ),
        (ct_config(fmt="nvfp4-pack-quantized"), r"format='nvfp4-pack-quantized' is not supported \(supported: "),
        (
            ct_config(acts={"num_bits": 16, "type": "float", "strategy": "token", "dynamic": True}),
            r"input_activations: num_bits=16 type='float' is not supported \(supported: num_bits=8",
        ),
        (
            ct_config(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
            r"sparsity_config=.* is not supported yet \(supported: dense quantized weights",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\] must be two positive"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, r"weight_block_size=\[128, 0\] must be two"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            r"activation_scheme='static': block-wise FP8 takes 'dynamic'",
        ),
        ({"quant_method": "fp8", "activation_scheme": "per-row"}, r"activation_scheme='per-row' must be"),
    ],
)
def test_unsupported_schemes_are_named(config, match):
    cls = CompressedTensorsConfig if config["quant_method"] == "compressed-tensors" else Fp8Config
    with pytest.raises(ValueError, match=match):
        cls.from_config(config)


def test_targets_pick_layers():
    config = ct_config()
    config["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    ct = CompressedTensorsConfig.from_config(config)
    mlp = L.MergedColumnParallelLinear(16, [8, 8], False, ct, "model.layers.0.mlp.gate_up_proj")
    attn = L.RowParallelLinear(16, 16, False, ct, "model.layers.0.self_attn.o_proj")
    assert isinstance(mlp.quant_method, Fp8LinearMethod) and attn.quant_method is L.DENSE


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (17, 33), (48, 40)])
@pytest.mark.parametrize("rows", [1, 7, 64, 512])
@pytest.mark.parametrize("static", [False, True])
def test_cuda_scaled_mm_against_dequantized(n, k, rows, static):
    """torch._scaled_mm (row-wise scales, bfloat16 out) where K and N divide by 16, the fallback elsewhere."""
    g = torch.Generator().manual_seed(n + k + rows)
    q, scale = quantized(torch.randn(n, k, generator=g) / k**0.5, per_row=True)
    x = torch.randn(rows, k, generator=g)
    input_scale = torch.tensor(x.abs().max().item() / 448) if static else None
    bias = torch.randn(n, generator=g)
    # the kernel quantizes the bfloat16 activations: so does the reference
    xa = ref_activations(
        x.bfloat16().float(), "static" if static else "dynamic", None if input_scale is None else input_scale.item()
    )
    ref = F.linear(xa, q.float() * scale[:, None], bias)
    dev = torch.device("cuda")
    out = fp8_linear(
        x.to(dev, torch.bfloat16),
        q.to(dev),
        scale.to(dev),
        None if input_scale is None else input_scale.to(dev),
        bias.to(dev, torch.bfloat16),
    )
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # bfloat16 output and cuBLASLt's summation order
    torch.testing.assert_close(out.float().cpu(), ref, atol=0.1, rtol=0.05)


@pytest.mark.gpu
def test_cuda_layer_keeps_fp8_weights():
    with torch.device("cuda"):
        layer = L.ColumnParallelLinear(64, 48, False, Fp8Config.dynamic(), "proj")
        layer.weight.data.normal_()
    layer.process_weights_after_loading()
    assert type(layer.quant_method).__name__ == "Fp8ScaledMMMethod"
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (48,)
    x = torch.randn(5, 64, device="cuda")
    ref = F.linear(
        ref_activations(x.cpu(), "dynamic", None), layer.weight.float().cpu() * layer.weight_scale.cpu()[:, None]
    )
    torch.testing.assert_close(layer(x).float().cpu(), ref, atol=0.05, rtol=0.02)


def decode_layer(strategy: str, activations: str, device: str):
    """A [4096 -> 1000] fp8 layer with bias on `device`, weights quantized per row or per tensor, static scale 0.02."""
    with torch.device(device):
        layer = L.ColumnParallelLinear(4096, 1000, True, OneMethod(Fp8LinearMethod(strategy, activations)), "proj")
    g = torch.Generator().manual_seed(1)
    q, scale = quantized(torch.randn(1000, 4096, generator=g), per_row=strategy == "channel")
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    if activations == "static":
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor([0.02]))
    layer.bias.data.copy_(torch.randn(1000, generator=g))
    layer.process_weights_after_loading()
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["dynamic", "static", "dynamic-tensor"])
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_cuda_decode_rows_quantize_in_the_gemv(strategy, activations):
    """Batches of 1..16 rows (up to FUSE_MAX_M quantized inside the GEMV): bit-identical to quantizing first
    (the per-token Triton kernel, the static scale or the batch's) and then the GEMV on fp8 activations."""
    from pagedllm.layers.quantization.fp8_gemv import fp8_gemv
    from pagedllm.layers.quantization.fp8_ops import quantize_activations

    layer = decode_layer(strategy, activations, "cuda")
    assert type(layer.quant_method).__name__ == "Fp8ScaledMMMethod"
    for rows in range(1, 17):
        x = 3 * torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_activations(x, layer.input_scale, activations == "dynamic-tensor")
        want = fp8_gemv(xq, xs, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16)), rows


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_cuda_mid_batches_take_the_triton_gemm(activations):
    """Batches in fp8_gemm.TABLE's buckets (17..64 rows) run the Triton GEMM: against the float32 sums of the same
    fp8 products, scaled and rounded once to bfloat16, then the bias added (torch._scaled_mm cannot be the
    reference: it needs N divisible by 16, and this layer's 1000 outputs are not)."""
    from pagedllm.layers.quantization.fp8_gemm import gemm_applies
    from pagedllm.layers.quantization.fp8_ops import quantize_activations

    layer = decode_layer("channel", activations, "cuda")
    for rows in (17, 33, 64):
        x = 3 * torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        assert gemm_applies(x, layer.weight), rows
        xq, xs = quantize_activations(x, layer.input_scale)
        sums = xq.float() @ layer.weight.float().t()  # exact products of fp8 values, summed in float32
        want = (sums * xs * layer.weight_scale.reshape(1, -1)).to(torch.bfloat16).float() + layer.bias.float()
        got = layer(x).float()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 1024])  # N % 16: the dequantized matmul / cuBLASLt's at 256 rows
def test_cuda_norm_and_silu_hand_over_quantized_rows(n):
    """An RMSNorm or SiLU-and-mul linked to a dynamic per-token FP8 layer (models/llama.py: link_fp8_inputs) hands
    over fp8 rows and scales for batches the layer would quantize itself (2+ rows): its output is bit-identical to
    the layer's on the plain rows, on the GEMV (2..16 rows), the Triton GEMM (17..64) and the large-batch paths."""
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.layernorm import RMSNorm
    from pagedllm.layers.quantization.fp8_ops import QuantizedActivations

    with torch.device("cuda"):
        layer = L.ColumnParallelLinear(4096, n, True, OneMethod(Fp8LinearMethod("channel", "dynamic")), "proj")
        norm, act = RMSNorm(4096).to(torch.bfloat16), SiluAndMul()
    g = torch.Generator().manual_seed(n)
    q, scale = quantized(torch.randn(n, 4096, generator=g), per_row=True)
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.process_weights_after_loading()
    norm.weight.data.copy_(1 + 0.2 * torch.randn(4096, generator=g))
    norm.fp8_output_for = act.fp8_output_for = layer.takes_fp8_input
    for rows in (1, 2, 17, 64, 256):
        x = 3 * torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        handed, res = norm(x, residual)
        assert isinstance(handed, QuantizedActivations) == (rows > 1), rows
        norm.fp8_output_for = None
        plain, plain_res = norm(x, residual)
        norm.fp8_output_for = layer.takes_fp8_input
        assert torch.equal(res, plain_res)
        assert torch.equal(layer(handed).view(torch.int16), layer(plain).view(torch.int16)), rows
        gate_up = torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16)
        handed = act(gate_up)
        act.fp8_output_for = None
        plain = act(gate_up)
        act.fp8_output_for = layer.takes_fp8_input
        assert torch.equal(layer(handed).view(torch.int16), layer(plain).view(torch.int16)), rows
