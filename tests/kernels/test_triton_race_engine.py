"""The engine's racing steps end to end on the CPU, the race kernels interpreted (sample/vocab_race.py, which only
CUDA runners build on their own): a runner given a VocabRace samples greedy requests as the CPU sampler's argmax,
a seeded request gets the same tokens alone and in a batch, and a step with a filtered row takes the sampler."""

from __future__ import annotations

import pytest
import sampling_kernels
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.sample.vocab_race import VocabRace

pytest.importorskip("triton")
sampling_kernels.race_module()  # interpreted where there is no CUDA

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 2, 77], [1, 250, 3], [8] * 11)]


class _WholeHead:
    """The model's logits as one slice (a CPU head packs its weight for oneDNN: shard_logits reads compute_logits)."""

    def __init__(self, model, vocab):
        self.model, self.first_row, self.num_rows = model, 0, vocab

    def shard_logits(self, hidden):
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    _, path = save_tiny_decoder("llama-race-engine", LlamaConfig, LlamaForCausalLM, TINY_DECODER, tmp_path_factory)
    plain = LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=16, seed=3)
    racing = LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=16, seed=3)
    runner = racing.llm_engine.core.executor.runner
    runner.race = VocabRace(runner.device, 3, 8, _WholeHead(runner.model, TINY_DECODER["vocab_size"]))
    calls = []
    sample = runner.race.sample
    runner.race.sample = lambda *args: calls.append(1) or sample(*args)
    yield plain, racing, calls
    for llm in (plain, racing):
        llm.llm_engine.shutdown()


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_requests_race_to_the_argmax(engines):
    plain, racing, calls = engines
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = len(calls)
    assert _tokens(racing, PROMPTS, params) == _tokens(plain, PROMPTS, params)
    assert len(calls) - before >= 8  # every decode step raced


def test_a_seeded_request_races_to_the_same_tokens_in_any_batch(engines):
    _, racing, calls = engines
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    others = [SamplingParams(temperature=1.2, max_tokens=5, ignore_eos=True), SamplingParams(temperature=0)]
    alone = _tokens(racing, PROMPTS[:1], seeded)[0]
    before = len(calls)
    assert _tokens(racing, PROMPTS, [seeded, *others])[0] == alone
    assert len(calls) > before
    # a filtered request in the batch: its steps take the sampler (the CPU's draws differ from the race's)
    before = len(calls)
    _tokens(racing, PROMPTS[:2], [seeded, SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True)])
    assert len(calls) - before == 8 - 3  # only the steps after the filtered request finished
