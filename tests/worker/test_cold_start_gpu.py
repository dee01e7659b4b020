"""Cold start on the GPU: the parallel pre-compile leaves nothing for the first requests to compile, and lazy
CUDA-graph capture captures the other sizes on first use with the same tokens. Skipped without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
OPTS = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, block_size=4)
# a fresh interpreter (no kernel compiled in memory yet): LLM(), then the first requests with a hook counting the
# Triton compiles they start
COUNT_COMPILES = """
import json, sys
from triton import knobs
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
compiled = []
knobs.runtime.jit_cache_hook = lambda *, fn, **_: compiled.append(fn.name)
prompts = [{"prompt_token_ids": list(range(1, n + 1))} for n in (3, 17, 40)]
llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)  # temperature 1
llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0), use_tqdm=False)
llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, top_k=5, top_p=0.9, repetition_penalty=1.2,
                                     logprobs=3), use_tqdm=False)
print(json.dumps(compiled))
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    kwargs = dict(TINY_DECODER)
    _, path = save_tiny_decoder("cold-start", transformers.LlamaConfig, transformers.LlamaForCausalLM, kwargs,
                                tmp_path_factory)  # fmt: skip
    return path


def _compiles_after_start(path: str, compile_threads: int) -> list[str]:
    opts = dict(OPTS, max_num_seqs=16, compilation_config={"compile_threads": compile_threads})
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_COMPILES, path, json.dumps(opts)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_precompile_leaves_nothing_for_the_first_requests(tiny_llama):
    assert _compiles_after_start(tiny_llama, 0)  # without it, the first requests compile kernels
    assert _compiles_after_start(tiny_llama, 4) == []


def _greedy(llm: LLM, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 320, (int(k),), generator=gen).tolist()} for k in range(2, n + 2)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_lazy_capture_captures_on_first_use_with_the_same_tokens(tiny_llama):
    eager_capture = LLM(tiny_llama, dtype="float32", max_num_seqs=32, **OPTS)
    expected = _greedy(eager_capture, 12)
    assert sorted(eager_capture.llm_engine.core.executor.runner.graphs.graphs) == [1, 2, 4, 8, 16, 24, 32]
    del eager_capture
    lazy = LLM(tiny_llama, dtype="float32", max_num_seqs=32, compilation_config={"lazy_cudagraph_capture": True},
               **OPTS)  # fmt: skip
    graphs = lazy.llm_engine.core.executor.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 32]
    assert _greedy(lazy, 12) == expected  # 12 decodes pad to 16: captured on the first such step
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 32]
    assert graphs.num_replays > 0
