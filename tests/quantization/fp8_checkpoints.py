"""FP8 checkpoints of a saved tiny HF Llama, written by compressed-tensors' own compressor (the format llm-compressor
writes) or in the "fp8" layout (per-tensor weight_scale / input_scale beside fp8 weights), and the float32 weights
they dequantize to."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = (16, 32)  # the block-wise checkpoints' [rows, cols]: splits no merged projection of the tiny model
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(PROJECTIONS)}


def input_amax(model: torch.nn.Module, calibration: list[list[int]]) -> dict[str, float]:
    """The largest |input| each projection sees over the calibration prompts (a static min-max observer)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in _linears(model).items():

        def hook(mod, args, name=name):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in calibration:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def block_scales(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """One min-max scale per [bn, bk] block of w [N, K] (the last blocks may be short): [ceil(N/bn), ceil(K/bk)]."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
    return padded.reshape(-(-n // bn), bn, -(-k // bk), bk).amax(dim=(1, 3)) / FP8_MAX


def expand_blocks(scales: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    bn, bk = -(-shape[0] // scales.shape[0]), -(-shape[1] // scales.shape[1])
    return scales.repeat_interleave(bn, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]


def write_compressed_tensors(hf_path: str, out: str, preset: str, calibration: list[list[int]]) -> None:
    """Quantizes the float checkpoint at hf_path with compressed-tensors' preset scheme ("FP8": per-tensor weights,
    static per-tensor activations; "FP8_DYNAMIC": per-channel weights, dynamic per-token activations; "FP8_BLOCK":
    its block-wise scheme with blocks of BLOCK instead of 128 x 128, for the tiny model) and saves it compressed
    ("float-quantized") to `out`. Scales are min-max: amax / 448."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    amax = input_amax(model, calibration)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if preset == "FP8_BLOCK":
        scheme.weights.block_structure = list(BLOCK)
        scheme.input_activations.group_size = BLOCK[1]
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in _linears(model).items():
            w, shape = module.weight.float(), module.weight_scale.shape
            if preset == "FP8_BLOCK":
                scale = block_scales(w, *BLOCK)
            else:
                scale = w.abs().amax(dim=1, keepdim=True) if module.weight_scale.numel() > 1 else w.abs().amax()
                scale = scale / FP8_MAX
            module.weight_scale.copy_(scale.reshape(shape))
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(amax[name] / FP8_MAX)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


def write_fp8(hf_path: str, out: str, calibration: list[list[int]] | None, block: tuple[int, int] | None = None):
    """The "fp8" layout: fp8 weights with a per-tensor weight_scale, and with calibration a static input_scale per
    projection (activation_scheme "static"), else dynamic activations; with `block` a weight_scale_inv per block
    (weight_block_size)."""
    import transformers

    shutil.copytree(hf_path, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    amax = input_amax(model, calibration) if calibration else {}
    tensors = load_file(os.path.join(hf_path, "model.safetensors"))
    for name in _linears(model):
        w = tensors[f"{name}.weight"].float()
        if block is not None:
            scale = block_scales(w, *block)
            tensors[f"{name}.weight"] = (w / expand_blocks(scale, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            tensors[f"{name}.weight_scale_inv"] = scale
            continue
        scale = w.abs().amax() / FP8_MAX
        tensors[f"{name}.weight"] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[f"{name}.weight_scale"] = scale.reshape(())
        if calibration:
            tensors[f"{name}.input_scale"] = torch.tensor(amax[name] / FP8_MAX)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    scheme = "static" if calibration else "dynamic"
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": []}
    if block is not None:
        config["quantization_config"]["weight_block_size"] = list(block)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)


def dequantized_weights(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each fp8 weight times its scale (per tensor, row or block), in float32."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale", "zero_point")):
            continue
        if t.dtype == FP8:
            scale = tensors.get(name + "_scale", tensors.get(name + "_scale_inv")).float()
            if scale.dim() == 2 and scale.shape[1] > 1:
                scale = expand_blocks(scale, t.shape)
            elif scale.numel() > 1:
                scale = scale.reshape(-1, 1)
            t = t.float() * scale.reshape(()) if scale.numel() == 1 else t.float() * scale
        out[name] = t.float()
    return out
