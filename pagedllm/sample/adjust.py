"""From the persistent batch's rows to what the sampler applies to the logits: per-request adjustments (allowed
tokens, logit bias, EOS/stop ids before min_tokens, bad words, logits processors) and penalties."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.sample.logits_processors import Penalties, apply_token_constraints
from pagedllm.sample.metadata import SamplingMetadata

if TYPE_CHECKING:  # the runner's persistent batch: the sampler reads its rows
    from pagedllm.worker.input_batch import InputBatch


def _short_of_min_tokens(batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    return num_tokens - batch.num_prompt[rows] < batch.min_tokens[rows]  # [rows] EOS and stop ids still banned


def adjusted_rows(
    batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray, sampling: SamplingMetadata
) -> np.ndarray:
    """Which of these rows' logits may change before the logprobs read them: adjust_logits' rows, and the penalized
    rows where the sampler penalizes in place. [rows] bool"""
    adjusted = batch.adjusts_logits[rows] | _short_of_min_tokens(batch, rows, num_tokens)
    return adjusted | batch.penalized[rows] if sampling.penalizes_in_place else adjusted


def adjust_logits(
    batch: InputBatch,
    rows: np.ndarray,
    num_tokens: np.ndarray,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Allowed tokens, logit bias, EOS/stop ids held back before min_tokens, bad words and logits processors, in
    place where it can (the penalties are the sampler's). num_tokens [rows]: each request's tokens including one
    still on the device (async scheduling); the rows that read their output tokens (penalties, bad words, logits
    processors) have none there."""
    short = _short_of_min_tokens(batch, rows, num_tokens)
    if not (batch.adjusts_logits[rows].any() or short.any()):
        return logits
    params = [batch.params[int(r)] for r in rows]
    allowed = {i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids}
    bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias}
    banned = {i: list(batch.min_tokens_stop_ids[int(rows[i])]) for i in np.nonzero(short)[0].tolist()}
    for i, p in enumerate(params):
        if p.bad_words_token_ids:
            banned.setdefault(i, []).extend(_bad_word_endings(p.bad_words_token_ids, _outputs(batch, int(rows[i]))))
    logits = apply_token_constraints(logits, allowed, bias, banned)
    for i, row in enumerate(rows.tolist() if batch.logits_processors else ()):
        for fn in batch.logits_processors.get(row, ()):
            logits[i] = _call_processor(fn, batch, row, logits[i])
    return logits


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


def penalties(batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray | None = None) -> Penalties | None:
    """The penalties of these rows (None: none has any); their tokens are on the host (the rows that read their
    outputs wait for them). num_tokens [rows]: the tokens each row counts (default: the request's known tokens; a
    draft position counts the drafts before it, written after them)."""
    penalized = np.nonzero(batch.penalized[rows])[0]
    if not len(penalized):
        return None
    sel = rows[penalized]
    lengths = batch.num_tokens[sel] if num_tokens is None else num_tokens[penalized]
    width = int(lengths.max())
    return Penalties(
        penalized,
        batch.token_ids[sel, :width],
        batch.num_prompt[sel],
        lengths,
        batch.repetition_penalty[sel],
        batch.presence_penalty[sel],
        batch.frequency_penalty[sel],
    )
