"""Engine-wide logits processor classes (vLLM v1's `LLM(logits_processors=[...])` with `SamplingParams.extra_args`)
on a tiny random Llama in float32: the rows a processor applies to get exactly its tokens, the others exactly the
tokens of an engine without processors, while requests join, finish (different max_tokens), wait for a free row and
are preempted, so that their batch sees adds, removals and moves. Also the per-request adapter (vLLM's
custom_req.py), an import-string class, and the errors (bad extra_args, bad classes, refused modes)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.v1.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from pagedllm.v1.sample.logits_processor.builtin import process_dict_updates

VOCAB = TINY_DECODER["vocab_size"]


class TargetToken(LogitsProcessor):
    """vLLM's custom.py example: a request naming `target_token` samples only that token."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not (isinstance(target, int) and 0 <= target < VOCAB):
            raise ValueError(f"target_token={target!r} must be a token id")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.req_info, batch_update, lambda p, _, __: (p.extra_args or {}).get("target_token"))

    def apply(self, logits):
        if self.req_info:
            rows = torch.tensor(list(self.req_info), device=logits.device)
            cols = torch.tensor(list(self.req_info.values()), device=logits.device)
            keep = logits[rows, cols].clone()
            logits[rows] = float("-inf")
            logits[rows, cols] = keep
        return logits


class CountUp(LogitsProcessor):
    """Forces (first prompt token + outputs so far) % vocab: wrong if an index held another request's state or the
    output list it was given did not follow the request's tokens (preemption included)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, tuple[list[int], list[int]]] = {}
        self.updates: list[BatchUpdate] = []
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs  # vLLM's VllmConfig names

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if batch_update is not None:
            self.updates.append(batch_update)
        counts = lambda p, prompt, out: (prompt, out) if "count" in (p.extra_args or {}) else None  # noqa: E731
        process_dict_updates(self.req_info, batch_update, counts)
        if batch_update is not None:
            assert all(index < batch_update.batch_size for index in self.req_info)

    def apply(self, logits):
        for index, (prompt, outputs) in self.req_info.items():
            logits[index] = float("-inf")
            logits[index, (prompt[0] + len(outputs)) % VOCAB] = 0.0
        return logits


class TargetByImport(TargetToken):
    """The same rule under its own key, named to LLM by an import string."""

    def update_state(self, batch_update):
        process_dict_updates(self.req_info, batch_update, lambda p, _, __: (p.extra_args or {}).get("import_target"))


class NeverArgmax(LogitsProcessor):
    """Argmax-invariant in name only: a step of greedy rows alone must skip it (vLLM's rule)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.applied = 0

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        self.applied += 1
        return logits


class PerRequestTarget:
    def __init__(self, target: int):
        self.target = target

    def __call__(self, output_ids, logits):
        keep = logits[self.target].item()
        logits[:] = float("-inf")
        logits[self.target] = keep
        return logits


class WrappedTarget(AdapterLogitsProcessor):
    """vLLM's custom_req.py example: a per-request callable made from extra_args["adapter_target"]."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        return PerRequestTarget(args["adapter_target"]) if "adapter_target" in args else None


PROMPTS = [[(7 * i + 3 * j) % 300 + 10 for j in range(5 + 4 * i)] for i in range(6)]
MAX_TOKENS = [3, 20, 5, 22, 4, 16]
EXTRA = [{"target_token": 17}, None, {"adapter_target": 250}, {"count": 1}, None, {"import_target": 99}]
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_num_seqs=3, block_size=4, num_gpu_blocks_override=12)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )[1]


def params(extra, max_tokens, i):
    sampled = dict(temperature=0.8, seed=5) if i == 4 else dict(temperature=0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra, **sampled)


def expected(base, i):
    extra = EXTRA[i] or {}
    target = extra.get("target_token", extra.get("adapter_target", extra.get("import_target")))
    if target is not None:
        return [target] * MAX_TOKENS[i]
    if "count" in extra:
        return [(PROMPTS[i][0] + k) % VOCAB for k in range(MAX_TOKENS[i])]
    return base[i]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_class_processors_follow_the_batch_exactly(path, async_scheduling):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(path, async_scheduling=async_scheduling, **ENGINE)
    base = [
        o.outputs[0].token_ids
        for o in plain.generate(prompts, [params(None, n, i) for i, n in enumerate(MAX_TOKENS)], use_tqdm=False)
    ]
    del plain
    procs = [TargetToken, CountUp, WrappedTarget, f"{__name__}:TargetByImport", NeverArgmax]
    llm = LLM(path, async_scheduling=async_scheduling, logits_processors=procs, **ENGINE)
    sps = [params(e, n, i) for i, (e, n) in enumerate(zip(EXTRA, MAX_TOKENS))]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected(base, i), i
    scheduler = llm.llm_engine.core.scheduler
    custom = llm.llm_engine.core.executor.runner.sampler.custom
    count_up = next(p for p in custom.always if isinstance(p, CountUp))
    assert count_up.max_num_seqs == ENGINE["max_num_seqs"]
    kinds = {d for u in count_up.updates for _, _, d in u.moved}
    assert any(u.removed for u in count_up.updates) and len({u.batch_size for u in count_up.updates}) > 1
    assert scheduler.num_preemptions > 0 and kinds and kinds <= set(MoveDirectionality), scheduler.num_preemptions
    # a greedy-only batch skips the argmax-invariant processor; a sampled row runs it
    never = next(p for p in custom.sampling if isinstance(p, NeverArgmax))
    before = never.applied
    llm.generate([prompts[0]], params(None, 2, 0), use_tqdm=False)
    assert never.applied == before
    llm.generate([prompts[0]], params(None, 2, 4), use_tqdm=False)
    assert never.applied == before + 2


def test_bad_extra_args_and_bad_classes_are_value_errors(path):
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1])
    llm = LLM(path, logits_processors=[TargetToken], **ENGINE)
    with pytest.raises(ValueError, match="target_token='x'"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # the engine goes on
    for bad, match in [
        ([int], "not a LogitsProcessor subclass"),
        (["no_such_module_xyz:Cls"], "cannot import"),
        ([f"{__name__}:Missing"], "cannot import"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(path, logits_processors=bad, **ENGINE)
    with pytest.raises(ValueError, match="speculative_config"):
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
        LLM(path, logits_processors=[TargetToken], speculative_config=spec, **ENGINE)


class Mirror(LogitsProcessor):
    """Keeps index -> the request's first prompt token for every request."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, int] = {}
        self.size = 0

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.req_info, batch_update, lambda p, prompt, out: prompt[0])
        self.size = batch_update.batch_size if batch_update is not None else self.size

    def apply(self, logits):
        return logits


def test_each_update_puts_every_request_at_its_logits_row():
    import numpy as np

    from pagedllm.sample.custom_batch import CustomLogitsProcessors
    from pagedllm.worker.input_batch import InputBatch
    from pagedllm.worker.scheduler_output import NewRequestData

    rng = np.random.default_rng(0)
    batch = InputBatch(8, 16, 4)
    custom = CustomLogitsProcessors((Mirror,), None, torch.device("cpu"))
    mirror = custom.always[0]
    admitted = 0
    for _ in range(300):
        for req_id in list(batch.row_of):  # some leave (finish or preemption)
            if rng.random() < 0.2:
                batch.remove(req_id)
        while batch.free_rows and rng.random() < 0.5:  # some join; the first prompt token names the admission
            admitted += 1
            new = NewRequestData(f"r{admitted}", [admitted, 1], 2, SamplingParams(), [], 0, [])
            batch.add(new)
        rows = np.array(list(batch.row_of.values()), dtype=np.int64)
        rows = rows[rng.random(len(rows)) < 0.8]  # the step's sampled rows (not all scheduled), in any order
        rng.shuffle(rows)
        if not len(rows):
            continue
        custom.update(batch, rows)
        want = {i: int(batch.token_ids[r, 0]) for i, r in enumerate(rows.tolist())}
        assert mirror.req_info == want and mirror.size == len(rows)
