"""The Triton attention backend against the torch reference backend over the same paged cache.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest.py before
the kernel module is imported, or the module is re-imported), with tiny shapes; with CUDA the same tests run compiled on
the GPU, and the `gpu`-marked tests add realistic shapes.

Tolerances: float32 1e-4 (the kernels sum in another order and use exp2; tl.dot runs in IEEE fp32 for fp32 input);
bfloat16 2e-2 absolute on outputs of magnitude ~1 (both sides round the probabilities to bf16 before P @ V, and
bf16 has 8 bits of mantissa: one ulp at 1.0 is 7.8e-3); float16 5e-3 (11 bits)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")


def _fresh(name: str):
    """The module, re-imported when it was first imported before the interpreter was switched on."""
    mod = importlib.import_module(name)
    if DEVICE.type == "cpu" and type(getattr(mod, "unified_attention_kernel", None)).__name__ != "InterpretedFunction":
        mod = importlib.reload(mod)
    return mod


kernels = _fresh("pagedllm.kernels.paged_attention")
triton_backend = importlib.import_module("pagedllm.attention.triton_backend")
if triton_backend.unified_attention_kernel is not kernels.unified_attention_kernel:
    triton_backend = importlib.reload(triton_backend)

from pagedllm.attention import torch_backend  # noqa: E402
from pagedllm.attention.common import BatchLayout  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, pad_tokens=0):
    """A step over `reqs` = [(context_len, query_len)]: a cache whose context slots hold random K/V, blocks given
    out in a shuffled order, and the new q/k/v. Returns (q, k, v, kv_cache, layout)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // block_size) for c, n in reqs)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 3
    perm = torch.randperm(num_blocks, generator=g).numpy()
    block_table = np.zeros((len(reqs), max_blocks), dtype=np.int64)  # [num_reqs, max_blocks]
    used = 0
    for i, (c, n) in enumerate(reqs):
        nb = -(-(c + n) // block_size)
        block_table[i, :nb] = perm[used : used + nb]
        used += nb
    qsl = np.zeros(len(reqs) + 1, dtype=np.int64)  # [num_reqs + 1]
    qsl[1:] = np.cumsum([n for _, n in reqs])
    seq_lens = np.array([c + n for c, n in reqs], dtype=np.int64)  # [num_reqs]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = []
    for i, (c, n) in enumerate(reqs):
        pos = np.arange(c, c + n)
        slots.append(block_table[i, pos // block_size] * block_size + pos % block_size)
    slots.append(np.full(pad_tokens, -1, dtype=np.int64))
    slot_mapping = torch.from_numpy(np.concatenate(slots))  # [num_tokens]
    num_tokens = int(qsl[-1]) + pad_tokens
    # q as a strided view of a wider projection output, as the models hand it over
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # [num_tokens, num_heads, head_dim]
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    layout = BatchLayout(qsl, seq_lens, block_table, slot_mapping, block_size, torch.device("cpu"))
    return q, k, v, kv_cache, layout


def run_both(q, k, v, kv_cache, layout, sliding_window=None, num_splits=None, block_n=None, **extras):
    """(triton output, torch output, triton cache, torch cache), both on DEVICE; the torch side gets no padding rows."""
    num_real = int(layout.query_start_loc[-1])
    q, k, v, kv_cache = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv_cache.to(DEVICE)
    qsl, seq_lens, table, bs = layout.query_start_loc, layout.seq_lens, layout.block_table, layout.block_size
    ref_layout = BatchLayout(qsl, seq_lens, table, layout.slot_mapping[:num_real].to(DEVICE), bs, DEVICE)
    ref_meta = torch_backend.build_metadata(ref_layout)
    ref_cache = torch_backend.from_slot_major(kv_cache)
    scale = q.shape[-1] ** -0.5
    extras = {key: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for key, x in extras.items()}
    ref = torch_backend.forward(
        q[:num_real], k[:num_real], v[:num_real], ref_cache, ref_meta, scale, sliding_window, **extras
    )
    meta = triton_backend.build_metadata(BatchLayout(qsl, seq_lens, table, layout.slot_mapping.to(DEVICE), bs, DEVICE))
    meta.num_splits, meta.block_n = num_splits, block_n
    out = triton_backend.forward(q, k, v, kv_cache, meta, scale, sliding_window, **extras)
    return out[:num_real].cpu(), ref.cpu(), kv_cache.cpu(), torch_backend.to_slot_major(ref_cache, q.shape[-1]).cpu()


@pytest.fixture
def one_tile_splits(monkeypatch):
    """Splits as short as one key tile, so the tiny contexts here still split (the default minimum is 128 keys)."""
    monkeypatch.setattr(triton_backend, "MIN_TOKENS_PER_SPLIT", 1)


def check(q, k, v, kv_cache, layout, dtype, **kw):
    out, ref, cache, ref_cache = run_both(q, k, v, kv_cache, layout, **kw)
    assert torch.equal(cache, ref_cache), "the KV-cache write differs"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# a prefill chunk from scratch, a chunk starting mid-block after 5 cached tokens, decodes over short and long
# (several blocks) contexts
MIXED = [(0, 7), (5, 6), (37, 1), (12, 1), (3, 1)]


@pytest.mark.usefixtures("one_tile_splits")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_matches_torch(dtype, block_size, heads, num_splits):
    q, k, v, cache, layout = make_batch(MIXED, *heads, 32, block_size, dtype)
    check(q, k, v, cache, layout, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_head_dims(dtype, head_dim):
    q, k, v, cache, layout = make_batch([(9, 3), (21, 1)], 4, 2, head_dim, 4, dtype, seed=1)
    check(q, k, v, cache, layout, dtype, block_n=16)


@pytest.mark.usefixtures("one_tile_splits")
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window(num_splits, window):
    q, k, v, cache, layout = make_batch([(0, 9), (13, 5), (40, 1), (4, 1)], 4, 2, 32, 4, torch.float32, seed=2)
    check(q, k, v, cache, layout, torch.float32, sliding_window=window, num_splits=num_splits, block_n=16)


@pytest.mark.usefixtures("one_tile_splits")
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_long_context(num_splits, dtype):
    """Decodes only (one query token per program); split-K over contexts of many blocks, some splits empty."""
    q, k, v, cache, layout = make_batch([(70, 1), (3, 1), (33, 1)], 8, 2, 32, 4, dtype, seed=3)
    check(q, k, v, cache, layout, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("in_kernel", [True, False])
def test_split_minimum_keys(monkeypatch, in_kernel):
    """Splits of at least MIN_TOKENS_PER_SPLIT keys: a grid of 4 splits over 16-key tiles uses 1, 2 and all 4 of
    them for contexts of 4, 301 and 1,001 keys; the splits past the keys exit (merged in the kernel) or write empty
    partials (merged by the reduce kernel), and every row still equals the reference."""
    monkeypatch.setattr(triton_backend, "SPLIT_IN_KERNEL", in_kernel)
    monkeypatch.setattr(triton_backend, "MIN_TOKENS_PER_SPLIT", 256)  # 16 tiles of 16 keys
    q, k, v, cache, layout = make_batch([(3, 1), (300, 1), (1000, 1)], 4, 2, 32, 16, torch.float32, seed=11)
    check(q, k, v, cache, layout, torch.float32, num_splits=4, block_n=16)


@pytest.mark.usefixtures("one_tile_splits")
@pytest.mark.parametrize("in_kernel", [True, False])
def test_split_padding_row(monkeypatch, in_kernel):
    """A CUDA graph's padding row (sequence length 0, slot -1) beside a real decode, 4 splits: zeros for it (no NaN),
    and the real row as without it."""
    monkeypatch.setattr(triton_backend, "SPLIT_IN_KERNEL", in_kernel)
    q, k, v, cache, layout = make_batch([(40, 1)], 4, 2, 32, 16, torch.float32, seed=12)
    want, _, _, _ = run_both(q, k, v, cache.clone(), layout, num_splits=4, block_n=16)
    table = torch.from_numpy(layout.block_table).to(torch.int32)
    meta = triton_backend.static_decode_metadata(
        slot_mapping=torch.cat([layout.slot_mapping, torch.tensor([-1])]).to(DEVICE),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([41, 0], dtype=torch.int32, device=DEVICE),
        block_table=torch.cat([table, torch.zeros_like(table)]).to(DEVICE),
        block_size=16,
        max_seq_len=41,
        num_splits=4,
    )
    meta.block_n = 16
    q2, k2, v2 = (torch.cat([x, torch.zeros_like(x)]).to(DEVICE) for x in (q, k, v))
    out = triton_backend.forward(q2, k2, v2, cache.clone().to(DEVICE), meta, q.shape[-1] ** -0.5).cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:1], want, atol=1e-6, rtol=1e-6)


def test_num_splits_bounds():
    q, k, v, cache, layout = make_batch([(30, 1)], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits=33"):
        run_both(q, k, v, cache, layout, num_splits=triton_backend.MAX_SPLITS + 1)


def test_default_tiles_and_padding_rows():
    """Default key tile (64, several cache blocks per tile) and padded rows (slot -1) that write nothing."""
    q, k, v, cache, layout = make_batch([(0, 20), (70, 1), (100, 3)], 4, 1, 32, 16, torch.float32, seed=4, pad_tokens=2)
    check(q, k, v, cache, layout, torch.float32)


@pytest.mark.usefixtures("one_tile_splits")
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("extras", ["softcap", "alibi", "both+window"])
def test_softcap_and_alibi(extras, num_splits):
    """Gemma 2's score soft cap and Bloom's ALiBi slopes, in prefill chunks (with and without context) and
    decodes. A cap of 0.5 on scores of magnitude ~1-5 changes them a lot; the slopes are large enough to matter."""
    from pagedllm.layers.attention import alibi_slopes

    kw = {}
    if extras != "alibi":
        kw["logits_soft_cap"] = 0.5
    if extras != "softcap":
        kw["alibi_slopes"] = alibi_slopes(4) * 4
    if extras.endswith("window"):
        kw["sliding_window"] = 7
    q, k, v, cache, layout = make_batch([(0, 9), (13, 5), (40, 1), (4, 1)], 4, 2, 32, 4, torch.float32, seed=8)
    check(q, k, v, cache, layout, torch.float32, num_splits=num_splits, block_n=16, **kw)
    window = kw.pop("sliding_window", None)
    with_extras, _, _, _ = run_both(q, k, v, cache.clone(), layout, window, num_splits, 16, **kw)
    plain, _, _, _ = run_both(q, k, v, cache.clone(), layout, window, num_splits, 16)
    assert (with_extras - plain).abs().max() > 0.05, "the extras should change the output"


# prefill chunks long enough for key tiles that every row sees (they skip the mask) before the diagonal ones,
# with and without cached context, one starting mid-block, beside decodes
LONG_PREFILL = [(0, 45), (40, 30), (19, 26), (50, 1), (7, 1)]


@pytest.mark.usefixtures("one_tile_splits")
@pytest.mark.parametrize(
    "extras",
    [
        {},
        {"num_splits": 3},
        {"sliding_window": 20},
        {"sliding_window": 20, "num_splits": 2},
        {"logits_soft_cap": 0.5},
        {"alibi": True},
    ],
)
def test_mask_free_interior_tiles(monkeypatch, extras):
    """Small prefill tiles (BLOCK_M 16: 8 query tokens x 2 heads, BLOCK_N 16 over blocks of 4) so that most key
    tiles of a program lie before its first query (no mask), the rest on the diagonal, past the window's lower edge
    or at the end of a split's range (masked)."""
    from pagedllm.layers.attention import alibi_slopes

    monkeypatch.setitem(triton_backend.PREFILL_TILES, 32, (16, 16, 4, 2))
    assert triton_backend._tiles(2, 30, 32, False) == (8, 16, 16, 4, 2)
    kw = dict(extras)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_slopes(4) * 4
    q, k, v, cache, layout = make_batch(LONG_PREFILL, 4, 2, 32, 4, torch.float32, seed=9)
    check(q, k, v, cache, layout, torch.float32, **kw)


@pytest.mark.parametrize("tiles", [(64, 32, 4, 3), (128, 16, 8, 2), (16, 64, 2, 4)])
def test_prefill_tiles_override(monkeypatch, tiles):
    """PREFILL_TILES sets the prefill tiles of its head dim (BLOCK_Q = rows // group) and leaves decodes' alone;
    the output matches torch with each."""
    rows, block_n, warps, stages = tiles
    monkeypatch.setitem(triton_backend.PREFILL_TILES, 128, tiles)
    block_q, block_m = rows // 4, max(16, rows)
    assert triton_backend._tiles(4, 100, 128, False) == (block_q, block_m, block_n, warps, stages)
    assert triton_backend._tiles(4, 1, 128, False) == (1, 16, 128, 4, 3)
    assert triton_backend._tiles(4, 1, 128, True) == (1, 16, 128, 2, 2)  # an FP8 cache: its own decode tiles
    assert triton_backend._tiles(4, 100, 64, False) == (16, 64, 64, 4, 2)  # another head dim keeps the rule
    q, k, v, cache, layout = make_batch([(0, 40), (21, 19), (33, 1)], 8, 2, 80, 4, torch.bfloat16, seed=10)
    monkeypatch.setitem(triton_backend.PREFILL_TILES, 128, (rows // 2, block_n, warps, stages))  # group 4 -> 2
    check(q, k, v, cache, layout, torch.bfloat16)


def test_choose_num_splits():
    f = triton_backend.choose_num_splits
    assert f(num_programs=8 * 8, max_seq_len=4096, max_query_len=1, sms=132) == 5  # ceil(264 / 64) waves
    assert f(num_programs=8, max_seq_len=2048, max_query_len=1, sms=132) == 16  # capped by 2048 / 128 keys
    assert f(num_programs=1, max_seq_len=100_000, max_query_len=1, sms=132) == 32  # MAX_SPLITS
    assert f(num_programs=32 * 8, max_seq_len=2048, max_query_len=1, sms=132) == 2  # under two waves
    assert f(num_programs=512, max_seq_len=4096, max_query_len=1, sms=132) == 1  # two waves and more
    assert f(num_programs=8, max_seq_len=200, max_query_len=1, sms=132) == 1  # short contexts
    assert f(num_programs=8, max_seq_len=4096, max_query_len=5, sms=132) == 1  # a prefill chunk in the batch


# -- realistic shapes, compiled on the GPU --------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)])
def test_gpu_realistic_mixed(dtype, heads):
    rng = np.random.default_rng(0)
    reqs = [(int(c), 1) for c in rng.integers(1, 4096, size=48)]  # decodes up to 4k context
    reqs += [(0, 300), (1000, 512), (37, 129), (2048, 1)]  # prefill chunks incl. one mid-block
    q, k, v, cache, layout = make_batch(reqs, *heads, 128, 16, dtype, seed=5)
    check(q, k, v, cache, layout, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("num_seqs", [1, 4, 64])
def test_gpu_decode_split_k(num_splits, num_seqs):
    rng = np.random.default_rng(num_seqs)
    reqs = [(int(c), 1) for c in rng.integers(1024, 4096, size=num_seqs)]
    q, k, v, cache, layout = make_batch(reqs, 16, 8, 128, 16, torch.bfloat16, seed=6)
    check(q, k, v, cache, layout, torch.bfloat16, num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_sliding_window_long():
    reqs = [(3000, 1), (0, 700), (2500, 64), (100, 1)]
    q, k, v, cache, layout = make_batch(reqs, 32, 8, 128, 16, torch.bfloat16, seed=7)
    check(q, k, v, cache, layout, torch.bfloat16, sliding_window=512)
