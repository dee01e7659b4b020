"""A model folder for dummy-weight runs that need a tokenizer (the server streams text; `bench throughput`
detokenizes as vLLM's does): a copy of a benchmarks/configs config.json plus a word-level tokenizer with one
entry per id of the model's vocabulary ("w<id>", so every id decodes to text; bos/eos are the config's ids, marked
special). Decoding costs about what a real tokenizer's does per token; no hub is needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_tokenizer(config_dir: str, dest: str) -> str:
    """dest (created) holding config_dir's config.json and the word-level tokenizer of its vocab_size; returns dest."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(dest)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", folder / "config.json")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vocab = {f"w{i}": i for i in range(int(config["vocab_size"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    special = {}
    for name in ("bos_token", "eos_token"):
        token_id = config.get(f"{name}_id")
        if isinstance(token_id, int) and 0 <= token_id < len(vocab):
            special[name] = f"w{token_id}"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.save_pretrained(str(folder))
    return str(folder)
