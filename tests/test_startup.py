"""Start-up time split of LLM() (pagedllm/startup.py), the compilation_config keys of the cold start, and the
sizes lazy CUDA-graph capture takes at start. The GPU side (the parallel pre-compile, lazy capture) is in
tests/worker/test_cold_start_gpu.py."""

from __future__ import annotations

import logging
import time

import pytest
import transformers
from tiny_models import TINY_DECODER

from pagedllm import LLM, SamplingParams
from pagedllm.config import CompilationConfig
from pagedllm.worker.cuda_graphs import capture_sizes, start_sizes


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory) -> str:
    """A tiny Llama config.json alone: the engine builds dummy weights for it."""
    path = tmp_path_factory.mktemp("tiny-llama-config")
    transformers.LlamaConfig(**TINY_DECODER, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def test_startup_split_sums_to_the_wall_time(tiny_config_dir, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.startup")
    start = time.perf_counter()
    llm = LLM(tiny_config_dir, load_format="dummy", skip_tokenizer_init=True, device="cpu",
              kv_cache_memory_bytes=1 << 22, max_num_seqs=4)  # fmt: skip
    wall = time.perf_counter() - start
    split = llm.startup_seconds
    for phase in ("import", "config", "weights", "compile", "kv_cache", "graph_capture", "engine_other", "total"):
        assert phase in split and split[phase] >= 0.0, (phase, split)
    assert "tokenizer" not in split  # skip_tokenizer_init: no tokenizer phase ran
    assert list(split)[0] == "import" and list(split)[-1] == "total"
    assert list(split).index("weights") < list(split).index("compile") < list(split).index("graph_capture")
    assert split["import"] > 0.0  # `import pagedllm` ran in this process
    parts = sum(v for k, v in split.items() if k not in ("import", "total"))
    assert split["total"] == pytest.approx(parts)
    # the phases cover LLM() up to the few statements between them
    assert wall - 0.05 - 0.02 * wall <= split["total"] <= wall
    assert split["weights"] > 0.0 and split["kv_cache"] > 0.0
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedllm.startup"]
    assert len(lines) == 1 and "LLM() started in" in lines[0] and "weights" in lines[0], lines
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_compilation_config_cold_start_keys():
    config = CompilationConfig.from_user({"compile_threads": 3, "lazy_cudagraph_capture": True})
    assert (config.compile_threads, config.lazy_cudagraph_capture) == (3, True)
    default = CompilationConfig.from_user(None)
    assert 1 <= default.compile_threads <= 8 and default.lazy_cudagraph_capture is False
    assert CompilationConfig.from_user({"compile_threads": 0}).compile_threads == 0
    with pytest.raises(ValueError, match=r"compile_threads=-1 must be in \[0, 64\]"):
        CompilationConfig.from_user({"compile_threads": -1})
    with pytest.raises(TypeError, match="compile_threads='4' must be an integer"):
        CompilationConfig.from_user({"compile_threads": "4"})
    with pytest.raises(TypeError, match="lazy_cudagraph_capture='yes' must be True or False"):
        CompilationConfig.from_user({"lazy_cudagraph_capture": "yes"})


@pytest.mark.parametrize(
    ("max_num_seqs", "lazy", "expected"),
    [
        (256, False, capture_sizes(256, None)),
        (256, True, [1, 2, 4, 8, 256]),
        (20, True, [1, 2, 4, 8, 20]),
        (6, True, [1, 2, 4, 6]),
    ],
)
def test_start_sizes(max_num_seqs, lazy, expected):
    sizes = capture_sizes(max_num_seqs, None)
    assert start_sizes(sizes, lazy) == expected
    assert set(start_sizes(sizes, lazy)) <= set(sizes) and max(sizes) in start_sizes(sizes, lazy)
