"""The sampled verification rule against the target distribution, statistically (chi-square): with a point-mass draft
t, the first emitted token must follow the target p (temperature, penalties, top-p applied as without drafts), t is
accepted with probability p(t), a rejection emits a token of the residual max(p - q, 0) normalized (p without t),
and after an accepted draft the next token follows the target at the draft's position, whose penalties count the
draft among the outputs; with grammar masks, one per position, the same holds for the masked target. 120k
requests, one draft each, sampled in one vectorized call of the step sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedllm.sample.step_sampler import StepSampler
from pagedllm.sample.verify import accept
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.scheduler_output import NewRequestData

N, VOCAB, DRAFT = 120_000, 8, 5
PROMPT, OUTPUT = [1, 2], [3]
LOGITS = (  # the model's logits at the last known position and at the draft's position
    torch.tensor([0.3, 1.1, -0.4, 0.9, 0.2, 1.0, -1.0, 0.6]),
    torch.tensor([0.5, -0.2, 0.8, 1.2, 0.1, 1.3, 0.4, -0.6]),
)
PARAMS = SamplingParams(temperature=0.8, top_p=0.85, repetition_penalty=1.3, presence_penalty=0.4, max_tokens=8)


def reference(logits: torch.Tensor, prompt: list[int], output: list[int]) -> np.ndarray:
    """The target distribution by the rules' definitions: the repetition penalty (HF's: divide positive, multiply
    negative logits of tokens seen in the prompt or output), the presence penalty over the output, the temperature,
    then top-p (the most probable tokens whose mass before them is below top_p), renormalized."""
    x = logits.double().clone()
    for t in set(prompt + output):
        x[t] = x[t] / PARAMS.repetition_penalty if x[t] > 0 else x[t] * PARAMS.repetition_penalty
    for t in set(output):
        x[t] -= PARAMS.presence_penalty
    p = torch.softmax(x / PARAMS.temperature, -1).numpy()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(VOCAB, dtype=bool)
    keep[order[before < PARAMS.top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def assert_follows(tokens: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[p == 0].sum() == 0, f"tokens outside the support: {counts}"
    support = p > 0
    expected = p[support] * len(tokens)
    result = chisquare(counts[support], expected)
    assert result.pvalue > 1e-4, (counts, expected, result)


def verify(masks: np.ndarray | None = None) -> list[list[int]]:
    """N requests with one draft each, verified in one call of the step sampler; masks [2, words] (one per position,
    as the scheduler fills them) or None -> per request the emitted tokens."""
    batch = InputBatch(1, 16, 1)
    batch.add(NewRequestData("r", PROMPT + OUTPUT, len(PROMPT), PARAMS, [0], 3, []))
    sampler = StepSampler(batch, torch.device("cpu"), seed=0)
    rows, num_tokens, num_drafts = np.zeros(N, np.int64), np.full(N, 3), np.ones(N, np.int64)
    batch.token_ids[0, 3] = DRAFT  # the draft after the known tokens, as the runner writes it
    step = sampler.prepare(rows, num_tokens, None if masks is None else [masks] * N, num_drafts)
    logits = torch.stack(LOGITS).repeat(N, 1)  # [2N, vocab]: per request its two positions
    targets = sampler.sample(logits, step).sampled.tolist()
    return accept([[DRAFT]] * N, targets)


def assert_verified(emitted: list[list[int]], p0: np.ndarray, p1: np.ndarray) -> None:
    """The first emitted token follows p0 (the target at the last known position), a rejection emits from p0
    without the draft, and the token after an accepted draft follows p1."""
    assert 0.05 < p0[DRAFT] < 0.8 and (p0 > 0).sum() >= 4  # a draft both accepted and rejected; top-p cuts some
    first = np.array([e[0] for e in emitted])
    assert_follows(first, p0)
    accepted = first == DRAFT
    rejected_first = first[~accepted]
    residual = np.where(np.arange(VOCAB) == DRAFT, 0.0, p0)
    assert_follows(rejected_first, residual / residual.sum())
    bonus = np.array([e[1] for e in emitted if len(e) == 2])
    assert len(bonus) == accepted.sum()
    assert_follows(bonus, p1)


@pytest.mark.parametrize("sampling_path", ["c", "torch"], indirect=True)
def test_sampled_verification_follows_the_target(sampling_path):
    p1 = reference(LOGITS[1], PROMPT, OUTPUT + [DRAFT])
    assert_verified(verify(), reference(LOGITS[0], PROMPT, OUTPUT), p1)
    # the penalty at the draft's position counts the draft: without it the bonus distribution would differ
    assert not np.allclose(p1, reference(LOGITS[1], PROMPT, OUTPUT), atol=1e-3)


@pytest.mark.parametrize("sampling_path", ["c", "torch"], indirect=True)
def test_masked_verification_follows_the_masked_target(sampling_path):
    """Structured outputs with drafts: each position samples under its own grammar mask (the mask after the tokens
    before it), so every emitted token follows the masked target distribution, as without drafts."""
    allowed = (np.array([1, 1, 1, 0, 1, 1, 0, 1], bool), np.array([1, 0, 1, 0, 1, 0, 1, 1], bool))
    masks = np.stack([np.packbits(a, bitorder="little").astype(np.int32) for a in allowed])  # [2 positions, 1 word]

    def masked(logits: torch.Tensor, keep: np.ndarray) -> torch.Tensor:
        return logits.masked_fill(torch.from_numpy(~keep), float("-inf"))

    p0 = reference(masked(LOGITS[0], allowed[0]), PROMPT, OUTPUT)
    p1 = reference(masked(LOGITS[1], allowed[1]), PROMPT, OUTPUT + [DRAFT])
    assert_verified(verify(masks), p0, p1)
    # the masks bite: unmasked, or with the first position's mask at both, the distributions differ
    assert not np.allclose(p0, reference(LOGITS[0], PROMPT, OUTPUT), atol=1e-3)
    assert not np.allclose(p1, reference(masked(LOGITS[1], allowed[0]), PROMPT, OUTPUT + [DRAFT]), atol=1e-3)
