"""The sampler: greedy, temperature, min-p, top-k and top-p with per-request values, and per-request seeds, in one
vectorized pass over the batch (no loop over requests, no sort of the vocabulary).

Plain rows (temperature, optionally min-p; no top-k / top-p) are the common case:
  - on the GPU one Triton kernel draws them all by the exponential race (Gumbel-max) over the logits in place, with
    Philox numbers keyed per row (pagedllm/kernels/sampling.py), without a host sync;
  - elsewhere by inverse CDF in two levels: a cumsum over the sums of fixed-size chunks of p picks the chunk, a cumsum
    inside it the token (no sequential pass over the whole row), in blocks of rows that stay in cache.
Both are exact draws, but different ones: the same seed gives different tokens on the GPU and on the CPU.

Filtered rows become unnormalized probabilities p = exp(x - max x) (x = logits / temperature). min-p zeroes
p < min_p. top-k / top-p become one threshold per row (keep p >= threshold):
  - from the row's CANDIDATES (or top_k) largest p when the kept set lies among them (top-k rows always; top-p rows
    whose nucleus ends there), sampled over those candidates;
  - otherwise (a flat distribution with a large nucleus) from a histogram over the float bits of p that narrows the cut
    to one bin, sorted exactly; sampled over the whole vocabulary.
An inverse-CDF row draws with one uniform number, a GPU plain row with one Philox key. A seeded row's number (key) is
a hash of (seed, position): it depends on the request alone, so a seeded request gets the same tokens whatever shares
its batch, before and after preemption."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import to_device
from pagedllm.kernels import use_triton

_EPS = 1e-5
CANDIDATES = 256
_HIST_BINS = 2048
_ONE_BITS = 0x3F800000  # float32 1.0 as an int32
_BIN_SHIFT = 18  # 23 mantissa bits - 18 = 5: 32 histogram bins per power of two
_LOG2E = 1.4426950408889634  # exp(z) = 2 ** (z * log2(e))
_CHUNK = 1024  # tokens per chunk of the two-level inverse CDF
_BLOCK_BYTES = 8 << 20  # CPU plain rows: logits per block of rows, so that a block's passes hit the cache


@dataclass
class SamplingMetadata:
    """The sampler's inputs for one step. Which rows sample and which filter is decided on the host, so the
    sampler needs no device sync for it. Build it with `SamplingMetadata.build`."""

    all_greedy: bool
    greedy_rows: torch.Tensor  # [num_greedy] int64: batch rows that take the argmax
    sample_rows: torch.Tensor  # [num_sample] int64: batch rows that sample
    plain: torch.Tensor  # [num_plain] int64: positions in sample_rows without top-k / top-p
    filtered: torch.Tensor  # [num_filtered] int64: positions in sample_rows with top-k or top-p
    temperature: torch.Tensor  # [num_sample] float32
    top_k: torch.Tensor  # [num_filtered] int64, 0 = off
    top_p: torch.Tensor  # [num_filtered] float32, 1 = off
    max_top_k: int
    any_top_p_only: bool  # some filtered row has top-p without top-k (its nucleus is over the whole row)
    min_p: torch.Tensor | None  # [num_sample] float32; None when no row uses it
    seeded: torch.Tensor | None  # [num_sample] bool; None when no row has a seed
    seed_uniforms: torch.Tensor | None  # [num_sample] float32: seeded_uniform of (seed, position) where seeded
    seed_keys: torch.Tensor | None  # [num_sample] int64: seeded_key of (seed, position) where seeded

    @classmethod
    def build(
        cls,
        temperature: np.ndarray,  # [batch] float32
        top_k: np.ndarray,  # [batch] int64, 0 = off
        top_p: np.ndarray,  # [batch] float32, 1 = off
        min_p: np.ndarray,  # [batch] float32, 0 = off
        seeds: np.ndarray | None = None,  # [batch] int64
        seeded: np.ndarray | None = None,  # [batch] bool
        positions: np.ndarray | None = None,  # [batch] int64: tokens each request has generated (the draw's counter)
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        sampling = temperature >= _EPS
        rows = np.nonzero(sampling)[0]
        k, p = top_k[rows], top_p[rows]
        is_filtered = (k > 0) | (p < 1.0)
        filtered = np.nonzero(is_filtered)[0]
        any_seed = seeded is not None and bool(seeded[rows].any())
        any_min_p = bool((min_p[rows] > 0).any())
        if any_seed:  # hashed here, on the host: a few small numpy ops instead of dozens of device kernels
            seeds, positions = seeds[rows].astype(np.int64), positions[rows].astype(np.int64)
        hashed = lambda fn: fn(seeds, positions) if any_seed else None  # noqa: E731
        ints = {"greedy_rows": np.nonzero(~sampling)[0], "sample_rows": rows, "plain": np.nonzero(~is_filtered)[0]}
        ints |= {"filtered": filtered, "top_k": k[filtered], "seeded": seeded[rows] if any_seed else None}
        ints["seed_keys"] = hashed(seeded_key)
        floats = {"temperature": temperature[rows], "top_p": p[filtered], "min_p": min_p[rows] if any_min_p else None}
        floats["seed_uniforms"] = hashed(seeded_uniform)
        tensors = _to_device_packed(ints, np.int64, device) | _to_device_packed(floats, np.float32, device)
        tensors["seeded"] = None if tensors["seeded"] is None else tensors["seeded"].bool()
        return cls(
            all_greedy=not bool(sampling.any()),
            max_top_k=int(k[filtered].max()) if len(filtered) else 0,
            any_top_p_only=bool(((k[filtered] == 0) & (p[filtered] < 1.0)).any()),
            **tensors,
        )


def _to_device_packed(arrays: dict[str, np.ndarray | None], dtype, device) -> dict[str, torch.Tensor | None]:
    """The arrays (as dtype) in one host-to-device copy, through pinned memory on CUDA (no wait for the device's
    queue), as views of it; None stays None. One copy instead of one per array: each costs host time."""
    kept = {name: a for name, a in arrays.items() if a is not None}
    whole = to_device(np.concatenate([a.astype(dtype, copy=False) for a in kept.values()]), torch.device(device))
    out: dict[str, torch.Tensor | None] = dict.fromkeys(arrays)
    start = 0
    for name, a in kept.items():
        out[name] = whole[start : start + len(a)]
        start += len(a)
    return out


def _hash32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer mix (int64 arrays holding values < 2**32; every product stays below 2**63)."""
    mask = 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    return (x >> 16) ^ x


def _seeded_bits(seeds: np.ndarray, positions: np.ndarray, salt: int) -> np.ndarray:
    """32 random bits per (seed, position), one stream per salt. [rows] int64 in [0, 2**32)"""
    lo, hi = seeds & 0xFFFFFFFF, (seeds >> 32) & 0xFFFFFFFF
    key = _hash32(lo ^ _hash32(hi + 0x9E3779B9))
    return _hash32(key ^ _hash32((positions & 0xFFFFFFFF) + salt))


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per (seed, position) (int64 arrays), whatever else is in the batch. [rows] float32"""
    return ((_seeded_bits(seeds, positions, 0x7F4A7C15) >> 8) * (1.0 / (1 << 24))).astype(np.float32)


def seeded_key(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A 63-bit Philox key per (seed, position) for the GPU's plain rows, whatever else is in the batch. [rows] int64"""
    hi = _seeded_bits(seeds, positions, 0x2545F491) & 0x7FFFFFFF
    return (hi << 32) | _seeded_bits(seeds, positions, 0x7F4A7C15)


def _nucleus_by_candidates(p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int, whole: bool):
    """top-k, then top-p over each row's largest p (top-p over the whole row's mass needs `whole`). Returns
    (candidate p with dropped ones zeroed [rows, k0], candidate ids [rows, k0], whether the kept set lies among the
    candidates [rows])."""
    k0 = min(p.shape[1], max(CANDIDATES, max_top_k))
    vals, ids = p.topk(k0, dim=-1)  # [rows, k0], descending
    position = torch.arange(k0, device=p.device)[None, :]
    by_k = top_k > 0
    vals = vals.masked_fill(position >= torch.where(by_k, top_k, k0)[:, None], 0.0)
    by_p = ~by_k & (top_p < 1.0)  # top-p over the whole (min-p filtered) row
    total = vals.sum(dim=-1)
    if whole:  # some row's top-p is over the whole row
        total = torch.where(by_p, p.sum(dim=-1), total)
    mass = total * top_p  # the mass the nucleus must reach
    mass = torch.where(top_p < 1.0, mass, float("inf"))  # top_p = 1: no cut (not even by rounding)
    cum = vals.cumsum(dim=-1)
    before = cum - vals  # mass of the more likely candidates
    vals = vals.masked_fill((before >= mass[:, None]) & (position > 0), 0.0)
    exact = by_k | (cum[:, -1] >= mass)
    return vals, ids, exact


def _nucleus_threshold_by_histogram(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest p a top-p row keeps, for rows whose nucleus is too large for the candidates: a histogram over
    the float bits of p (32 bins per power of two, monotonic in p) narrows the cut to one bin, whose members are
    then sorted. p [rows, vocab] float32 in [0, 1]. [rows]"""
    rows = p.shape[0]
    bins = (_ONE_BITS - p.view(torch.int32)).bitwise_right_shift_(_BIN_SHIFT)  # [rows, vocab] bin 0: p near 1
    bins = bins.clamp_(0, _HIST_BINS - 1).long()  # the last bin gathers p < 2**-64 and p = 0; p a hair above 1: 0
    hist = torch.zeros(rows, _HIST_BINS, dtype=p.dtype, device=p.device).scatter_add_(1, bins, p)
    cum = hist.cumsum(dim=-1)
    mass = (cum[:, -1] * top_p)[:, None]
    cut = torch.searchsorted(cum, mass).clamp_(max=_HIST_BINS - 1)  # [rows, 1]: the bin where the nucleus ends
    above = cum.gather(1, cut) - hist.gather(1, cut)  # mass of the more likely bins
    in_cut = bins == cut
    width = int(in_cut.sum(dim=-1).max())
    members = p.where(in_cut, 0.0).topk(max(width, 1), dim=-1).values  # [rows, width] descending
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


def _probabilities(x: torch.Tensor, inv_t: torch.Tensor, min_p: torch.Tensor | None, out: torch.Tensor):
    """out = exp(x / T - max(x / T)) [rows, n] (the largest 1), min-p filtered; x is only read unless it is out.
    inv_t, min_p [rows, 1]. Returns out and the rows with every token banned [rows, 1] bool (all 0 in out), or None
    where none can be (a CPU row whose max is finite). Computed as 2 ** ((x - max) * log2(e) / T): torch's exp2 is
    several times faster than its exp on the CPU."""
    scale = inv_t * _LOG2E  # [rows, 1]
    top = x.amax(dim=-1, keepdim=True)
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
        p.masked_fill_(p < min_p, 0.0)
    return p, dead


def _draw_plain(logits, rows, inv_t, min_p, u) -> torch.Tensor:
    """Inverse-CDF draws for rows without top-k / top-p, in blocks of rows (CPU: a few MiB, so that the max, exp and
    chunk-sum passes over a block hit the cache): p into a zero-padded scratch, then the two-level draw.
    logits [batch, vocab] (read only), rows [n] sorted batch rows, inv_t [n, 1], min_p [n, 1] or None, u [n] -> [n]"""
    n, vocab = len(rows), logits.shape[1]
    block = n if logits.is_cuda else max(1, min(n, _BLOCK_BYTES // (logits.element_size() * vocab)))
    padded = -(-vocab // _CHUNK) * _CHUNK
    scratch = torch.empty(block, padded, dtype=torch.float32, device=logits.device)  # [block, padded]
    scratch[:, vocab:] = 0.0  # the padding of the last chunk weighs nothing
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    for start in range(0, n, block):
        end = min(n, start + block)
        x = logits[start:end] if n == logits.shape[0] else logits[rows[start:end]]  # all rows: a view, no copy
        p = scratch[: end - start]  # [b, padded]
        _, dead = _probabilities(x, inv_t[start:end], None if min_p is None else min_p[start:end], p[:, :vocab])
        tokens = _draw_two_level(p, u[start:end], _CHUNK).clamp_(max=vocab - 1)
        out[start:end] = tokens if dead is None else tokens.masked_fill_(dead.squeeze(1), 0)  # banned rows: token 0
    return out


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [batch, vocab] (only read) -> sampled token ids [batch] int64. float32; the model's dtype also
        works when every row is greedy or plain (the argmax and the GPU kernel read it exactly as float32)."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if len(meta.greedy_rows):
            out[meta.greedy_rows] = logits[meta.greedy_rows].argmax(dim=-1)
        race = use_triton(logits)  # GPU: the plain rows in one kernel
        u = self._uniforms(meta) if len(meta.filtered) or not race else None  # [num_sample]
        if len(meta.plain) and race:
            from pagedllm.kernels.sampling import sample_plain

            sample_plain(logits, meta.sample_rows, meta.plain, meta.temperature, self._keys(meta), meta.min_p, out)
        elif len(meta.plain):
            rows, inv_t, min_p, u_plain = _take(meta, meta.plain, u)
            out[rows] = _draw_plain(logits, rows, inv_t, min_p, u_plain)
        if len(meta.filtered):
            rows, inv_t, min_p, u_filtered = _take(meta, meta.filtered, u)
            x = logits[rows]  # [num_filtered, vocab] a copy, changed in place
            p, dead = _probabilities(x, inv_t, min_p, out=x)
            tokens = _draw_filtered(p, u_filtered, meta)
            out[rows] = tokens if dead is None else tokens.masked_fill_(dead.squeeze(1), 0)  # banned rows: token 0
        return out

    def _uniforms(self, meta: SamplingMetadata) -> torch.Tensor:
        """[num_sample] in [0, 1): from the engine's generator, or from (seed, position) for seeded requests."""
        u = torch.rand(len(meta.sample_rows), generator=self.generator, device=meta.sample_rows.device)
        if meta.seeded is not None:
            u = torch.where(meta.seeded, meta.seed_uniforms, u)
        return u

    def _keys(self, meta: SamplingMetadata) -> torch.Tensor:
        """[num_sample] int64 Philox keys for the GPU's plain rows: from the engine's generator (one call a step), or
        from (seed, position) for seeded requests."""
        n, device = len(meta.sample_rows), meta.sample_rows.device
        keys = torch.randint(1 << 62, (n,), generator=self.generator, device=device)
        if meta.seeded is not None:
            keys = torch.where(meta.seeded, meta.seed_keys, keys)
        return keys


def _take(meta: SamplingMetadata, index: torch.Tensor, u: torch.Tensor):
    """The batch rows, 1 / temperature [n, 1], min-p [n, 1] (or None) and uniforms [n] of the sampled rows at index
    (positions in sample_rows); no gather where index is all of them."""
    every = len(index) == len(meta.sample_rows)
    pick = (lambda t: t) if every else (lambda t: t[index])  # noqa: E731
    min_p = None if meta.min_p is None else pick(meta.min_p)[:, None]
    return pick(meta.sample_rows), 1.0 / pick(meta.temperature)[:, None], min_p, pick(u)


def _draw_filtered(p: torch.Tensor, u: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Draws from rows with top-k / top-p: over their candidates, or (a wide nucleus) over the whole row."""
    vals, ids, exact = _nucleus_by_candidates(p, meta.top_k, meta.top_p, meta.max_top_k, meta.any_top_p_only)
    picked = ids.gather(1, _draw(vals, u)[:, None]).squeeze(1)
    if not meta.any_top_p_only:
        return picked
    wide = torch.nonzero(~exact).squeeze(1)
    if len(wide):
        pw = p[wide]
        threshold = _nucleus_threshold_by_histogram(pw, meta.top_p[wide])
        picked[wide] = _draw(pw.masked_fill_(pw < threshold[:, None], 0.0), u[wide])
    return picked
