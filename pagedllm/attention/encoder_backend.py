"""Attention without a KV cache, for pooling runs: every sequence is whole in the batch, so each attends only to
itself. Bidirectional (encoders) or causal (decoders used as embedders), optionally with a sliding window.

The flat batch [num_tokens, ...] is gathered into a right-padded [num_seqs, num_heads, max_len, head_dim] block and
run through one scaled_dot_product_attention call with a key-padding mask. On CPU that beats one call per sequence
by 2-4x (measured on 64 sequences of 8-200 tokens) and a block-diagonal mask over the whole flat batch, whose cost
grows with the square of the batch's tokens. The runner sorts sequences by length, so there is little padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class EncoderMetadata:
    num_seqs: int
    max_len: int
    causal: bool
    gather_idx: torch.Tensor | None  # [num_seqs, max_len] flat row of each padded slot; None when no padding
    valid_rows: torch.Tensor | None  # [num_tokens] rows of the padded [num_seqs * max_len] that hold tokens
    key_mask: torch.Tensor | None  # [num_seqs, 1, 1, max_len] bool, True for real keys; None when no padding


def build_metadata(seq_lens: list[int], causal: bool, device: torch.device) -> EncoderMetadata:
    num_seqs, max_len = len(seq_lens), max(seq_lens)
    if all(n == max_len for n in seq_lens):
        return EncoderMetadata(num_seqs, max_len, causal, None, None, None)
    lens = torch.tensor(seq_lens, dtype=torch.int64)  # [num_seqs]
    starts = torch.cumsum(lens, 0) - lens  # [num_seqs]
    slots = torch.arange(max_len, dtype=torch.int64)  # [max_len]
    valid = slots[None, :] < lens[:, None]  # [num_seqs, max_len]
    gather_idx = torch.where(valid, starts[:, None] + slots[None, :], 0)
    valid_rows = valid.reshape(-1).nonzero().squeeze(1)  # [num_tokens]
    key_mask = valid[:, None, None, :]  # right padding: a causal query never reaches a padded key
    return EncoderMetadata(
        num_seqs, max_len, causal, gather_idx.to(device), valid_rows.to(device), None if causal else key_mask.to(device)
    )


def _window_mask(max_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[max_len, max_len] bool: causal and at most `window - 1` tokens back (HF's sliding window)."""
    i = torch.arange(max_len, device=device)
    diff = i[:, None] - i[None, :]  # query - key
    return (diff >= 0) & (diff < window)


def _padded(x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
    """[num_tokens, heads, head_dim] -> [num_seqs, heads, max_len, head_dim] (a view where there is no padding)."""
    if meta.gather_idx is None:
        return x.unflatten(0, (meta.num_seqs, meta.max_len)).transpose(1, 2)
    return x[meta.gather_idx].transpose(1, 2)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: EncoderMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim] -> [num_tokens, num_heads,
    head_dim]. kv_cache is ignored (there is none in a pooling run)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    qp, kp, vp = _padded(q, meta), _padded(k, meta), _padded(v, meta)
    mask, is_causal = meta.key_mask, meta.causal
    if meta.causal and sliding_window is not None and sliding_window < meta.max_len:
        mask, is_causal = _window_mask(meta.max_len, sliding_window, q.device), False
    gqa = k.shape[1] != num_heads
    out = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )  # [num_seqs, num_heads, max_len, head_dim]
    out = out.transpose(1, 2).reshape(meta.num_seqs * meta.max_len, num_heads, head_dim)
    return out if meta.valid_rows is None else out[meta.valid_rows]
