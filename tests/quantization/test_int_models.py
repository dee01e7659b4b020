"""Weight-only integer checkpoints (W4A16 / W8A16) of tiny random Llama and Qwen2 models (Qwen2: q/k/v biases) end to
end on CPU in float32 compute: compressed-tensors pack-quantized (int4 per group symmetric and asymmetric, int8
channel-wise) written by the compressed-tensors package, GPTQ (4-bit act order asymmetric, 8-bit channel-wise
symmetric) and AWQ (4-bit) written from their specs (int_checkpoints.py).

Oracle: the float32 HF transformers model with each projection's weight replaced by what the checkpoint's integers
dequantize to (for compressed-tensors the package's own fake_quantize; for GPTQ / AWQ the writer's integers before
packing times their scales). transformers itself cannot run these formats on this CPU-only setup (GPTQ / AWQ need
their kernel packages). Logits close, greedy tokens identical, and far from the float model's (the integer weights are
in use)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from int_checkpoints import write_awq, write_compressed_tensors, write_gptq
from tiny_models import TINY_DECODER, save_tiny_decoder
from tiny_models import our_logits as _our_logits

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import LinearBase

IDS = list(range(3, 40))
CPU = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24, block_size=4, skip_tokenizer_init=True)
# name -> (architecture, writer, its arguments)
FORMATS = {
    "ct-w4a16-sym-g32": ("llama", write_compressed_tensors, dict(bits=4, group_size=32, sym=True)),
    "ct-w4a16-asym-g32": ("qwen2", write_compressed_tensors, dict(bits=4, group_size=32, sym=False)),
    "ct-w8a16-channel": ("llama", write_compressed_tensors, dict(bits=8, group_size=None, sym=True)),
    "gptq-4bit-g16-actorder": ("llama", write_gptq, dict(bits=4, group_size=16, sym=False, act_order=True)),
    "gptq-8bit-channel": ("qwen2", write_gptq, dict(bits=8, group_size=-1, sym=True, act_order=False)),
    "awq-4bit-g32": ("qwen2", write_awq, dict(group_size=32)),
}
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    return {
        arch: save_tiny_decoder(f"int-{arch}", *classes, dict(TINY_DECODER), tmp_path_factory)
        for arch, classes in ARCHS.items()
    }


def _oracle(float_path: str, weights: dict[str, torch.Tensor]):
    model = transformers.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    missing = set(weights) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(weights, strict=False)
    return model


@pytest.fixture(scope="module", params=list(FORMATS))
def int_pair(request, float_models, tmp_path_factory):
    arch, writer, kwargs = FORMATS[request.param]
    if writer is write_compressed_tensors:
        pytest.importorskip("compressed_tensors")
    float_path = float_models[arch][1]
    out = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    reference = writer(float_path, out, **kwargs)
    assert len(reference) == 14  # 7 projections x 2 layers
    return request.param, LLM(out, **CPU), _oracle(float_path, reference), float_models[arch][0]


def test_projections_dequantized_on_cpu(int_pair):
    """On CPU every projection holds the dequantized weight (oneDNN's packing); no packed tensor is left."""
    _, llm, _, _ = int_pair
    model = llm.llm_engine.core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 8
    for m in linears:
        assert type(m.quant_method).__name__ in ("OneDNNLinearMethod", "DenseLinearMethod")
        assert not any(hasattr(m, t) for t in ("qweight", "qzeros", "weight_packed", "g_idx"))


def test_logits_match_the_oracle(int_pair):
    _, llm, oracle, float_model = int_pair
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
        float_logits = float_model(torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert (ours - float_logits).abs().max() > 1e-3, "the integer rounding must show (10x the tolerance above)"


def test_greedy_tokens_match_the_oracle(int_pair):
    _, llm, oracle, _ = int_pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 9, 21)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = oracle.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist(), f"prompt {p}"


def _with_quantization_config(float_path: str, dst, quantization_config: dict) -> str:
    """float_path's config.json with `quantization_config`, beside a weights file that is never read: a check that
    fails must fail before loading."""
    config = json.loads(open(os.path.join(float_path, "config.json")).read())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "model.safetensors").write_bytes(b"not read")
    return str(dst)


def _ct(weights: dict, activations: dict | None = None, fmt: str = "pack-quantized") -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}


INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
BAD_CONFIGS = {
    "gptq-3bit": (dict(quant_method="gptq", bits=3, group_size=128), r"gptq: quantization_config.bits=3 .*\[4, 8\]"),
    "gptq-group-0": (
        dict(quant_method="gptq", bits=4, group_size=0),
        r"gptq: quantization_config.group_size=0 is not supported \(supported: a positive number",
    ),
    "gptq-marlin-format": (
        dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"),
        r"gptq: quantization_config.checkpoint_format='marlin' is not supported \(supported: \['gptq', 'gptq_v2'\]",
    ),
    "awq-8bit": (dict(quant_method="awq", bits=8, group_size=128), r"awq: quantization_config.bits=8 .*\[4\]"),
    "awq-gemv": (
        dict(quant_method="awq", bits=4, group_size=128, version="gemv"),
        r"awq: quantization_config.version='gemv' is not supported \(supported: 'gemm'\)",
    ),
    "ct-int2": (
        _ct({**INT4, "num_bits": 2}),
        r"compressed-tensors: quantization_config.config_groups.group_0.weights.num_bits=2 .*\[4, 8\]",
    ),
    "ct-int-tensor": (
        _ct({**INT4, "strategy": "tensor"}),
        r"weights.strategy='tensor' is not supported for int weights \(supported: 'channel', 'group'\)",
    ),
    "ct-w8a8-int8": (
        _ct({**INT4, "num_bits": 8, "strategy": "channel"}, {"num_bits": 8, "type": "int", "strategy": "token"}),
        r"int weights with quantized activations \(W8A8 INT8\) are not supported yet",
    ),
    "ct-int-naive": (
        _ct(INT4, fmt="naive-quantized"),
        r"format='naive-quantized' is not supported for int weights \(supported: 'pack-quantized'\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_schemes_are_refused_before_loading(float_models, tmp_path, case):
    config, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        LLM(_with_quantization_config(float_models["llama"][1], tmp_path, config), skip_tokenizer_init=True)


GPTQ4 = dict(quant_method="gptq", bits=4, group_size=32, desc_act=False, sym=True)


def test_quantization_argument_checks_the_checkpoint(float_models, tmp_path):
    path = _with_quantization_config(float_models["llama"][1], tmp_path, GPTQ4)
    with pytest.raises(
        ValueError, match=r"quantization='awq' contradicts the checkpoint, which is quantized as 'gptq'"
    ):
        LLM(path, quantization="awq", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"quantization='gptq' needs a checkpoint quantized in that format"):
        LLM(float_models["llama"][1], quantization="gptq", skip_tokenizer_init=True)


def test_forced_quantization_and_dummy_weights(float_models, tmp_path):
    """quantization="gptq" on a GPTQ checkpoint is accepted; dummy weights (the benchmarks' path) fill the packed
    tensors with random bits and g_idx with the plain groups, and the model generates."""
    shutil.copy(os.path.join(float_models["llama"][1], "config.json"), tmp_path / "float.json")
    path = _with_quantization_config(float_models["llama"][1], tmp_path, GPTQ4)
    llm = LLM(path, quantization="gptq", load_format="dummy", **CPU)
    layer = llm.llm_engine.core.executor.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight is None or layer.weight.dtype == torch.float32
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
