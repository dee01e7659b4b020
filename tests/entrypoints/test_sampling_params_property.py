"""Property: any SamplingParams either raises ValueError (at construction or submission) or generates, with
finite logprobs and the token count its limits allow."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams

floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([0.0, 1.0, -1.0, 2.0])
ints = st.integers(min_value=-3, max_value=60) | st.sampled_from([2**63, -(2**63) - 1, 10**9])


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=64 << 20)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=floats,
    top_p=floats,
    top_k=ints,
    min_p=floats,
    presence=floats,
    frequency=floats,
    repetition=floats,
    logprobs=st.none() | ints,
    max_tokens=st.none() | ints,
    min_tokens=ints,
    n=ints,
    seed=st.none() | ints,
    logit_bias=st.none() | st.dictionaries(ints, floats, max_size=2),
)
def test_any_params_raise_value_error_or_generate_finite(
    llm,
    temperature,
    top_p,
    top_k,
    min_p,
    presence,
    frequency,
    repetition,
    logprobs,
    max_tokens,
    min_tokens,
    n,
    seed,
    logit_bias,
):
    try:
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logprobs=logprobs,
            max_tokens=None if max_tokens is None else min(max_tokens, 4),
            min_tokens=min(min_tokens, 4),
            n=min(n, 3) if n > 0 else n,
            seed=seed,
            logit_bias=logit_bias,
        )
        out = llm.generate(["The weather today is"], params, use_tqdm=False)[0]
    except ValueError:
        return
    assert 1 <= len(out.outputs) <= 3
    for completion in out.outputs:
        assert 1 <= len(completion.token_ids) <= (params.max_tokens or 10**9)
        for position in completion.logprobs or []:
            assert all(math.isfinite(lp.logprob) for lp in position.values())
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(repetition_penalty=1e-40, temperature=1.0),  # logits overflow to inf
        dict(repetition_penalty=1e30, temperature=0.7, top_p=0.5),
        dict(temperature=1e6),
        dict(temperature=1e-4, top_k=5),
        dict(allowed_token_ids=[2], min_tokens=3, temperature=1.0),  # every token banned until min_tokens
    ],
)
def test_extreme_values_still_generate(llm, kwargs):
    out = llm.generate(["The weather today is"], SamplingParams(max_tokens=4, logprobs=1, **kwargs), use_tqdm=False)[
        0
    ].outputs[0]
    assert 1 <= len(out.token_ids) <= 4
    assert all(math.isfinite(lp.logprob) for pos in out.logprobs for lp in pos.values())
