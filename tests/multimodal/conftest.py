"""The tiny LLaVA checkpoint (tests/tiny_llava.py), saved once per session."""

from __future__ import annotations

import pytest
from tiny_llava import save_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(HF model, its processor, the checkpoint folder)."""
    return save_tiny_llava(tmp_path_factory)


@pytest.fixture(scope="session", params=["qwen2_vl", "q25"])
def tiny_qwen2_vl(request, tmp_path_factory):
    """Qwen2-VL, then Qwen2.5-VL: (HF model, its processor, the checkpoint folder)."""
    from tiny_qwen2_vl import save_tiny_qwen2_vl

    return save_tiny_qwen2_vl(tmp_path_factory, request.param)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """Gemma3ForConditionalGeneration: (HF model, its processor, the checkpoint folder)."""
    from tiny_gemma3 import save_tiny_gemma3

    return save_tiny_gemma3(tmp_path_factory)
