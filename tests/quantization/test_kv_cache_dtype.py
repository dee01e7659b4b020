"""kv_cache_dtype: validation (CPU), the checkpoint's per-tensor KV-cache scales reaching the attention layers, and
the cache's bytes per block. The FP8 cache's kernels are tested in tests/kernels/test_triton_fp8_kv_cache.py."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.layers.attention import Attention
from pagedllm.model_loader.loader import get_model
from pagedllm.worker.model_runner import ModelRunner

K_SCALES, V_SCALES = [0.25, 0.5], [0.125, 2.0]  # per layer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_decoder(
        "kv-llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )[1]


def _with_scales(src: str, dst: str, names: tuple[str, str], kv_cache_scheme: dict | None = None) -> str:
    """A copy of the checkpoint at src with per-layer KV scales named `<layer prefix>.<names[0|1]>`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for i, (ks, vs) in enumerate(zip(K_SCALES, V_SCALES)):
        tensors[f"model.layers.{i}.self_attn.{names[0]}"] = torch.tensor(ks)
        tensors[f"model.layers.{i}.self_attn.{names[1]}"] = torch.tensor([vs])
    save_file(tensors, path)
    if kv_cache_scheme is not None:  # a compressed-tensors config whose only linear group is dense-equivalent
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["re:.*never_matches$"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
            "kv_cache_scheme": kv_cache_scheme,
        }
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return dst


@pytest.mark.parametrize("value", ["fp16", "int8", "FP8", 8, None])
def test_unknown_kv_cache_dtype_is_named(tiny, value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.* must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"):
        EngineArgs(model=tiny, device="cpu", kv_cache_dtype=value, skip_tokenizer_init=True).create_engine_config()


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_on_cpu_is_refused_before_loading(tiny, value):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{value}' is not supported on device='cpu'.*CUDA"):
        LLM(tiny, device="cpu", kv_cache_dtype=value, skip_tokenizer_init=True)


def test_flag_and_default():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.cli_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert EngineArgs().kv_cache_dtype == "auto"


@pytest.mark.parametrize(
    "names,scheme",
    [
        (("k_scale", "v_scale"), {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
        (("k_proj.output_scale", "v_proj.output_scale"), None),
    ],
)
def test_checkpoint_kv_scales_reach_attention(tiny, tmp_path, names, scheme):
    """Before: "checkpoint tensor '...k_scale' has no matching parameter" (and kv_cache_scheme refused)."""
    path = _with_scales(tiny, str(tmp_path / "scaled"), names, scheme)
    config = EngineArgs(model=path, device="cpu", dtype="float32", skip_tokenizer_init=True).create_engine_config()
    model = get_model(config.model, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [(a.k_scale, a.v_scale) for a in layers] == list(zip(K_SCALES, V_SCALES))


def test_checkpoint_without_scales_keeps_one(tiny):
    config = EngineArgs(model=tiny, device="cpu", dtype="float32", skip_tokenizer_init=True).create_engine_config()
    model = get_model(config.model, torch.device("cpu"))
    assert {(a.k_scale, a.v_scale) for a in model.modules() if isinstance(a, Attention)} == {(1.0, 1.0)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_cache_divides_bytes_per_block(tiny, dtype):
    """An FP8 cache stores one byte per value: half a bfloat16 cache's bytes per block, a quarter of float32's, so
    the same memory holds 2x / 4x the blocks."""
    args = EngineArgs(model=tiny, device="cpu", dtype=dtype, skip_tokenizer_init=True, max_model_len=64)
    config = args.create_engine_config()
    plain = ModelRunner(config).kv_bytes_per_block()
    config.cache.cache_dtype = "fp8"  # (the runner alone; EngineArgs refuses it on CPU)
    runner = ModelRunner(config)
    assert runner.kv_cache_dtype == torch.float8_e4m3fn
    cfg = transformers.AutoConfig.from_pretrained(tiny)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_fp8 = 2 * 16 * cfg.num_key_value_heads * head_dim * cfg.num_hidden_layers
    assert runner.kv_bytes_per_block() == per_fp8
    assert plain == per_fp8 * getattr(torch, dtype).itemsize


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scaled", [False, True], ids=["scales-1", "checkpoint-scales"])
def test_cuda_fp8_cache_end_to_end(tiny, tmp_path, kv_cache_dtype, scaled):
    """bfloat16 model on CUDA: the FP8 cache holds twice the blocks in the same memory, its cache tensors are FP8,
    and the prompt logprobs stay within 0.1 of the bfloat16 cache's (FP8 keeps 2-3 mantissa bits of K and V; the
    tiny model's logprobs are ~-5.8), greedy decoding through CUDA graphs included."""
    path = _with_scales(tiny, str(tmp_path / "scaled"), ("k_scale", "v_scale")) if scaled else tiny
    base = dict(device="cuda", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for dtype in ("auto", kv_cache_dtype):
        llm = LLM(path, kv_cache_dtype=dtype, **base)
        runner = llm.llm_engine.core.executor.runner
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        results[dtype] = (llm.llm_engine.core.config.cache.num_blocks, runner.attn_layers[0].kv_cache.dtype, lps)
        del llm
    blocks, cache_dtype, lps = results[kv_cache_dtype]
    assert blocks == 2 * results["auto"][0]
    assert cache_dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    np.testing.assert_allclose(lps, results["auto"][2], atol=0.1, rtol=0)


def test_serve_flag_reaches_the_engine(tiny, capsys):
    """`pagedllm serve MODEL --kv-cache-dtype fp8` on a CPU: the engine's refusal, exit status 2 (the serve extra's
    packages needed: without them `serve` stops before the engine)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from pagedllm.cli import main

    flags = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", "8388608", "--kv-cache-dtype", "fp8"]
    assert main(["serve", tiny, *flags]) == 2
    assert "kv_cache_dtype='fp8' is not supported on device='cpu'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "capability,value,ok", [((8, 0), "fp8", False), ((8, 0), "fp8_e5m2", True), ((9, 0), "fp8", True)]
)
def test_e4m3_cache_needs_ada_or_newer(monkeypatch, capability, value, ok):
    """Triton converts E4M3 on compute capability 8.9+ only (E5M2 on 8.0+): an A100 is told to use fp8_e5m2."""
    from pagedllm import engine_checks, kernels

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    check = lambda: engine_checks.check_kv_cache_dtype(value, torch.device("cuda"), "auto", "generate")  # noqa: E731
    if ok:
        check()
    else:
        with pytest.raises(
            ValueError, match=r"kv_cache_dtype='fp8' \(FP8 E4M3\) needs .* 8.9 .* use kv_cache_dtype='fp8_e5m2'"
        ):
            check()
