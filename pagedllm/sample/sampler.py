"""The sampler: greedy, temperature, min-p, top-k and top-p with per-request values, and per-request seeds, in one
vectorized pass over the batch (no loop over requests, no sort of the vocabulary).

On the GPU one Triton kernel takes every row of the batch (pagedllm/kernels/sampling.py): the argmax, the
exponential race of a plain row (pagedllm/kernels/race.py; the engine's steps of plain rows alone race without this
kernel, sample/vocab_race.py), or an inverse-CDF draw over the row's per-lane softmax sums after min-p (a threshold),
top-k (over a list of candidates) and top-p (by rejection), with Philox numbers keyed per row; the logits are read in
place, no host sync.

On the CPU one C call takes every row (pagedllm/kernels/cpu_sampling.c), a row at a time per thread with its passes
in cache: the argmax, or an inverse-CDF draw after min-p, top-k (over candidates from the tiles with the largest
maxima) and top-p (by rejection: redrawn among the tokens more likely than a draw outside the nucleus).

Elsewhere (torch; also a CPU without a C compiler):
  - greedy and filtered rows start from the maxima of tiles of 64 logits (pagedllm/sample/tiles.py): on the CPU one
    pass of maxima is several times faster than torch's argmax or topk over the rows, and the rest reads a few tiles;
  - plain rows (temperature, optionally min-p; no top-k / top-p) are drawn by inverse CDF in two levels: a cumsum over
    the sums of fixed-size chunks of p picks the chunk, a cumsum inside it the token (no sequential pass over the
    whole row), in blocks of rows that stay in cache;
  - filtered rows become unnormalized probabilities p = exp(x - max x) (x = logits / temperature). min-p zeroes
    p < min_p. top-k / top-p become one threshold per row (keep p >= threshold): from the row's CANDIDATES (or top_k)
    largest p when the kept set lies among them (top-k rows always; top-p rows whose nucleus ends there), sampled
    over those candidates; otherwise (a flat distribution with a large nucleus) from a histogram over the float bits
    of p that narrows the cut to one bin, sorted exactly; sampled over the whole vocabulary. Only top-p rows without
    top-k need p of their whole row (the nucleus is a share of its mass).
An inverse-CDF row draws with one uniform number (a C top-p row's further rounds with numbers hashed from it), a GPU
row with one Philox key. A seeded row's number (key) is a hash of (seed, position): it depends on the request alone,
so a seeded request gets the same tokens whatever shares its batch, before and after preemption. Every path draws
exactly, but differently: the same seed gives different tokens on the GPU, in the C kernels and in torch."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from pagedllm.kernels import cpu_sampling, greedy_tokens
from pagedllm.sample import tiles
from pagedllm.sample.impl import TRITON, choose_impl
from pagedllm.sample.logits_processors import apply_penalties
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.resident_inputs import ResidentInputs

CANDIDATES = 256
_HIST_BINS = 2048
_ONE_BITS = 0x3F800000  # float32 1.0 as an int32
_BIN_SHIFT = 18  # 23 mantissa bits - 18 = 5: 32 histogram bins per power of two
_LOG2E = 1.4426950408889634  # exp(z) = 2 ** (z * log2(e))
_CHUNK = 1024  # tokens per chunk of the two-level inverse CDF
_BLOCK_BYTES = 8 << 20  # CPU plain rows: logits per block of rows, so that a block's passes hit the cache


def _nucleus(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor | None = None):
    """top-k, then top-p over each row's candidates: its largest p, descending [rows, k0] (a top-p row without top-k
    takes its nucleus's share of the whole row's mass, total [rows], where given; else of its candidates'). Returns
    (the candidates with dropped ones zeroed, whether the kept set lies among the candidates [rows])."""
    k0 = vals.shape[1]
    position = torch.arange(k0, device=vals.device)[None, :]
    by_k = top_k > 0
    vals = vals.masked_fill(position >= torch.where(by_k, top_k, k0)[:, None], 0.0)
    by_p = ~by_k & (top_p < 1.0)  # top-p over the whole (min-p filtered) row
    if total is None:
        total = vals.sum(dim=-1)
    else:
        total = torch.where(by_p, total, vals.sum(dim=-1))
    mass = total * top_p  # the mass the nucleus must reach
    mass = torch.where(top_p < 1.0, mass, float("inf"))  # top_p = 1: no cut (not even by rounding)
    cum = vals.cumsum(dim=-1)
    before = cum - vals  # mass of the more likely candidates
    vals = vals.masked_fill((before >= mass[:, None]) & (position > 0), 0.0)
    exact = by_k | (cum[:, -1] >= mass)
    return vals, exact


def _nucleus_threshold_by_histogram(p: torch.Tensor, top_p: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """The smallest p a top-p row keeps, for rows whose nucleus is too large for the candidates: a histogram over
    the float bits of p (32 bins per power of two, monotonic in p) narrows the cut to one bin, whose members are
    then sorted. p [rows, vocab] float32 in [0, 1]. [rows]"""
    rows = p.shape[0]
    bins = torch.neg(p.view(torch.int32), out=scratch.take(p.shape, torch.int32)).add_(_ONE_BITS)
    bins = bins.bitwise_right_shift_(_BIN_SHIFT).clamp_(0, _HIST_BINS - 1)  # [rows, vocab] bin 0: p near 1
    # the last bin gathers p < 2**-64 and p = 0; p a hair above 1: 0
    index = scratch.take(p.shape, torch.int64).copy_(bins)
    hist = torch.zeros(rows, _HIST_BINS, dtype=p.dtype, device=p.device).scatter_add_(1, index, p)
    cum = hist.cumsum(dim=-1)
    mass = (cum[:, -1] * top_p)[:, None]
    cut = torch.searchsorted(cum, mass).clamp_(max=_HIST_BINS - 1)  # [rows, 1]: the bin where the nucleus ends
    above = cum.gather(1, cut) - hist.gather(1, cut)  # mass of the more likely bins
    in_cut = scratch.take(p.shape, torch.bool)
    if p.is_cuda:
        torch.eq(bins, cut.int(), out=in_cut)
    else:  # numpy's comparison into bools is several times faster on the CPU
        np.equal(bins.numpy(), cut.int().numpy(), out=in_cut.numpy())
    members = tiles.pack(p, in_cut, 0.0)[0].sort(dim=-1, descending=True).values  # [rows, width]
    before = above + members.cumsum(dim=-1) - members
    kept = torch.minimum((before < mass).sum(dim=-1), (members > 0).sum(dim=-1))  # never a zeroed (min-p) member
    last = kept.clamp_(min=1)[:, None] - 1  # the last kept member
    return members.gather(1, last).squeeze(1)


def _search(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first index whose running sum exceeds target, kept below the total (so never a zero weight).
    cum [rows, n] non-decreasing, target [rows] >= 0 -> [rows]"""
    total = cum[:, -1]
    target = target.clamp(max=torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target[:, None], right=True).squeeze(1).clamp_(max=cum.shape[1] - 1)


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one index per row from non-negative weights [rows, n] with u [rows] in [0, 1).
    The weights become their running sums (in place)."""
    cum = weights.cumsum_(dim=-1)
    return _search(cum, u * cum[:, -1])


def _draw_two_level(p: torch.Tensor, u: torch.Tensor, chunk: int = _CHUNK) -> torch.Tensor:
    """_draw without its sequential cumsum over the whole row: a cumsum over the sums of the chunks picks the chunk
    where u's share of the mass falls, a cumsum inside that chunk the index. It sums in another order than _draw, so
    the two pick the same index except where u * total falls within rounding of a boundary.
    p [rows, num_chunks * chunk] non-negative (zero-padded), u [rows] in [0, 1) -> [rows]"""
    rows = p.shape[0]
    chunks = p.view(rows, -1, chunk)  # [rows, num_chunks, chunk]
    cum = chunks.sum(dim=-1).cumsum_(dim=-1)  # [rows, num_chunks]
    total = cum[:, -1]
    target = (u * total).clamp_(max=torch.nextafter(total, torch.zeros_like(total)))  # [rows]
    k = _search(cum, target)  # [rows] the chunk
    before = cum.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1).masked_fill_(k == 0, 0.0)  # earlier chunks
    inner = chunks.gather(1, k[:, None, None].expand(rows, 1, chunk)).squeeze(1)  # [rows, chunk]
    return k * chunk + _search(inner.cumsum_(dim=-1), target - before)


def _probabilities(x: torch.Tensor, inv_t: torch.Tensor, min_p: torch.Tensor | None, out: torch.Tensor, top=None):
    """out = exp(x / T - max(x / T)) [rows, n] (the largest 1), min-p filtered; x is only read unless it is out.
    inv_t, min_p [rows, 1]; top: x's row maxima [rows, 1] where known. Returns out and the rows with every token
    banned [rows, 1] bool (all 0 in out), or None where none can be (a CPU row whose max is finite). Computed as
    2 ** ((x - max) * log2(e) / T): torch's exp2 is several times faster than its exp on the CPU."""
    scale = inv_t * _LOG2E  # [rows, 1]
    top = x.amax(dim=-1, keepdim=True) if top is None else top
    # extreme penalties or temperatures can overflow: +inf becomes the largest float, NaN is dropped (on a GPU
    # always, rather than a sync to ask)
    if not x.is_cuda and bool(torch.isfinite(top * scale).all()):
        p, dead = torch.sub(x, top, out=out).mul_(scale), None  # (torch's addcmul is slower than the two on the CPU)
    else:
        x = torch.mul(x, scale, out=out)  # -inf stays -inf (nan_to_num's default would make it the lowest float)
        x = torch.nan_to_num_(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
        top = x.amax(dim=-1, keepdim=True)
        dead = torch.isinf(top)  # every token banned
        p = x.sub_(top.masked_fill_(dead, 0.0))
    p.exp2_()  # in out: no new buffer
    if min_p is not None:
        _drop_below(p, min_p)
    return p, dead


def _drop_below(p: torch.Tensor, bound: torch.Tensor) -> None:
    """p < bound becomes 0, in place (bound [rows, 1]). Long rows on the CPU one by one as torch's threshold (p <= the
    float below the bound), several times faster there than a masked fill (whose single call wins on short rows)."""
    if p.is_cuda or p.shape[1] < 1024:
        p.masked_fill_(p < bound, 0.0)
        return
    below = torch.nextafter(bound, torch.zeros_like(bound)).flatten().tolist()
    for row, b, under in zip(p, bound.flatten().tolist(), below):
        if b > 0:
            torch.nn.functional.threshold_(row, under, 0.0)


def _draw_plain(logits, rows, inv_t, min_p, u, scratch: _Scratch) -> torch.Tensor:
    """Inverse-CDF draws for rows without top-k / top-p, in blocks of rows (CPU: a few MiB, so that the max, exp and
    chunk-sum passes over a block hit the cache): p into a zero-padded scratch, then the two-level draw.
    logits [batch, vocab] (read only), rows [n] sorted batch rows, inv_t [n, 1], min_p [n, 1] or None, u [n] -> [n]"""
    n, vocab = len(rows), logits.shape[1]
    block = n if logits.is_cuda else max(1, min(n, _BLOCK_BYTES // (logits.element_size() * vocab)))
    padded = -(-vocab // _CHUNK) * _CHUNK
    ps = scratch.take((block, padded))
    ps[:, vocab:] = 0.0  # the padding of the last chunk weighs nothing
    xs = None if n == logits.shape[0] else scratch.take((block, vocab), logits.dtype)  # all rows: views, no copy
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    for start in range(0, n, block):
        end = min(n, start + block)
        x = logits[start:end] if xs is None else torch.index_select(logits, 0, rows[start:end], out=xs[: end - start])
        p = ps[: end - start]  # [b, padded]
        _, dead = _probabilities(x, inv_t[start:end], None if min_p is None else min_p[start:end], p[:, :vocab])
        tokens = _draw_two_level(p, u[start:end], _CHUNK).clamp_(max=vocab - 1)
        out[start:end] = tokens if dead is None else tokens.masked_fill_(dead.squeeze(1), 0)  # banned rows: token 0
    return out


class Sampler:
    """The sampling rules over a batch of logits, in the implementation chosen when it is built (impl.py)."""

    def __init__(self, device: torch.device, seed: int, impl: str | None = None) -> None:
        self.impl = impl or choose_impl(device)
        self.on_cuda = torch.device(device).type == "cuda"  # the torch path's choices of ops
        # for requests without a seed: the torch path's uniforms, the GPU kernel's key of each step
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.keys = random.Random(seed)  # the GPU kernel's key of each step (a few times faster to draw than rng's)
        self.scratch = _Scratch(device)  # the torch path's large temporaries
        self.c_scratch = cpu_sampling.Scratch()  # the C kernels' working rows (also lent to the logprobs)
        self.kernel_memory = None  # the GPU kernel's working memory (sampling.Memory), made at its first launch
        # the GPU kernel's inputs kept on the device from step to step (the engine's steps build them there)
        self.resident = ResidentInputs(device) if self.impl == TRITON else None

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, logprob_copies: torch.Tensor | None = None
    ) -> torch.Tensor:
        """logits [batch, vocab] -> sampled token ids [batch] int64. float32; the model's dtype also works on the
        GPU or when every row is greedy (the argmax and the GPU kernel read it exactly as float32). The penalties
        change the penalized rows in place, except in the GPU kernel (it samples from penalized copies). The GPU
        kernel also writes the logprobs of meta.logprobs, read from logprob_copies (the wanted rows, in order, as
        they were before anything changed them) or else from logits."""
        if meta.penalties is not None:
            apply_penalties(logits, *meta.penalties, self.c_scratch, impl=self.impl)
        if meta.params is not None:  # CPU: every row in one C call
            if meta.all_greedy and logits.dtype == torch.bfloat16:  # no float32 copy of them
                return cpu_sampling.argmax_bf16(logits)
            u = self.rng.random(len(logits), dtype=np.float32)
            if meta.seed_uniforms is not None:
                seeded = meta.seed_uniforms.numpy()
                u = np.where(seeded >= 0, seeded, u)
            return cpu_sampling.sample(logits.float(), meta.params, u, self.c_scratch)
        if meta.all_greedy:
            return greedy_tokens(logits) if self.on_cuda else tiles.argmax(logits, tiles.tile_maxima(logits))
        if meta.device_inputs is not None:  # GPU: every row in one kernel
            from pagedllm.kernels.sampling import Logprobs, Memory, sample

            lp, copied = meta.logprobs, logprob_copies is not None
            if lp is not None:
                lp = Logprobs(logprob_copies if copied else logits, lp.out, lp.k_max, copied)
            if self.kernel_memory is None:
                self.kernel_memory = Memory()
            key = self.keys.getrandbits(62)
            return sample(logits, meta.device_inputs, key, lp, memory=self.kernel_memory, out=meta.sampled)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy, filtered = meta.greedy_rows, meta.filtered
        # their rows start from the maxima of tiles (tiles.py): one pass over the whole batch where they are most
        # of it, else over copies of their rows
        every = tiles.tile_maxima(logits) if 2 * (len(greedy) + len(filtered)) >= len(out) else None

        def maxima(rows: torch.Tensor) -> torch.Tensor:
            return tiles.tile_maxima(logits.index_select(0, rows)) if every is None else every[rows]

        if len(greedy):
            out[greedy] = tiles.argmax(logits, maxima(greedy), greedy)
        u = self._uniforms(meta)  # [num_sample]
        self.scratch.reset()
        if len(meta.plain):
            rows, inv_t, min_p, u_plain = _take(meta, meta.plain, u)
            out[rows] = _draw_plain(logits, rows, inv_t, min_p, u_plain, self.scratch)
        if len(filtered):
            rows, inv_t, min_p, u_filtered = _take(meta, filtered, u)
            out[rows] = _draw_filtered(logits, rows, maxima(rows), inv_t, min_p, u_filtered, meta, self.scratch)
        return out

    def _uniforms(self, meta: SamplingMetadata) -> torch.Tensor:
        """[num_sample] in [0, 1): from the engine's generator, or from (seed, position) for seeded requests."""
        u = torch.rand(len(meta.sample_rows), generator=self.generator, device=meta.sample_rows.device)
        if meta.seeded is not None:
            u = torch.where(meta.seeded, meta.seed_uniforms, u)
        return u


def _take(meta: SamplingMetadata, index: torch.Tensor, u: torch.Tensor):
    """The batch rows, 1 / temperature [n, 1], min-p [n, 1] (or None) and uniforms [n] of the sampled rows at index
    (positions in sample_rows); no gather where index is all of them."""
    every = len(index) == len(meta.sample_rows)
    pick = (lambda t: t) if every else (lambda t: t[index])  # noqa: E731
    min_p = None if meta.min_p is None else pick(meta.min_p)[:, None]
    return pick(meta.sample_rows), 1.0 / pick(meta.temperature)[:, None], min_p, pick(u)


def _draw_filtered(logits, rows, maxima, inv_t, min_p, u, meta: SamplingMetadata, scratch: _Scratch) -> torch.Tensor:
    """Draws from rows with top-k / top-p over their largest p (the candidates: CANDIDATES, or top_k), or over the
    whole row where top-p's nucleus is wider. The candidates are read from the tiles with the largest maxima
    (pagedllm/sample/tiles.py); only rows with top-p alone need p of the whole row (the nucleus is a share of its
    mass). Where some row's max is not finite (NaN, inf, or x / T overflowing), every row takes p of the whole row,
    sanitized. logits [batch, vocab] (read only), rows [n] batch rows, maxima tile_maxima(logits[rows]), inv_t,
    min_p [n, 1] or None, u [n] -> [n]"""
    k0 = min(logits.shape[1], max(CANDIDATES, meta.max_top_k))
    if not bool(torch.isfinite(maxima.amax(dim=-1, keepdim=True) * (inv_t * _LOG2E)).all()):  # as _probabilities
        x = torch.index_select(logits, 0, rows, out=scratch.take((len(rows), logits.shape[1])))
        p, dead = _probabilities(x, inv_t, min_p, out=x)
        vals, ids = tiles.topk(p, k0, tiles.tile_maxima(p))
        tokens = _draw_nucleus(vals, ids, meta.top_k, meta.top_p, u, scratch, p)
        return tokens if dead is None else tokens.masked_fill_(dead.squeeze(1), 0)  # banned rows: token 0
    out = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    pick = lambda t, at: None if t is None else t[at]  # noqa: E731
    for top_p_alone in (False, True):
        at = torch.nonzero((meta.top_k == 0) == top_p_alone).squeeze(1)
        if not len(at):
            continue
        x, ids = tiles.topk(logits, k0 if top_p_alone else min(logits.shape[1], meta.max_top_k), maxima[at], rows[at])
        vals, _ = _probabilities(x, inv_t[at], pick(min_p, at), out=x)  # their max is the row's
        p = None
        if top_p_alone:
            x = torch.index_select(logits, 0, rows[at], out=scratch.take((len(at), logits.shape[1])))
            p, _ = _probabilities(x, inv_t[at], pick(min_p, at), out=x, top=maxima[at].amax(dim=-1, keepdim=True))
        out[at] = _draw_nucleus(vals, ids, meta.top_k[at], meta.top_p[at], u[at], scratch, p)
    return out


def _draw_nucleus(vals, ids, top_k, top_p, u, scratch: _Scratch, p: torch.Tensor | None = None) -> torch.Tensor:
    """Draws over the candidates (their p [rows, k0] descending, ids [rows, k0]) after top-k and top-p; given p of
    the whole rows [rows, vocab], top-p rows without top-k take their nucleus's share of the whole row's mass, and
    those whose nucleus is wider than the candidates draw over the whole row, cut where a histogram finds. [rows]"""
    vals, exact = _nucleus(vals, top_k, top_p, None if p is None else p.sum(dim=-1))
    picked = ids.gather(1, _draw(vals, u)[:, None]).squeeze(1)
    if p is None:
        return picked
    wide = torch.nonzero(~exact).squeeze(1)
    if len(wide):
        pw = torch.index_select(p, 0, wide, out=scratch.take((len(wide), p.shape[1])))
        _drop_below(pw, _nucleus_threshold_by_histogram(pw, top_p[wide], scratch)[:, None])
        picked[wide] = _draw(pw, u[wide])
    return picked


class _Scratch:
    """The torch path's large temporaries, in memory kept from step to step: fresh memory costs a page fault per
    4 KiB, which on the CPU costs more than a pass over it. take() hands out views of one buffer in turn, free again
    at the next reset(); the buffer grows to the most that a step took (until then, take() allocates)."""

    def __init__(self, device: torch.device | str) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.used = self.peak = 0

    def reset(self) -> None:
        if self.peak > len(self.buffer):  # with room for a step that takes a little more
            self.buffer = torch.empty(self.peak * 5 // 4, dtype=torch.uint8, device=self.buffer.device)
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        start = -(-self.used // 64) * 64  # aligned for any dtype (and a cache line)
        self.used = start + math.prod(shape) * dtype.itemsize
        self.peak = max(self.peak, self.used)
        if self.used > len(self.buffer):
            return torch.empty(shape, dtype=dtype, device=self.buffer.device)
        return self.buffer[start : self.used].view(dtype).view(shape)
