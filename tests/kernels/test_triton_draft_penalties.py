"""The GPU sampling kernel at draft positions (speculative decoding): a penalized row sampled at its last known
position and at each draft position counts, at each, the drafts before it (the per-position lengths the step
sampler passes), as the torch path does. Without CUDA the kernel runs in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch

from pagedllm.sample.adjust import penalties
from pagedllm.sample.impl import TORCH, TRITON
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sample.verify import expand_rows
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.scheduler_output import NewRequestData

pytest.importorskip("triton")
sampling_kernels.load()

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 24
REQUESTS = {  # name -> (prompt + outputs, prompt length, drafts, params)
    "rep": ([1, 2, 3, 4, 5], 3, [6, 7, 6], SamplingParams(temperature=0, repetition_penalty=3.0)),
    "plain": ([8, 9], 1, [9, 9], SamplingParams(temperature=0)),
    "freq": ([2, 3, 10], 2, [11, 12, 11], SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.0)),
}


def sample(impl: str, count_drafts: bool = True) -> list[int]:
    batch = InputBatch(4, 32, 1)
    for name, (tokens, num_prompt, drafts, params) in REQUESTS.items():
        batch.add(NewRequestData(name, tokens, num_prompt, params, [], 0, []))
        row = batch.row_of[name]
        batch.token_ids[row, len(tokens) : len(tokens) + len(drafts)] = drafts  # as the model runner writes them
    rows = np.array([batch.row_of[n] for n in REQUESTS], dtype=np.int64)
    num_drafts = np.array([len(r[2]) for r in REQUESTS.values()], dtype=np.int64)
    rows, num_tokens = expand_rows(rows, batch.num_tokens[rows], num_drafts)
    pens = penalties(batch, rows, num_tokens if count_drafts else None)
    meta = SamplingMetadata.build(
        batch.temperature[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows], seeds=batch.seed[rows],
        seeded=batch.has_seed[rows], positions=num_tokens - batch.num_prompt[rows], device=DEVICE, penalties=pens,
        num_top=batch.num_logprobs[rows], impl=impl,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(rows), VOCAB, generator=gen)
    logits[:, [6, 7, 11, 12]] += 2.5  # the drafts are likely picks: their penalties decide
    return Sampler(DEVICE, 0, impl)(logits.to(DEVICE), meta).cpu().tolist()


def test_the_kernel_counts_the_drafts_before_each_position():
    expected = sample(TORCH)
    assert expected != sample(TORCH, count_drafts=False)  # the drafts' penalties change some picks
    assert sample(TRITON) == expected
    assert sample(TRITON, count_drafts=False) == sample(TORCH, count_drafts=False)  # the kernel reads the lengths
