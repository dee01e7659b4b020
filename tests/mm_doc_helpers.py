"""Shared by the documents' multimodal examples (test_vllm_mm_doc_examples.py, test_vllm_mm_doc_inputs.py; their
fixtures llava_docs, qwen_docs, doc_media and mm_doc_env are in tests/conftest.py): names, HF reference texts."""

from __future__ import annotations

from pathlib import Path

import pytest

MAX_TOKENS = 8  # the generation default of the fixtures llava_docs and qwen_docs (tests/conftest.py)
EOS_ID = 96  # the char tokenizer's </s>: pagedllm stops there, HF's tiny models (no eos in their config) go on
LLAVA_HUB = ("llava-hf/llava-1.5-7b-hf", "microsoft/Phi-3.5-vision-instruct")
QWEN_HUB = ("Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct")
QWEN = pytest.mark.parametrize("tiny_qwen2_vl", ["qwen2_vl"], indirect=True)


def load(folder: Path, name: str):
    from PIL import Image

    return Image.open(folder / name).convert("RGB")


def until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


def hf_texts(hf_generate, hf, processor, requests: list[tuple[str, list]]) -> list[str]:
    """HF's greedy text for each (prompt, images)."""
    texts = []
    for prompt, images in requests:
        ids = until_eos(hf_generate(hf, processor, prompt, images, MAX_TOKENS))
        texts.append(processor.tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def printed(texts: list[str]) -> str:
    return "".join(t + "\n" for t in texts)
