"""The sampler: greedy, temperature, min-p, top-k and top-p with per-request values, and per-request seeds.

Rows with top-k / top-p whose kept tokens lie among their CANDIDATES most likely ones are filtered and sampled
over those candidates only (no sort of the vocabulary); the others over the whole vocabulary. Rows with a seed
draw from their own generator, and every choice above depends on the row alone, so a seeded request gets the same
tokens whatever shares its batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = 1e-5


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [batch] float32
    all_greedy: bool
    top_k: torch.Tensor | None  # [batch] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [batch] float32; None when no row uses it
    min_p: torch.Tensor | None  # [batch] float32; None when no row uses it
    generators: dict[int, torch.Generator]  # batch row -> its seeded generator


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's k most likely tokens, then the smallest set whose probability reaches top_p."""
    if top_p is None and top_k is not None:
        k_max = int(top_k.max())
        kth = logits.topk(min(k_max, logits.shape[-1]), dim=-1).values  # [batch, k_max], descending
        k = torch.where(top_k > 0, top_k, k_max).clamp(max=kth.shape[-1])
        threshold = kth.gather(1, (k - 1)[:, None])
        threshold = torch.where(top_k[:, None] > 0, threshold, torch.full_like(threshold, float("-inf")))
        return logits.masked_fill(logits < threshold, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        threshold = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


CANDIDATES = 256  # top-k / top-p rows whose kept tokens lie among their 256 most likely sample from those alone


def _candidate_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Which rows' top-k / top-p sets lie inside their CANDIDATES most likely tokens, decided from each row alone
    (so a seeded row samples the same way whatever shares its batch).
    Returns (mask, top values, top ids, each row's logsumexp)."""
    k0 = min(CANDIDATES, logits.shape[1])
    vals, ids = logits.topk(k0, dim=-1)  # [rows, k0], descending
    lse = logits.logsumexp(dim=-1)  # [rows]
    mass = (vals - lse[:, None]).exp().sum(dim=-1)  # probability of the top k0
    by_k = (top_k > 0) & (top_k <= k0)
    by_p = (top_p < 1.0) & (mass >= top_p)
    return by_k | by_p, vals, ids, lse


def _filter_candidates(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, full_lse: torch.Tensor):
    """top-k then top-p over each row's sorted candidates (exactly as over the whole vocabulary)."""
    k0 = vals.shape[1]
    position = torch.arange(k0, device=vals.device)[None, :]
    k = torch.where(top_k > 0, top_k, k0)
    vals = vals.masked_fill(position >= k[:, None], float("-inf"))
    # probabilities: over the top-k set when top-k is on, else over the whole vocabulary
    lse = torch.where(top_k > 0, vals.logsumexp(dim=-1), full_lse)
    probs = (vals - lse[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    return vals.masked_fill((before >= top_p[:, None]) & (position > 0), float("-inf"))


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [batch, vocab] float32 -> sampled token ids [batch] int64."""
        out = logits.argmax(dim=-1)
        if meta.all_greedy:
            return out
        # rows that sample; a row left with no finite logit (every token banned) keeps its argmax
        rows = torch.nonzero((meta.temperature >= _EPS) & torch.isfinite(logits).any(dim=-1)).squeeze(1)
        # extreme penalties or temperatures can overflow: +inf becomes the largest float, NaN is dropped
        x = torch.nan_to_num(
            logits[rows] / meta.temperature[rows, None], nan=float("-inf"), posinf=torch.finfo(logits.dtype).max
        )
        if meta.min_p is not None:
            x = apply_min_p(x, meta.min_p[rows])
        top_k = meta.top_k[rows] if meta.top_k is not None else torch.zeros_like(rows)
        top_p = meta.top_p[rows] if meta.top_p is not None else torch.ones(len(rows), device=x.device)
        fast, vals, ids, lse = _candidate_rows(x, top_k, top_p)
        gens = {i: meta.generators[int(r)] for i, r in enumerate(rows.tolist()) if int(r) in meta.generators}
        fast_rows = torch.nonzero(fast).squeeze(1)
        if len(fast_rows):
            kept = _filter_candidates(vals[fast_rows], top_k[fast_rows], top_p[fast_rows], lse[fast_rows])
            picked = self._draw(kept.softmax(dim=-1), fast_rows, gens)
            out[rows[fast_rows]] = ids[fast_rows].gather(1, picked[:, None]).squeeze(1)
        slow_rows = torch.nonzero(~fast).squeeze(1)
        if len(slow_rows):
            xs = x[slow_rows]
            if bool(((top_k[slow_rows] > 0) | (top_p[slow_rows] < 1.0)).any()):
                xs = apply_top_k_top_p(xs, top_k[slow_rows], top_p[slow_rows])
            out[rows[slow_rows]] = self._draw(xs.softmax(dim=-1), slow_rows, gens)
        return out

    def _draw(self, probs: torch.Tensor, rows: torch.Tensor, gens: dict[int, torch.Generator]) -> torch.Tensor:
        """One token per row from probs [n, k]; rows with a seed draw from their own generator."""
        picked = torch.empty(len(rows), dtype=torch.int64, device=probs.device)
        seeded = [(j, gens[r]) for j, r in enumerate(rows.tolist()) if r in gens]
        plain = [j for j, r in enumerate(rows.tolist()) if r not in gens]
        if plain:
            index = torch.tensor(plain, device=probs.device)
            picked[index] = torch.multinomial(probs[index], 1, generator=self.generator).squeeze(1)
        for j, gen in seeded:
            picked[j] = torch.multinomial(probs[j : j + 1], 1, generator=gen)[0, 0]
        return picked
