"""A quantization method added from outside the model files: weight-only int8 with one float32 scale per output row,
registered by name and chosen per layer by the checkpoint's quantization_config (config.json). The reference is HF
transformers running the dequantized weights in float32: greedy tokens identical, logits close."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.attention.common import BatchLayout
from pagedllm.forward_context import forward_context
from pagedllm.layers.linear import LinearBase, new_param
from pagedllm.layers.quantization import LinearMethod, QuantizationConfig, register_quantization_config

KEPT_DENSE = "model.layers.1.mlp.down_proj"  # named in the checkpoint's modules_to_not_convert
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Int8WeightMethod(LinearMethod):
    """weight int8 [out, in] and weight_scale float32 [out]: W = weight * weight_scale[:, None]."""

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        rows, loader = sum(output_sizes), layer.weight_loader
        layer.weight = new_param(rows, input_size, dtype=torch.int8, output_dim=0, input_dim=1, weight_loader=loader)
        layer.weight_scale = new_param(rows, dtype=torch.float32, output_dim=0, weight_loader=loader)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]
        return F.linear(x, w, layer.bias)


@register_quantization_config("toy_int8")
class Int8WeightConfig(QuantizationConfig):
    def __init__(self, not_converted: list[str]) -> None:
        self.not_converted = not_converted

    @classmethod
    def from_config(cls, config: dict) -> Int8WeightConfig:
        return cls(list(config.get("modules_to_not_convert", [])))

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        return None if prefix in self.not_converted else Int8WeightMethod()


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1) / 127  # [out]
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _write_int8_checkpoint(hf: torch.nn.Module, path: str) -> None:
    """Replaces the saved checkpoint by an int8 one and sets the HF model's weights to the dequantized values."""
    tensors = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module.endswith(PROJECTIONS) and module != KEPT_DENSE:
                q, scale = _quantize(param.data)
                param.data.copy_(q.float() * scale[:, None])
                tensors[name], tensors[f"{module}.weight_scale"] = q, scale
            else:
                tensors[name] = param.data.clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "toy_int8", "modules_to_not_convert": [KEPT_DENSE]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """(HF model on the dequantized weights, its logits of IDS before quantizing, pagedllm on the int8 checkpoint)."""
    hf, path = save_tiny_decoder(
        "toy-int8", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    with torch.no_grad():
        float_logits = hf(torch.tensor([IDS])).logits[0]
    _write_int8_checkpoint(hf, path)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, block_size=4)
    return hf, float_logits, llm


def _runner(llm: LLM):
    return llm.llm_engine.core.executor.runner


def _our_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = _runner(llm)
    n, dev = len(ids), runner.device
    table = np.arange(-(-n // runner.block_size), dtype=np.int64)[None, :]
    layout = BatchLayout(np.array([0, n]), np.array([n]), table, torch.arange(n, device=dev), runner.block_size, dev)
    with torch.inference_mode(), forward_context(runner.backend.build_metadata(layout)):
        hidden = runner.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev))
        return runner.model.compute_logits(hidden).cpu()


def test_each_layer_takes_the_method_its_prefix_asks_for(int8):
    model = _runner(int8[2]).model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(linears) == 8
    for name, layer in linears.items():
        if name == KEPT_DENSE:  # the dense method or the packing it chose after loading
            assert not isinstance(layer.quant_method, Int8WeightMethod) and not hasattr(layer, "weight_scale")
        else:
            assert isinstance(layer.quant_method, Int8WeightMethod)
            assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (layer.output_size,)


def test_logits_match_the_dequantized_reference(int8):
    hf, float_logits, llm = int8
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert (ours - float_logits).abs().max() > 1e-3  # far outside the tolerance: the int8 weights are in use


def test_greedy_tokens_match_the_dequantized_reference(int8):
    hf, _, llm = int8
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 7, 19)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist(), f"prompt {p}"
