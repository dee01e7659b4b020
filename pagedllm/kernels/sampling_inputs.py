"""The sampling kernel's inputs (pagedllm/kernels/sampling.py), laid out on the host: every row's parameters, the
order of the rows' programs, the penalized rows' tokens and penalties and the rows that want logprobs, in one int32
array (one host-to-device copy per step). numpy only."""

from __future__ import annotations

import numpy as np

GREEDY_BELOW = 1e-5  # a temperature below this takes the argmax (every sampler path: SamplingMetadata too)
PARAMS = 10  # words per row of pack_params


def pack_params(
    temperature: np.ndarray,  # [batch] float32
    top_k: np.ndarray,  # [batch] int64, 0 = off
    top_p: np.ndarray,  # [batch] float32, 1 = off
    min_p: np.ndarray,  # [batch] float32, 0 = off
    seeds: np.ndarray | None = None,  # [batch] int64
    seeded: np.ndarray | None = None,  # [batch] bool
    positions: np.ndarray | None = None,  # [batch] int64: the draw's counter of a seeded row
    penalized: np.ndarray | None = None,  # [batch] int32: each row's place among pack_rows' rows, -1: none
    wanted: np.ndarray | None = None,  # [batch] int32: each row's place among the rows wanting logprobs, -1: none
    out: np.ndarray | None = None,  # [batch, PARAMS] int32 to write into
) -> np.ndarray:
    """The kernel's parameters of every row, PARAMS 32-bit words each: float32 temperature (below GREEDY_BELOW:
    argmax), top_k (0 = off), top_p, min_p; the seed's low and high words, the position, whether the row is seeded;
    its penalties' place, its logprobs' place (int32). [batch, PARAMS] int32"""
    n = len(temperature)
    packed = np.empty((n, PARAMS), dtype=np.int32) if out is None else out
    floats = packed.view(np.float32)
    floats[:, 0], floats[:, 1], floats[:, 2], floats[:, 3] = temperature, top_k, top_p, min_p
    if seeded is not None and seeded.any():
        packed[:, 4:6] = seeds.astype(np.int64).reshape(-1, 1).view(np.int32)  # low word, high word
        packed[:, 6] = positions
        packed[:, 7] = seeded
    else:
        packed[:, 4:8] = 0
    packed[:, 8] = -1 if penalized is None else penalized
    packed[:, 9] = -1 if wanted is None else wanted
    return packed


def program_order(params: np.ndarray) -> np.ndarray:
    """The rows in the order of their programs, the likely slowest first (programs start in order, and those of a
    big batch do not all fit on the device at once): penalized, then filtered, then plain draws, then argmax rows.
    params [batch, PARAMS] int32 (pack_params) -> [batch] int32"""
    floats = params.view(np.float32)
    draws = floats[:, 0] >= GREEDY_BELOW
    filtered = (floats[:, 1] > 0) | (floats[:, 2] < 1.0) | (floats[:, 3] > 0)
    weight = draws * (1 + 2 * filtered) + 4 * (params[:, 8] >= 0) + (params[:, 9] >= 0)
    return np.argsort(-weight, kind="stable").astype(np.int32)


def input_words(batch: int, num_pen: int = 0, pen_stride: int = 0, num_wanted: int = 0) -> tuple[np.ndarray, ...]:
    """An int32 array in the layout of the kernel's inputs, and its sections as views, to be written in place: (the
    words, params [batch, PARAMS] (pack_params), the rows in the order of their programs [batch] (program_order),
    the penalized rows [num_pen, pen_stride] (penalties.pack_rows), the rows that want logprobs [num_wanted])"""
    order_at = batch * PARAMS
    pen_at = order_at + batch
    wanted_at = pen_at + num_pen * pen_stride
    words = np.empty(wanted_at + num_wanted, dtype=np.int32)
    params, order = words[:order_at].reshape(batch, PARAMS), words[order_at:pen_at]
    return words, params, order, words[pen_at:wanted_at].reshape(num_pen, pen_stride), words[wanted_at:]


def pack_inputs(
    params: np.ndarray, penalties: np.ndarray | None = None, wanted: np.ndarray | None = None
) -> np.ndarray:
    """Every input of the kernel in one array (one host-to-device copy; input_words' layout): params [batch,
    PARAMS] (pack_params), the penalized rows [penalized, max_len + 5] (penalties.pack_rows) and the rows that want
    logprobs [wanted]. [words] int32"""
    num_pen, pen_stride = (0, 0) if penalties is None else penalties.shape
    words, *sections = input_words(len(params), num_pen, pen_stride, 0 if wanted is None else len(wanted))
    params_out, order, pen_out, wanted_out = sections
    params_out[:] = params
    order[:] = program_order(params)
    if num_pen:
        pen_out[:] = penalties
    if wanted is not None:
        wanted_out[:] = wanted
    return words
