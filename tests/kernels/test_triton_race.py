"""The race over the vocabulary (pagedllm/kernels/race.py): any split of a row into slices finds the winner of the
whole row, greedy rows take the first largest logit, draws follow softmax(x / T), and the sampling kernel draws its
plain rows exactly as the race does (with the host's keys of seeded rows, pagedllm/sample/vocab_race.py). Without
CUDA the kernels run in Triton's interpreter (tests/kernels/conftest.py) on small vocabularies."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch
from test_triton_sampling import chi_square_pvalue, random_seeds

from pagedllm.kernels import sampling_inputs
from pagedllm.sample.metadata import seeded_key

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
race = sampling_kernels.race_module()
sampling = sampling_kernels.load()[-1]


def winners(logits, keys, temperature, splits=(), num_sms=4):
    """The race's tokens over logits [rows, vocab] cut into slices at `splits` (each slice its own launch, as a
    tensor-parallel rank's)."""
    rows, vocab = logits.shape
    packed = torch.full((rows,), race.NONE, dtype=torch.int64, device=DEVICE)
    bounds = [0, *splits, vocab]
    keys, temperature = keys.to(DEVICE), temperature.to(DEVICE)
    for lo, hi in zip(bounds, bounds[1:]):
        race.race(logits[:, lo:hi].to(DEVICE), keys, temperature, packed, lo, num_sms)
    out = race.tokens(packed, torch.empty(rows, dtype=torch.int64, device=DEVICE))
    assert (packed == race.NONE).all()  # left ready for the next race
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_split_of_the_vocabulary_finds_the_same_winner(dtype):
    torch.manual_seed(0)
    rows, vocab = 6, 5003
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    keys = torch.tensor(random_seeds(rows, 1))
    temperature = torch.tensor([0.0, 0.3, 1.0, 1.0, 2.5, 0.7])
    whole = winners(logits, keys, temperature)
    assert whole[0] == logits[0].float().argmax()
    for splits in ((2501,), (1, 4097), (1234, 2502, 3751)):  # slices starting off a multiple of 4 too
        assert torch.equal(winners(logits, keys, temperature, splits), whole)
    # one program per row (a chunk longer than the row) finds it too
    assert torch.equal(winners(logits, keys, temperature, num_sms=1), whole)


def test_greedy_rows_take_the_first_largest_and_never_nan():
    x = torch.zeros(5, 40)
    x[0, [7, 30]] = 5.0  # a tie: the lower token
    x[1] = float("nan")
    x[1, 33] = -1.0  # the only number
    x[2] = float("-inf")  # every token banned: token 0
    x[3, [12, 25]] = float("inf")
    x[4] = -1.0
    x[4, [5, 30]] = torch.tensor([-0.0, 0.0])  # equal values: the lower token, whichever slice holds it
    keys, temperature = torch.zeros(5, dtype=torch.int64), torch.zeros(5)
    expected = torch.tensor([7, 33, 0, 12, 5])
    assert torch.equal(winners(x, keys, temperature), expected)
    assert torch.equal(winners(x, keys, temperature, (9, 26)), expected)
    # temperature rows: NaN never drawn, +inf always wins, a banned row takes token 0
    temperature = torch.ones(5)
    got = winners(x, torch.arange(5), temperature, (9,))
    assert got[1] == 33 and got[2] == 0 and got[3] in (12, 25)


def test_draws_follow_the_softmax():
    vocab, draws, temperature = 10, 20000 if DEVICE.type == "cuda" else 1200, 0.8  # (interpreted: a program a draw)
    x = torch.linspace(-1.5, 1.5, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    keys = torch.tensor(random_seeds(draws, 2))  # one row per draw, each with its own key
    tokens = winners(x.expand(draws, vocab).contiguous(), keys, torch.full((draws,), temperature))
    assert chi_square_pvalue(tokens, (x.double() / temperature).softmax(-1)) > 1e-3


def test_the_sampling_kernel_draws_plain_rows_as_the_race():
    """Seeded plain rows in the sampling kernel (as in a batch with filtered rows) give the race's tokens, keyed on
    the host as the racing steps key them; greedy rows the same argmax."""
    torch.manual_seed(5)
    rows, vocab = 8, 300
    logits = torch.randn(rows, vocab) * 2
    seeds = random_seeds(rows, 4)
    positions = np.arange(rows, dtype=np.int64) * 7 + 3
    temperature = np.array([0.0, 0.5, 1.0, 1.5, 0.9, 0.0, 2.0, 1.0], dtype=np.float32)
    params = sampling_inputs.pack_params(
        temperature, np.zeros(rows, dtype=np.int64), np.ones(rows, dtype=np.float32), np.zeros(rows, np.float32),
        seeds, np.ones(rows, dtype=bool), positions,
    )  # fmt: skip
    kernel = sampling.sample(logits.to(DEVICE), sampling_kernels.device_inputs(params), 0, block=64).cpu()
    keys = torch.from_numpy(seeded_key(seeds, positions))
    assert torch.equal(kernel, winners(logits, keys, torch.from_numpy(temperature), (97,)))


class _Head:
    """An LM head's slice of the vocabulary: rows [first_row, first_row + num_rows) of logits given per hidden row."""

    def __init__(self, logits, first_row, num_rows):
        self.logits, self.first_row, self.num_rows = logits, first_row, num_rows

    def shard_logits(self, hidden):  # hidden: the rows' indices
        return self.logits[hidden.long(), self.first_row : self.first_row + self.num_rows]


class _Ranks:
    """Two tensor-parallel ranks in one process: the first rank's all-reduce (max) runs the second rank's race into
    the same winners (what the max of the two would be)."""

    def __init__(self):
        self.other = None

    def all_reduce_max(self, packed):
        if self.other is not None:
            race.race(*self.other, packed, self.other_first, 4)
        return packed


def test_racing_steps_sample_a_batch_as_the_sampling_kernel_would():
    """VocabRace over a persistent batch (greedy, seeded and unseeded rows; one rank, then two ranks holding halves
    of the vocabulary) gives the sampling kernel's tokens for the seeded and greedy rows, the same on both."""
    from pagedllm.sample.vocab_race import VocabRace, plain_rows
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.input_batch import InputBatch
    from pagedllm.worker.scheduler_output import NewRequestData

    vocab = 203
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=1.3)]
    params.append(SamplingParams(temperature=1.0, seed=-5))
    batch = InputBatch(6, 32, 4)
    for i, p in enumerate(params):
        batch.add(NewRequestData(f"r{i}", [1, 2, 3 + i], 3, p, [], 0, []))
    rows = np.array([batch.row_of[f"r{i}"] for i in range(4)])
    num_tokens = np.array([9, 5, 7, 12])
    assert plain_rows(batch, rows, num_tokens)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(8)) * 2
    hidden = torch.arange(4, device=DEVICE)

    def sample(first, count, ranks):
        vr = VocabRace(DEVICE, seed=1, max_rows=6, head=_Head(logits.to(DEVICE), first, count))
        step = vr.prepare(batch, rows, num_tokens)
        if ranks.other is not None:  # the second rank's half, with the same inputs
            ranks.other = (logits[:, count:].to(DEVICE), step.keys, step.temperature)
        return vr.sample(hidden, step, ranks).cpu()

    one = sample(0, vocab, _Ranks())
    two = _Ranks()
    two.other, two.other_first = (), 101
    assert torch.equal(sample(0, 101, two), one)
    # the sampling kernel's tokens for the greedy and seeded rows (the unseeded row's key differs there)
    temperature = batch.temperature[rows]
    packed = sampling_inputs.pack_params(
        temperature, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows], batch.seed[rows], batch.has_seed[rows],
        num_tokens - batch.num_prompt[rows],
    )  # fmt: skip
    kernel = sampling.sample(logits.to(DEVICE), sampling_kernels.device_inputs(packed), 0, block=64).cpu()
    assert torch.equal(kernel[[0, 1, 3]], one[[0, 1, 3]])


@pytest.mark.parametrize(
    "params",
    [
        dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(logprobs=0), dict(repetition_penalty=1.2),
        dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]), dict(bad_words=["x"]), dict(min_tokens=4),
        dict(structured_outputs={"regex": "a+"}),
    ],
)  # fmt: skip
def test_steps_with_any_other_rule_do_not_race(params):
    from pagedllm.sample.vocab_race import plain_rows
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.input_batch import InputBatch
    from pagedllm.worker.scheduler_output import NewRequestData

    batch = InputBatch(4, 32, 4)
    p = SamplingParams(temperature=0.5, **params)
    if p.bad_words:
        p.bad_words_token_ids = [[7]]
    batch.add(NewRequestData("plain", [1, 2], 2, SamplingParams(temperature=0.5), [], 0, []))
    batch.add(NewRequestData("other", [1, 2], 2, p, [], 0, []))
    rows, num_tokens = np.array([0, 1]), np.array([2, 2])
    assert plain_rows(batch, rows[:1], num_tokens[:1])
    assert not plain_rows(batch, rows, num_tokens)
    # a follower's copy of a request with logits processors (the callables stay with the driver)
    batch.add(NewRequestData("lp", [1, 2], 2, SamplingParams(), [], 0, [], has_logits_processors=True))
    assert not plain_rows(batch, np.array([0, 2]), num_tokens)
