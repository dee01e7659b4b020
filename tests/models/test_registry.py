"""The architecture registry: every entry resolves to a model class; anything else is one clear error."""

from __future__ import annotations

import pytest

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
