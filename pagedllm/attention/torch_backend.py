"""The CPU attention backend (and the reference anywhere): writes new K/V to the paged cache, then attends over it.

Its cache (allocate_kv_cache) is [2, num_kv_heads, num_blocks, block_size * head_dim]: K and V heads-major, so a
head's part of a block is one run of memory ([block_size, head_dim]). On CPU, C kernels (pagedllm.kernels.cpu_kernels)
write the cache and attend the paged rows, reading each block in place once; without a C compiler, or for other
dtypes and devices, the same computation runs on torch ops: paged rows as two batched matmuls over gathered blocks.
A paged row is one query token over its request's first seq_len cached tokens: every decode, and for the C kernels
each token of a short prefill chunk (PAGED_PREFILL_LEN). Other prefill chunks (all of them on the torch-op path) run
one SDPA call each, on the chunk's own K/V when it has no earlier context, else on K/V gathered from the cache."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.common import BatchLayout
from pagedllm.kernels import cpu_kernels

SUPPORTS_CUDA_GRAPHS = False  # its metadata holds host arrays that the forward reads (a sync inside a graph)


@dataclass
class PrefillChunk:
    q_start: int
    q_end: int
    context_len: int  # tokens before this chunk, already in the cache
    blocks: torch.Tensor | None  # [num_blocks] cache blocks of all its tokens, when context_len > 0
    positions: torch.Tensor | None  # [q_len] query positions, when a mask is needed
    paged: bool = False  # its tokens are also paged rows: the C kernels attend them there, not through SDPA


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    # paged rows: the decodes first, then the tokens of short prefill chunks (the C kernels take them all, the
    # torch-op path the decodes: a prefill token's own row would gather its whole prefix)
    paged_token_idx: torch.Tensor | None  # [num_rows] the flat batch's tokens that attend as paged rows
    paged_blocks: torch.Tensor | None  # [num_rows, max_blocks] their requests' cache blocks, padded with a valid id
    paged_seq_lens: torch.Tensor | None  # [num_rows] the cached tokens each row attends (its position + 1)
    num_decodes: int  # the first rows
    decode_padded: bool  # whether some decode rows see slots past their length (the torch-op path's mask)
    prefills: list[PrefillChunk]  # every prefill chunk, those of the paged rows marked
    cached: dict = field(default_factory=dict)  # per-step tensors built on first use by the torch-op path


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[2, num_kv_heads, num_blocks, block_size * head_dim], zeroed, so slots never written hold finite values: a
    decode reads whole blocks, and a masked slot's zero probability times NaN would still be NaN. On CPU the memory
    is an anonymous mapping: the OS zeroes each 4 KiB page when it is first written, not the whole cache up front
    (numpy's calloc would ask for 2 MiB huge pages, and a first write into one stalls while 2 MiB are zeroed)."""
    shape = (2, num_kv_heads, num_blocks, block_size * head_dim)
    if device.type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE)  # not shared with children
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def _blocks(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[2, num_kv_heads, num_blocks, block_size, head_dim] (a view)."""
    return kv_cache.view(*kv_cache.shape[:3], -1, head_dim)


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached K and V of `slots` [n], each [n, num_kv_heads, head_dim] (copies)."""
    flat = kv_cache.view(2, kv_cache.shape[1], -1, head_dim)  # [2, num_kv_heads, num_slots, head_dim]
    kv = flat.index_select(2, slots).transpose(1, 2)  # [2, n, num_kv_heads, head_dim]
    return kv[0], kv[1]


def from_slot_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """This backend's copy of a cache laid out [2, num_blocks, block_size, num_kv_heads, head_dim] (the Triton
    backend's layout), to compare backends on one cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    own = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_cache.dtype, kv_cache.device)
    _blocks(own, head_dim).copy_(kv_cache.permute(0, 3, 1, 2, 4))
    return own


def to_slot_major(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The cache's values as [2, num_blocks, block_size, num_kv_heads, head_dim] (a copy)."""
    return _blocks(kv_cache, head_dim).permute(0, 2, 3, 1, 4).contiguous()


# Prefill chunks of sequences up to this long attend as paged rows in the C kernel: one SDPA call per chunk costs
# more than the kernel's passes over so few keys (2 threads, bfloat16, 9/3 heads: 2.5x faster at 16 tokens, 1.7x at
# 32, even near 192)
PAGED_PREFILL_LEN = 128


def build_metadata(layout: BatchLayout, paged_prefill_len: int | None = None) -> TorchAttentionMetadata:
    """paged_prefill_len: prefill chunks whose sequence is at most this long also become paged rows, one per query
    token (attending its own prefix), like decodes (default: PAGED_PREFILL_LEN on CPU, else 0)."""
    qsl, seq_lens, bs = layout.query_start_loc, layout.seq_lens, layout.block_size
    query_lens = layout.query_lens
    dev = layout.device
    if paged_prefill_len is None:
        paged_prefill_len = PAGED_PREFILL_LEN if dev.type == "cpu" else 0
    short = (query_lens > 1) & (seq_lens <= paged_prefill_len)
    decodes = np.nonzero(query_lens == 1)[0]
    paged_reqs = np.concatenate([decodes, np.nonzero(short)[0]])
    paged_token_idx = paged_blocks = paged_seq_lens = None
    decode_padded = False
    if len(paged_reqs):
        q_lens = query_lens[paged_reqs]
        first = np.repeat(np.cumsum(q_lens) - q_lens, q_lens)  # each row's request's first row
        offset = np.arange(len(first)) - first  # the row's query token within its request
        lens = np.repeat(seq_lens[paged_reqs] - q_lens + 1, q_lens) + offset
        num_blocks = -(-int(lens.max()) // bs)
        decode_padded = bool((lens[: len(decodes)] != num_blocks * bs).any())
        # entries past a request's own blocks are stale or 0: valid ids whose slots the mask hides
        paged_token_idx = torch.from_numpy(np.repeat(qsl[paged_reqs], q_lens) + offset).to(dev)
        table = layout.block_table[paged_reqs, :num_blocks]
        paged_blocks = torch.from_numpy(np.ascontiguousarray(np.repeat(table, q_lens, axis=0))).to(dev)
        paged_seq_lens = torch.from_numpy(lens).to(dev)
    prefills = []
    for i in np.nonzero(query_lens > 1)[0]:
        q_start, q_end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        context = seq_len - (q_end - q_start)
        blocks = positions = None
        if context > 0:
            blocks = torch.from_numpy(layout.block_table[i, : -(-seq_len // bs)].copy()).to(dev)
            positions = torch.arange(context, seq_len, device=dev)
        prefills.append(PrefillChunk(q_start, q_end, context, blocks, positions, bool(short[i])))
    return TorchAttentionMetadata(
        layout.slot_mapping, paged_token_idx, paged_blocks, paged_seq_lens, len(decodes), decode_padded, prefills
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
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size * head_dim] from allocate_kv_cache
    meta: TorchAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Scores are q.k * scale, then cap * tanh(scores / cap) with a soft cap, plus slope * (key_pos - q_pos) with
    ALiBi slopes; causal, within the sliding window when there is one. The C kernels compute neither extra: with
    one, every row attends on the torch-op path."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    block_size = kv_cache.shape[3] // head_dim
    in_c = cpu_kernels.supports(q, num_kv_heads, block_size)
    if in_c:
        cpu_kernels.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
    else:
        _write_kv(k, v, kv_cache, meta.slot_mapping)
    extras = Extras(logits_soft_cap, alibi_slopes)
    in_c = in_c and extras.none
    out = torch.empty_like(q)
    if in_c and meta.paged_token_idx is not None:
        cpu_kernels.decode_attention(
            q,
            out,
            meta.paged_token_idx,
            kv_cache[0],
            kv_cache[1],
            meta.paged_blocks,
            meta.paged_seq_lens,
            scale,
            sliding_window,
        )
    elif meta.num_decodes:
        rows = meta.paged_token_idx[: meta.num_decodes]
        out[rows] = _decode(q[rows], kv_cache, meta, scale, sliding_window, extras)
    for chunk in meta.prefills:
        if in_c and chunk.paged:
            continue
        out[chunk.q_start : chunk.q_end] = _attend_chunk(q, k, v, kv_cache, chunk, scale, sliding_window, extras)
    return out


def _attend_chunk(q, k, v, kv_cache, chunk, scale: float, sliding_window: int | None, extras) -> torch.Tensor:
    """One prefill chunk's attention on torch ops: [q_len, num_heads, head_dim]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    # 4-D [1, heads, len, dim]: with 3-D inputs SDPA takes its slow math kernel on CPU (several times slower)
    qc = _heads_first(q[chunk.q_start : chunk.q_end]).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
    if chunk.context_len == 0 and sliding_window is None and extras.none:
        kc = _heads_first(k[chunk.q_start : chunk.q_end]).unsqueeze(0)
        vc = _heads_first(v[chunk.q_start : chunk.q_end]).unsqueeze(0)
        o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
    else:
        if chunk.context_len == 0:
            kc, vc = _heads_first(k[chunk.q_start : chunk.q_end]), _heads_first(v[chunk.q_start : chunk.q_end])
            q_pos = torch.arange(chunk.q_end - chunk.q_start, device=q.device)
        else:  # [num_kv_heads, seq_len, head_dim] from the cache's blocks
            k_blocks, v_blocks = _blocks(kv_cache, head_dim)
            seq_len = chunk.context_len + chunk.q_end - chunk.q_start
            kc = k_blocks.index_select(1, chunk.blocks).view(num_kv_heads, -1, head_dim)
            vc = v_blocks.index_select(1, chunk.blocks).view(num_kv_heads, -1, head_dim)
            kc, vc = kc[:, :seq_len].contiguous(), vc[:, :seq_len].contiguous()
            q_pos = chunk.positions
        mask = _window_mask(q_pos, kc.shape[1], sliding_window)
        if extras.none:
            o = F.scaled_dot_product_attention(
                qc, kc.unsqueeze(0), vc.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            o = _attend_with_extras(qc[0], kc, vc, q_pos, mask, scale, extras)[None]
    return o[0].transpose(0, 1)


@dataclass
class Extras:
    """The score transforms beyond scale and mask: a soft cap, ALiBi slopes [num_heads]."""

    logits_soft_cap: float | None
    alibi_slopes: torch.Tensor | None

    @property
    def none(self) -> bool:
        return not self.logits_soft_cap and self.alibi_slopes is None

    def apply(self, scores: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, slope_shape: tuple) -> None:
        """In place on float32 scores whose last dim is the keys; q_pos and the slopes (viewed as slope_shape)
        broadcast against them."""
        if self.logits_soft_cap:
            cap = self.logits_soft_cap
            scores.div_(cap).tanh_().mul_(cap)
        if self.alibi_slopes is not None:
            scores.add_(self.alibi_slopes.view(slope_shape) * (k_pos - q_pos).float())


def _attend_with_extras(q, k, v, q_pos, mask, scale, extras: Extras) -> torch.Tensor:
    """One prefill chunk in plain ops: q [num_heads, q_len, head_dim], k/v [num_kv_heads, k_len, head_dim],
    mask [q_len, k_len] bool -> [num_heads, q_len, head_dim]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = torch.matmul(q, k.transpose(1, 2)).float() * scale  # [num_heads, q_len, k_len]
    k_pos = torch.arange(k.shape[1], device=q.device)
    extras.apply(scores, q_pos[None, :, None], k_pos, (-1, 1, 1))
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def _write_kv(k, v, kv_cache, slot_mapping):
    """The new tokens' K/V into their slots, in torch ops."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    slots = kv_cache.view(2, num_kv_heads, -1, head_dim)  # [2, num_kv_heads, num_slots, head_dim]
    slots[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    slots[1].index_copy_(1, slot_mapping, v.transpose(0, 1))


def _decode(q, kv_cache, meta, scale, sliding_window, extras: Extras):
    """The decodes (one query token each), all at once over their gathered cache blocks, in torch ops.

    Grouped-query math with two batched matmuls, batched over (kv head, row): on CPU much faster than SDPA's
    kernel for one query token."""
    blocks = meta.paged_blocks[: meta.num_decodes]  # [num_rows, max_blocks]
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, num_cache_blocks, block_values = kv_cache.shape[1:]
    num_blocks, block_size = blocks.shape[1], block_values // head_dim
    seq_len, batch = num_blocks * block_size, num_kv_heads * num_rows
    if "decode_rows" not in meta.cached:  # each head's part of the cache offset to that head
        heads = torch.arange(num_kv_heads, device=blocks.device)[:, None] * num_cache_blocks
        meta.cached["decode_rows"] = (heads + blocks.reshape(1, -1)).view(-1)  # [(kv_head, row, block)]
    rows = meta.cached["decode_rows"]
    kd = kv_cache[0].view(-1, block_values).index_select(0, rows).view(batch, seq_len, head_dim)
    vd = kv_cache[1].view(-1, block_values).index_select(0, rows).view(batch, seq_len, head_dim)
    group = num_heads // num_kv_heads
    qg = q.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1).reshape(batch, group, head_dim)
    scores = torch.bmm(qg, kd.transpose(1, 2)).float() * scale  # [(kv_head, row), group, len]
    if not extras.none:
        lens = meta.paged_seq_lens[: meta.num_decodes]
        q_pos = (lens - 1)[None, :, None, None]  # [1, num_rows, 1, 1]
        k_pos = torch.arange(seq_len, device=q.device)
        extras.apply(scores.view(num_kv_heads, num_rows, group, seq_len), q_pos, k_pos, (num_kv_heads, 1, group, 1))
    bias = _decode_bias(meta, seq_len, sliding_window)
    if bias is not None:
        scores.view(num_kv_heads, num_rows, group, seq_len).add_(bias)
    probs = scores.softmax(dim=-1).to(q.dtype)
    o = torch.bmm(probs, vd)  # [(kv_head, row), group, dim]
    return o.view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1).reshape(num_rows, num_heads, head_dim)


def _decode_bias(meta: TorchAttentionMetadata, seq_len: int, sliding_window: int | None) -> torch.Tensor | None:
    """Additive mask [num_decodes, 1, seq_len] hiding slots past each decode's length (and keys outside the
    window); built once per step."""
    key = ("decode_bias", sliding_window or 0)
    if key not in meta.cached:
        bias = None
        if meta.decode_padded or (sliding_window is not None and seq_len > sliding_window):
            k_pos = torch.arange(seq_len, device=meta.paged_blocks.device)
            lens = meta.paged_seq_lens[: meta.num_decodes, None]
            visible = k_pos[None, :] < lens  # [num_rows, seq_len]
            if sliding_window is not None:
                visible &= k_pos[None, :] >= lens - sliding_window
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias = bias.masked_fill_(~visible, float("-inf"))[:, None, :]
        meta.cached[key] = bias
    return meta.cached[key]
