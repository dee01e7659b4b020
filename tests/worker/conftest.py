"""The model runner tests' shared setup: a tiny Llama saved once, the EngineConfig of a runner over it and a fresh
runner with its KV cache. A test module sets BLOCK (block size) and BLOCKS_PER_REQ (blocks each request owns; 4
requests' worth are allocated)."""

from __future__ import annotations

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm.engine_args import EngineArgs
from pagedllm.worker.model_runner import ModelRunner


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(HF model, its folder)."""
    return save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )


@pytest.fixture(scope="module")
def config(request, tiny):
    args = EngineArgs(
        model=tiny[1], dtype="float32", device="cpu", block_size=request.module.BLOCK, max_num_seqs=4,
        max_model_len=64, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
    )  # fmt: skip
    return args.create_engine_config()


@pytest.fixture
def runner(request, config):
    runner = ModelRunner(config)
    runner.allocate_kv_cache(4 * request.module.BLOCKS_PER_REQ)
    return runner
