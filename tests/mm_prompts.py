"""Shared by the vision-language model tests: a small float32 CPU engine and prompts with images."""

from __future__ import annotations

from pagedllm import LLM


def make_llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22, block_size=4)
    return LLM(path, **{**options, **kwargs})


def as_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
