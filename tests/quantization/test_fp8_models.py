"""FP8 checkpoints of a tiny random Llama end to end on CPU in float32 compute: compressed-tensors' FP8 (per-tensor
weights, static activations) and FP8_DYNAMIC (per-channel weights, per-token activations) written by the
compressed-tensors package, the "fp8" layout (static and dynamic activations), and quantization="fp8" of the float
checkpoint at load.

Oracles: transformers loading the compressed-tensors checkpoint itself (it decompresses the weights and rounds the
activations to fp8 as the scheme says); for the "fp8" layout and quantization="fp8", which transformers does not run
on CPU, the float HF model with the dequantized weights and its projections' inputs rounded to fp8 by the plain
rule below (per token: scale = amax / 448; static: the checkpoint's input_scale). Logits close, greedy tokens
identical; the logits are also checked to be far from the float model's, so the fp8 weights are in use."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import shutil

import pytest
import torch
import transformers
from fp8_checkpoints import (
    BLOCK,
    FP8,
    FP8_MAX,
    PROJECTIONS,
    dequantized_weights,
    input_amax,
    write_compressed_tensors,
    write_fp8,
)
from safetensors.torch import load_file, save_file
from tiny_models import TINY_DECODER, save_tiny_decoder
from tiny_models import our_logits as _our_logits

import pagedllm.layers.quantization.fp8 as fp8_method
from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization import supported_quantizations

IDS = list(range(3, 40))
CALIBRATION = [IDS, list(range(100, 140))]
FORMATS = ["ct-FP8", "ct-FP8_DYNAMIC", "ct-FP8_BLOCK", "fp8-static", "fp8-dynamic", "fp8-block", "at-load"]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    hf, path = save_tiny_decoder(
        "fp8-llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    return hf, path


def _fake_quant(x: torch.Tensor, scale: float | None, group: int | None = None) -> torch.Tensor:
    """x rounded to fp8 per token (scale None), per token and run of `group` features, or with a static scale."""
    if group is not None:
        return torch.cat([_fake_quant(x[..., j : j + group], None) for j in range(0, x.shape[-1], group)], dim=-1)
    s = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX if scale is None else torch.tensor(scale)
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def _reference(float_path: str, weights: dict[str, torch.Tensor], static: dict[str, float] | None, group=None):
    """The float HF model with `weights`, its projections' inputs rounded to fp8 (static: per-projection scales;
    group: per token and run of `group` features)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(PROJECTIONS):
            scale = static[name] if static is not None else None
            module.register_forward_pre_hook(lambda mod, args, s=scale: (_fake_quant(args[0], s, group),))
    return model


def _per_channel(float_path: str) -> dict[str, torch.Tensor]:
    """quantization="fp8" by hand: each projection's weight fp8 per output row (scale = row amax / 448)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32)
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(".weight") and name[: -len(".weight")].endswith(PROJECTIONS):
            s = param.abs().amax(dim=1, keepdim=True) / FP8_MAX
            out[name] = (param / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
    return out


CPU = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24, block_size=4)


def _build(fmt: str, float_model, tmp_path_factory, engine: dict = CPU):
    """(pagedllm LLM, oracle model) for one format."""
    hf, float_path = float_model
    kwargs = dict(skip_tokenizer_init=True, **engine)
    if fmt == "at-load":
        return LLM(float_path, quantization="fp8", **kwargs), _reference(float_path, _per_channel(float_path), None)
    out = str(tmp_path_factory.mktemp(fmt))
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
        write_compressed_tensors(float_path, out, fmt[3:], CALIBRATION)
        oracle = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        return LLM(out, **kwargs), oracle
    static, block = fmt == "fp8-static", BLOCK if fmt == "fp8-block" else None
    write_fp8(float_path, out + "/ckpt", CALIBRATION if static else None, block)
    scales = {k: v / FP8_MAX for k, v in input_amax(hf, CALIBRATION).items()} if static else None
    group = block[1] if block else None
    return LLM(out + "/ckpt", **kwargs), _reference(float_path, dequantized_weights(out + "/ckpt"), scales, group)


@pytest.fixture(scope="module", params=FORMATS)
def fp8_pair(request, float_model, tmp_path_factory):
    return request.param, *_build(request.param, float_model, tmp_path_factory)


def test_every_projection_takes_the_fp8_method(fp8_pair):
    _, llm, _ = fp8_pair
    model = llm.llm_engine.core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 8
    assert all(type(m.quant_method).__name__ == "Fp8EmulatedMethod" for m in linears)
    for layer in model.model.layers:  # each norm and the SiLU feed their one linear (taken quantized on CUDA only)
        attn, mlp = layer.self_attn, layer.mlp
        assert layer.input_layernorm.fp8_output_for.__self__ is attn.qkv_proj
        assert layer.post_attention_layernorm.fp8_output_for.__self__ is mlp.gate_up_proj
        assert mlp.act_fn.fp8_output_for.__self__ is mlp.down_proj
        assert not mlp.down_proj.takes_fp8_input(torch.zeros(4, mlp.down_proj.input_size))


def test_logits_match_the_oracle(fp8_pair, float_model):
    fmt, llm, oracle = fp8_pair
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
        float_logits = float_model[0](torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS)
    # 2e-3: an activation a hair from an fp8 rounding boundary may round the other way (upstream float32 sums differ
    # in the last bits), a step of 1/16 of its value; the fp8 rounding itself moves the logits by 1e-2 and more
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert (ours - float_logits).abs().max() > 1e-2, "the fp8 rounding must show"


def test_greedy_tokens_match_the_oracle(fp8_pair):
    _, llm, oracle = fp8_pair
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


def _config_only(src: str, dst) -> str:
    """src's config.json beside a weights file that is never read: a check that fails must fail before loading."""
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    (dst / "model.safetensors").write_bytes(b"not read")
    return str(dst)


@pytest.mark.parametrize("value", ["bnb", "FP8", 8, ""])
def test_unknown_quantization_is_refused_before_loading(float_model, tmp_path, value):
    supported = supported_quantizations()  # the built-ins and any registered by other tests
    assert {"awq", "bitsandbytes", "compressed-tensors", "fp8", "gguf", "gptq"} <= set(supported)
    with pytest.raises(
        ValueError, match=rf"quantization={value!r} is not supported; supported: {re.escape(str(supported))}"
    ):
        LLM(_config_only(float_model[1], tmp_path), quantization=value, skip_tokenizer_init=True)


def test_quantization_that_contradicts_the_checkpoint(float_model, tmp_path):
    write_fp8(float_model[1], str(tmp_path / "fp8"), None)
    path = _config_only(str(tmp_path / "fp8"), tmp_path)
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors' contradicts the checkpoint.*'fp8'"):
        LLM(path, quantization="compressed-tensors", skip_tokenizer_init=True)


@pytest.mark.parametrize("value", ["compressed-tensors", "gguf"])
def test_formats_that_need_a_quantized_checkpoint(float_model, tmp_path, value):
    message = rf"quantization={value!r} needs a checkpoint quantized.*\['fp8', 'bitsandbytes'\]"
    with pytest.raises(ValueError, match=message):
        LLM(_config_only(float_model[1], tmp_path), quantization=value, skip_tokenizer_init=True)


def test_unsupported_checkpoint_scheme_is_refused_before_loading(float_model, tmp_path):
    config = json.loads((pathlib.Path(float_model[1]) / "config.json").read_text())
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}  # FP8 weights in the int packing
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"config_groups.group_0.format='pack-quantized' is not supported"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_static_checkpoint_without_input_scales(float_model, tmp_path):
    path = str(tmp_path / "fp8")
    write_fp8(float_model[1], path, CALIBRATION)
    tensors = {
        k: v for k, v in load_file(f"{path}/model.safetensors").items() if "layers.1.mlp" not in k or "input" not in k
    }
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for \['model.layers.1.mlp.down_proj.input_scale'"):
        LLM(path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt,method",
    [("at-load", "Fp8ScaledMMMethod"), ("ct-FP8", "Fp8ScaledMMMethod"), ("fp8-block", "Fp8BlockGemmMethod")],
)
def test_cuda_fp8_end_to_end(float_model, tmp_path_factory, fmt, method, monkeypatch):
    """On CUDA in bfloat16 (CUDA graphs on): every projection on its FP8 GEMM with fp8 weights; logits near the
    float32 oracle, and the same argmax wherever the oracle's top two logits are 0.1 or more apart. Per-token
    activations come quantized from the norms' and SiLU's kernels: the same logits, to the bit, as quantizing them
    in the layers."""
    engine = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=256)
    llm, oracle = _build(fmt, float_model, tmp_path_factory, engine)
    model = llm.llm_engine.core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert {type(m.quant_method).__name__ for m in linears} == {method}
    assert all(m.weight.dtype == FP8 for m in linears)
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS).float()
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
    if method == "Fp8ScaledMMMethod":
        monkeypatch.setattr(fp8_method, "FUSE_INPUT_QUANT", False)
        assert torch.equal(_our_logits(llm, IDS).float(), ours)
        monkeypatch.undo()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 0.1
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
    out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8  # decode steps through the captured graphs
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_dummy_weights_quantized_at_load(float_model):
    """The benchmarks' path: dummy float weights, quantization="fp8"; the layers hold what fp8 represents."""
    llm = LLM(
        float_model[1], load_format="dummy", quantization="fp8", dtype="float32", device="cpu", skip_tokenizer_init=True
    )
    layer = llm.llm_engine.core.executor.runner.model.model.layers[0].mlp.down_proj
    assert type(layer.quant_method).__name__ == "Fp8EmulatedMethod"
    with torch.inference_mode():  # the rows of the identity pass fp8 rounding exactly (scale 1/448): W.T
        w = layer(torch.eye(layer.input_size)).T  # [out, in]
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    assert torch.equal((w / scale).to(FP8).float() * scale, w)  # every row on its fp8 grid
    assert len(torch.unique(w)) > 256  # per-row scales: more distinct values than one fp8 grid has
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_block_layout_as_transformers_reads_it(float_model, tmp_path, monkeypatch):
    """transformers dequantizes a block-wise "fp8" checkpoint where it finds no GPU (weights only; with one it keeps
    them fp8, so the GPU is hidden from it): its weights are the ones the reference above takes (weight_scale_inv
    multiplies, one per [16, 32] block)."""
    path = str(tmp_path / "blk")
    write_fp8(float_model[1], path, None, BLOCK)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    monkeypatch.undo()
    ours = dequantized_weights(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    theirs = dict(hf.named_parameters())[name].float()
    assert theirs.shape == ours[name].shape
    torch.testing.assert_close(theirs, ours[name], atol=0, rtol=1e-2)  # transformers may keep bfloat16 copies
