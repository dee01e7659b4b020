"""With VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM's in-process engine, which its reproducibility example sets before
drawing random.randint after LLM(seed=42)), LLM(seed=S) seeds the caller's random, numpy and torch generators;
without it (vLLM's default: its engine in another process) or with seed=None they are left alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_decoder("llama-seed", transformers.LlamaConfig, transformers.LlamaForCausalLM,
                             dict(TINY_DECODER), tmp_path_factory)[1]  # fmt: skip


def draws() -> tuple:
    return random.randint(0, 10**9), int(np.random.randint(0, 10**9)), int(torch.randint(0, 10**9, ()))


def test_the_seed_reaches_the_global_generators(tiny_llama, monkeypatch):
    base = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)
    random.seed(42), np.random.seed(42), torch.manual_seed(42)
    LLM(tiny_llama, seed=7, **base)  # vLLM's default: the caller's generators are untouched
    assert draws() == (random.seed(42), np.random.seed(42), torch.manual_seed(42), draws())[-1]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    random.seed(42), np.random.seed(42), torch.manual_seed(42)
    expected = draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    LLM(tiny_llama, seed=42, **base)
    assert draws() == expected
    random.seed(42), np.random.seed(42), torch.manual_seed(42)
    LLM(tiny_llama, seed=None, **base)
    assert draws() == expected  # untouched
