"""Bad quantization input is one ValueError before any weight is read, naming the format and what is supported: a
quantization_config that names no format, a `quantization=` that contradicts the checkpoint (every quantized format,
GGUF included). Each checkpoint here is a config.json beside a weights file that is not a weights file."""

from __future__ import annotations

import json
import os
import re
import types

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM
from pagedllm.layers.quantization import checkpoint_quantization, quantization_config_from_hf, supported_quantizations

CPU = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


@pytest.fixture(scope="module")
def float_path(tmp_path_factory) -> str:
    return save_tiny_decoder(
        "qc-llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )[1]


def config_only(float_path: str, dst, quantization_config) -> str:
    config = json.loads(open(os.path.join(float_path, "config.json")).read())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "model.safetensors").write_bytes(b"not read")
    return str(dst)


def supported_message() -> str:
    return re.escape(f"(supported: {supported_quantizations()})")


@pytest.mark.parametrize("raw", [{}, {"bits": 4, "group_size": 128}, {"quant_method": None}])
def test_a_quantization_config_without_a_format(float_path, tmp_path, raw):
    """Refused when the engine is configured (it used to fail later, at load, without the supported formats)."""
    path = config_only(float_path, tmp_path, raw)
    with pytest.raises(ValueError, match=r"quantization_config=.* names no quant_method: .*" + supported_message()):
        LLM(path, **CPU)


def test_checkpoint_quantization_reads_the_format():
    class Method:  # transformers' QuantizationMethod enum
        value = "gptq"

    assert checkpoint_quantization(types.SimpleNamespace()) is None
    assert checkpoint_quantization(types.SimpleNamespace(quantization_config=None)) is None
    assert checkpoint_quantization(types.SimpleNamespace(quantization_config={"quant_method": "awq"})) == "awq"
    mixin = types.SimpleNamespace(quant_method=Method())
    assert checkpoint_quantization(types.SimpleNamespace(quantization_config=mixin)) == "gptq"
    for raw in ({}, ["fp8"], {"quant_method": None}):
        with pytest.raises(ValueError, match="names no quant_method"):
            checkpoint_quantization(types.SimpleNamespace(quantization_config=raw))
    with pytest.raises(ValueError, match=r"quant_method=5 must name a quantization " + supported_message()):
        quantization_config_from_hf(types.SimpleNamespace(quantization_config={"quant_method": 5}))


CHECKPOINTS = {  # a valid quantization_config of each quantized format
    "awq": dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"),
    "gptq": dict(quant_method="gptq", bits=4, group_size=32, desc_act=False, sym=True),
    "bitsandbytes": dict(quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
    },
    "fp8": dict(quant_method="fp8", activation_scheme="dynamic"),
}


@pytest.mark.parametrize("found", list(CHECKPOINTS))
@pytest.mark.parametrize("requested", ["fp8", "bitsandbytes", "gptq"])
def test_quantization_that_contradicts_each_format(float_path, tmp_path, found, requested):
    """quantization= of another format than the checkpoint's: refused naming both; the same one: accepted as far as
    configuring (the weights file then fails to read, so a load was attempted)."""
    path = config_only(float_path, tmp_path, CHECKPOINTS[found])
    if requested == found:
        with pytest.raises(Exception) as info:
            LLM(path, quantization=requested, **CPU)
        assert type(info.value).__name__ == "SafetensorError", info.value  # reading the weights file
        return
    message = rf"quantization={requested!r} contradicts the checkpoint, which is quantized as {found!r}"
    with pytest.raises(ValueError, match=message):
        LLM(path, quantization=requested, **CPU)


def test_quantization_that_contradicts_a_gguf_file(smollm2):
    with pytest.raises(
        ValueError, match=r"quantization='fp8' contradicts the checkpoint, which is quantized as 'gguf'"
    ):
        LLM(smollm2, quantization="fp8", **CPU)
