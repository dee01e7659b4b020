"""Steps whose sampled rows are all plain (greedy, or a temperature alone) sample on the GPU by the exponential race
over the vocabulary (pagedllm/kernels/race.py), each tensor-parallel rank over its own slice of the LM head's logits:
no rank gathers the whole vocabulary's logits, and the ranks' winners meet in one all-reduce (max) of an int64 per
row, after which every rank holds the sampled tokens (no broadcast). With one rank the same kernel races over the
whole row in chunks, many programs per row.

Every rank decides alone, from the persistent batch it keeps like the driver, whether a step races: its rows want no
min-p, top-k, top-p, penalties, logprobs, allowed-token masks (structured outputs), logit changes (bias, allowed
tokens, bad words, logits processors, min_tokens' banned ids) and verify no drafts. Unseeded rows key their draws by
a step key that every rank draws from the same generator (seeded by the engine's seed), in the same steps; a seeded
row by (seed, position), as the sampling kernel keys it, whose plain rows race the same way: a seeded request gets the
same tokens whatever shares its batch and whatever the tensor-parallel size."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import Staging
from pagedllm.kernels.sampling_inputs import GREEDY_BELOW
from pagedllm.sample.metadata import seeded_key


@dataclass
class RaceStep:
    """A racing step's rows [n] (of the persistent batch, in logits order) and their inputs on the device."""

    rows: np.ndarray
    keys: torch.Tensor  # [n] int64 each row's Philox key
    temperature: torch.Tensor  # [n] float32 (0: the argmax)


def plain_rows(batch, rows: np.ndarray, num_tokens: np.ndarray) -> bool:
    """Whether every one of these rows of the persistent batch samples plainly this step (num_tokens [n]: its
    tokens so far, for min_tokens)."""
    short = num_tokens - batch.num_prompt[rows] < batch.min_tokens[rows]
    return bool(batch.plain[rows].all() and not short.any())


class VocabRace:
    """The racing steps of one rank's runner: their inputs, uploaded before the forward, and their draw."""

    def __init__(self, device: torch.device, seed: int, max_rows: int, head) -> None:
        from pagedllm.kernels import race

        self.race = race
        self.device = device
        self.head = head  # the model's ParallelLMHead (its slice of the vocabulary: first_row, num_rows)
        self.keys = random.Random(seed)  # the step keys of unseeded rows: the same on every rank
        self.staging = Staging(device)
        self.packed = torch.full((max_rows,), race.NONE, dtype=torch.int64, device=device)  # left as NONE
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4

    def prepare(self, batch, rows: np.ndarray, num_tokens: np.ndarray) -> RaceStep:
        """The step's inputs for these rows (all plain), in one upload: each row's key, then its temperature."""
        n = len(rows)
        step_key = self.keys.getrandbits(62)
        temperature = batch.temperature[rows]
        sampling = temperature >= GREEDY_BELOW
        keys = step_key + np.arange(n, dtype=np.int64)
        seeded = batch.has_seed[rows] & sampling
        if seeded.any():
            positions = num_tokens[seeded] - batch.num_prompt[rows[seeded]]
            keys[seeded] = seeded_key(batch.seed[rows[seeded]], positions)
        words = np.empty(3 * n, dtype=np.int32)
        words[: 2 * n] = keys.view(np.int32)
        words[2 * n :] = np.where(sampling, temperature, 0.0).astype(np.float32).view(np.int32)
        up = self.staging.upload(words)
        return RaceStep(rows, up[: 2 * n].view(torch.int64), up[2 * n :].view(torch.float32))

    def sample(self, hidden: torch.Tensor, step: RaceStep, tp) -> torch.Tensor:
        """hidden [n, hidden] -> the sampled tokens [n] int64, on every rank of the tensor-parallel group tp."""
        n = hidden.shape[0]
        logits = self.head.shard_logits(hidden)  # [n, rows_per_rank]: this rank's slice (and padding)
        packed = self.packed[:n]
        self.race.race(logits[:, : self.head.num_rows], step.keys, step.temperature, packed, self.head.first_row,
                       self.num_sms)  # fmt: skip
        tp.all_reduce_max(packed)
        return self.race.tokens(packed, torch.empty(n, dtype=torch.int64, device=self.device))

    def warm_up(self, logits: torch.Tensor) -> None:
        """One race over logits [n, vocab] in the model's dtype (compiles the kernels), leaving nothing behind."""
        n = logits.shape[0]
        keys = torch.zeros(n, dtype=torch.int64, device=self.device)
        temperature = torch.ones(n, dtype=torch.float32, device=self.device)
        self.race.race(logits, keys, temperature, self.packed[:n], 0, self.num_sms)
        self.race.tokens(self.packed[:n], torch.empty(n, dtype=torch.int64, device=self.device))
