"""Bidirectional attention among the placeholder tokens of one image during prefill (Gemma 3, as transformers'
token_type_ids mask): a full-attention layer lets a query attend causally OR to any token of its own image; a
sliding-window layer does the same within the window (key > query - window). Text tokens and decodes are causal.

The paged attention kernels are causal only. So such a layer first runs its backend as usual (which also writes the
step's K/V into the cache), then recomputes the rows of the step's image tokens on torch ops over keys read back
from the cache: a query at position p of an image that ends at position e attends the keys [0, e), within the window
when the layer has one. The scheduler never ends a prefill chunk inside such an image (MultiModalFeature.bidirectional),
so all of its keys are in the cache by then; a prefix-cache hit may end inside one, its cached tokens' K/V having
been computed with the whole image (the image's hash is in those blocks' keys)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.layers.attention import FP8_KV_DTYPES, Attention
from pagedllm.layers.rotary_embedding import apply_qk_rotary
from pagedllm.multimodal.inputs import MultiModalFeature


@dataclass
class ImageSpan:
    """The query tokens of one image in one step."""

    row_start: int  # the flat batch's row of the first one
    positions: torch.Tensor  # [n] their positions, consecutive; the last is the image's last placeholder
    key_slots: torch.Tensor  # [end] cache slots of the request's positions [0, end), end = the image's end


def step_spans(
    features: list[MultiModalFeature], row_start: int, start: int, end: int, block_table: np.ndarray, block_size: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(row, positions, key slots) of each bidirectional item among one request's `features` whose tokens this step
    computes: positions [start, end), from the flat batch's row `row_start`; block_table [max_blocks] its blocks."""
    out = []
    for f in features:
        lo, hi = max(start, f.offset), f.end
        if not f.bidirectional or lo >= min(end, hi):
            continue
        if hi > end:
            raise RuntimeError(f"a prefill chunk ends at {end}, inside an image at [{f.offset}, {f.end})")
        keys = np.arange(hi)
        slots = block_table[keys // block_size] * block_size + keys % block_size
        out.append((row_start + lo - start, np.arange(lo, hi), slots))
    return out


class ImageBidirectionalAttention(Attention):
    """Attention whose image-token rows follow the rule above while `spans` is set (by the model, for one forward)."""

    spans: list[ImageSpan] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope=None, qk_norms=None) -> torch.Tensor:
        n = q.shape[0]
        if rope is not None:  # the image rows attend again with the rotated q: rotated here, not in the backend
            q, k = apply_qk_rotary(
                q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim), rope, qk_norms
            )
            q, k = q.reshape(n, -1), k.reshape(n, -1)
        out = super().forward(q, k, v)  # [num_tokens, num_heads * head_dim]; the step's K/V are now cached
        if not self.spans:
            return out
        q, out = q.view(n, self.num_heads, self.head_dim), out.view(n, self.num_heads, self.head_dim).clone()
        for span in self.spans:
            rows = slice(span.row_start, span.row_start + len(span.positions))
            out[rows] = self._attend(q[rows], span)
        return out.view(n, -1)

    def _attend(self, q: torch.Tensor, span: ImageSpan) -> torch.Tensor:
        """q [n, num_heads, head_dim] over the keys [0, end) -> [n, num_heads, head_dim]."""
        k, v = self.backend.read_kv(self.kv_cache, span.key_slots, self.head_dim)  # [end, num_kv_heads, head_dim]
        if k.dtype in FP8_KV_DTYPES:
            k, v = k.to(q.dtype) * self.k_scale, v.to(q.dtype) * self.v_scale
        group = self.num_heads // self.num_kv_heads
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [num_heads, end, head_dim]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)).float() * self.scale  # [num_heads, n, end]
        cap = self.extras.get("logits_soft_cap")
        if cap:
            scores = torch.tanh(scores / cap) * cap
        if self.sliding_window is not None:
            k_pos = torch.arange(k.shape[1], device=q.device)
            outside = k_pos[None, :] <= span.positions[:, None] - self.sliding_window  # [n, end]
            scores = scores.masked_fill(outside, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(v.dtype), v).transpose(0, 1)


def set_spans(layers: list[ImageBidirectionalAttention], spans: list[ImageSpan] | None) -> None:
    for layer in layers:
        layer.spans = spans
