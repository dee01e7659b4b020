"""The fused decode-attention launches of the Triton backend against the unfused ones, bit for bit:
- rotary_write_kv (per-head q/k RMSNorm, rotary, K/V cache write in one launch) against fused_ops.qk_rotary then
  write_kv: the same rotated q and the same cache bytes (plain and FP8 caches; slot -1 rows leave the cache alone);
- split-K merged by the attention kernel's last programs against reduce_splits_kernel: the same output bits, and
  the counters are zero again after every call;
- the Attention layer's rope seam: the Triton backend (fused) and a backend without the fused path (rotates first)
  give what rotating first gives.

Without CUDA the kernels run in Triton's interpreter (conftest.py), tiny shapes; with CUDA they run compiled (the
`gpu`-marked tests add realistic shapes)."""

from __future__ import annotations

import importlib
import types

import pytest
import test_triton_attention as base
import torch

from pagedllm.attention.common import BatchLayout
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_qk_rotary

DEVICE = base.DEVICE
triton_backend = base.triton_backend
ops = importlib.import_module("pagedllm.kernels.fused_ops")
if DEVICE.type == "cpu" and type(ops.qk_rotary_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TENSOR_DEVICE = torch.empty(0, device=DEVICE).device  # (cuda:0, as the backend keys its counter buffers)


def split_counters() -> torch.Tensor | None:
    return triton_backend._counters.get(TENSOR_DEVICE)


def rotary_case(heads, kv_heads, head_dim, dtype, with_norm, cache_dtype, num_tokens=7, seed=0):
    """(q, k, v strided views of one qkv row per token, cos, sin, norm (q_w, k_w, eps) or None, cache, slots):
    slots of distinct cache rows, two of them -1 (padding)."""
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, 4096, 500_000.0, None)
    cos, sin = rope(torch.randint(0, 4096, (num_tokens,), generator=g), dtype)  # [num_tokens, 1, head_dim / 2]
    qkv = (2 * torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    norm = None
    if with_norm:
        weights = [(1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2)]
        norm = (*weights, 1e-6)
    block_size = 4
    num_blocks = -(-2 * num_tokens // block_size)  # half the slots stay unwritten
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[1] = slots[4] = -1
    to = (lambda x: x.to(DEVICE)) if DEVICE.type == "cuda" else (lambda x: x)
    return to(q), to(k), to(v), to(cos), to(sin), norm, to(cache), to(slots)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 2, 80), (3, 1, 96)])
def test_rotary_write_matches_rotary_then_write(dtype, with_norm, heads, kv_heads, head_dim):
    case = rotary_case(heads, kv_heads, head_dim, dtype, with_norm, dtype)
    check_rotary_write(*case)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_fp8_cache(fp8, dtype):
    case = rotary_case(4, 2, 64, dtype, True, fp8, seed=1)
    check_rotary_write(*case, k_scale=0.05, v_scale=0.02)


def check_rotary_write(q, k, v, cos, sin, norm, cache, slots, k_scale=1.0, v_scale=1.0):
    weights = norm[:2] if norm is not None else None
    ref_q, ref_k = ops.qk_rotary(q, k, cos, sin, weights, norm[2] if norm else 1e-6)
    ref_cache = cache.clone()
    triton_backend.write_kv(ref_k, v, ref_cache, slots, k_scale, v_scale)
    before = cache.clone()
    out_q = triton_backend.rotary_write_kv(q, k, v, cache, slots, (cos, sin), norm, k_scale, v_scale)
    assert out_q.shape == q.shape and out_q.is_contiguous()
    assert torch.equal(as_bits(out_q), as_bits(ref_q))
    assert torch.equal(as_bits(cache), as_bits(ref_cache))
    # every written slot changed nothing else; padding rows wrote nothing
    row_bytes = k.shape[1] * k.shape[2] * cache.element_size()
    slot_major = triton_backend.cache_to_slot_major  # (an FP8 cache keeps V transposed within each block)
    flat, flat_before = (as_bits(slot_major(c)).view(2, -1, row_bytes) for c in (cache, before))
    written = slots[slots >= 0].cpu()
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    assert not torch.equal(flat[:, written], flat_before[:, written])


def run_split(reqs, heads, head_dim, dtype, num_splits, in_kernel, monkeypatch, block_n=16, seed=0):
    q, k, v, cache, layout = base.make_batch(reqs, *heads, head_dim, 16, dtype, seed=seed)
    q, k, v, cache = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE)
    qsl, seq_lens, table, slots = layout.query_start_loc, layout.seq_lens, layout.block_table, layout.slot_mapping
    meta = triton_backend.build_metadata(BatchLayout(qsl, seq_lens, table, slots.to(DEVICE), 16, DEVICE))
    meta.num_splits, meta.block_n = num_splits, block_n
    monkeypatch.setattr(triton_backend, "SPLIT_IN_KERNEL", in_kernel)
    return triton_backend.forward(q, k, v, cache, meta, head_dim**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (the interpreter: an even and an odd split count; CUDA all four)
@pytest.mark.parametrize("num_splits", [2, 3, 5, 8] if DEVICE.type == "cuda" else [2, 5])
@pytest.mark.parametrize(
    "reqs,heads",
    [([(300, 1), (77, 1), (513, 1)], (4, 2)), ([(150, 1), (40, 1)], (6, 1)), ([(200, 3), (90, 2)], (4, 4))],
)
def test_split_merge_in_kernel_matches_reduce_kernel(dtype, num_splits, reqs, heads, monkeypatch):
    # (the last case is a verify-like batch: several query tokens per request, BLOCK_Q > 1 programs)
    reduced = run_split(reqs, heads, 64, dtype, num_splits, False, monkeypatch)
    assert split_counters() is None or not split_counters().any()
    monkeypatch.setattr(triton_backend, "reduce_splits_kernel", None)  # the merge must need no second launch
    merged = run_split(reqs, heads, 64, dtype, num_splits, True, monkeypatch)
    counters = split_counters()
    assert counters.dtype == torch.int32 and not counters.any(), "the last programs re-zero their counters"
    assert torch.equal(as_bits(merged), as_bits(reduced))
    unsplit = run_split(reqs, heads, 64, dtype, 1, True, monkeypatch)
    torch.testing.assert_close(merged.float(), unsplit.float(), atol=base.TOL[dtype], rtol=0)


def test_split_counters_grow_and_are_kept():
    triton_backend._counters.clear()
    first = triton_backend.split_counters(DEVICE, 10)
    assert first.numel() >= 10 and not first.any()
    assert triton_backend.split_counters(DEVICE, 20) is first
    bigger = triton_backend.split_counters(DEVICE, first.numel() + 1)
    assert bigger.numel() > first.numel() and triton_backend.split_counters(DEVICE, 5) is bigger
    assert any(b is first for b in triton_backend._outgrown)  # (a graph captured with it may still read it)


def attention_case(backend, heads, kv_heads, head_dim, dtype, with_norm, rotate_first, seed=3):
    """The Attention layer's output and cache for one mixed step, q/k rotated by the layer (rope=) or before it."""
    reqs = [(20, 1), (0, 5), (33, 1)]
    q, k, v, cache, layout = base.make_batch(reqs, heads, kv_heads, head_dim, 16, dtype, seed=seed, pad_tokens=2)
    n = q.shape[0]
    rope = RotaryEmbedding(head_dim, 128, 10000.0, None)
    cos, sin = rope(torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)), dtype)
    norms = None
    if with_norm:
        norms = tuple(RMSNorm(head_dim, eps=1e-6).to(dtype).to(DEVICE) for _ in range(2))
        with torch.no_grad():
            for i, norm in enumerate(norms):
                norm.weight.copy_(1 + 0.1 * (i + 1) * torch.arange(head_dim, dtype=dtype) / head_dim)
    layer = Attention(heads, head_dim, head_dim**-0.5, kv_heads)
    layer.backend, layer.kv_cache = backend, cache.to(DEVICE)
    q, k, v = (x.to(DEVICE).reshape(n, -1) for x in (q, k, v))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    qsl, seq_lens, table, slots = layout.query_start_loc, layout.seq_lens, layout.block_table, layout.slot_mapping
    meta = backend.build_metadata(BatchLayout(qsl, seq_lens, table, slots.to(DEVICE), 16, DEVICE))
    with forward_context(meta):
        if rotate_first:
            rq, rk = apply_qk_rotary(q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), (cos, sin), norms)
            out = layer(rq.reshape(n, -1), rk.reshape(n, -1), v)
        else:
            out = layer(q, k, v, rope=(cos, sin), qk_norms=norms)
    return out[: n - 2].cpu(), layer.kv_cache.cpu()


@pytest.mark.parametrize("with_norm", [False, True])
def test_attention_layer_rope_seam(with_norm):
    dtype = torch.float32
    out, cache = attention_case(triton_backend, 4, 2, 32, dtype, with_norm, rotate_first=False)
    ref_out, ref_cache = attention_case(triton_backend, 4, 2, 32, dtype, with_norm, rotate_first=True)
    if DEVICE.type == "cuda":  # there apply_qk_rotary runs fused_ops.qk_rotary: the same bits
        assert torch.equal(cache, ref_cache) and torch.equal(out, ref_out)
    else:  # the CPU rotary is the C kernel: the same math in another compiler's order
        torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    # a backend without the fused path gets rotated q and k, exactly as apply_qk_rotary makes them
    plain = types.SimpleNamespace(build_metadata=triton_backend.build_metadata, forward=triton_backend.forward)
    out2, cache2 = attention_case(plain, 4, 2, 32, dtype, with_norm, rotate_first=False)
    assert torch.equal(out2, ref_out) and torch.equal(cache2, ref_cache)


# -- realistic shapes, compiled on the GPU --------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_rotary_write_llama_shapes(with_norm, cache_dtype):
    case = list(rotary_case(32, 8, 128, torch.bfloat16, with_norm, torch.bfloat16, num_tokens=64))
    case[6] = case[6].to(cache_dtype)
    scales = (0.05, 0.02) if cache_dtype != torch.bfloat16 else (1.0, 1.0)
    check_rotary_write(*case, *scales)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 7, 16, 32])
def test_gpu_split_merge_llama_shapes(num_splits, monkeypatch):
    reqs = [(8191, 1)] * 3 + [(1500, 1)]
    reduced = run_split(reqs, (32, 8), 128, torch.bfloat16, num_splits, False, monkeypatch, block_n=None)
    merged = run_split(reqs, (32, 8), 128, torch.bfloat16, num_splits, True, monkeypatch, block_n=None)
    assert torch.equal(merged, reduced) and not split_counters().any()
