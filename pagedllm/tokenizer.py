"""Loading the tokenizer: the GGUF's own (converted once, then cached) or a transformers tokenizer directory."""

from __future__ import annotations

import os

from pagedllm.model_loader.resolve import resolve_model

# the files a transformers tokenizer directory holds (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def get_tokenizer(
    model_path: str,
    tokenizer: str | None,
    trust_remote_code: bool,
    revision: str | None = None,
    download_dir: str | None = None,
):
    """`tokenizer` overrides where the tokenizer comes from (a directory, a .gguf file or a repo id, downloaded
    without weights at `revision`); a directory needs tokenizer files only, no model."""
    if tokenizer is not None and os.path.isdir(os.path.expanduser(tokenizer)):
        path = os.path.abspath(os.path.expanduser(tokenizer))
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise ValueError(
                f"tokenizer={tokenizer!r} is a directory without tokenizer files: "
                f"expected one of {list(TOKENIZER_FILES)}"
            )
    elif tokenizer is not None:
        path = resolve_model(tokenizer, revision, download_dir, tokenizer_only=True)
    else:
        path = model_path
    if path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        name = "tokenizer" if tokenizer is not None else "model"
        raise ValueError(f"{name}={tokenizer or model_path!r}: no tokenizer could be loaded from {path!r}: {e}") from e
