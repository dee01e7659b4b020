"""The sampler's C kernels on the CPU (cpu_sampling.c, built into the cpu_kernels library): one call draws a token
for every row of the batch, one computes the logprobs of the rows that want them, one applies the penalties. Each
runs on torch's threads, a row at a time per thread, with the row's later passes in cache."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.kernels import cpu_kernels


def available(x: torch.Tensor) -> bool:
    """Whether the kernels take x's rows: float32 on the CPU, and a built library."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.compiled() is not None


class Scratch:
    """The kernels' memory, kept from step to step (fresh memory costs a page fault per 4 KiB, which here costs more
    than the work): each thread's working rows, the penalties' count table (zero between calls) and copies of logits
    rows for the logprobs."""

    def __init__(self) -> None:
        self.working = torch.empty(0)
        self.counts = np.zeros(0, dtype=np.int32)
        self.copies = torch.empty(0)

    def take(self, vocab: int, threads: int) -> torch.Tensor:
        size = threads * cpu_kernels.compiled().sampling_scratch_floats(vocab)
        if len(self.working) < size:
            self.working = torch.empty(size)
        return self.working

    def count_table(self, vocab: int, threads: int) -> np.ndarray:
        if len(self.counts) < threads * vocab:
            self.counts = np.zeros(threads * vocab, dtype=np.int32)
        return self.counts

    def rows(self, n: int, vocab: int) -> torch.Tensor:
        """[n, vocab] float32, valid until the next call."""
        if self.copies.numel() < n * vocab:
            self.copies = torch.empty(n * vocab)
        return self.copies[: n * vocab].view(n, vocab)


def sample(
    logits: torch.Tensor,  # [rows, vocab] float32
    params: torch.Tensor,  # [rows, 4] float32 contiguous: temperature (below 1e-5: argmax), top_k, top_p, min_p
    uniforms: np.ndarray,  # [rows] float32 in [0, 1): each sampled row's draw
    scratch: Scratch,
    kept: np.ndarray | None = None,  # [rows] int64 out: how many tokens each row could have drawn
) -> torch.Tensor:
    """One token per row: the argmax, or a draw from softmax(x / T) after min-p, top-k and top-p. [rows] int64"""
    logits = cpu_kernels.contiguous_rows(logits)
    rows, vocab = logits.shape
    threads = torch.get_num_threads()
    out = torch.empty(rows, dtype=torch.int64)
    uniforms = np.ascontiguousarray(uniforms, dtype=np.float32)
    assert params.is_contiguous() and params.dtype == torch.float32 and params.shape == (rows, 4)
    cpu_kernels.compiled().sample_rows(
        logits.data_ptr(),
        logits.stride(0),
        rows,
        vocab,
        params.data_ptr(),
        uniforms.ctypes.data,
        out.data_ptr(),
        None if kept is None else kept.ctypes.data,
        scratch.take(vocab, threads).data_ptr(),
        threads,
    )
    return out


def argmax_bf16(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) of bfloat16 logits [rows, vocab] (the argmax of their exact float32 copy, without
    making it: the first largest, NaN counting as the largest). [rows] int64"""
    logits = cpu_kernels.contiguous_rows(logits)
    assert logits.dtype == torch.bfloat16 and logits.device.type == "cpu"
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    cpu_kernels.compiled().argmax_rows_bf16(
        logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr(), torch.get_num_threads()
    )
    return out


def logprobs(
    addresses: np.ndarray,  # [rows] int64: where each row's float32 logits start
    vocab: int,
    chosen: torch.Tensor,  # [rows] int64
    num_top: int,
    scratch: Scratch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logprob [rows], rank [rows] int64, top ids [rows, num_top] int64, top logprobs [rows, num_top])"""
    rows = len(addresses)
    threads = torch.get_num_threads()
    addresses = np.ascontiguousarray(addresses, dtype=np.int64)
    chosen = chosen.contiguous()
    chosen_lp, ranks = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    top_ids, top_lp = torch.empty(rows, num_top, dtype=torch.int64), torch.empty(rows, num_top)
    cpu_kernels.compiled().logprobs_rows(
        addresses.ctypes.data,
        rows,
        vocab,
        chosen.data_ptr(),
        num_top,
        chosen_lp.data_ptr(),
        ranks.data_ptr(),
        top_ids.data_ptr(),
        top_lp.data_ptr(),
        scratch.take(vocab, threads).data_ptr(),
        threads,
    )
    return chosen_lp, ranks, top_ids, top_lp


def apply_penalties(
    logits: torch.Tensor,  # [batch, vocab] float32, changed in place
    rows: np.ndarray,  # [n] the batch rows penalized
    token_ids: np.ndarray,  # [n, max_len] int64: each row's prompt then output tokens
    num_prompt: np.ndarray,  # [n]
    num_tokens: np.ndarray,  # [n]
    repetition: np.ndarray,  # [n] float32
    presence: np.ndarray,
    frequency: np.ndarray,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties, in place."""
    assert logits.stride(-1) == 1
    threads = torch.get_num_threads()
    counts = (scratch or Scratch()).count_table(logits.shape[1], threads)
    tokens = np.ascontiguousarray(token_ids, dtype=np.int64)
    ints = [np.ascontiguousarray(a, dtype=np.int64) for a in (rows, num_prompt, num_tokens)]
    floats = [np.ascontiguousarray(a, dtype=np.float32) for a in (repetition, presence, frequency)]
    cpu_kernels.compiled().apply_penalties(
        logits.data_ptr(),
        logits.stride(0),
        ints[0].ctypes.data,
        len(rows),
        tokens.ctypes.data,
        tokens.shape[1],
        ints[1].ctypes.data,
        ints[2].ctypes.data,
        *(a.ctypes.data for a in floats),
        logits.shape[1],
        counts.ctypes.data,
        threads,
    )
    return logits


def apply_bitmask(
    logits: torch.Tensor,  # [batch, vocab] float32, changed in place
    rows: np.ndarray,  # [n] int64: the batch rows masked
    masks: np.ndarray,  # [n, words] int32: bit t % 32 of word t / 32 allows token t
) -> torch.Tensor:
    """Every token a row's mask does not allow becomes -inf (tokens past 32 * words are kept)."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    masks = np.ascontiguousarray(masks, dtype=np.int32)
    cpu_kernels.compiled().apply_bitmask(
        logits.data_ptr(), logits.stride(0), rows.ctypes.data, len(rows), masks.ctypes.data, masks.shape[1],
        logits.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return logits
