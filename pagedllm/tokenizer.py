"""Loading the tokenizer: the GGUF's own (converted once, then cached) or a transformers tokenizer directory."""

from __future__ import annotations

from pagedllm.model_loader.resolve import resolve_model


def get_tokenizer(model_path: str, tokenizer: str | None, trust_remote_code: bool, revision: str | None = None):
    """`tokenizer` overrides where the tokenizer comes from (a directory, a .gguf file or a cached repo id)."""
    path = resolve_model(tokenizer, revision) if tokenizer is not None else model_path
    if path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
