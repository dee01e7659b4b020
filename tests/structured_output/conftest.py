"""A tiny random Llama with a character-level tokenizer (tests/char_tokenizer.py), its vocab padded past the
tokenizer's (those ids must never be allowed), and an engine on it."""

from __future__ import annotations

import pytest
from char_tokenizer import EOS_ID, MODEL_VOCAB, char_tokenizer
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_char_model(tmp_path_factory) -> str:
    kwargs = dict(TINY_DECODER, vocab_size=MODEL_VOCAB, eos_token_id=EOS_ID, bos_token_id=None)
    _, path = save_tiny_decoder("tiny_char_llama", LlamaConfig, LlamaForCausalLM, kwargs, tmp_path_factory)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llm(tiny_char_model):
    from pagedllm import LLM

    return LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20)
