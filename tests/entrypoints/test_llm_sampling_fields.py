"""SamplingParams fields end to end on the bundled model: logprobs and penalties against HF transformers."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def hf(smollm2_hf_copy):
    smollm2_hf_copy.generation_config.eos_token_id = None  # all max_new_tokens, as with ignore_eos
    return smollm2_hf_copy


def test_logprobs_match_hf_log_softmax(llm, hf):
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True), use_tqdm=False
    )
    tok = llm.get_tokenizer()
    for out in outs:
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for pos, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(out.prompt_token_ids) - 1 + pos]
            top = row.topk(5)
            assert set(entry) == set(top.indices.tolist()) | {token}
            for tid, lp in entry.items():
                assert abs(lp.logprob - row[tid].item()) < 2e-3
                assert lp.rank == int((row > row[tid]).sum()) + 1
                assert lp.decoded_token == tok.decode([tid])
            assert entry[token].rank == 1  # greedy
            total += entry[token].logprob
        assert abs(c.cumulative_logprob - total) < 1e-4


def test_no_logprobs_unless_asked(llm):
    c = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None
    c = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert [list(d) for d in c.logprobs] == [[t] for t in c.token_ids]


def test_repetition_penalty_greedy_matches_hf(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                do_sample=False,
                repetition_penalty=1.3,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_allowed_token_ids_and_logit_bias(llm):
    allowed = [11, 12, 13, 14]
    out = llm.generate(
        PROMPTS,
        SamplingParams(temperature=1.0, max_tokens=10, allowed_token_ids=allowed, ignore_eos=True, seed=3),
        use_tqdm=False,
    )
    assert all(t in allowed for o in out for t in o.outputs[0].token_ids)
    forced = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}), use_tqdm=False
    )[0].outputs[0]
    assert forced.token_ids == [42] * 5


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logit_bias", {"7": 1.0}),
        ("logit_bias", {7: 101.0}),
        ("allowed_token_ids", []),
    ],
)
def test_new_fields_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary(llm, field):
    value = {10**6: 1.0} if field == "logit_bias" else [10**6]
    with pytest.raises(ValueError, match=field):
        llm.generate(["hi"], SamplingParams(**{field: value}))


def test_n_samples_differ_and_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    again = llm.generate(["Hello", PROMPTS[0]], [SamplingParams(max_tokens=3), params], use_tqdm=False)[1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    seqs = [c.token_ids for c in first.outputs]
    assert len({tuple(s) for s in seqs}) == 3
    assert [c.token_ids for c in again.outputs] == seqs


def test_n_greedy_sequences_are_identical_and_share_the_prompt_blocks(llm):
    prompt = "A long prompt that covers several KV-cache blocks of sixteen tokens each, " * 3
    out = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert out.num_cached_tokens >= 16  # the second sequence found the first one's prompt blocks


def test_best_of_returns_the_most_likely_n(llm):
    base = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    all4 = llm.generate(PROMPTS[:1], SamplingParams(**{**_fields(base), "n": 4, "logprobs": 0}), use_tqdm=False)[0]
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    best = llm.generate(PROMPTS[:1], SamplingParams(**{**_fields(base), "n": 2, "best_of": 4}), use_tqdm=False)[0]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best.outputs)


def test_best_of_below_n_is_rejected():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("temperature", "seed", "max_tokens", "ignore_eos")}


def _check_prompt_logprobs(out, hf, k: int):
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        row, token = ref[pos - 1], ids[pos]
        assert set(plp[pos]) == set(row.topk(k).indices.tolist()) | {token}
        for tid, lp in plp[pos].items():
            assert abs(lp.logprob - row[tid].item()) < 2e-3
            assert lp.rank == int((row > row[tid]).sum()) + 1


def test_prompt_logprobs_match_hf(llm, hf):
    prompts = ["The quick brown fox jumps over the lazy dog because it was", "x = [1, 2, 3]\nprint(sum(x))"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for out in outs:
        _check_prompt_logprobs(out, hf, 3)
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_prompt_logprobs_across_chunks_and_preemption(smollm2, hf):
    prompt = "A sentence long enough to be cut into several chunks of sixteen tokens by the scheduler. " * 3
    chunked = LLM(smollm2, dtype="float32", max_num_batched_tokens=16, num_gpu_blocks_override=9)
    params = [SamplingParams(max_tokens=40, prompt_logprobs=2, ignore_eos=True) for _ in range(3)]
    outs = chunked.generate([prompt, prompt + "Again.", prompt + "Once more."], params, use_tqdm=False)
    assert chunked.llm_engine.core.scheduler.num_preemptions > 0
    for out in outs:
        _check_prompt_logprobs(out, hf, 2)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("One two three four five six seven eight nine ten eleven twelve")
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate([ids], SamplingParams(truncate_prompt_tokens=5, **greedy), use_tqdm=False)[0]
    direct = llm.generate([ids[-5:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_logits_processors_two_and_three_arguments(llm):
    seen = []

    def force_42(output_ids, logits):
        seen.append(list(output_ids))
        forced = torch.full_like(logits, float("-inf"))
        forced[42] = 0.0
        return forced

    def ban_42_and_record_prompt(prompt_ids, output_ids, logits):
        seen.append(("prompt", list(prompt_ids)))
        logits[42] = float("-inf")
        return logits

    out = llm.generate(
        PROMPTS[:1], SamplingParams(max_tokens=3, logits_processors=[force_42], ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == [42, 42, 42] and seen == [[], [42], [42, 42]]
    seen.clear()
    out = llm.generate(
        PROMPTS[:1],
        SamplingParams(
            temperature=0, max_tokens=2, ignore_eos=True, logits_processors=[force_42, ban_42_and_record_prompt]
        ),
        use_tqdm=False,
    )[0]
    assert 42 not in out.outputs[0].token_ids  # the second processor sees the first one's output
    assert ("prompt", out.prompt_token_ids) in seen


def test_bad_words_are_never_completed(llm):
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate(PROMPTS[:1], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    word = base.text.split()[0]  # the first word the model wants to say
    out = llm.generate(PROMPTS[:1], SamplingParams(bad_words=[word], **greedy), use_tqdm=False)[0].outputs[0]
    assert word not in out.text.split()
    assert out.token_ids != base.token_ids


def test_beam_search_top_beam_matches_hf(llm, hf):
    from pagedllm import BeamSearchParams

    prompts = ["The capital of France is", "My favourite food is"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert len(out.sequences) == 3
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                num_beams=3,
                do_sample=False,
                max_new_tokens=8,
                pad_token_id=0,
                early_stopping=False,
            )
        top = out.sequences[0]
        assert top.tokens == ref[0].tolist()
        assert top.tokens[: len(ids)] == ids and len(top.tokens) == len(ids) + 8
        assert abs(top.cum_logprob - sum(d[t].logprob for d, t in zip(top.logprobs, top.tokens[len(ids) :]))) < 1e-4
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)


def test_beam_search_params_validation():
    from pagedllm import BeamSearchParams

    for kwargs in (dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0)):
        with pytest.raises(ValueError, match="beam_width|max_tokens"):
            BeamSearchParams(**kwargs)


def test_use_beam_search_in_generate_equals_beam_search(llm):
    from pagedllm import BeamSearchParams

    prompt = "The capital of France is"
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ref = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs) == 2
    for completion, seq in zip(out.outputs, ref.sequences):
        assert completion.token_ids == seq.tokens[len(out.prompt_token_ids) :]
        assert completion.cumulative_logprob == pytest.approx(seq.cum_logprob)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.5)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(use_beam_search=True, temperature=0)


@pytest.mark.parametrize("num_logprobs", [0, 2, 8])  # 8: more than the 2 * beam_width the search asks for
def test_use_beam_search_returns_logprobs_of_each_token(llm, hf, num_logprobs):
    prompt = "The capital of France is"
    params = SamplingParams(
        use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=4, ignore_eos=True, logprobs=num_logprobs
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    for completion in out.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        ids = out.prompt_token_ids + completion.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)  # [len, vocab]
        for j, (tid, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(out.prompt_token_ids) + j - 1]
            top = row.topk(num_logprobs).indices.tolist() if num_logprobs else []
            assert list(position)[0] == tid and set(position) == {tid, *top}
            for t, lp in position.items():
                assert lp.logprob == pytest.approx(float(row[t]), abs=2e-3)
                assert lp.decoded_token == tok.decode([t])
            assert [position[t].rank for t in top] == list(range(1, num_logprobs + 1))
        total = sum(d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
