"""From the persistent batch to the sampler's inputs: per-request logit adjustments, sampling metadata, and the
logprobs of the sampled tokens."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from pagedllm.sample.logits_processors import apply_penalties, apply_token_constraints
from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.worker.input_batch import InputBatch


def adjust_logits(batch: InputBatch, rows: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
    """Allowed tokens, logit bias, EOS/stop ids held back before min_tokens, then penalties; in place where it can."""
    params = [batch.params[int(r)] for r in rows]
    allowed = {i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids}
    bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias}
    short = batch.num_tokens[rows] - batch.num_prompt[rows] < batch.min_tokens[rows]
    banned = {i: list(batch.min_tokens_stop_ids[int(rows[i])]) for i in np.nonzero(short)[0].tolist()}
    for i, p in enumerate(params):
        if p.bad_words_token_ids:
            banned.setdefault(i, []).extend(_bad_word_endings(p.bad_words_token_ids, _outputs(batch, int(rows[i]))))
    logits = apply_token_constraints(logits, allowed, bias, banned)
    for i, p in enumerate(params):
        for fn in p.logits_processors or []:
            logits[i] = _call_processor(fn, batch, int(rows[i]), logits[i])
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if not penalized:
        return logits
    sel = rows[penalized]
    value = lambda name: torch.tensor([getattr(params[i], name) for i in penalized], device=logits.device)  # noqa: E731
    index = torch.tensor(penalized, device=logits.device)
    width = int(batch.num_tokens[sel].max())
    return apply_penalties(
        logits,
        index,
        batch.token_ids[sel, :width],
        batch.num_prompt[sel],
        batch.num_tokens[sel],
        value("repetition_penalty").float(),
        value("presence_penalty").float(),
        value("frequency_penalty").float(),
    )


def _outputs(batch: InputBatch, row: int) -> list[int]:
    return batch.token_ids[row, batch.num_prompt[row] : batch.num_tokens[row]].tolist()


def _bad_word_endings(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far (one-token words always)."""
    return [s[-1] for s in sequences if len(s) == 1 or output[len(output) - len(s) + 1 :] == s[:-1]]


def _call_processor(fn, batch: InputBatch, row: int, logits: torch.Tensor) -> torch.Tensor:
    """A user logits processor: fn(output_ids, logits) or fn(prompt_ids, output_ids, logits) -> logits."""
    if len(inspect.signature(fn).parameters) == 3:
        return fn(batch.token_ids[row, : batch.num_prompt[row]].tolist(), _outputs(batch, row), logits)
    return fn(_outputs(batch, row), logits)


def sampling_metadata(batch: InputBatch, rows: np.ndarray, device) -> SamplingMetadata:
    return SamplingMetadata.build(
        batch.temperature[rows],
        batch.top_k[rows],
        batch.top_p[rows],
        batch.min_p[rows],
        seeds=batch.seed[rows],
        seeded=batch.has_seed[rows],
        positions=batch.num_tokens[rows] - batch.num_prompt[rows],
        device=device,
    )


def logprob_rows(raw_logits: torch.Tensor, num_top: list[int | None]) -> torch.Tensor | None:
    """A copy of the rows that want logprobs, taken before the logits are adjusted in place. [wanted, vocab]"""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    if not wanted:
        return None
    return raw_logits[torch.tensor(wanted, device=raw_logits.device)]


def sampled_logprobs(
    raw_logits: torch.Tensor | None,  # [wanted rows, vocab] float32, before any adjustment
    sampled: torch.Tensor,  # [rows]
    num_top: list[int | None],  # per row: how many top logprobs (None: none wanted)
) -> list[tuple[list[int], list[float], list[int]] | None]:
    """Per row (token ids, logprobs, ranks): the sampled token first, then the row's top-k; None if not wanted.
    raw_logits holds only the rows that want logprobs, in order."""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    if not wanted:
        return [None] * len(num_top)
    lse = raw_logits.logsumexp(dim=-1, keepdim=True)  # [wanted, 1]
    chosen = sampled[torch.tensor(wanted, device=sampled.device)]
    chosen_logit = raw_logits.gather(1, chosen[:, None])
    ranks = (raw_logits > chosen_logit).sum(dim=1) + 1  # 1 = the most likely token
    chosen_lp = (chosen_logit - lse).squeeze(1)
    k_max = max(num_top[i] for i in wanted)
    top_logits, top_ids = raw_logits.topk(k_max, dim=-1) if k_max else (raw_logits[:, :0], chosen[:, None][:, :0])
    top_lp = top_logits - lse
    out: list = [None] * len(num_top)
    for j, i in enumerate(wanted):
        k = num_top[i]
        ids = [int(chosen[j])] + top_ids[j, :k].tolist()
        lps = [float(chosen_lp[j])] + top_lp[j, :k].tolist()
        out[i] = (ids, lps, [int(ranks[j])] + list(range(1, k + 1)))
    return out
