"""The logprobs of sampled (or prompt) tokens: the rows that want them kept as they were before anything changed the
logits in place (logprob_rows), then each chosen token's logprob and rank and the row's top-k (logprob_tensors), on
the device until one copy to the host (LogprobTensors.tolists)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import pinned_copy, to_device
from pagedllm.kernels import cpu_sampling
from pagedllm.sample import tiles
from pagedllm.sample.impl import TRITON, C, impl_of
from pagedllm.sample.metadata import SamplingMetadata

_LOG2E = 1.4426950408889634  # exp(z) = 2 ** (z * log2(e))
_BLOCK_BYTES = 2 << 20  # CPU logprobs: logits per block of rows


@dataclass
class LogprobRows:
    """The logits that the logprobs read, as they were before anything changed them in place (logprob_rows)."""

    logits: torch.Tensor  # [rows, vocab] the step's logits
    wanted: np.ndarray  # [wanted] the rows that want logprobs
    copies: torch.Tensor  # [copied, vocab]: every wanted row (torch path; the GPU kernel's where one changes); those
    # that change (C kernels); or the logits themselves (read in place)
    copy_of: np.ndarray  # [wanted] each wanted row's place in copies, -1: read in place
    wanted_index: torch.Tensor | None = None  # wanted on the logits' device, where it was uploaded (None: not)

    def addresses(self) -> np.ndarray:
        """Where each wanted row's float32 logits start. [wanted] int64"""
        in_place = self.logits.data_ptr() + self.wanted * (self.logits.stride(0) * 4)
        copied = self.copies.data_ptr() + self.copy_of * (self.copies.stride(0) * 4)
        return np.where(self.copy_of >= 0, copied, in_place)

    @property
    def copied(self) -> torch.Tensor | None:
        """The copies of every wanted row, in order (None: the logits are read in place)."""
        return None if self.copies is self.logits else self.copies


def logprob_rows(
    raw_logits: torch.Tensor,
    num_top: np.ndarray,
    adjusted: np.ndarray | None = None,
    scratch: cpu_sampling.Scratch | None = None,
    impl: str | None = None,  # the sampler's implementation (None: the one that takes raw_logits)
) -> LogprobRows | None:
    """Keeps the rows that want logprobs (num_top [rows] int: the top logprobs each row wants, -1: none) as they are
    before anything changes raw_logits in place (adjusted [rows] bool: the rows that may change; None: any). The GPU
    sampling kernel reads the wanted rows in place unless one of them changes (then a copy of them all). The torch
    path reads one tensor of every wanted row: raw_logits itself where that is all of them and none changes, else a
    copy. The C kernels read rows by address and copy only the wanted rows that may change (into the scratch's rows,
    valid until its next copies)."""
    wanted = np.flatnonzero(num_top >= 0)
    if not len(wanted):
        return None
    in_order = np.arange(len(wanted))
    impl = impl or impl_of(raw_logits)
    if impl == TRITON:
        if adjusted is not None and not adjusted[wanted].any():
            return LogprobRows(raw_logits, wanted, raw_logits, np.full(len(wanted), -1))
        if len(wanted) == len(num_top):
            return LogprobRows(raw_logits, wanted, raw_logits.clone(), in_order)
        index = to_device(wanted, raw_logits.device)
        return LogprobRows(raw_logits, wanted, raw_logits.index_select(0, index), in_order, index)
    if impl != C:
        index = None
        if len(wanted) < len(num_top):
            index = to_device(wanted, raw_logits.device)
            copies = raw_logits.index_select(0, index)
        elif adjusted is None or adjusted.any():
            copies = raw_logits.clone()
        else:
            copies = raw_logits
        return LogprobRows(raw_logits, wanted, copies, in_order, index)
    copied = wanted if adjusted is None else wanted[adjusted[wanted]]
    out = scratch.rows(len(copied), raw_logits.shape[1]) if scratch is not None else None
    copies = torch.index_select(raw_logits, 0, to_device(copied, raw_logits.device), out=out)
    copy_of = np.full(len(wanted), -1, dtype=np.int64)
    copy_of[np.searchsorted(wanted, copied)] = np.arange(len(copied))
    return LogprobRows(raw_logits, wanted, copies, copy_of)


def pack_logprobs(chosen, ranks, chosen_lp, top_ids, top_lp) -> torch.Tensor:
    """One row of 32-bit words per wanted row, as the GPU kernels write them (pagedllm/kernels/logprobs.py): the
    chosen token, its rank (1 = the most likely token), its logprob and 0 (float32 bits: the kernels write the logit
    and the log-sum-exp, whose difference is the logprob), then the top-k tokens, then their logprobs (float32 bits);
    one tensor, one copy to the host. chosen, ranks, chosen_lp [wanted], top_ids, top_lp [wanted, k] -> [wanted,
    4 + 2 k] int32"""
    bits = lambda t: t.float().contiguous().view(torch.int32)  # noqa: E731
    zero = torch.zeros_like(chosen, dtype=torch.int32)[:, None]
    columns = [chosen.int()[:, None], ranks.int()[:, None], bits(chosen_lp[:, None]), zero, top_ids.int(), bits(top_lp)]
    return torch.cat(columns, dim=1)


@dataclass
class LogprobTensors:
    """The logprobs of the rows that want them, still on the device; `tolists` reads them on the host."""

    num_top: np.ndarray  # [rows] int: how many top logprobs each row wants (-1: none)
    packed: torch.Tensor | np.ndarray  # [wanted, 4 + 2 max k] int32: pack_logprobs (on the host: numpy)

    def tolists(self) -> list[tuple[list[int], list[float], list[int]] | None]:
        """Per row (token ids, logprobs, ranks): the chosen token first, then the row's top-k; None if not wanted.
        A device tensor is copied to the host with one wait (after the host's own work)."""
        words = self.packed
        if isinstance(words, torch.Tensor):
            if words.is_cuda:
                words = pinned_copy(words)
                torch.cuda.current_stream().synchronize()
            words = words.numpy()
        wanted = np.flatnonzero(self.num_top >= 0)
        rows, k_max = len(words), (words.shape[1] - 4) // 2
        floats = words.view(np.float32)
        ids = np.empty((rows, 1 + k_max), dtype=np.int32)  # the chosen token first
        ids[:, 0], ids[:, 1:] = words[:, 0], words[:, 4 : 4 + k_max]
        logprobs = np.empty((rows, 1 + k_max), dtype=np.float32)
        np.subtract(floats[:, 2], floats[:, 3], out=logprobs[:, 0])
        logprobs[:, 1:] = floats[:, 4 + k_max :]
        ranks = np.empty((rows, 1 + k_max), dtype=np.int32)  # the chosen token's, then the top-k's: 1, 2, ...
        ranks[:, 0], ranks[:, 1:] = words[:, 1], np.arange(1, k_max + 1)
        entries = zip(ids.tolist(), logprobs.tolist(), ranks.tolist())
        out: list = [None] * len(self.num_top)
        k = self.num_top[wanted]
        if (k == k_max).all():
            for i, entry in zip(wanted.tolist(), entries):
                out[i] = entry
        else:
            for i, n, (ids_i, lps_i, ranks_i) in zip(wanted.tolist(), (k + 1).tolist(), entries):
                out[i] = (ids_i[:n], lps_i[:n], ranks_i[:n])
        return out


def logprob_tensors(
    raw: LogprobRows | None,  # the wanted rows before any adjustment (logprob_rows)
    sampled: torch.Tensor,  # [rows]
    num_top: np.ndarray,  # [rows] int: how many top logprobs each row wants (-1: none)
    scratch: cpu_sampling.Scratch | None = None,  # the C kernels' working rows
    sampling: SamplingMetadata | None = None,  # the step's: the GPU kernel has computed its logprobs already
    impl: str | None = None,  # the sampler's implementation (None: the one that takes raw.logits)
) -> LogprobTensors | None:
    """The chosen tokens' logprobs and ranks and each wanted row's top-k, on the device (no host sync)."""
    if raw is None:
        return None
    if sampling is not None and sampling.logprobs is not None:
        return LogprobTensors(num_top, sampling.logprobs.out)
    index = None
    if len(raw.wanted) < len(num_top):
        index = raw.wanted_index if raw.wanted_index is not None else to_device(raw.wanted, sampled.device)
    k_max = int(num_top[raw.wanted].max())
    raw_logits = raw.copies  # every wanted row (not on the C kernels' path), or the logits read in place
    if raw.copied is None and index is not None:  # the wanted rows of logits left in place
        raw_logits = raw.logits.index_select(0, index)
    chosen = sampled if index is None else sampled.index_select(0, index)
    impl = impl or impl_of(raw.logits)
    if impl == TRITON:  # one kernel
        from pagedllm.kernels.logprobs import logprobs

        return LogprobTensors(num_top, logprobs(raw_logits, chosen, k_max))
    if impl == C:  # one C call
        vocab = raw.logits.shape[1]
        chosen_lp, ranks, top_ids, top_lp = cpu_sampling.logprobs(
            raw.addresses(), vocab, chosen, k_max, scratch or cpu_sampling.Scratch()
        )  # fmt: skip
        return LogprobTensors(num_top, pack_logprobs(chosen, ranks, chosen_lp, top_ids, top_lp))
    chosen_logit = raw_logits.gather(1, chosen[:, None])
    if raw_logits.is_cuda:
        lse = raw_logits.logsumexp(dim=-1, keepdim=True)  # [wanted, 1]
        ranks = (raw_logits > chosen_logit).sum(dim=1) + 1  # 1 = the most likely token
        top_logits, top_ids = raw_logits.topk(k_max, dim=-1) if k_max else (raw_logits[:, :0], chosen[:, None][:, :0])
    else:  # torch's CPU topk over whole rows is several times slower than a max over their tiles
        maxima = tiles.tile_maxima(raw_logits)
        lse, ranks = _logsumexp_and_ranks(raw_logits, maxima.amax(dim=-1, keepdim=True), chosen_logit)
        top_logits, top_ids = tiles.topk(raw_logits, k_max, maxima)
    packed = pack_logprobs(chosen, ranks, (chosen_logit - lse).squeeze(1), top_ids, top_logits - lse)
    return LogprobTensors(num_top, packed)


def _logsumexp_and_ranks(x: torch.Tensor, top: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On the CPU: x.logsumexp(-1, keepdim=True) [rows, 1] given each row's max top [rows, 1], and the rank of chosen
    [rows, 1] in its row (1 + the count of larger values) [rows]. In blocks of rows through one small buffer (whole
    rows of temporaries would cost a page fault per 4 KiB each step; a block's second pass reads it from cache). The
    logsumexp as log(sum(2 ** ((x - max) * log2(e)))) + max: torch's CPU exp2 is several times faster than its exp;
    the count as floats: torch's comparison into floats is faster than into bools."""
    rows, vocab = x.shape
    block = max(1, min(rows, _BLOCK_BYTES // (4 * vocab)))
    buffer = torch.empty(block, vocab)  # float32 (counts exact below 2**24 whatever x's dtype)
    top = top.masked_fill(~torch.isfinite(top), 0.0)  # an infinite max: the sum is inf (or 0 for -inf) as it is
    sums, larger = torch.empty(rows, 1), torch.empty(rows)
    for start in range(0, rows, block):
        end = min(rows, start + block)
        b = buffer[: end - start]
        torch.sub(x[start:end], top[start:end], out=b).mul_(_LOG2E).exp2_()
        torch.sum(b, dim=-1, keepdim=True, out=sums[start:end])
        torch.sum(torch.gt(x[start:end], chosen[start:end], out=b), dim=-1, out=larger[start:end])
    return sums.log_().add_(top), larger.long() + 1


def sampled_logprobs(
    raw: LogprobRows | None,
    sampled: torch.Tensor,
    num_top: np.ndarray,
    scratch: cpu_sampling.Scratch | None = None,
    sampling: SamplingMetadata | None = None,
    impl: str | None = None,
) -> list[tuple[list[int], list[float], list[int]] | None]:
    """logprob_tensors read on the host at once: per row (token ids, logprobs, ranks) or None if not wanted."""
    tensors = logprob_tensors(raw, sampled, num_top, scratch, sampling, impl)
    return tensors.tolists() if tensors is not None else [None] * len(num_top)
