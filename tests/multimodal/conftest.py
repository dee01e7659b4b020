"""The tiny LLaVA checkpoint (tests/tiny_llava.py), saved once per session."""

from __future__ import annotations

import pytest
from tiny_llava import save_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(HF model, its processor, the checkpoint folder)."""
    return save_tiny_llava(tmp_path_factory)
