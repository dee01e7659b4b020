"""A character-level HF tokenizer for tiny test models: one token per printable ASCII character and newline, then
</s>; a model's vocab may be larger (ids past EOS_ID have no token)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
EOS_ID = len(CHARS)  # 96
MODEL_VOCAB = 128  # ids 97..127 have no token


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(CHARS)} | {"</s>": EOS_ID}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def save_char_llama(name: str, tmp_path_factory) -> str:
    """A tiny random Llama (tests/tiny_models.py) whose vocab is MODEL_VOCAB, saved with char_tokenizer(): a
    tokenizer-backed model for text, stop strings and streaming tests."""
    from tiny_models import TINY_DECODER, save_tiny_decoder
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(TINY_DECODER, vocab_size=MODEL_VOCAB, eos_token_id=EOS_ID, bos_token_id=None)
    _, path = save_tiny_decoder(name, LlamaConfig, LlamaForCausalLM, kwargs, tmp_path_factory)
    char_tokenizer().save_pretrained(path)
    return path
