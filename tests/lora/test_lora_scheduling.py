"""LoRA in the scheduler and the KV manager: at most max_loras distinct adapters run at once (the others wait in
order, never fail), and the prefix cache never shares blocks between adapters (or an adapter and the base)."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import ModelRunnerOutput

BS = 4


def make_scheduler(max_loras: int | None, caching: bool = False, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_loras=max_loras),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        20,
    )


def make_request(req_id: str, prompt: list[int], lora_id: int, max_tokens: int = 2) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return Request(req_id, prompt, sp, eos_token_id=0, max_tokens=max_tokens, lora_request=lora)


def finish_step(sched: Scheduler, so) -> None:
    sampled = {
        r: [7] for r in so.num_scheduled_tokens if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    }
    sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))


def test_distinct_adapters_per_step_are_limited_and_the_rest_wait_in_order():
    sched = make_scheduler(max_loras=2)
    for req_id, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 0), ("f", 3)]:
        sched.add_request(make_request(req_id, [1, 2, 3], lora))
    so = sched.schedule()
    # adapters 1 and 2 take the two slots; c and f (adapter 3) wait, d (adapter 1) and e (base) run
    assert list(so.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert [r.request_id for r in sched.waiting] == ["c", "f"]
    assert {r.req_id: r.lora_request.lora_int_id if r.lora_request else 0 for r in so.new_reqs} == {
        "a": 1, "b": 2, "d": 1, "e": 0,
    }  # fmt: skip
    finish_step(sched, so)  # one token each: a, b, d, e still running (max_tokens 2)
    so = sched.schedule()
    assert "c" not in so.num_scheduled_tokens and "f" not in so.num_scheduled_tokens
    finish_step(sched, so)  # the second token ends a, b, d, e
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["c", "f"]


def test_without_lora_limit_all_run():
    sched = make_scheduler(max_loras=None)
    for req_id, lora in [("a", 0), ("b", 0), ("c", 0)]:
        sched.add_request(make_request(req_id, [1, 2, 3], lora))
    assert list(sched.schedule().num_scheduled_tokens) == ["a", "b", "c"]


def test_prefix_cache_keys_include_the_adapter():
    sched = make_scheduler(max_loras=4, caching=True, max_num_seqs=1)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    hits = {}
    for req_id, lora in [("base", 0), ("a1", 1), ("a2", 2), ("a1-again", 1), ("base-again", 0)]:
        sched.add_request(make_request(req_id, prompt, lora, max_tokens=1))
        so = sched.schedule()
        hits[req_id] = sched.requests[req_id].num_cached_tokens
        finish_step(sched, so)
    # only the same adapter (or the base model again) finds the 3 full blocks
    assert hits == {"base": 0, "a1": 0, "a2": 0, "a1-again": 12, "base-again": 12}
