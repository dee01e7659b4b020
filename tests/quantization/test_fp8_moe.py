"""FP8 routed experts on CPU in float32 compute: a tiny random Qwen3-MoE whose attention projections and experts are
FP8 ("fp8" layout: per-tensor scales; compressed-tensors FP8_DYNAMIC layout: per-channel scales), dynamic
activations. pagedllm dequantizes the experts at load and runs them on float activations (weight-only); the dense
projections round their inputs to fp8 per token.

Oracle: HF transformers' float Qwen3-MoE with every quantized weight replaced by what it dequantizes to (fp8 value x
scale) and the attention projections' inputs rounded to fp8 per token (scale = amax / 448), the experts' not. Greedy
tokens identical, logprobs within 1e-4 (float32 on both sides), and far from the float model's (the fp8 weights are in
use). Experts quantized in a format pagedllm does not run are refused before loading."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import TINY_DECODER, hf_greedy, save_tiny_decoder

from pagedllm import LLM, SamplingParams

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
CPU = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, block_size=4, skip_tokenizer_init=True)
MOE = dict(TINY_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
QUANTIZED = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
PROMPTS = [list(range(3, 20)), [7, 1, 300, 45, 45, 2]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return save_tiny_decoder("fp8-moe", transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, MOE,
                             tmp_path_factory)  # fmt: skip


def write_fp8_moe(float_path: str, out: str, per_channel: bool, experts_only: bool = False) -> dict[str, torch.Tensor]:
    """The fp8 checkpoint (experts_only: the attention projections stay float); returns the float32 weights its
    quantized tensors dequantize to."""
    quantized = QUANTIZED[len(ATTENTION) :] if experts_only else QUANTIZED
    shutil.copytree(float_path, out)
    path = os.path.join(out, "model.safetensors")
    tensors, dequantized = load_file(path), {}
    for name in [n for n in list(tensors) if n.endswith(".weight") and n[: -len(".weight")].endswith(quantized)]:
        w = tensors[name].float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = (amax / FP8_MAX).clamp_min(1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[name], tensors[name[: -len("weight")] + "weight_scale"] = (
            q,
            scale.reshape(-1, 1) if per_channel else scale,
        )
        dequantized[name] = q.float() * scale
    save_file(tensors, path)
    if per_channel:
        act = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": act}
        ignore = ["lm_head", "re:.*mlp.gate$", *(["re:.*self_attn.*"] if experts_only else [])]
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
              "ignore": ignore}  # fmt: skip
    else:
        qc = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": list(ATTENTION) if experts_only else [],
        }
    _set_quantization_config(out, qc)
    return dequantized


def _set_quantization_config(path: str, qc: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _round_per_token(x: torch.Tensor) -> torch.Tensor:
    s = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def _oracle(float_path: str, dequantized: dict[str, torch.Tensor], tmp_path) -> torch.nn.Module:
    ref_path = str(tmp_path / "dequantized")
    shutil.copytree(float_path, ref_path)
    tensors = load_file(os.path.join(ref_path, "model.safetensors"))
    tensors.update(dequantized)
    save_file(tensors, os.path.join(ref_path, "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(ATTENTION):
            module.register_forward_pre_hook(lambda mod, args: (_round_per_token(args[0]),))
    return model


@pytest.mark.parametrize("per_channel", [False, True], ids=["fp8-tensor", "ct-channel"])
def test_fp8_experts_match_the_dequantized_oracle(moe, tmp_path, per_channel):
    hf, float_path = moe
    out = str(tmp_path / "ckpt")
    oracle = _oracle(float_path, write_fp8_moe(float_path, out, per_channel), tmp_path)
    llm = LLM(out, **CPU)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    moved = 0.0
    for prompt, o in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(oracle, prompt, 8)
        got = o.outputs[0]
        assert got.token_ids == tokens
        ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-4, rtol=0)
        float_tokens, float_logprobs = hf_greedy(hf, prompt, 8)
        n = next((i for i, (a, b) in enumerate(zip(tokens, float_tokens)) if a != b), len(tokens))
        moved = max(moved, max([abs(a - b) for a, b in zip(logprobs[:n], float_logprobs[:n])] or [1.0]))
    assert moved > 1e-3  # the float model differs: fp8 weights are in use
    experts = [m for m in llm.llm_engine.core.executor.runner.model.modules() if type(m).__name__ == "FusedMoE"]
    assert experts and all(m.w13_weight.dtype == torch.float32 for m in experts)  # dequantized at load


def test_unsupported_expert_quantization_is_refused(moe, tmp_path):
    """Static per-tensor activations (compressed-tensors' FP8 preset) are not run by the float experts."""
    out = str(tmp_path / "static")
    shutil.copytree(moe[1], out)
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    group = {"targets": ["Linear"], "weights": scheme, "input_activations": scheme}
    _set_quantization_config(out, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"group_0": group}})  # fmt: skip
    with pytest.raises(ValueError, match=r"mlp.experts: quantized experts \(compressed-tensors.*not supported"):
        LLM(out, **CPU)
