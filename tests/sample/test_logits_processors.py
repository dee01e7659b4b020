"""Penalties, logit bias and allowed tokens against HF's processors and plain re-implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pagedllm.sample.logits_processors import apply_penalties, apply_token_constraints


@pytest.fixture(autouse=True)
def _paths(sampling_path):
    """Every test here runs on each CPU sampling path."""


VOCAB = 50


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 1, 12)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 0, 3)]
    return logits, prompts, outputs


def _ours(logits, prompts, outputs, rep, pres, freq):
    f = lambda v: np.array(v, dtype=np.float32)  # noqa: E731
    rows = [p + o for p, o in zip(prompts, outputs)]
    token_ids = np.full((len(rows), max(map(len, rows)) + 2), 7, dtype=np.int64)  # padding past the end: ignored
    for i, r in enumerate(rows):
        token_ids[i, : len(r)] = r
    num_prompt = np.array([len(p) for p in prompts])
    num_tokens = np.array([len(r) for r in rows])
    index = np.arange(len(rows))
    return apply_penalties(logits.clone(), index, token_ids, num_prompt, num_tokens, f(rep), f(pres), f(freq))


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


def test_penalties_reach_only_the_given_batch_rows():
    logits, prompts, outputs = _case(3)
    batch = torch.cat([logits, logits]) * 0.5  # [6, vocab]
    penalized = _ours(logits * 0.5, prompts, outputs, [1.5, 1.2, 0.8], [0.3, 0.0, 1.0], [0.2, 0.5, 0.0])
    rows = [p + o for p, o in zip(prompts, outputs)]
    token_ids = np.zeros((3, max(map(len, rows))), dtype=np.int64)
    for i, r in enumerate(rows):
        token_ids[i, : len(r)] = r
    f = lambda v: np.array(v, dtype=np.float32)  # noqa: E731
    out = apply_penalties(
        batch.clone(), np.array([3, 1, 5]), token_ids, np.array([len(p) for p in prompts]),
        np.array([len(r) for r in rows]), f([1.5, 1.2, 0.8]), f([0.3, 0.0, 1.0]), f([0.2, 0.5, 0.0]),
    )  # fmt: skip
    torch.testing.assert_close(out[[3, 1, 5]], penalized)  # batch rows 3, 1, 5 hold the case's rows 0, 1, 2
    torch.testing.assert_close(out[[0, 2, 4]], batch[[0, 2, 4]])


def test_penalties_count_each_rows_repeats_and_skip_rows_without_tokens():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4)) * 4
    prompts = [[3, 3, 9], [], [7, 49], [0]]
    outputs = [[9, 9, 4, 3], [], [49, 7, 7, 7], [0, 0]]  # tokens in both, repeated; a row with none at all
    rep, pres, freq = [1.3, 1.5, 0.8, 1.1], [0.5, 1.0, -0.5, 0.2], [0.25, 1.0, 0.75, 2.0]
    ours = _ours(logits, prompts, outputs, rep, pres, freq)
    for i in range(4):
        expected = logits[i].clone()
        for token in set(prompts[i] + outputs[i]):
            value = expected[token]
            expected[token] = value / rep[i] if value > 0 else value * rep[i]
            count = outputs[i].count(token)
            expected[token] -= count * freq[i] + (1.0 if count > 0 else 0.0) * pres[i]
        torch.testing.assert_close(ours[i], expected)
