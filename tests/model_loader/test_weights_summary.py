"""LLM() logs one line with the weights' memory and the method running each linear layer kind."""

from __future__ import annotations

import logging

import pytest
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny_decoder("llama-summary", LlamaConfig, LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory)[1]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_weights_and_methods_logged(quantization, llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(llama_path, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, quantization=quantization)
    lines = [r.getMessage() for r in caplog.records if "linear methods:" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    model = llm.llm_engine.core.executor.runner.model
    gib = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()) / 2**30
    assert f"weights {gib:.2f} GiB" in line or "weights 0.00 GiB" in line
    kinds = dict(part.split(": ") for part in line.split("linear methods: ")[1].split(", "))
    assert set(kinds) >= {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    if quantization is None:  # the dense method of this device (oneDNN on CPU)
        assert all("Fp8" not in m and "Linear" in m for m in kinds.values())
    else:
        assert "Fp8" in kinds["qkv_proj"] and "Fp8" in kinds["down_proj"]
