"""Weight-only integer checkpoints (W4A16 / W8A16) of a saved tiny HF model, and the float32 weights they dequantize
to (computed from the integer values before packing, so a packing mistake on either side shows):

- compressed-tensors "pack-quantized", written by the compressed-tensors package's own compressor (the code
  llm-compressor saves with), scales and zero points from its own min-max rule (calculate_qparams);
- GPTQ and AWQ, written here from their specs (the packing loops below follow AutoGPTQ's and AutoAWQ's writers)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: position i of a word holds column 8 j + AWQ_ORDER[i]


def _projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The module names of the projections ("model.layers.0.self_attn.q_proj", ...)."""
    return [
        n[: -len(".weight")] for n in tensors if n.endswith(".weight") and n[: -len(".weight")].endswith(PROJECTIONS)
    ]


def _update_config(path: str, quantization_config: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def min_max_quantize(w_t: torch.Tensor, groups: torch.Tensor, num_groups: int, bits: int, sym: bool):
    """w_t [K, N] float, groups [K] -> (q [K, N] in 0..2**bits - 1, zero [G, N] ints, scale [G, N] fp16) by
    min-max per group and column; asymmetric zeros kept in 1..2**bits - 1 (GPTQ's original format cannot store 0)."""
    top = (1 << bits) - 1
    scale = torch.empty(num_groups, w_t.shape[1])
    zero = torch.empty(num_groups, w_t.shape[1], dtype=torch.long)
    for g in range(num_groups):
        rows = w_t[groups == g]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if sym:
            scale[g] = torch.maximum(-lo, hi) / (top / 2) + 1e-8
            zero[g] = 1 << (bits - 1)
        else:
            scale[g] = (hi - lo) / top + 1e-8
            zero[g] = torch.round(-lo / scale[g]).long().clamp(1, top)
    scale = scale.half()
    q = torch.clamp(torch.round(w_t / scale.float()[groups]) + zero[groups], 0, top).long()
    return q, zero, scale


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> the same bits as int32."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def write_gptq(hf_path: str, out: str, bits: int, group_size: int, sym: bool, act_order: bool, seed: int = 0):
    """GPTQ's original ("gptq") checkpoint format. qweight int32 [K / pack, N]: row k of the int weight goes to word
    row k // pack at bit offset bits * (k % pack). qzeros int32 [G, N / pack]: (zero - 1) of column n at word column
    n // pack, bit offset bits * (n % pack). scales fp16 [G, N]. g_idx int32 [K]: without act order k // group_size;
    with it, features are quantized in a random order `perm` and feature perm[i] falls in group i // group_size."""
    shutil.copytree(hf_path, out)
    tensors = load_file(os.path.join(hf_path, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    reference = {}
    for name in _projections(tensors):
        w_t = tensors.pop(f"{name}.weight").float().t()  # [K, N]
        k, n = w_t.shape
        size = k if group_size == -1 else group_size
        order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // size
        num_groups = -(-k // size)
        q, zero, scale = min_max_quantize(w_t, g_idx, num_groups, bits, sym)
        qweight = torch.zeros(k // pack, n, dtype=torch.long)
        for row in range(k):
            qweight[row // pack] |= q[row] << (bits * (row % pack))
        qzeros = torch.zeros(num_groups, n // pack, dtype=torch.long)
        for col in range(n):
            qzeros[:, col // pack] |= (zero[:, col] - 1) << (bits * (col % pack))
        tensors[f"{name}.qweight"] = _to_int32(qweight)
        tensors[f"{name}.qzeros"] = _to_int32(qzeros)
        tensors[f"{name}.scales"] = scale
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
        reference[f"{name}.weight"] = ((q - zero[g_idx]).float() * scale.float()[g_idx]).t().contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = dict(quant_method="gptq", bits=bits, group_size=group_size, desc_act=act_order, sym=sym)
    _update_config(out, {**config, "checkpoint_format": "gptq"})
    return reference


def write_awq(hf_path: str, out: str, group_size: int):
    """AutoAWQ's GEMM format (4 bits, zero points). qweight int32 [K, N / 8]: for word column j, bit offset 4 i holds
    column 8 j + AWQ_ORDER[i] of the int weight [K, N]. qzeros int32 [G, N / 8]: the zero points packed the same way.
    scales fp16 [G, N]. Groups: k // group_size."""
    shutil.copytree(hf_path, out)
    tensors = load_file(os.path.join(hf_path, "model.safetensors"))
    reference = {}
    for name in _projections(tensors):
        w_t = tensors.pop(f"{name}.weight").float().t()  # [K, N]
        k, n = w_t.shape
        groups = torch.arange(k) // group_size
        q, zero, scale = min_max_quantize(w_t, groups, -(-k // group_size), 4, sym=False)
        qweight = torch.zeros(k, n // 8, dtype=torch.long)
        qzeros = torch.zeros(zero.shape[0], n // 8, dtype=torch.long)
        for col in range(n // 8):
            for i in range(8):
                qweight[:, col] |= q[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
                qzeros[:, col] |= zero[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
        tensors[f"{name}.qweight"] = _to_int32(qweight)
        tensors[f"{name}.qzeros"] = _to_int32(qzeros)
        tensors[f"{name}.scales"] = scale
        reference[f"{name}.weight"] = ((q - zero[groups]).float() * scale.float()[groups]).t().contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _update_config(out, dict(quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"))
    return reference


def write_compressed_tensors(hf_path: str, out: str, bits: int, group_size: int | None, sym: bool):
    """compressed-tensors' pack-quantized format through its ModelCompressor: int `bits` weights, per group of
    `group_size` input features (None: per output channel), symmetric or not; scales and zero points by its
    calculate_qparams from each group's min and max. Returns the float32 weights the packed ints stand for, by the
    package's own dequantize (fake_quantize of the weights before compression)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    strategy = "channel" if group_size is None else "group"
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group_size, symmetric=sym)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    reference = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight.float()  # [N, K]
            grouped = w.reshape(w.shape[0], -1, group_size or w.shape[1])  # [N, G, size]
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            zp = getattr(module, "weight_zero_point", None)
            reference[f"{name}.weight"] = fake_quantize(w, module.weight_scale, zp, args).float()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return reference


def write_compressed_tensors_w8a8(hf_path: str, out: str, input_amax: dict[str, float] | None):
    """compressed-tensors' W8A8 INT8 ("int-quantized") through its ModelCompressor: int8 weights with a scale per
    output channel (row amax / 127), activations dynamic per token, or with `input_amax` a static per-tensor scale
    (amax / 127) per projection. Returns the float32 weights the int8 weights stand for (weight * scale, read back
    from the saved checkpoint)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    static = input_amax is not None
    acts = QuantizationArgs(num_bits=8, type="int", strategy="tensor" if static else "token", dynamic=not static)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                module.weight_scale.copy_(module.weight.abs().amax(dim=1, keepdim=True) / 127.0)
            if static and hasattr(module, "input_scale"):
                module.input_scale.fill_(input_amax[name] / 127.0)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    return {
        name: t.float() * tensors[name + "_scale"].float()
        for name, t in tensors.items()
        if t.dtype == torch.int8 and name.endswith(".weight")
    }
