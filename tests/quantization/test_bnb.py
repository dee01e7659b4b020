"""bitsandbytes checkpoints of a tiny random Llama, made by the real tools: transformers loads the float checkpoint
with `BitsAndBytesConfig` (bitsandbytes' CPU backend quantizes it) and `save_pretrained` writes it. 4-bit nf4 with
double quantization, fp4 without it (bfloat16 compute dtype, o_proj and lm_head left unquantized), nf4 with the
packed codes stored as bfloat16 (bnb_4bit_quant_storage), and 8-bit LLM.int8 (outlier threshold 6). Run in float32
on CPU.

Oracles:
- 8-bit: the checkpoint loaded by transformers itself (bitsandbytes' int8 matmul with its outlier columns).
- 4-bit: the float32 HF model with each projection's weight replaced by bitsandbytes' own dequantization of the saved
  tensors (`bitsandbytes.functional.dequantize_4bit`). transformers' 4-bit forward is not a float32 oracle on this
  CPU: bitsandbytes repacks the weight for a bfloat16 kernel at inference (its logits are checked within that
  noise), and its CPU dequantization kernel misplaces blocks that straddle two rows (K not a multiple of the
  blocksize), so these checkpoints use an intermediate size of 128; K = 96 is checked against bitsandbytes' generic
  torch dequantization below, and end to end through quantization="bitsandbytes".
- quantization="bitsandbytes" of a float checkpoint (4-bit nf4 at load, as vLLM): the float32 HF model with each
  projection's weight replaced by bitsandbytes' quantize_4bit(nf4, blocksize 64) dequantized.
Logits close, greedy tokens identical, and far from the float model's (the 4-bit or 8-bit weights are in use)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny_models import TINY_DECODER, save_tiny_decoder
from tiny_models import our_logits as _our_logits

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.bnb_format import codebook, dequantize_4bit, regroup_4bit, unpack_rows


def _bnb():
    """bitsandbytes.functional, or the test skipped: the package makes the checkpoints and is the oracle (the
    option checks below run without it)."""
    return pytest.importorskip("bitsandbytes.functional")


IDS = list(range(3, 40))
CPU = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24, block_size=4, skip_tokenizer_init=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = {  # name -> BitsAndBytesConfig keywords
    "nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4-bf16-compute-skip": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        llm_int8_skip_modules=["o_proj", "lm_head"],
    ),
    "nf4-bf16-storage": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16),
    "int8": dict(load_in_8bit=True, llm_int8_threshold=6.0),
}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    kwargs = dict(TINY_DECODER, intermediate_size=128)
    return save_tiny_decoder(
        "bnb-llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, kwargs, tmp_path_factory
    )


def _dequantized_4bit(path: str) -> dict[str, torch.Tensor]:
    """{"<module>.weight": float32 W} of every 4-bit weight in the checkpoint, by bitsandbytes' dequantize_4bit."""
    F = _bnb()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for name in tensors:
        if ".weight.quant_state." not in name:
            continue
        module = name.split(".weight.")[0]
        parts = {k[len(module) + len(".weight.") :]: v for k, v in tensors.items() if k.startswith(module + ".weight.")}
        state = F.QuantState.from_dict(parts, device=torch.device("cpu"))
        out[f"{module}.weight"] = F.dequantize_4bit(tensors[f"{module}.weight"], state).float()
    return out


def _float_with(float_path: str, weights: dict[str, torch.Tensor]):
    model = transformers.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()
    missing = set(weights) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(weights, strict=False)
    return model


def _make_checkpoint(float_path: str, out: str, variant: str) -> str:
    """transformers loads the float checkpoint with BitsAndBytesConfig (bitsandbytes quantizes it) and saves it."""
    _bnb()
    config = transformers.BitsAndBytesConfig(**VARIANTS[variant])
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        float_path, quantization_config=config, device_map="cpu", dtype=torch.float32
    )
    quantized.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def bnb_case(request, float_model, tmp_path_factory):
    """(variant, pagedllm LLM, oracle, float HF model, HF's own load of the checkpoint, its folder)."""
    hf_float, float_path = float_model
    out = _make_checkpoint(float_path, str(tmp_path_factory.mktemp(request.param) / "ckpt"), request.param)
    hf_bnb = transformers.AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float32).eval()
    oracle = hf_bnb if request.param == "int8" else _float_with(float_path, _dequantized_4bit(out))
    return request.param, LLM(out, **CPU), oracle, hf_float, hf_bnb, out


def test_checkpoint_holds_the_bitsandbytes_format(bnb_case):
    """The tools wrote what the decoder reads (a change in their format fails here first)."""
    variant, _, _, _, _, path = bnb_case
    tensors = load_file(os.path.join(path, "model.safetensors"))
    base = "model.layers.0.self_attn.q_proj"
    if variant == "int8":
        assert tensors[f"{base}.weight"].dtype == torch.int8 and tensors[f"{base}.SCB"].shape == (64,)
        return
    storage = torch.bfloat16 if "storage" in variant else torch.uint8
    assert tensors[f"{base}.weight"].dtype == storage and tensors[f"{base}.weight"].shape[1] == 1
    assert (f"{base}.weight.nested_absmax" in tensors) == ("double-quant" in variant)
    skipped = "model.layers.0.self_attn.o_proj.weight"
    assert ("skip" in variant) == (tensors[skipped].dtype == torch.float32)


def test_projections_on_cpu(bnb_case):
    """On CPU every projection holds the dequantized weight (oneDNN's packing; 8-bit behind LLM.int8's input rule);
    none keeps its codes."""
    variant, llm, _, _, _, _ = bnb_case
    model = llm.llm_engine.core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 8
    expected = ("LLMInt8Method",) if variant == "int8" else ("OneDNNLinearMethod", "DenseLinearMethod")
    for m in linears:
        assert type(m.quant_method).__name__ in expected, m.prefix
        assert not any(hasattr(m, t) for t in ("bnb_codes", "bnb_scales", "SCB"))


def test_logits_match_the_oracle(bnb_case):
    variant, llm, oracle, hf_float, hf_bnb, _ = bnb_case
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
        float_logits = hf_float(torch.tensor([IDS])).logits[0]
        theirs = hf_bnb(torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    shows = 1e-3 if variant == "int8" else 1e-2  # 10x / 100x the tolerance above
    assert (ours - float_logits).abs().max() > shows, "the quantization must show"
    torch.testing.assert_close(ours, theirs, atol=3e-2, rtol=0)  # transformers' own forward (bfloat16 kernel)


def test_greedy_tokens_match_the_oracle(bnb_case):
    _, llm, oracle, _, _, _ = bnb_case
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 9, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p in prompts:  # one request at a time, as HF runs them: LLM.int8's outlier columns depend on the batch
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        with torch.no_grad():
            ref = oracle.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist(), f"prompt {p}"


@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_fused_qkv_rows_regrouped(bits, tmp_path_factory):
    """GPT-NeoX stores q, k and v fused and interleaved per head; the model regroups the rows of the decoded 4-bit
    codes and scales (8-bit: the int8 weight and SCB) as it does a float weight's."""
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=320)
    _, path = save_tiny_decoder(
        "bnb-neox", transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, kwargs, tmp_path_factory
    )
    variant = "nf4-double-quant" if bits == 4 else "int8"
    out = _make_checkpoint(path, str(tmp_path_factory.mktemp(f"neox-{bits}") / "ckpt"), variant)
    if bits == 4:
        oracle = _float_with(path, _dequantized_4bit(out))
    else:
        oracle = transformers.AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(_our_logits(LLM(out, **CPU), IDS), ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def in_flight(tmp_path_factory):
    """quantization="bitsandbytes" of the float TINY_DECODER (down_proj: K = 96, blocks straddling rows) and its
    oracle: each projection's weight through bitsandbytes' quantize_4bit (nf4, blocks of 64) and back."""
    F, cfg = _bnb(), transformers.LlamaConfig
    hf, path = save_tiny_decoder(
        "bnb-in-flight", cfg, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    weights = {}
    for name, w in hf.state_dict().items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
            weights[name] = _generic_dequantize(packed, state)
    return LLM(path, quantization="bitsandbytes", **CPU), _float_with(path, weights), hf, path


def _generic_dequantize(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' torch dequantization (its CPU kernel misplaces blocks that straddle rows)."""
    F = _bnb()
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    code = F.get_4bit_type(state.quant_type, device="cpu")
    flat = packed.contiguous().view(torch.uint8).reshape(-1)
    return _dequantize_4bit_compute(flat, absmax.float(), code, state.blocksize, state.shape, torch.float32)


def test_in_flight_nf4_matches_the_oracle(in_flight):
    llm, oracle, hf_float, _ = in_flight
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
        float_logits = hf_float(torch.tensor([IDS])).logits[0]
    ours = _our_logits(llm, IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert (ours - float_logits).abs().max() > 1e-2
    prompt = list(range(7, 20))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    with torch.no_grad():
        ref_ids = oracle.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=10, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    assert out[0].outputs[0].token_ids == ref_ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (5, 200), (300, 64), (7, 33)])
def test_decode_matches_bitsandbytes(quant_type, double_quant, shape):
    """One weight's serialized tensors (bitsandbytes' QuantState.as_dict(packed=True), as transformers saves them),
    in shuffled order among other tensors, decoded against bitsandbytes' torch dequantization; K not a multiple of
    the blocksize, odd sizes, and more than 256 blocks (several nested blocks) included."""
    F, g = _bnb(), torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = torch.randn(*shape, generator=g)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=double_quant)
    stream = [("m.proj.weight", packed), ("m.norm.weight", torch.ones(3))]
    stream += [(f"m.proj.weight.{k}", v) for k, v in state.as_dict(packed=True).items()]
    random.Random(shape[1]).shuffle(stream)
    out = dict(regroup_4bit(stream, torch.uint8, quant_type))
    assert set(out) == {"m.norm.weight", "m.proj.bnb_codes", "m.proj.bnb_scales"}
    assert out["m.proj.bnb_codes"].shape == (shape[0], -(-shape[1] // 2))
    codes = unpack_rows(out["m.proj.bnb_codes"], shape[1])
    ours = dequantize_4bit(codes, out["m.proj.bnb_scales"], codebook(quant_type))
    torch.testing.assert_close(ours, _generic_dequantize(packed, state), atol=0, rtol=0)


def test_vllm_load_format_alias(in_flight):
    """vLLM's load_format="bitsandbytes" (quantization unset) quantizes a float checkpoint at load, as
    quantization="bitsandbytes" does; another quantization with it is refused."""
    _, oracle, _, path = in_flight
    with torch.no_grad():
        ref = oracle(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(
        _our_logits(LLM(path, load_format="bitsandbytes", **CPU), IDS), ref, atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match=r"load_format='bitsandbytes' reads bitsandbytes weights: quantization='fp8'"):
        LLM(path, load_format="bitsandbytes", quantization="fp8", **CPU)


def test_incomplete_group_is_refused():
    packed, state = _bnb().quantize_4bit(torch.randn(8, 64), blocksize=64, quant_type="nf4")
    stream = [("m.proj.weight", packed), ("m.proj.weight.absmax", state.absmax)]
    with pytest.raises(ValueError, match=r"4-bit weight of m.proj lacks its tensors \['quant_map', 'quant_state'\]"):
        list(regroup_4bit(stream, torch.uint8, "nf4"))


@pytest.mark.parametrize("what", ["quant_type", "quant_map"])
def test_group_of_another_type_is_refused(what):
    """A weight whose quant_state names another type than the config's, or whose table is not its type's."""
    packed, state = _bnb().quantize_4bit(torch.randn(8, 64), blocksize=64, quant_type="fp4")
    tensors = state.as_dict(packed=True)
    if what == "quant_map":
        tensors["quant_map"] = tensors["quant_map"].flip(0)
    stream = [("m.proj.weight", packed)] + [(f"m.proj.weight.{k}", v) for k, v in tensors.items()]
    expected = "nf4" if what == "quant_type" else "fp4"
    message = {
        "quant_type": r"m.proj.weight.quant_state: quant_type='fp4' differs from .*bnb_4bit_quant_type='nf4'",
        "quant_map": r"m.proj.weight.quant_map=\[.*\] is not bitsandbytes' fp4 table",
    }[what]
    with pytest.raises(ValueError, match=message):
        list(regroup_4bit(stream, torch.uint8, expected))


def _with_quantization_config(float_path: str, dst, quantization_config: dict) -> str:
    """float_path's config.json with `quantization_config`, beside a weights file that is never read: a check that
    fails must fail before loading."""
    config = json.loads(open(os.path.join(float_path, "config.json")).read())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "model.safetensors").write_bytes(b"not read")
    return str(dst)


FOUR = dict(quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4")
BAD_CONFIGS = {
    "quant-type": (
        {**FOUR, "bnb_4bit_quant_type": "int4"},
        r"bitsandbytes: quantization_config.bnb_4bit_quant_type='int4' is not supported \(supported: \['nf4', 'fp4'\]",
    ),
    "neither-bits": (
        dict(quant_method="bitsandbytes", load_in_4bit=False, load_in_8bit=False),
        r"load_in_4bit=False and load_in_8bit=False; exactly one must be true",
    ),
    "storage": (
        {**FOUR, "bnb_4bit_quant_storage": "int32"},
        r"bnb_4bit_quant_storage='int32' is not supported \(supported: \['uint8', 'int8', 'float16'",
    ),
    "compute-dtype": (
        {**FOUR, "bnb_4bit_compute_dtype": "float64"},
        r"bnb_4bit_compute_dtype='float64' is not supported \(supported: \['float32', 'float16', 'bfloat16'\]",
    ),
    "fp16-weights": (
        dict(quant_method="bitsandbytes", load_in_8bit=True, llm_int8_has_fp16_weight=True),
        r"llm_int8_has_fp16_weight=True is not supported",
    ),
    "threshold": (
        dict(quant_method="bitsandbytes", load_in_8bit=True, llm_int8_threshold=-1),
        r"llm_int8_threshold=-1 is not supported \(supported: a number >= 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_options_fail_before_loading(case, float_model, tmp_path):
    config, message = BAD_CONFIGS[case]
    path = _with_quantization_config(float_model[1], tmp_path, config)
    with pytest.raises(ValueError, match=message):
        LLM(path, **CPU)


def test_quantization_must_match_the_checkpoint(float_model, tmp_path):
    path = _with_quantization_config(float_model[1], tmp_path, FOUR)
    with pytest.raises(
        ValueError, match=r"quantization='fp8' contradicts the checkpoint, which is quantized as 'bitsa"
    ):
        LLM(path, quantization="fp8", **CPU)


def test_moe_experts_are_refused():
    from pagedllm.layers.fused_moe.fp8_moe import expert_fp8_strategy
    from pagedllm.layers.quantization.bitsandbytes import BitsAndBytesConfig

    for config in (BitsAndBytesConfig.from_config(FOUR), BitsAndBytesConfig.in_flight()):
        with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts: quantized experts \(bitsandbytes"):
            expert_fp8_strategy(config, "model.layers.1.mlp.experts")


def _generate(path: str, tp: int) -> list:
    llm = LLM(path, tensor_parallel_size=tp, max_num_batched_tokens=16, **CPU)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 17, 30)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]  # fmt: skip
    finally:
        llm.llm_engine.shutdown()


def test_tp2_matches_one_rank(float_model, tmp_path):
    """Two CPU ranks (gloo): each takes its rows (column-parallel) or input features (row-parallel: o_proj's 64
    split into 32, finer than the 64-feature scale runs decoded) of the codes and scales; the same greedy tokens as
    one rank, logprobs within float32 all-reduce noise."""
    path = _make_checkpoint(float_model[1], str(tmp_path / "ckpt"), "nf4-double-quant")
    one, two = _generate(path, 1), _generate(path, 2)
    for (tokens1, lps1), (tokens2, lps2) in zip(one, two):
        assert tokens2 == tokens1
        torch.testing.assert_close(torch.tensor(lps2), torch.tensor(lps1), atol=1e-4, rtol=0)
