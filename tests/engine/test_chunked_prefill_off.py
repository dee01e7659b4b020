"""enable_chunked_prefill=False (vLLM's keyword and flag): a prompt is computed in one step, waiting (in order) for a
step with budget for all of it; the token budget defaults to at least max_model_len and may not be set below it;
greedy tokens are those of chunked prefill."""

from __future__ import annotations

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.worker.scheduler_output import ModelRunnerOutput


def make_scheduler(chunked: bool, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, chunked_prefill=chunked)
    return Scheduler(config, CacheConfig(block_size=4, enable_prefix_caching=False), 64)


def step(sched: Scheduler) -> dict[str, int]:
    so = sched.schedule()
    done = {
        r: [7] for r in so.num_scheduled_tokens if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    }
    sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=done))
    return dict(so.num_scheduled_tokens)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_waits_for_a_step_with_room_for_all_of_it(chunked):
    sched = make_scheduler(chunked)
    for rid, length in (("a", 40), ("b", 40), ("c", 10)):
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        sched.add_request(Request(rid, list(range(1, length + 1)), sp, eos_token_id=0, max_tokens=4))
    if chunked:
        assert step(sched) == {"a": 40, "b": 24}
        assert step(sched) == {"a": 1, "b": 16, "c": 10}
    else:  # b does not fit beside a, and c keeps its place behind b
        assert step(sched) == {"a": 40}
        assert step(sched) == {"a": 1, "b": 40, "c": 10}


def test_the_budget_and_its_bounds():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=32 is below max_model_len=64 with enable_chunked"):
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=64, chunked_prefill=False)
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold=16 cuts prompts into chunks"):
        SchedulerConfig(max_model_len=64, long_prefill_token_threshold=16, chunked_prefill=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    cfg = dict(TINY_DECODER, max_position_embeddings=16384)
    return save_tiny_decoder("llama-nochunk", transformers.LlamaConfig, transformers.LlamaForCausalLM, cfg,
                             tmp_path_factory)[1]  # fmt: skip


def test_engine_args_flag_and_default_budget(tiny_llama):
    base = dict(model=tiny_llama, device="cpu", skip_tokenizer_init=True, max_model_len=16384)
    on = EngineArgs(**base).create_engine_config().scheduler
    off = EngineArgs(**base, enable_chunked_prefill=False).create_engine_config().scheduler
    assert (on.chunked_prefill, on.max_num_batched_tokens) == (True, 8192)
    assert (off.chunked_prefill, off.max_num_batched_tokens) == (False, 16384)  # raised to max_model_len
    assert EngineArgs(**base, max_num_seqs=None).create_engine_config().scheduler.max_num_seqs == 256  # vLLM's None


def test_greedy_tokens_equal_chunked_prefill(tiny_llama):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for i in range(45)]} for j in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for chunked in (True, False):
        llm = LLM(tiny_llama, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                  max_num_batched_tokens=64, enable_chunked_prefill=chunked, kv_cache_memory_bytes=1 << 22)  # fmt: skip
        assert llm.llm_engine.core.scheduler.chunked_prefill is chunked
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]  # chunked: the second prompt's first step is a 19-token chunk
