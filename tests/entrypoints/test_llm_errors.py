"""Bad input gets a clear ValueError/TypeError before anything runs, and the engine keeps serving."""

from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, max_model_len=256, num_gpu_blocks_override=8, block_size=16)


@pytest.fixture(scope="module")
def baseline(llm):
    return llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _still_serves(llm, baseline):
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -1.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("n", 0),
        ("min_tokens", -1),
    ],
)
def test_sampling_params_out_of_range(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])


def test_empty_prompt_list(llm, baseline):
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([], GREEDY)
    _still_serves(llm, baseline)


def test_empty_prompt(llm, baseline):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    _still_serves(llm, baseline)


def test_prompt_longer_than_max_model_len(llm, baseline):
    with pytest.raises(ValueError, match=r"max_model_len=256") as err:
        llm.generate({"prompt_token_ids": [1] * 257}, GREEDY)
    assert "257" in str(err.value)
    _still_serves(llm, baseline)


@pytest.mark.parametrize("bad", [49152, 10**9, -1])
def test_token_ids_outside_vocab(llm, baseline, bad):
    with pytest.raises(ValueError, match=r"prompt_token_ids.*\[0, 49152\)"):
        llm.generate([[1, 2, bad]], GREEDY)
    _still_serves(llm, baseline)


def test_allowed_token_ids_outside_vocab(llm):  # (stop_token_ids may lie outside: they never match, as in vLLM)
    with pytest.raises(ValueError, match=r"allowed_token_ids=10000000.*\[0, 49152\)"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[3, 10**7]))


def test_one_bad_prompt_rejects_the_batch_before_anything_runs(llm, baseline):
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [5, 10**9]}, "also fine"], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    _still_serves(llm, baseline)


def test_request_that_can_never_fit_the_cache_is_rejected(llm, baseline):
    # 8 blocks of 16 tokens = 128 slots; 100 prompt tokens + 40 new tokens cannot all be cached at once.
    with pytest.raises(ValueError, match="KV-cache blocks"):
        llm.generate({"prompt_token_ids": [7] * 100}, SamplingParams(max_tokens=40))
    _still_serves(llm, baseline)


def test_max_tokens_is_capped_by_max_model_len(smollm2):
    short = LLM(smollm2, max_model_len=128, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    out = short.generate({"prompt_token_ids": [7] * 120}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_wrong_types(llm):
    with pytest.raises(TypeError, match="prompts"):
        llm.generate(12345, GREEDY)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(["a"], {"temperature": 0})
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(["a"], [GREEDY, GREEDY])


def test_unknown_llm_keyword_names_it(smollm2):
    with pytest.raises(TypeError, match="not_an_option"):
        LLM(smollm2, not_an_option=3)


def test_tensor_parallel_needs_divisible_heads(smollm2):
    """SmolLM2 has 9 attention heads: two ranks cannot split them (the worker process is ended)."""
    with pytest.raises(ValueError, match="num_heads=9 must be divisible by the tensor-parallel size 2"):
        LLM(smollm2, tensor_parallel_size=2)


def test_missing_model_names_the_offline_variable():
    with pytest.raises(ValueError, match=r"some-org/missing-model.*not found.*HF_HUB_OFFLINE is set"):
        LLM("some-org/missing-model")
