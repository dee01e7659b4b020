"""The sampler: greedy, temperature, min-p, top-k and top-p with per-request values, and per-request seeds.

Random choice uses the exponential-race form of sampling: argmax(probs / q) with q ~ Exp(1) drawn per row,
so a seeded request draws its q from its own generator and gets the same tokens whatever shares its batch."""

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


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [batch, vocab] float32 -> sampled token ids [batch] int64."""
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature < _EPS
        temp = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp[:, None]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        sampled = probs.div_(q).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)
