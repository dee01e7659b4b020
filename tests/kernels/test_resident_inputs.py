"""The GPU sampling kernel's inputs kept on the device (ResidentInputs) against the same inputs uploaded whole every
step: over steps where requests join and leave the batch, with seeds, penalties and logprobs, the kernel that
advances its own state draws the same tokens and logprobs, and its state ends up holding what the host holds.
Without CUDA the kernel runs in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch

from pagedllm.sample.resident_inputs import ResidentInputs
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.scheduler_output import NewRequestData

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 50
sampling = sampling_kernels.load()[-1]

REQUESTS = {  # request -> its sampling parameters
    "greedy": SamplingParams(temperature=0),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "top_k": SamplingParams(temperature=0.9, top_k=5, seed=8),
    "penalized": SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.7),
    "penalized_draw": SamplingParams(temperature=1.2, top_p=0.9, frequency_penalty=1.5, seed=9, logprobs=3),
    "unseeded": SamplingParams(temperature=0.8, min_p=0.05, logprobs=1),
    "late_penalized": SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=0),
}
SCHEDULE = [  # the requests of each step, in logits order
    ["greedy", "seeded", "penalized"],
    ["greedy", "seeded", "penalized"],
    ["seeded", "penalized", "top_k", "penalized_draw"],
    ["seeded", "penalized", "top_k", "penalized_draw"],
    ["penalized_draw", "seeded", "unseeded"],
    ["penalized_draw", "seeded", "unseeded", "late_penalized"],
    ["penalized_draw", "seeded", "unseeded", "late_penalized"],
    ["penalized_draw", "seeded", "unseeded", "late_penalized"],
    ["greedy"],
    ["penalized_draw", "seeded", "unseeded", "late_penalized", "greedy"],
]


def run(resident_for_step, late: bool = False) -> tuple[list, InputBatch]:
    """Every step of SCHEDULE sampled with the ResidentInputs resident_for_step(step) gives; a request joins the
    batch at its first step and leaves after its last. late: each step's tokens reach the host one step later, as
    under async scheduling (the next step counts them as tokens still on the device; a row given to another request
    meanwhile does not take them). Returns each step's tokens and logprob rows, and the batch."""
    gen = torch.Generator().manual_seed(0)
    batch = InputBatch(8, 64, 4)
    sampler = Sampler(torch.device("cpu"), seed=3)  # the keys of unseeded rows: the same sequence each run
    last_step = {name: max(i for i, s in enumerate(SCHEDULE) if name in s) for name in REQUESTS}
    results, pending = [], []  # pending: (row, admission, token) not yet on the host
    for step, names in enumerate(SCHEDULE):
        for name in names:
            if name not in batch.row_of:  # joins with a prompt of a few tokens (a late request: some outputs too)
                prompt = torch.randint(0, VOCAB, (3 + len(name) % 4,), generator=gen).tolist()
                outputs = [1, 1, 2] if name == "late_penalized" else []
                batch.add(NewRequestData(name, prompt + outputs, len(prompt), REQUESTS[name], [], 0, []))
        rows = np.array([batch.row_of[n] for n in names], dtype=np.int64)
        on_device = {(row, admission) for row, admission, _ in pending}
        num_tokens = batch.num_tokens[rows] + [(r, batch.generation[r]) in on_device for r in rows.tolist()]
        meta = resident_for_step(step).update(batch, rows, num_tokens)
        logits = (torch.randn(len(rows), VOCAB, generator=gen) * 2).to(DEVICE)
        tokens = sampler(logits, meta).cpu().tolist()
        logprobs = meta.logprobs.out.cpu().tolist() if meta.logprobs is not None else None
        results.append((tokens, logprobs))
        sampled = [(row, int(batch.generation[row]), token) for row, token in zip(rows.tolist(), tokens)]
        arrived, pending = (pending, sampled) if late else (sampled, [])
        for row, admission, token in arrived:
            if batch.generation[row] == admission:
                batch.append_token(row, token)
        for name in names:
            if last_step[name] == step:
                batch.remove(name)
    return results, batch


def test_kept_state_draws_as_uploads_of_everything_every_step(monkeypatch):
    """The same tokens and logprobs whether the state is kept from step to step or built anew each step; the kept
    state is uploaded only on the steps whose rows changed."""
    from pagedllm.device import Staging

    copies = []
    upload = Staging.upload
    monkeypatch.setattr(Staging, "upload", lambda self, words: copies.append(len(words)) or upload(self, words))
    kept = ResidentInputs(DEVICE)
    kept_results, _ = run(lambda step: kept)
    kept_copies = len(copies)
    fresh_results, _ = run(lambda step: ResidentInputs(DEVICE))
    assert kept_results == fresh_results
    assert len(copies) - kept_copies == len(SCHEDULE) - 1  # built anew: every step but the one of torch's argmax
    # kept: the first step and each step whose rows changed (2, 4, 5, 9); none on steps 1, 3, 6 and 7, nor on step
    # 8 (every row greedy: torch's argmax), after which step 9 uploads the greedy row again (its position moved on)
    assert kept_copies == 5


def test_late_tokens_and_growing_token_lists_change_nothing(monkeypatch):
    """Tokens that reach the host a step late (async scheduling: the state holds them already, nothing waits for
    them) and penalized token lists that outgrow their room (copied on the device into longer rows, several times):
    the same tokens and logprobs as steps whose tokens reach the host at once."""
    import pagedllm.sample.resident_inputs as resident_inputs

    in_step = ResidentInputs(DEVICE)
    expected, batch = run(lambda step: in_step)
    assert in_step.token_cap == batch.token_ids.shape[1]  # the usual room, at most the longest a request gets: 65
    monkeypatch.setattr(resident_inputs, "MIN_TOKEN_CAP", 4)
    kept = ResidentInputs(DEVICE)
    got, _ = run(lambda step: kept, late=True)
    assert got == expected
    assert kept.token_cap >= 16  # grown from 4 at least twice


def test_state_holds_the_hosts_tokens_and_positions():
    """After steps of a penalized and a seeded request, the state's token lists and positions are the host's."""
    from pagedllm.kernels.sampling_inputs import NUM_TOKENS, PARAMS, POSITION

    gen = torch.Generator().manual_seed(1)
    batch = InputBatch(4, 32, 2)
    sampler = Sampler(torch.device("cpu"), seed=0)
    resident = ResidentInputs(DEVICE)
    params = [SamplingParams(temperature=0, frequency_penalty=0.3), SamplingParams(temperature=1.0, seed=2)]
    batch.add(NewRequestData("0", [5, 6], 2, params[0], [], 0, []))  # a prompt of 2
    batch.add(NewRequestData("1", [5, 6, 7], 2, params[1], [], 0, []))  # a prompt of 2 and one output
    rows = np.array([batch.row_of["1"], batch.row_of["0"]])
    for _ in range(5):
        meta = resident.update(batch, rows, batch.num_tokens[rows].copy())
        tokens = sampler((torch.randn(2, VOCAB, generator=gen) * 2).to(DEVICE), meta).cpu().tolist()
        for row, token in zip(rows.tolist(), tokens):
            batch.append_token(row, token)
    state = resident.state.cpu().numpy()
    words = state[: resident.num_rows * PARAMS].reshape(resident.num_rows, PARAMS)
    held = state[resident.num_rows * PARAMS :].reshape(resident.num_rows, resident.token_cap)
    pen_row = batch.row_of["0"]
    n = int(batch.num_tokens[pen_row])
    assert words[pen_row, NUM_TOKENS] == n == 7
    assert held[pen_row, :n].tolist() == batch.token_ids[pen_row, :n].tolist()
    for row in rows.tolist():
        assert words[row, POSITION] == batch.num_tokens[row] - batch.num_prompt[row]
