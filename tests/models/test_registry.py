"""The architecture registry: every entry resolves to a model class; anything else is one clear error."""

from __future__ import annotations

import json
import pathlib

import pytest

from pagedllm.models import registry
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.registry import get_model_class, supported_architectures


@pytest.mark.parametrize("architecture", supported_architectures())
def test_every_registered_architecture_imports(architecture):
    cls = get_model_class(architecture)
    assert isinstance(cls, type) and hasattr(cls, "load_weights")


def test_unknown_architecture_names_it_and_the_supported_list():
    with pytest.raises(ValueError) as err:
        get_model_class("FooForCausalLM")
    message = str(err.value)
    assert "'FooForCausalLM' is not supported" in message
    for name in ("OPTForCausalLM", "Gemma2ForCausalLM", "LlamaForCausalLM"):
        assert name in message


def test_llm_refuses_an_unknown_architecture(tmp_path):
    """The error reaches the user from LLM(...) before any weight is read."""
    import transformers

    from pagedllm import LLM

    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    config.architectures = ["FooForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'FooForCausalLM' is not supported; supported: \[.*'OPTForCausalLM'"):
        LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)


def test_pooling_refuses_alibi_attention(tmp_path):
    """The pooling path attends with plain SDPA: a model with ALiBi (or soft-capping) is refused when built."""
    import transformers

    from pagedllm import LLM

    config = transformers.BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=32)
    transformers.BloomForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomForCausalLM cannot run as a pooling model: .*ALiBi"):
        LLM(str(tmp_path), task="embed", skip_tokenizer_init=True)


def test_learned_positions_cap_max_model_len(tmp_path, monkeypatch):
    """GPT-2 has n_positions learned positions: a longer max_model_len is refused, not an index error later; also
    when VLLM_ALLOW_LONG_MAX_MODEL_LEN lifts the general limit (a learned table cannot be stretched)."""
    import transformers

    from pagedllm import LLM

    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len=100 is out of range: \[1, 64\]"):
        LLM(str(tmp_path), max_model_len=100, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(ValueError, match=r"max_model_len=100 must be <= 64: GPT2LMHeadModel has 64 learned positions"):
        LLM(str(tmp_path), max_model_len=100, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)


class _OutOfTreeLlama(LlamaForCausalLM):
    """An out-of-tree model: Llama's forward under another architecture name."""


@pytest.fixture
def registry_table(monkeypatch):
    """The registry's table, restored after the test."""
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))


@pytest.mark.parametrize("how", ["class", "lazy string"])
def test_registered_out_of_tree_model_loads_by_its_architecture(how, registry_table, tmp_path_factory):
    import transformers
    from tiny_models import TINY_DECODER, save_tiny_decoder

    from pagedllm import LLM, ModelRegistry, SamplingParams

    _, path = save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, {**TINY_DECODER}, tmp_path_factory
    )
    opts = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 4, 5, 6, 7]}, {"prompt_token_ids": [9]}]
    want = [o.outputs[0].token_ids for o in LLM(path, **opts).generate(prompts, params, use_tqdm=False)]

    config_file = pathlib.Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["OutOfTreeLlamaForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'OutOfTreeLlamaForCausalLM' is not supported"):
        LLM(path, **opts)
    ModelRegistry.register_model(
        "OutOfTreeLlamaForCausalLM", _OutOfTreeLlama if how == "class" else f"{__name__}:_OutOfTreeLlama"
    )
    assert "OutOfTreeLlamaForCausalLM" in ModelRegistry.get_supported_archs()
    llm = LLM(path, **opts)
    assert type(llm.llm_engine.core.executor.runner.model) is _OutOfTreeLlama
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


@pytest.mark.parametrize("bad", ["no_colon_here", "a.b:", ":Cls", "a b:Cls", 3])
def test_register_model_refuses_a_malformed_class(bad, registry_table):
    from pagedllm import ModelRegistry

    with pytest.raises(ValueError, match=r"model_cls=.*expected 'module.path:ClassName' or a class"):
        ModelRegistry.register_model("XForCausalLM", bad)


def test_register_model_unimportable_string_is_a_value_error_when_used(registry_table):
    from pagedllm import ModelRegistry

    ModelRegistry.register_model("XForCausalLM", "no_such_pkg.models:X")  # lazy: nothing imported yet
    with pytest.raises(ValueError, match=r"'XForCausalLM': model class 'no_such_pkg.models:X' cannot be imported"):
        get_model_class("XForCausalLM")
    ModelRegistry.register_model("YForCausalLM", "pagedllm.models.llama:NoSuchClass")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_model_class("YForCausalLM")
