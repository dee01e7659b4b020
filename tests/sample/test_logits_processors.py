"""Penalties, logit bias and allowed tokens against HF's processors and plain re-implementations."""

from __future__ import annotations

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pagedllm.sample.logits_processors import apply_penalties, apply_token_constraints, token_counts

VOCAB = 50


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 1, 12)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 0, 3)]
    return logits, prompts, outputs


def _ours(logits, prompts, outputs, rep, pres, freq):
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return apply_penalties(
        logits.clone(),
        token_counts(prompts, VOCAB, logits.device),
        token_counts(outputs, VOCAB, logits.device),
        f(rep),
        f(pres),
        f(freq),
    )


def test_repetition_penalty_matches_hf():
    logits, prompts, outputs = _case(0)
    penalties = [1.3, 0.7, 2.0]
    ours = _ours(logits, prompts, outputs, penalties, [0.0] * 3, [0.0] * 3)
    for i, penalty in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0])


def test_presence_and_frequency_follow_the_openai_formula():
    logits, prompts, outputs = _case(1)
    pres, freq = [0.5, -1.0, 2.0], [1.5, 0.3, -2.0]
    ours = _ours(logits, prompts, outputs, [1.0] * 3, pres, freq)
    for i in range(3):
        expected = logits[i].clone()
        for token in range(VOCAB):
            count = outputs[i].count(token)  # only generated tokens count, not the prompt
            expected[token] -= count * freq[i] + (1.0 if count > 0 else 0.0) * pres[i]
        torch.testing.assert_close(ours[i], expected)


def test_logit_bias_allowed_and_banned_tokens():
    logits, _, _ = _case(2)
    out = apply_token_constraints(
        logits.clone(), allowed={1: [3, 7, 9]}, bias={0: {4: 2.5, 10: -100.0}}, banned={2: [0, 1]}
    )
    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 10] -= 100.0
    expected[1, [t for t in range(VOCAB) if t not in (3, 7, 9)]] = float("-inf")
    expected[2, [0, 1]] = float("-inf")
    torch.testing.assert_close(out, expected)
