"""The sampling kernel's inputs (pagedllm/kernels/sampling.py), laid out on the host. numpy only.

Two int32 arrays on the device:
  state  per row of the persistent batch (not of the step): PARAMS words of parameters ([rows, PARAMS], pack_params),
         then the tokens of the penalized rows ([rows, token_cap]: prompt then output tokens). The kernel advances
         it as it samples (advance): every sampled row's position and, for a penalized row, its token list and
         count; so a batch that goes on as it was needs no upload the next step.
  step   for the rows of one step's logits: the batch row of each, its place among the penalized rows (-1: none),
         its place among the rows that want logprobs (-1: none), the rows in the order of their programs, where its
         patch starts (-1: none), then the rows that want logprobs, then the patches (step_words). A patch holds a
         row's PARAMS words and then its tokens (as many as its NUM_TOKENS word says): the row's program writes it
         into the state before it reads the state (and marks it written: a later step that reuses the words finds
         no patch), so a row that joins the batch travels with the step's words (one
         host-to-device copy, no scatter of its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

GREEDY_BELOW = 1e-5  # a temperature below this takes the argmax (every sampler path: SamplingMetadata too)
PARAMS = 13  # words per row of pack_params
POSITION, NUM_PROMPT, NUM_TOKENS = 6, 8, 9  # places of the words the kernel reads and advances


@dataclass
class DeviceInputs:
    """The sampling kernel's inputs on the device (the module's docstring)."""

    state: torch.Tensor  # [rows * PARAMS + rows * token_cap] int32
    step: torch.Tensor  # [5 batch + wanted + patches] int32 (step_words)
    num_rows: int  # rows of the state
    token_cap: int  # token places per row of the state (0: no penalized row)
    num_pen: int  # penalized rows in the step
    advance: bool  # the kernel advances the state (positions, token lists) as it samples


def pack_params(
    temperature: np.ndarray,  # [rows] float32
    top_k: np.ndarray,  # [rows] int64, 0 = off
    top_p: np.ndarray,  # [rows] float32, 1 = off
    min_p: np.ndarray,  # [rows] float32, 0 = off
    seeds: np.ndarray | None = None,  # [rows] int64
    seeded: np.ndarray | None = None,  # [rows] bool
    positions: np.ndarray | None = None,  # [rows] int64: tokens generated so far (the draw's counter)
    num_prompt: np.ndarray | None = None,  # [rows] a penalized row's prompt tokens
    num_tokens: np.ndarray | None = None,  # [rows] its tokens (prompt + output)
    repetition: np.ndarray | None = None,  # [rows] float32 each: its penalties
    presence: np.ndarray | None = None,
    frequency: np.ndarray | None = None,
    out: np.ndarray | None = None,  # [rows, PARAMS] int32 to write into
) -> np.ndarray:
    """The kernel's parameters of rows, PARAMS 32-bit words each: float32 temperature (below GREEDY_BELOW: argmax),
    top_k (0 = off), top_p, min_p; the seed's low and high words, the position, whether the row is seeded; the
    prompt length and length of its token list, float32 repetition, presence and frequency penalties (read where the
    step penalizes the row). [rows, PARAMS] int32"""
    n = len(temperature)
    packed = np.empty((n, PARAMS), dtype=np.int32) if out is None else out
    floats = packed.view(np.float32)
    floats[:, 0], floats[:, 1], floats[:, 2], floats[:, 3] = temperature, top_k, top_p, min_p
    packed[:, 4:6] = 0 if seeds is None else seeds.astype(np.int64).reshape(-1, 1).view(np.int32)  # low, high word
    packed[:, POSITION] = 0 if positions is None else positions
    packed[:, 7] = 0 if seeded is None else seeded
    packed[:, NUM_PROMPT] = 0 if num_prompt is None else num_prompt
    packed[:, NUM_TOKENS] = 0 if num_tokens is None else num_tokens
    floats[:, 10] = 1.0 if repetition is None else repetition
    floats[:, 11] = 0.0 if presence is None else presence
    floats[:, 12] = 0.0 if frequency is None else frequency
    return packed


def program_order(sampling: np.ndarray, filtered: np.ndarray, penalized: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The rows in the order of their programs, the likely slowest first (programs start in order, and those of a
    big batch do not all fit on the device at once): penalized, then filtered, then plain draws, then argmax rows.
    Each [batch] bool -> [batch] int32"""
    as_int = lambda mask: mask.view(np.int8)  # noqa: E731
    weight = as_int(sampling) * (1 + 2 * as_int(filtered)) + 4 * as_int(penalized) + as_int(wanted)
    return np.argsort((7 - weight).astype(np.int8), kind="stable").astype(np.int32)  # small ints: a radix sort


def step_words(
    batch_rows: np.ndarray,  # [batch] the state row of each logits row
    sampling: np.ndarray,  # [batch] bool: the row draws (else the argmax)
    filtered: np.ndarray,  # [batch] bool: with top-k, top-p or min-p
    penalized: np.ndarray,  # [batch] bool
    wanted: np.ndarray,  # [batch] bool: wants logprobs
    patched: np.ndarray | None = None,  # [batch] bool: the rows whose state comes in patches
    params: np.ndarray | None = None,  # [patched rows, PARAMS] their parameters (pack_params)
    tokens: np.ndarray | None = None,  # [patched rows, width] their tokens (as many as each one's NUM_TOKENS)
) -> np.ndarray:
    """The step's words: each logits row's state row, its place among the penalized rows and among the rows that
    want logprobs (-1: none), the rows in the order of their programs (program_order), where each row's patch starts
    (-1: none), the rows that want logprobs, then the patches. [5 batch + wanted rows + patches] int32"""
    n = len(batch_rows)
    listed = np.flatnonzero(wanted)
    head = 5 * n + len(listed)
    lengths = np.zeros(0, dtype=np.int64)
    if patched is not None and patched.any():
        lengths = params[:, NUM_TOKENS].astype(np.int64)
    sizes = PARAMS + lengths
    words = np.empty(head + int(sizes.sum()), dtype=np.int32)
    words[:n] = batch_rows
    words[n : 3 * n] = -1
    words[n : 2 * n][penalized] = np.arange(int(penalized.sum()))
    words[2 * n : 3 * n][listed] = np.arange(len(listed))
    words[3 * n : 4 * n] = program_order(sampling, filtered, penalized, wanted)
    words[4 * n : 5 * n] = -1
    words[5 * n : head] = listed
    if len(lengths):
        starts = head + np.cumsum(sizes) - sizes  # [patched rows]
        words[4 * n : 5 * n][patched] = starts
        words[(starts[:, None] + np.arange(PARAMS)).ravel()] = params.ravel()
        held = np.arange(tokens.shape[1])[None, :] < lengths[:, None]  # [patched rows, width]
        words[(starts[:, None] + PARAMS + np.arange(tokens.shape[1]))[held]] = tokens[held]
    return words


def is_filtered(top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    return (top_k > 0) | (top_p < 1.0) | (min_p > 0)


def pack_inputs(
    params: np.ndarray,  # [batch, PARAMS] (pack_params)
    penalized: np.ndarray | None = None,  # [num_pen] the penalized rows
    tokens: np.ndarray | None = None,  # [num_pen, max_len] their prompt then output tokens (lengths in params)
    wanted: np.ndarray | None = None,  # [wanted] the rows that want logprobs
) -> tuple[np.ndarray, np.ndarray, int]:
    """Every input of a kernel launch whose logits rows are the state's rows, built anew (nothing kept on the device
    from an earlier step): (state words, step words, token_cap). A penalized row's count in params must not exceed
    max_len."""
    n = len(params)
    floats = params.view(np.float32)
    token_cap = 0 if tokens is None else tokens.shape[1] + 1  # room for the token the step appends
    state = np.zeros(n * PARAMS + n * token_cap, dtype=np.int32)
    state[: n * PARAMS] = params.ravel()
    pen = np.zeros(n, dtype=bool)
    if penalized is not None and len(penalized):
        pen[penalized] = True
        state[n * PARAMS :].reshape(n, token_cap)[penalized, : tokens.shape[1]] = tokens
    want = np.zeros(n, dtype=bool)
    if wanted is not None:
        want[wanted] = True
    sampling = floats[:, 0] >= GREEDY_BELOW
    step = step_words(np.arange(n), sampling, is_filtered(floats[:, 1], floats[:, 2], floats[:, 3]), pen, want)
    return state, step, token_cap
