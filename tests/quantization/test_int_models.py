"""Integer checkpoints of tiny random Llama and Qwen2 models (Qwen2: q/k/v biases) end to end on CPU in float32
compute. Weight-only (W4A16 / W8A16): compressed-tensors pack-quantized (int4 per group symmetric and asymmetric, int8
channel-wise) written by the compressed-tensors package, GPTQ (4-bit act order asymmetric, 8-bit channel-wise
symmetric) and AWQ (4-bit) written from their specs (int_checkpoints.py). W8A8 INT8: compressed-tensors int-quantized
(per-channel weights; dynamic per-token or static per-tensor activations) written by the package.

Oracle: the float32 HF transformers model with each projection's weight replaced by what the checkpoint's integers
dequantize to (for pack-quantized the package's own fake_quantize; for GPTQ / AWQ the writer's integers before
packing times their scales; for W8A8 the saved int8 weights times their scales), and for W8A8 each projection's input
rounded to int8 by the plain rule (per token: scale = amax / 127, round half to even, clamp to [-128, 127]; static:
the checkpoint's scale), vLLM's rule. transformers itself cannot run these formats here (GPTQ / AWQ need their kernel
packages; its compressed-tensors emulation of int8 activations scales by amax / 127.5, not vLLM's amax / 127).
Logits close, greedy tokens identical, and far from the float model's (the integer weights are in use)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from fp8_checkpoints import PROJECTIONS, input_amax
from int_checkpoints import write_awq, write_compressed_tensors, write_compressed_tensors_w8a8, write_gptq
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
    "ct-w8a8-dynamic": ("llama", write_compressed_tensors_w8a8, dict(input_amax=None)),
    "ct-w8a8-static": ("qwen2", write_compressed_tensors_w8a8, dict(input_amax="calibrate")),
}
CALIBRATION = [IDS, list(range(100, 140))]
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


def _int8_round(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0 if scale is None else torch.tensor(scale)
    return torch.round(x / s).clamp(-128, 127) * s


def _oracle(float_path: str, weights: dict[str, torch.Tensor], w8a8: bool = False, amax: dict | None = None):
    """The float model with `weights`; w8a8: projection inputs rounded to int8 (per token, or amax / 127 static)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    missing = set(weights) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(weights, strict=False)
    for name, module in model.named_modules():
        if w8a8 and isinstance(module, torch.nn.Linear) and name.endswith(PROJECTIONS):
            scale = amax[name] / 127.0 if amax is not None else None
            module.register_forward_pre_hook(lambda mod, args, s=scale: (_int8_round(args[0], s),))
    return model


@pytest.fixture(scope="module", params=list(FORMATS))
def int_pair(request, float_models, tmp_path_factory):
    arch, writer, kwargs = FORMATS[request.param]
    if writer is write_compressed_tensors:
        pytest.importorskip("compressed_tensors")
    hf, float_path = float_models[arch]
    out = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    amax = input_amax(hf, CALIBRATION) if kwargs.get("input_amax") == "calibrate" else None
    reference = writer(float_path, out, **{**kwargs, **({"input_amax": amax} if amax else {})})
    assert len(reference) == 14  # 7 projections x 2 layers
    oracle = _oracle(float_path, reference, writer is write_compressed_tensors_w8a8, amax)
    return request.param, LLM(out, **CPU), oracle, hf


def test_projections_dequantized_on_cpu(int_pair):
    """On CPU every projection holds the dequantized weight (oneDNN's packing; W8A8: behind the activations'
    rounding); no packed tensor is left."""
    fmt, llm, _, _ = int_pair
    model = llm.llm_engine.core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 8
    expected = ("Int8EmulatedMethod",) if "w8a8" in fmt else ("OneDNNLinearMethod", "DenseLinearMethod")
    for m in linears:
        assert type(m.quant_method).__name__ in expected
        assert not any(hasattr(m, t) for t in ("qweight", "qzeros", "weight_packed", "g_idx"))


def test_logits_match_the_oracle(int_pair):
    fmt, llm, oracle, float_model = int_pair
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
        float_logits = float_model(torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS)
    # W8A8: an activation a hair from an int8 rounding boundary may round the other way (upstream float32 sums
    # differ in the last bits), a step of 1/127 of its row's largest value
    atol = 2e-3 if "w8a8" in fmt else 1e-4
    torch.testing.assert_close(ours, ref, atol=atol, rtol=1e-4)
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
    "ct-w4a8-int": (
        _ct(
            {**INT4, "strategy": "channel"},
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
            fmt="int-quantized",
        ),
        r"weights: num_bits=4 strategy='channel' symmetric=True is not supported with int8 activations",
    ),
    "ct-w8a8-asym-activations": (
        _ct(
            {**INT4, "num_bits": 8, "strategy": "channel"},
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": False},
            fmt="int-quantized",
        ),
        r"input_activations: .* symmetric=False strategy='token' dynamic=True is not supported \(supported: symm",
    ),
    "ct-w8a8-packed": (
        _ct({**INT4, "num_bits": 8, "strategy": "channel"}, {"num_bits": 8, "type": "int", "strategy": "token"}),
        r"format='pack-quantized' is not supported for W8A8 INT8 \(supported: \('int-quantized', 'naive-quan",
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


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt,method",
    [
        ("gptq-4bit-g16-actorder", "WNA16GemmMethod"),
        ("awq-4bit-g32", "WNA16GemmMethod"),
        ("ct-w4a16-asym-g32", "WNA16GemmMethod"),
        ("ct-w8a16-channel", "WNA16GemmMethod"),
        ("ct-w8a8-dynamic", "Int8GemmMethod"),
    ],
)
def test_cuda_end_to_end(float_models, tmp_path_factory, fmt, method):
    """On CUDA in bfloat16 (CUDA graphs on): every projection on its kernel with the weights kept packed (int8 for
    W8A8); logits near the float32 oracle, the same argmax wherever the oracle's top two logits are 0.1 or more apart,
    for a prefill (the dequantize-then-GEMM path above 64 rows) and decode steps (the fused kernel)."""
    import gc

    arch, writer, kwargs = FORMATS[fmt]
    if writer in (write_compressed_tensors, write_compressed_tensors_w8a8):
        pytest.importorskip("compressed_tensors")
    hf, float_path = float_models[arch]
    out = str(tmp_path_factory.mktemp(f"cuda-{fmt}") / "ckpt")
    oracle = _oracle(float_path, writer(float_path, out, **kwargs), writer is write_compressed_tensors_w8a8)
    llm = LLM(
        out, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=256, skip_tokenizer_init=True
    )
    model = llm.llm_engine.core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    methods = {m.prefix.rsplit(".", 1)[-1]: type(m.quant_method).__name__ for m in linears}
    # act order: the writer draws each projection's own permutation, so fused layers (qkv, gate_up) whose parts
    # disagree take the dense path (wna16.py); single projections stay packed on the kernel
    fused_method = "DenseLinearMethod" if "actorder" in fmt else method
    assert methods["o_proj"] == methods["down_proj"] == method
    assert methods["qkv_proj"] == methods["gate_up_proj"] == fused_method
    ids = (IDS * 3)[:100]  # 100 rows: the large-batch path
    for prompt in (ids, IDS[:5]):
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt])).logits[0]
        ours = _our_logits(llm, prompt).float().cpu()
        torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) >= 0.1
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8  # decode steps through the captured graphs
    del llm
    gc.collect()
    torch.cuda.empty_cache()
