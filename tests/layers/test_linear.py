"""The linear layers' seam: methods chosen by prefix, shard layout under a tensor-parallel build context, the dense
method's CPU variants and the GGUF 4-bit method, each against a plain torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import TINY_DECODER

from pagedllm.kernels import cpu_kernels, cpu_quant
from pagedllm.layers import linear as L
from pagedllm.layers.build_context import BuildContext, building
from pagedllm.layers.q4_linear import GROUP, MAX_ROWS, PackedQ4, q4_kernel_available
from pagedllm.layers.quantization import (
    QuantizationConfig,
    get_quantization_config,
    quantization_config_from_hf,
    register_quantization_config,
)
from pagedllm.layers.quantization import gguf as G
from pagedllm.models.bert import BertForSequenceClassification
from pagedllm.models.llama import LlamaForCausalLM


class RecordingConfig(QuantizationConfig):
    """Dense everywhere; remembers which prefix each layer asked for."""

    def __init__(self) -> None:
        self.asked: dict[str, object] = {}

    def get_linear_method(self, layer, prefix):
        self.asked[prefix] = layer
        return None


def _linears(model: torch.nn.Module) -> dict[str, L.LinearBase]:
    return {name: m for name, m in model.named_modules() if isinstance(m, L.LinearBase)}


def test_each_linear_is_asked_for_by_its_module_name():
    config = RecordingConfig()
    llama = LlamaForCausalLM(transformers.LlamaConfig(**TINY_DECODER), config, max_position=64)
    bert_config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, vocab_size=50
    )
    bert = BertForSequenceClassification(bert_config, config, max_position=64)
    linears = {**_linears(llama), **_linears(bert)}
    assert len(linears) == 4 * 2 + 4 * 2 + 2  # llama 4 per layer; bert 4 per layer, pooler, classifier
    assert {name: layer.prefix for name, layer in linears.items()} == {name: name for name in linears}
    assert config.asked == linears
    assert all(layer.quant_method is L.DENSE for layer in linears.values())


def _build(tp_rank: int, tp_size: int, make):
    with building(BuildContext(tp_rank=tp_rank, tp_size=tp_size)):
        return make()


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_take_their_heads(tp_size):
    """4 query heads over 2 KV heads of dim 3: each rank holds its query heads and its KV head (replicated past 2)."""
    head_dim, hidden = 3, 8
    w = {s: torch.randn(n * head_dim, hidden) for s, n in (("q", 4), ("k", 2), ("v", 2))}
    b = {s: torch.randn(t.shape[0]) for s, t in w.items()}
    for rank in range(tp_size):
        layer = _build(rank, tp_size, lambda: L.QKVParallelLinear(hidden, head_dim, 4, 2, True))
        for s in "qkv":
            layer.weight.weight_loader(layer.weight, w[s], s)
            layer.bias.weight_loader(layer.bias, b[s], s)
        kv_rank = rank * min(tp_size, 2) // tp_size
        kv_parts = min(tp_size, 2)
        expect = [w["q"].chunk(tp_size)[rank], w["k"].chunk(kv_parts)[kv_rank], w["v"].chunk(kv_parts)[kv_rank]]
        torch.testing.assert_close(layer.weight.data, torch.cat(expect), rtol=0, atol=0)
        expect_b = [b["q"].chunk(tp_size)[rank], b["k"].chunk(kv_parts)[kv_rank], b["v"].chunk(kv_parts)[kv_rank]]
        torch.testing.assert_close(layer.bias.data, torch.cat(expect_b), rtol=0, atol=0)
        assert (layer.q_size, layer.kv_size) == (12 // tp_size, 3 * 2 // kv_parts)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_and_row_shards(tp_size):
    gate, up, down, down_bias = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6), torch.randn(4)
    for rank in range(tp_size):
        merged = _build(rank, tp_size, lambda: L.MergedColumnParallelLinear(4, [6, 6], False))
        merged.weight.weight_loader(merged.weight, gate, 0)
        merged.weight.weight_loader(merged.weight, up, 1)
        expect = torch.cat([gate.chunk(tp_size)[rank], up.chunk(tp_size)[rank]])
        torch.testing.assert_close(merged.weight.data, expect, rtol=0, atol=0)
        row = _build(rank, tp_size, lambda: L.RowParallelLinear(6, 4, True))
        row.weight.weight_loader(row.weight, down, None)
        row.bias.weight_loader(row.bias, down_bias, None)
        torch.testing.assert_close(row.weight.data, down.chunk(tp_size, dim=1)[rank], rtol=0, atol=0)
        # the bias is added once in the ranks' sum: the first rank holds it, the others zeros
        torch.testing.assert_close(row.bias.data, down_bias if rank == 0 else torch.zeros(4), rtol=0, atol=0)


def test_shards_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_heads=3 must be divisible by the tensor-parallel size 2"):
        _build(0, 2, lambda: L.QKVParallelLinear(8, 2, 3, 1, False))
    with pytest.raises(ValueError, match="tp_rank=2 must be in"):
        BuildContext(tp_rank=2, tp_size=2)


def test_a_shard_of_the_wrong_shape_is_refused():
    layer = L.QKVParallelLinear(8, 2, 4, 2, False)
    with pytest.raises(ValueError, match=r"checkpoint tensor of shape \(4, 8\) does not fit parameter \(8, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(4, 8), "q")


def _loaded(layer: L.LinearBase, w: torch.Tensor, b: torch.Tensor) -> L.LinearBase:
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.skipif(L.pack_for_cpu(torch.ones(2, 2)) is None, reason="oneDNN is not available")
def test_dense_float32_on_cpu_takes_onednn():
    w, b = torch.randn(24, 16), torch.randn(24)
    layer = _loaded(L.ColumnParallelLinear(16, 24, True), w, b)
    assert layer.quant_method is L.ONEDNN and layer.weight is None  # the plain copy dropped
    for rows in (0, 1, 70):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_dense_bfloat16_takes_tiles_up_to_tile_rows(monkeypatch):
    """The variant chain on any CPU: a stand-in tile packing (recording its calls) for batches of up to TILE_ROWS
    tokens, the oneDNN (or plain) variant above."""
    calls = []
    monkeypatch.setattr(cpu_kernels, "pack_tiles", lambda w: ("tiles", w.clone()))
    monkeypatch.setattr(
        cpu_kernels, "linear_tiles", lambda x, t, b: calls.append(x.shape) or F.linear(x, t[1], b.to(x.dtype))
    )
    w, b = torch.randn(24, 16).bfloat16(), torch.randn(24).bfloat16()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = _loaded(L.RowParallelLinear(16, 24, True), w, b)
    finally:
        torch.set_default_dtype(torch.float32)
    assert isinstance(layer.quant_method, L.TiledLinearMethod)
    assert layer.tile_bias.dtype == torch.float32
    for shape in [(1, 16), (L.TILE_ROWS, 16), (4, L.TILE_ROWS // 4, 16), (L.TILE_ROWS + 1, 16)]:
        calls.clear()
        x = torch.randn(*shape).bfloat16()
        torch.testing.assert_close(layer(x), F.linear(x, w, b))
        assert bool(calls) == (x.numel() // 16 <= L.TILE_ROWS)


def test_a_layer_that_fuses_into_onednn_packs_no_tiles(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "pack_tiles", lambda w: pytest.fail("packed for tiles"))
    layer = L.RowParallelLinear(16, 24, True)
    layer.use_tiles = False
    _loaded(layer, torch.randn(24, 16), torch.randn(24))
    assert layer.cpu_tiles is None


def _packed_q4(rows: int, cols: int, gen: torch.Generator) -> PackedQ4:
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(rows, cols // GROUP, generator=gen) / 8
    zero = torch.randn(rows, cols // GROUP, generator=gen) / 8
    return PackedQ4(q, scale, zero)


def _q4_qkv(dense_v: bool, gen: torch.Generator):
    """A bfloat16 QKV layer (64 -> 64 + 32 + 32) of the gguf method, q and k loaded 4-bit, v 4-bit or dense."""
    shards = {s: _packed_q4(n, 64, gen) for s, n in (("q", 64), ("k", 32), ("v", 32))}
    if dense_v:
        shards["v"] = shards["v"].dequantize()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = L.QKVParallelLinear(64, 16, 4, 2, True, get_quantization_config("gguf")(), "qkv_proj")
    finally:
        torch.set_default_dtype(torch.float32)
    for s, t in shards.items():
        layer.weight.weight_loader(layer.weight, t, s)
    bias = torch.randn(128, generator=gen).bfloat16()
    layer.bias.weight_loader(layer.bias, bias)
    w = torch.cat([t.dequantize() if isinstance(t, PackedQ4) else t for t in shards.values()])  # [128, 64] f32
    layer.process_weights_after_loading()
    return layer, w, bias


@pytest.mark.skipif(not (q4_kernel_available() or cpu_quant.available()), reason="no 4-bit CPU kernel")
def test_gguf_q4_takes_the_4bit_kernel_up_to_max_rows(monkeypatch):
    layer, w, bias = _q4_qkv(False, torch.Generator().manual_seed(0))
    assert isinstance(layer.quant_method, G.Q4KernelMethod) and layer.q4 is None
    calls = []
    if cpu_quant.available():  # the C kernel where it builds, else torch's
        assert isinstance(layer.q4_weight, cpu_quant.QuantWeight)
        kernel = cpu_quant.quant_linear
        monkeypatch.setattr(cpu_quant, "quant_linear", lambda x, *a: calls.append(x.shape) or kernel(x, *a))
    else:
        q4_matmul = G.q4_matmul
        monkeypatch.setattr(G, "q4_matmul", lambda x, *a: calls.append(x.shape) or q4_matmul(x, *a))
    for rows in (1, MAX_ROWS, MAX_ROWS + 1, 80):
        calls.clear()
        x = torch.randn(rows, 64).bfloat16()
        ref = (x.double() @ w.bfloat16().double().t() + bias.double()).float()
        torch.testing.assert_close(layer(x).float(), ref, atol=0.05, rtol=0.02)
        assert bool(calls) == (rows <= MAX_ROWS)


def test_gguf_layer_with_a_dense_shard_stays_dense():
    """A merged layer whose rows did not all come 4-bit: the dequantized rows and the dense ones in one dense
    weight, no int4 kernel."""
    layer, w, bias = _q4_qkv(True, torch.Generator().manual_seed(1))
    assert not isinstance(layer.quant_method, G.Q4KernelMethod) and not hasattr(layer, "q4_weight")
    x = torch.randn(3, 64).bfloat16()
    ref = (x.double() @ w.bfloat16().double().t() + bias.double()).float()
    torch.testing.assert_close(layer(x).float(), ref, atol=0.05, rtol=0.02)


def test_packed_q4_narrows_rows_and_whole_groups():
    t = _packed_q4(6, 64, torch.Generator().manual_seed(2))
    torch.testing.assert_close(t.narrow(0, 2, 3).dequantize(), t.dequantize()[2:5])
    torch.testing.assert_close(t.narrow(1, 32, 32).dequantize(), t.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="whole groups of 32"):
        t.narrow(1, 16, 32)


def test_quantization_by_name():
    hf_config = transformers.LlamaConfig(**TINY_DECODER)
    assert quantization_config_from_hf(hf_config) is None
    hf_config.quantization_config = {"quant_method": "hqq", "nbits": 4}
    with pytest.raises(ValueError, match=r"quantization 'hqq' is not supported; supported: \[.*'gguf'"):
        quantization_config_from_hf(hf_config)
    with pytest.raises(ValueError, match="'gguf' is built in"):
        register_quantization_config("gguf")(RecordingConfig)
