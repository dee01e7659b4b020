"""long_prefill_token_threshold (vLLM's name): a prompt chunk longer than the threshold is cut to it, in the waiting
queue and for a running request's next chunk; decodes and short prompts are untouched; 0 is off; the generated
tokens are the same as without it; a bad value is a clear error."""

from __future__ import annotations

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.worker.scheduler_output import ModelRunnerOutput


def make_scheduler(threshold: int, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    return Scheduler(config, CacheConfig(block_size=4, enable_prefix_caching=False), 64)


def make_request(req_id: str, length: int) -> Request:
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(req_id, list(range(1, length + 1)), sp, eos_token_id=0, max_tokens=4)


def step(sched: Scheduler) -> dict[str, int]:
    so = sched.schedule()
    done = {
        r: [7] for r in so.num_scheduled_tokens if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    }
    sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=done))
    return dict(so.num_scheduled_tokens)


def test_long_prompts_are_cut_to_the_threshold_and_short_ones_are_not():
    sched = make_scheduler(threshold=16)
    sched.add_request(make_request("long", 40))
    sched.add_request(make_request("short", 10))
    assert step(sched) == {"long": 16, "short": 10}  # waiting: cut to 16; 10 <= 16 whole
    assert step(sched) == {"long": 16, "short": 1}  # running: the next chunk cut again; a decode
    assert step(sched) == {"long": 8, "short": 1}  # the rest (8 <= 16)
    assert step(sched) == {"long": 1, "short": 1}


def test_zero_is_off():
    sched = make_scheduler(threshold=0)
    sched.add_request(make_request("long", 40))
    assert step(sched) == {"long": 40}


def test_the_budget_still_caps_below_the_threshold():
    sched = make_scheduler(threshold=48, budget=32)
    sched.add_request(make_request("long", 40))
    assert step(sched) == {"long": 32}


def test_bad_values_are_errors():
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(TypeError, match="long_prefill_token_threshold=1.5"):  # as the other integer options
        SchedulerConfig(long_prefill_token_threshold=1.5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    import transformers
    from tiny_models import TINY_DECODER, save_tiny_decoder

    return save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )[1]


def test_engine_args_and_flag_reach_the_scheduler(tiny_llama):
    args = EngineArgs(model=tiny_llama, device="cpu", skip_tokenizer_init=True, long_prefill_token_threshold=256)
    assert args.create_engine_config().scheduler.long_prefill_token_threshold == 256
    from pagedllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--long-prefill-token-threshold", "128"])
    assert args.long_prefill_token_threshold == 128


def test_greedy_tokens_and_logprobs_are_the_same_with_the_threshold(tiny_llama):
    prompts = [{"prompt_token_ids": [(7 * i) % 250 + 1 for i in range(45)]}, {"prompt_token_ids": [3, 4]}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    outs, steps = [], []
    for threshold in (0, 8):
        llm = LLM(
            tiny_llama,
            device="cpu",
            dtype="float32",
            skip_tokenizer_init=True,
            long_prefill_token_threshold=threshold,
            kv_cache_memory_bytes=1 << 22,
        )
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        steps.append(llm.llm_engine.core.scheduler.num_steps)
        del llm
    assert steps[1] > steps[0]  # the 45-token prompt went in chunks of 8
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lq = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        assert lp == pytest.approx(lq, abs=1e-4)
