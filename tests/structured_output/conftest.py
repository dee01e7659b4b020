"""A tiny random Llama with a character-level tokenizer (one token per printable ASCII character, then </s>),
its vocab padded past the tokenizer's (those ids must never be allowed), and engines on it."""

from __future__ import annotations

import pytest
from tiny_models import TINY_DECODER, save_tiny_decoder
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
EOS_ID = len(CHARS)  # 96
MODEL_VOCAB = 128  # ids 97..127 have no token


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(CHARS)} | {"</s>": EOS_ID}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


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
