"""Quantized checkpoints under tensor parallelism: a tiny Llama in FP8, W4A16 and W8A8 INT8 formats, split over two
CPU processes (gloo, float32 compute), gives the greedy tokens of the same checkpoint on one rank, with logprobs within
1e-3.

Each rank takes its slice of the packed integers, scales, zero points and block scales: column-parallel layers their
output rows (on packed-word and block edges), row-parallel layers their input features (whole groups, blocks and
packed words). The schemes tested quantize activations the same way on one rank or two (static per-tensor scales, or
per token and group of 32 features, groups that a rank's shard never splits), so the two runs differ only by the
order of the all-reduce's sums (~1e-6); 1e-3 leaves room for one activation rounding to the neighbouring fp8 / int8
value. The one-rank run is itself checked against HF transformers on these checkpoints in tests/quantization.
Checkpoints whose groups do not fit a rank's shard are refused with a ValueError naming the group size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from quantization.fp8_checkpoints import BLOCK, input_amax, write_compressed_tensors, write_fp8
from quantization.int_checkpoints import write_awq, write_compressed_tensors_w8a8, write_gptq
from quantization.int_checkpoints import write_compressed_tensors as write_ct_int
from quantization.test_fp8_moe import MOE, write_fp8_moe
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams

BASE = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, block_size=4)
# the down projection's 128 inputs split into 64 per rank: whole groups of 16 / 32, whole fp8 blocks of 32 columns
CONFIG = dict(TINY_DECODER, intermediate_size=128)
CALIBRATION = [list(range(3, 40)), list(range(100, 140))]
FORMATS = {  # name -> (writer, its arguments, quick tier)
    "ct-FP8-static": (write_compressed_tensors, dict(preset="FP8", calibration=CALIBRATION), True),
    "fp8-block": (write_fp8, dict(calibration=None, block=BLOCK), False),
    "gptq-4bit-g16": (write_gptq, dict(bits=4, group_size=16, sym=False, act_order=False), True),
    "awq-4bit-g32": (write_awq, dict(group_size=32), False),
    "ct-w4a16-asym-g32": (write_ct_int, dict(bits=4, group_size=32, sym=False), False),
    "ct-w8a8-int8-static": (write_compressed_tensors_w8a8, dict(input_amax="calibrate"), False),
}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return save_tiny_decoder(
        "tp-quant-llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, CONFIG, tmp_path_factory
    )


@pytest.fixture(scope="module")
def float_path(float_model):
    return float_model[1]


def _generate(path: str, tp: int) -> list:
    llm = LLM(path, tensor_parallel_size=tp, max_num_batched_tokens=16, **BASE)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 17, 30)]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]  # fmt: skip
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if quick else pytest.mark.slow) for n, (_, _, quick) in FORMATS.items()]
)
def test_tp2_matches_one_rank(name, float_model, tmp_path):
    writer, kwargs, _ = FORMATS[name]
    if writer in (write_compressed_tensors, write_ct_int, write_compressed_tensors_w8a8):
        pytest.importorskip("compressed_tensors")
    if kwargs.get("input_amax") == "calibrate":  # static int8 activation scales
        kwargs = {**kwargs, "input_amax": input_amax(float_model[0], CALIBRATION)}
    out = str(tmp_path / "ckpt")
    writer(float_model[1], out, **kwargs)
    one, two = _generate(out, 1), _generate(out, 2)
    for (tokens1, lps1), (tokens2, lps2) in zip(one, two):
        assert tokens2 == tokens1
        np.testing.assert_allclose(lps2, lps1, atol=1e-3, rtol=0)


def test_group_that_splits_a_shard_is_refused(float_path, tmp_path):
    """AWQ groups of 64 input features: o_proj's 64 inputs split into 32 per rank."""
    out = str(tmp_path / "awq-g64")
    write_awq(float_path, out, group_size=64)
    with pytest.raises(ValueError, match=r"o_proj: group_size 64 input features does not divide the 32 input features"):
        LLM(out, tensor_parallel_size=2, **BASE)


def test_act_order_across_ranks_is_refused(float_path, tmp_path):
    out = str(tmp_path / "gptq-act")
    write_gptq(float_path, out, bits=4, group_size=16, sym=False, act_order=True)
    with pytest.raises(ValueError, match=r"act-order groups \(g_idx\) mix input features of several tensor-parallel"):
        LLM(out, tensor_parallel_size=2, **BASE)


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["fp8-tensor", "ct-channel"])
def test_tp2_fp8_experts_match_one_rank(per_channel, tmp_path_factory, tmp_path):
    """FP8 experts of a tiny Qwen3-MoE (attention float): each rank dequantizes its rows of gate / up and its
    columns of down, per-channel scales sliced with them."""
    _, path = save_tiny_decoder(
        "tp-fp8-moe", transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, MOE, tmp_path_factory
    )
    out = str(tmp_path / "ckpt")
    write_fp8_moe(path, out, per_channel, experts_only=True)
    one, two = _generate(out, 1), _generate(out, 2)
    for (tokens1, lps1), (tokens2, lps2) in zip(one, two):
        assert tokens2 == tokens1
        np.testing.assert_allclose(lps2, lps1, atol=1e-4, rtol=0)
