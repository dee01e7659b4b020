"""The reference attention backend in plain torch: writes new K/V to the paged cache, then attends over it.

Decodes (one query token) of all requests run as one padded SDPA call; prefill chunks run one SDPA call each,
directly on the chunk's K/V when there is no earlier context, else over K/V gathered from the cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.common import BatchLayout, slots_of


@dataclass
class PrefillChunk:
    q_start: int
    q_end: int
    context_len: int  # tokens before this chunk, already in the cache
    slots: torch.Tensor | None  # [seq_len] cache slots of all its tokens, when context_len > 0
    positions: torch.Tensor | None  # [q_len] query positions, when a mask is needed


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_token_idx: torch.Tensor | None  # [num_decodes] rows of the flat batch that are decodes
    decode_slots: torch.Tensor | None  # [num_decodes, max_seq_len] cache slots, padded with a valid slot
    decode_seq_lens: torch.Tensor | None  # [num_decodes]
    decode_padded: bool  # whether some decode rows are padded (a mask is needed)
    prefills: list[PrefillChunk]
    decode_bias: dict = field(default_factory=dict)  # sliding window (0: none) -> additive mask, built on first use


def build_metadata(layout: BatchLayout) -> TorchAttentionMetadata:
    qsl, seq_lens, bs = layout.query_start_loc, layout.seq_lens, layout.block_size
    query_lens = layout.query_lens
    dev = layout.device
    decode_reqs = np.nonzero(query_lens == 1)[0]
    decode_token_idx = decode_slots = decode_seq_lens = None
    decode_padded = False
    if len(decode_reqs):
        lens = seq_lens[decode_reqs]
        max_len = int(lens.max())
        decode_padded = bool((lens != max_len).any())
        pos = np.minimum(np.arange(max_len)[None, :], lens[:, None] - 1)  # pad with the last valid position
        table = layout.block_table[decode_reqs]
        slots = np.take_along_axis(table, pos // bs, axis=1) * bs + pos % bs  # [num_decodes, max_len]
        decode_token_idx = torch.from_numpy(qsl[decode_reqs]).to(dev)
        decode_slots = torch.from_numpy(slots).to(dev)
        decode_seq_lens = torch.from_numpy(lens).to(dev)
    prefills = []
    for i in np.nonzero(query_lens > 1)[0]:
        q_start, q_end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        context = seq_len - (q_end - q_start)
        slots = positions = None
        if context > 0:
            slots = torch.from_numpy(slots_of(layout.block_table[i], np.arange(seq_len), bs)).to(dev)
            positions = torch.arange(context, seq_len, device=dev)
        prefills.append(PrefillChunk(q_start, q_end, context, slots, positions))
    return TorchAttentionMetadata(
        layout.slot_mapping, decode_token_idx, decode_slots, decode_seq_lens, decode_padded, prefills
    )


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[..., len, heads, dim] -> contiguous [..., heads, len, dim] (SDPA on CPU is much faster on contiguous input)."""
    return x.transpose(-3, -2).contiguous()


def _window_mask(q_pos: torch.Tensor, k_len: int, sliding_window: int | None) -> torch.Tensor:
    """[q_len, k_len] bool: causal, and inside the sliding window when there is one."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def forward(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: TorchAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    v_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.decode_token_idx is not None:
        out[meta.decode_token_idx] = _decode(q[meta.decode_token_idx], k_cache, v_cache, meta, scale, sliding_window)
    for chunk in meta.prefills:
        # 4-D [1, heads, len, dim]: with 3-D inputs SDPA takes its slow math kernel on CPU (several times slower)
        qc = _heads_first(q[chunk.q_start : chunk.q_end]).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
        if chunk.context_len == 0 and sliding_window is None:
            kc = _heads_first(k[chunk.q_start : chunk.q_end]).unsqueeze(0)
            vc = _heads_first(v[chunk.q_start : chunk.q_end]).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if chunk.context_len == 0:
                kc, vc = k[chunk.q_start : chunk.q_end], v[chunk.q_start : chunk.q_end]
                q_pos = torch.arange(chunk.q_end - chunk.q_start, device=q.device)
            else:
                kc, vc = k_cache.index_select(0, chunk.slots), v_cache.index_select(0, chunk.slots)
                q_pos = chunk.positions
            mask = _window_mask(q_pos, kc.shape[0], sliding_window)
            kc, vc = _heads_first(kc).unsqueeze(0), _heads_first(vc).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
        o = o[0]
        out[chunk.q_start : chunk.q_end] = o.transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, meta, scale, sliding_window):
    """One query token per request, all requests at once over their padded cached K/V.

    Grouped-query math with two batched matmuls: much faster on CPU than SDPA's kernel for one query token."""
    slots = meta.decode_slots  # [num_decodes, max_len]
    num_decodes, max_len = slots.shape
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    shape = (num_decodes, max_len, num_kv_heads, head_dim)
    kd = _heads_first(k_cache.index_select(0, slots.view(-1)).view(shape))  # [num_decodes, kv_heads, max_len, dim]
    vd = _heads_first(v_cache.index_select(0, slots.view(-1)).view(shape))
    bias = _decode_bias(meta, sliding_window)
    if num_decodes == 1 and bias is None:  # a single unmasked row: SDPA's kernel is as fast and simpler
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, scale=scale, enable_gqa=True)
        return o.squeeze(2)
    qg = q.view(num_decodes, num_kv_heads, -1, head_dim)  # [num_decodes, kv_heads, group, dim]
    scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * scale  # [num_decodes, kv_heads, group, max_len]
    if bias is not None:
        scores += bias
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, vd).view(num_decodes, -1, head_dim)  # [num_decodes, num_heads, dim]


def _decode_bias(meta: TorchAttentionMetadata, sliding_window: int | None) -> torch.Tensor | None:
    """Additive mask [num_decodes, 1, 1, max_len] hiding padding (and keys outside the window); cached per step."""
    key = sliding_window or 0
    if key not in meta.decode_bias:
        max_len = meta.decode_slots.shape[1]
        bias = None
        if meta.decode_padded or (sliding_window is not None and max_len > sliding_window):
            k_pos = torch.arange(max_len, device=meta.decode_slots.device)
            lens = meta.decode_seq_lens[:, None]
            visible = k_pos[None, :] < lens  # [num_decodes, max_len]
            if sliding_window is not None:
                visible &= k_pos[None, :] >= lens - sliding_window
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias = bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        meta.decode_bias[key] = bias
    return meta.decode_bias[key]
