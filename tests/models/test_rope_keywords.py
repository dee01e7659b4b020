"""`rope_scaling` / `rope_theta` as LLM keywords, server flags and hf_overrides keys: applied to the HF config before
the model is built (transformers 5's rope_parameters and 4.x's attributes), the model then equal to HF's with the same
config; vLLM's max_model_len rule under rope scaling; bad values refused naming the field. Dynamic NTK against HF on
the one forward where the two agree."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from test_model_parity import _hf_greedy, _our_logits
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.cli import main
from pagedllm.layers.rope_config import apply_rope_overrides, rope_parameters

THETA = 1e6  # the checkpoint's own theta, which a rope_scaling override must keep
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 16}
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 23, block_size=4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    kwargs = dict(
        TINY_DECODER, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": THETA}
    )
    hf, path = save_tiny_decoder(
        "rope-kw", transformers.LlamaConfig, transformers.LlamaForCausalLM, kwargs, tmp_path_factory
    )
    return hf, path


def _hf_with(hf, rope: dict):
    """HF's Llama with the same weights and these rope_parameters."""
    config = transformers.LlamaConfig(**dict(TINY_DECODER, max_position_embeddings=64, rope_parameters=dict(rope)))
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(hf.state_dict())
    model.generation_config.eos_token_id = None
    return model


def _assert_same_as_hf(llm: LLM, ref) -> None:
    ids = list(range(3, 60))  # past original_max_position_embeddings=32
    with torch.no_grad():
        torch.testing.assert_close(_our_logits(llm, ids), ref(torch.tensor([ids])).logits[0], atol=2e-4, rtol=1e-4)
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_logprobs = _hf_greedy(ref, prompt, 8)
    assert got.token_ids == ref_tokens
    ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
    np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "kwargs, hf_rope",
    [
        ({"rope_scaling": YARN}, {**YARN, "rope_theta": THETA}),
        ({"hf_overrides": {"rope_scaling": YARN}}, {**YARN, "rope_theta": THETA}),
        ({"rope_theta": 500.0}, {"rope_type": "default", "rope_theta": 500.0}),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500.0},
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        ),
        (
            {"hf_overrides": {"rope_theta": 500.0, "rope_scaling": {"rope_type": "linear", "factor": 3.0}}},
            {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0},
        ),
    ],
    ids=["yarn-keyword", "yarn-hf-overrides", "theta-keyword", "linear-and-theta", "hf-overrides-both"],
)
def test_rope_keywords_give_hfs_model_with_that_config(llama, kwargs, hf_rope):
    hf, path = llama
    llm = LLM(path, **ENGINE, **kwargs)
    theta, scaling = rope_parameters(llm.llm_engine.config.model.hf_config)
    assert theta == hf_rope["rope_theta"]
    assert (scaling or {}).get("rope_type", "default") == hf_rope["rope_type"]
    _assert_same_as_hf(llm, _hf_with(hf, hf_rope))


def test_max_model_len_under_rope_scaling_follows_vllm(llama, monkeypatch):
    """Default and longest: max_position_embeddings (64) times the factor; YaRN: its
    original_max_position_embeddings times the factor; no scaling: 64."""
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    _, path = llama
    dummy = dict(ENGINE, load_format="dummy")
    linear = {"rope_type": "linear", "factor": 2.5}
    assert LLM(path, **dummy, rope_scaling=linear).llm_engine.config.model.max_model_len == 160
    assert LLM(path, **dummy, rope_scaling=linear, max_model_len=100).llm_engine.config.model.max_model_len == 100
    with pytest.raises(ValueError, match=r"max_model_len=161 is out of range: \[1, 160\]"):
        LLM(path, **dummy, rope_scaling=linear, max_model_len=161)
    yarn = dict(YARN, original_max_position_embeddings=16, factor=3.0)
    assert LLM(path, **dummy, rope_scaling=yarn).llm_engine.config.model.max_model_len == 48
    with pytest.raises(ValueError, match=r"max_model_len=49 is out of range: \[1, 48\]"):
        LLM(path, **dummy, rope_scaling=yarn, max_model_len=49)
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert LLM(path, **dummy, rope_scaling=dynamic, max_model_len=128).llm_engine.config.model.max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len=65 is out of range: \[1, 64\]"):
        LLM(path, **dummy, max_model_len=65)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rope_scaling": "yarn"}, r"rope_scaling='yarn' must be a dict"),
        ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, r"rope_scaling\['rope_type'\]='bogus' is not sup"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, r"rope_scaling\['factor'\]=0.0 is out of range"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": -1}}, r"rope_scaling\['factor'\]=-1 is out of range"),
        ({"rope_theta": 0.0}, r"rope_theta=0.0 is out of range: a number > 0"),
        ({"rope_theta": "1e6"}, r"rope_theta='1e6' must be a number > 0"),
        ({"hf_overrides": {"rope_scaling": {"rope_type": "x"}}}, r"hf_overrides: rope_scaling\['rope_type'\]='x'"),
        ({"hf_overrides": {"rope_scaling": 2.0}}, r"hf_overrides: rope_scaling=2.0 must be a dict"),
    ],
)
def test_bad_rope_values_are_value_errors_naming_the_field(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(llama[1], **ENGINE, load_format="dummy", **kwargs)


def test_overrides_on_a_transformers_4_style_config():
    """4.x configs keep rope_theta and rope_scaling as attributes: the overrides set those."""
    config = SimpleNamespace(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64)
    assert rope_parameters(config) == (10000.0, None)
    apply_rope_overrides(config, {"type": "dynamic", "factor": 2.0}, 5e5)
    assert config.rope_scaling == {"rope_type": "dynamic", "factor": 2.0} and config.rope_theta == 5e5
    scaling = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}
    assert rope_parameters(config) == (5e5, scaling)


def test_overrides_on_a_transformers_5_config_keep_its_other_rope_fields():
    config = transformers.PhiConfig(partial_rotary_factor=0.5, max_position_embeddings=64, rope_theta=777.0)
    apply_rope_overrides(config, {"rope_type": "yarn", "factor": 2.0})
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "factor": 2.0,
        "rope_theta": 777.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 64,  # filled in by transformers, as from a config.json
    }
    apply_rope_overrides(config, rope_theta=10.0)
    assert config.rope_parameters["rope_theta"] == 10.0 and config.rope_parameters["rope_type"] == "yarn"


def test_server_flags_reach_the_engine(llama, monkeypatch, capsys):
    """`pagedllm serve MODEL --rope-scaling JSON --rope-theta X` builds the engine with them; a bad value exits 2."""
    from pagedllm.entrypoints import llm as llm_module
    from pagedllm.entrypoints.openai import launcher

    class Built(Exception):
        pass

    def stop(llm):
        raise Built(llm)

    monkeypatch.setattr(launcher, "AsyncEngine", stop)
    monkeypatch.setattr(llm_module, "get_tokenizer", lambda *args: None)  # the tiny checkpoint has none
    flags = "--dtype float32 --load-format dummy --kv-cache-memory-bytes 8388608".split()
    scaling = json.dumps({"rope_type": "linear", "factor": 2.0})
    with pytest.raises(Built) as built:
        main(["serve", llama[1], *flags, "--rope-scaling", scaling, "--rope-theta", "2500"])
    model = built.value.args[0].llm_engine.config.model
    expected = {"rope_type": "linear", "factor": 2.0, "rope_theta": 2500.0, "max_position_embeddings": 64}
    assert rope_parameters(model.hf_config) == (2500.0, expected)
    assert model.max_model_len == 128
    assert main(["serve", llama[1], *flags, "--rope-scaling", '{"rope_type": "linear", "factor": -2}']) == 2
    assert "rope_scaling['factor']=-2 is out of range: a number > 0" in capsys.readouterr().err


def test_dynamic_ntk_equals_hf_on_a_forward_of_max_position_times_factor_tokens(tmp_path_factory):
    """HF's dynamic NTK recomputes its base from each forward's longest sequence; pagedllm (as vLLM) fixes it at
    max_position_embeddings * factor. They agree on a forward of exactly that many tokens (32 here): every
    position's logits, and the greedy token after a 32-token prompt with its logprob."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0}
    kwargs = dict(TINY_DECODER, max_position_embeddings=16, rope_parameters=rope)
    hf, path = save_tiny_decoder(
        "rope-dyn", transformers.LlamaConfig, transformers.LlamaForCausalLM, kwargs, tmp_path_factory
    )
    llm = LLM(path, **ENGINE)
    assert llm.llm_engine.config.model.max_model_len == 32
    prompt = torch.randint(0, 320, (32,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():  # first a shorter forward: HF's base for 20 tokens differs from the fixed one
        short = hf(torch.tensor([prompt[:20]])).logits[0]
        assert not torch.allclose(_our_logits(llm, prompt[:20]), short, atol=1e-3, rtol=0)
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_our_logits(llm, prompt), ref, atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_logprobs = _hf_greedy(hf, prompt, 1)
    assert got.token_ids == ref_tokens
    np.testing.assert_allclose([got.logprobs[0][got.token_ids[0]].logprob], ref_logprobs, atol=1e-4, rtol=0)


def test_a_callable_hf_override_sees_the_rope_keywords_applied(llama):
    """As in vLLM: the rope keywords go in with the dict overrides, a callable override runs last."""
    seen = []

    def override(config):
        seen.append(rope_parameters(config))
        return config

    LLM(llama[1], **ENGINE, load_format="dummy", rope_theta=321.0, hf_overrides=override)
    assert seen == [(321.0, None)]


@pytest.mark.parametrize("kw", [{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {"rope_theta": 1e5}])
def test_rope_keywords_on_a_model_without_rotary_are_refused(tmp_path_factory, kw):
    """GPT-2 has learned positions: a rope setting would be a silent no-op (and used to stretch max_model_len past
    its position table)."""
    from tiny_models import TINY_GPT2

    _, path = save_tiny_decoder("rope-kw-gpt2", transformers.GPT2Config, transformers.GPT2LMHeadModel,
                                dict(TINY_GPT2), tmp_path_factory)  # fmt: skip
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not use rotary"):
        LLM(path, **ENGINE, **kw)
