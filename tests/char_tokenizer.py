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
