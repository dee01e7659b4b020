"""The torch attention backend (its C kernels and its torch-op path) against plain per-request attention in float64
over the same paged cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.attention import torch_backend
from pagedllm.attention.common import BatchLayout
from pagedllm.kernels import cpu_kernels


def make_step(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """reqs = [(context_len, query_len)]: a cache whose context slots hold random K/V in shuffled blocks, stale
    random values in every other slot, and the step's new q/k/v (strided views of one projection output)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-(c + n) // block_size) for c, n in reqs]
    num_blocks = sum(nbs) + 3
    perm = torch.randperm(num_blocks, generator=g).numpy()
    table = np.zeros((len(reqs), max(nbs) + 2), dtype=np.int64)  # [num_reqs, max_blocks], unused ids stale
    table[:] = perm[-1]
    used, slots = 0, []
    for i, ((c, n), nb) in enumerate(zip(reqs, nbs)):
        table[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(c, c + n)
        slots.append(table[i, pos // block_size] * block_size + pos % block_size)
    slot_major = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    cache = torch_backend.from_slot_major(slot_major)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in reqs])]).astype(np.int64)
    seq_lens = np.array([c + n for c, n in reqs], dtype=np.int64)
    n = int(qsl[-1])
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q = q.view(n, num_heads, head_dim)
    k, v = k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)
    slot_mapping = torch.from_numpy(np.concatenate(slots))
    return q, k, v, cache, BatchLayout(qsl, seq_lens, table, slot_mapping, block_size, torch.device("cpu"))


def reference(q, k, v, cache, layout, scale, window):
    """Per request and head: softmax over its visible keys (causal, inside the window), in float64."""
    bs, head_dim = layout.block_size, k.shape[2]
    slot_major = torch_backend.to_slot_major(cache, head_dim)  # [2, num_blocks, block_size, kv_heads, head_dim]
    k_all = slot_major[0].reshape(-1, *slot_major.shape[3:])  # [num_slots, kv_heads, head_dim]
    v_all = slot_major[1].reshape(-1, *slot_major.shape[3:])
    k_all[layout.slot_mapping], v_all[layout.slot_mapping] = k, v  # the step's writes
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(len(layout.seq_lens)):
        start, end, seq_len = layout.query_start_loc[i], layout.query_start_loc[i + 1], int(layout.seq_lens[i])
        pos = np.arange(seq_len)
        slots = torch.from_numpy(layout.block_table[i, pos // bs] * bs + pos % bs)
        keys = k_all[slots].double().repeat_interleave(group, dim=1)  # [seq_len, heads, dim]
        values = v_all[slots].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if window is not None:
            visible &= torch.arange(seq_len)[None, :] > q_pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out, k_all, v_all


MIXED = [(0, 7), (5, 6), (37, 1), (12, 1), (3, 1), (0, 1), (16, 1)]
LONG_PREFILLS = [(0, 130), (100, 40)]  # sequences past PAGED_PREFILL_LEN: SDPA by default


def has_bf16_dot() -> bool:
    """Whether -march=native gives the kernels bfloat16 pair dot products (x86 avx512_bf16)."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(params=["c", "c-generic", "torch"])
def path(request, monkeypatch):
    if request.param.startswith("c"):
        if cpu_kernels.compiled() is None:
            pytest.fail("pagedllm.kernels.cpu_kernels did not build: it needs a C compiler (GCC 12+ or clang)")
        if not cpu_kernels.compiled().full_width_vectors():
            pytest.skip("without AVX-512 the backend keeps its torch ops (the kernels' own tests still run them)")
        if request.param == "c-generic":
            if not has_bf16_dot():
                pytest.skip("this CPU has no bfloat16 dot products: the 'c' runs are the generic path")
            # the decode path of CPUs without bfloat16 dot products, which converts each block to float32 (on such
            # CPUs every C-path test runs it already)
            generic = request.getfixturevalue("kernels_without")("-mno-avx512bf16")
            monkeypatch.setattr(cpu_kernels, "compiled", lambda: generic)
    else:
        monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,block_size,head_dim,window",
    [
        ((4, 4), 4, 32, None),
        ((9, 3), 16, 64, None),
        ((8, 2), 8, 16, 5),
        ((6, 1), 16, 64, 20),
        ((16, 1), 24, 48, 1),  # a block size off the 16-token vectors, the widest group, a window of one token
        ((4, 2), 32, 128, 16),  # a window ending on a block edge
    ],
)
@pytest.mark.parametrize("paged_prefill_len", [0, None, 1000], ids=["sdpa-prefill", "default", "paged-prefill"])
def test_matches_reference(path, dtype, heads, block_size, head_dim, window, paged_prefill_len):
    num_heads, num_kv_heads = heads
    q, k, v, cache, layout = make_step(MIXED + LONG_PREFILLS, num_heads, num_kv_heads, head_dim, block_size, dtype)
    assert cpu_kernels.supports(q, num_kv_heads, block_size) == path.startswith("c")
    scale = head_dim**-0.5
    ref, k_all, v_all = reference(q, k, v, cache, layout, scale, window)
    meta = torch_backend.build_metadata(layout, paged_prefill_len)
    paged = [c for c in meta.prefills if c.paged]
    assert len(meta.prefills) == 4 and len(paged) == {0: 0, None: 2, 1000: 4}[paged_prefill_len]  # default: <= 128
    assert meta.num_decodes == 5
    assert len(meta.paged_token_idx) == 5 + sum(c.q_end - c.q_start for c in paged)
    out = torch_backend.forward(q, k, v, cache, meta, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    written = torch_backend.to_slot_major(cache, head_dim)
    assert torch.equal(written[0].reshape(k_all.shape), k_all) and torch.equal(written[1].reshape(v_all.shape), v_all)


def test_decode_with_never_written_slots(path):
    """Slots past a request's length are never read by the C kernel (they hold NaN here), and hold the fresh
    cache's zeros for the torch path, which reads whole blocks and masks them (a zero probability times NaN would
    still be NaN)."""
    q, k, v, cache, layout = make_step([(5, 1), (20, 1), (16, 1)], 4, 2, 32, 16, torch.bfloat16)
    fresh = torch_backend.allocate_kv_cache(cache.shape[2], 16, 2, 32, torch.bfloat16, torch.device("cpu"))
    assert not fresh.any()
    slot_major = torch_backend.to_slot_major(cache, 32)
    written = torch.full_like(slot_major, float("nan") if path.startswith("c") else 0.0)
    for i, seq_len in enumerate(layout.seq_lens):  # only the context is copied over: later slots stay unwritten
        pos = np.arange(int(seq_len) - 1)
        blocks, offsets = layout.block_table[i, pos // 16], pos % 16
        written[:, blocks, offsets] = slot_major[:, blocks, offsets]
    fresh.copy_(torch_backend.from_slot_major(written))
    ref, _, _ = reference(q, k, v, fresh, layout, 32**-0.5, None)
    out = torch_backend.forward(q, k, v, fresh, torch_backend.build_metadata(layout), 32**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_slot_major_round_trip():
    slot_major = torch.randn(2, 5, 4, 3, 16)
    own = torch_backend.from_slot_major(slot_major)
    assert own.shape == (2, 3, 5, 4 * 16)
    assert torch.equal(torch_backend.to_slot_major(own, 16), slot_major)
    assert torch.equal(own[0, 1, 2].view(4, 16)[3], slot_major[0, 2, 3, 1])  # head 1, block 2, slot 3
    assert torch.equal(own[1, 1, 2].view(4, 16)[3], slot_major[1, 2, 3, 1])
