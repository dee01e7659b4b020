"""The sampler: greedy, temperature, min-p, top-k and top-p with per-request values, and per-request seeds, in one
vectorized pass over the batch (no loop over requests, no sort of the vocabulary).

Each sampled row becomes unnormalized probabilities p = exp(x - max x) (x = logits / temperature). min-p zeroes
p < min_p. top-k / top-p become one threshold per row (keep p >= threshold):
  - from the row's CANDIDATES (or top_k) largest p when the kept set lies among them (top-k rows always; top-p rows
    whose nucleus ends there), sampled over those candidates;
  - otherwise (a flat distribution with a large nucleus) from a histogram over the float bits of p that narrows the cut
    to one bin, sorted exactly; sampled over the whole vocabulary.
A row draws by inverse CDF with one uniform number. A seeded row's number is a hash of (seed, position): it depends
on the request alone, so a seeded request gets the same tokens whatever shares its batch, before and after
preemption."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_EPS = 1e-5
CANDIDATES = 256
_HIST_BINS = 2048
_ONE_BITS = 0x3F800000  # float32 1.0 as an int32
_BIN_SHIFT = 18  # 23 mantissa bits - 18 = 5: 32 histogram bins per power of two


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
    seeds: torch.Tensor | None  # [num_sample] int64 (any value where not seeded); None when no row has a seed
    seeded: torch.Tensor | None  # [num_sample] bool
    positions: torch.Tensor | None  # [num_sample] int64: tokens the request has generated (the draw's counter)

    @classmethod
    def build(
        cls,
        temperature: np.ndarray,  # [batch] float32
        top_k: np.ndarray,  # [batch] int64, 0 = off
        top_p: np.ndarray,  # [batch] float32, 1 = off
        min_p: np.ndarray,  # [batch] float32, 0 = off
        seeds: np.ndarray | None = None,  # [batch] int64
        seeded: np.ndarray | None = None,  # [batch] bool
        positions: np.ndarray | None = None,  # [batch] int64
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        sampling = temperature >= _EPS
        rows = np.nonzero(sampling)[0]
        k, p = top_k[rows], top_p[rows]
        is_filtered = (k > 0) | (p < 1.0)
        filtered = np.nonzero(is_filtered)[0]
        any_seed = seeded is not None and bool(seeded[rows].any())
        return cls(
            all_greedy=not bool(sampling.any()),
            greedy_rows=dev(np.nonzero(~sampling)[0]),
            sample_rows=dev(rows),
            plain=dev(np.nonzero(~is_filtered)[0]),
            filtered=dev(filtered),
            temperature=dev(temperature[rows].astype(np.float32)),
            top_k=dev(k[filtered].astype(np.int64)),
            top_p=dev(p[filtered].astype(np.float32)),
            max_top_k=int(k[filtered].max()) if len(filtered) else 0,
            any_top_p_only=bool(((k[filtered] == 0) & (p[filtered] < 1.0)).any()),
            min_p=dev(min_p[rows].astype(np.float32)) if bool((min_p[rows] > 0).any()) else None,
            seeds=dev(seeds[rows].astype(np.int64)) if any_seed else None,
            seeded=dev(seeded[rows]) if any_seed else None,
            positions=dev(positions[rows].astype(np.int64)) if any_seed else None,
        )


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (int64 tensors holding values < 2**32; every product stays below 2**63)."""
    mask = 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    return (x >> 16) ^ x


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One number in [0, 1) per (seed, position), the same on any device and in any batch. [rows] float32"""
    lo, hi = seeds & 0xFFFFFFFF, (seeds >> 32) & 0xFFFFFFFF
    key = _hash32(lo ^ _hash32(hi + 0x9E3779B9))
    bits = _hash32(key ^ _hash32((positions & 0xFFFFFFFF) + 0x7F4A7C15))
    return (bits >> 8).float() * (1.0 / (1 << 24))


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


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one index per row from non-negative weights [rows, n] with u [rows] in [0, 1).
    The weights become their running sums (in place)."""
    cum = weights.cumsum_(dim=-1)
    target = (u * cum[:, -1]).clamp_(max=torch.nextafter(cum[:, -1], torch.zeros_like(cum[:, -1])))
    return torch.searchsorted(cum, target[:, None], right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [batch, vocab] float32 -> sampled token ids [batch] int64."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if len(meta.greedy_rows):
            out[meta.greedy_rows] = logits[meta.greedy_rows].argmax(dim=-1)
        out[meta.sample_rows] = self._sample(logits[meta.sample_rows], meta)
        return out

    def _sample(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """x [num_sample, vocab] (a copy, changed in place) -> token ids [num_sample]."""
        inv_t = 1.0 / meta.temperature[:, None]
        top = x.amax(dim=-1, keepdim=True)  # the temperature (> 0) keeps the argmax
        dead = None
        # extreme penalties or temperatures can overflow: +inf becomes the largest float, NaN is dropped (on a GPU
        # always, rather than a sync to ask)
        if x.is_cuda or not bool(torch.isfinite(top * inv_t).all()):
            x = torch.nan_to_num_(x.mul_(inv_t), nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
            inv_t = torch.ones_like(inv_t)
            top = x.amax(dim=-1, keepdim=True)
            dead = torch.isinf(top)  # every token banned
            top = top.masked_fill(dead, 0.0)
        # exp((x - max) / T): unnormalized probabilities, the largest is 1 [num_sample, vocab]
        p = torch.addcmul(-top * inv_t, x, inv_t, out=x).exp_()  # in place: no new [num_sample, vocab] buffer
        if meta.min_p is not None:
            p.masked_fill_(p < meta.min_p[:, None], 0.0)
        u = self._uniforms(meta)
        if not len(meta.filtered):
            out = _draw(p, u)
        else:
            out = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
            if len(meta.plain):
                out[meta.plain] = _draw(p[meta.plain], u[meta.plain])
            pf = p if len(meta.filtered) == p.shape[0] else p[meta.filtered]
            out[meta.filtered] = _draw_filtered(pf, u[meta.filtered], meta)
        if dead is not None:  # a row with every token banned takes token 0, as the argmax of its logits does
            out.masked_fill_(dead.squeeze(1), 0)
        return out

    def _uniforms(self, meta: SamplingMetadata) -> torch.Tensor:
        """[num_sample] in [0, 1): from the engine's generator, or from (seed, position) for seeded requests."""
        u = torch.rand(len(meta.sample_rows), generator=self.generator, device=meta.sample_rows.device)
        if meta.seeded is not None:
            u = torch.where(meta.seeded, seeded_uniform(meta.seeds, meta.positions), u)
        return u


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
