"""The Triton attention backend over an FP8 KV cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2, per-tensor scales).

Without CUDA the kernels run in Triton's interpreter (conftest.py). Two checks per case:
- the write: each new token's cache row must equal torch's own quantization, clamp(x / scale, +-max).to(fp8), bit
  for bit (the kernel computes the same float32 quotient and rounds to nearest even);
- the attention: against the torch reference backend in float32 over the dequantized cache (every slot fp8 * scale,
  the new tokens' too). Both sides see the same K/V values, so the tolerance is the one of the unquantized kernel
  test for the query dtype (TOL in test_triton_attention), not FP8's precision.
A third check compares with attention over the unquantized K/V: E4M3 keeps 3 mantissa bits (relative rounding error
<= 2^-4), E5M2 2 bits (<= 2^-3). An output is a convex mix of V rows, so its error is at most that relative error of
the largest |V| plus what the rounded keys move the weights: the bound is 0.1 (E4M3) / 0.2 (E5M2) times the largest
output, while a scale applied wrong (twice, or not at all) is off by a factor of 20 or more."""

from __future__ import annotations

import pytest
import test_triton_attention as base
import torch

from pagedllm.attention.common import BatchLayout

DEVICE = base.DEVICE
triton_backend, torch_backend = base.triton_backend, base.torch_backend
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
CLOSE_TO_FLOAT = {torch.float8_e4m3fn: 0.1, torch.float8_e5m2: 0.2}  # relative to the largest output
K_SCALE, V_SCALE = 0.05, 0.02  # K / 0.05 and V / 0.02 span most of E4M3's range for randn values
FP8_E4M3 = torch.float8_e4m3fn


def quantize(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8[fp8], FP8[fp8]).to(fp8)


def run_fp8(reqs, heads, head_dim, block_size, dtype, fp8, seed=0, **meta_kw):
    """(triton output, float32 reference over the dequantized cache, attention over unquantized K/V, the written
    cache rows, torch's quantization of them)."""
    q, k, v, cache, layout = base.make_batch(reqs, *heads, head_dim, block_size, dtype, seed=seed)
    float_cache = cache.float()  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    cache8 = torch.stack([quantize(float_cache[0], K_SCALE, fp8), quantize(float_cache[1], V_SCALE, fp8)])
    q, k, v, cache8 = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache8.to(DEVICE)
    qsl, seq_lens, table, slots = layout.query_start_loc, layout.seq_lens, layout.block_table, layout.slot_mapping
    meta = triton_backend.build_metadata(BatchLayout(qsl, seq_lens, table, slots.to(DEVICE), block_size, DEVICE))
    for key, value in meta_kw.items():
        setattr(meta, key, value)
    scale = head_dim**-0.5
    cache8 = triton_backend.slot_major_to_cache(cache8)  # (V transposed within each block)
    out = triton_backend.forward(q, k, v, cache8, meta, scale, k_scale=K_SCALE, v_scale=V_SCALE).float().cpu()
    cache8 = triton_backend.cache_to_slot_major(cache8.cpu())
    flat = cache8.view(2, -1, *cache8.shape[3:])  # [2, num_slots, num_kv_heads, head_dim]
    written = flat[:, slots]
    expected = torch.stack([quantize(k, K_SCALE, fp8).cpu(), quantize(v, V_SCALE, fp8).cpu()])
    deq = torch.stack([cache8[0].float() * K_SCALE, cache8[1].float() * V_SCALE])
    ref = _torch_attention(
        q.float(), deq[0].view(-1, *deq.shape[3:])[slots], deq[1].view(-1, *deq.shape[3:])[slots], deq, layout, scale
    )
    plain = _torch_attention(q.float(), k.float(), v.float(), float_cache, layout, scale)
    return out, ref, plain, written, expected


def _torch_attention(q, k, v, cache, layout, scale):
    """The torch backend in float32 over `cache` (slot-major), writing k/v first."""
    cpu = torch.device("cpu")  # the reference runs on the CPU: its metadata too (the C kernels read host memory)
    tensors = (layout.query_start_loc, layout.seq_lens, layout.block_table, layout.slot_mapping)
    ref_layout = BatchLayout(*(t.cpu() if torch.is_tensor(t) else t for t in tensors), layout.block_size, cpu)
    ref_cache = torch_backend.from_slot_major(cache.cpu())
    meta = torch_backend.build_metadata(ref_layout)
    return torch_backend.forward(q.cpu(), k.cpu(), v.cpu(), ref_cache.cpu(), meta, scale).cpu()


def check(reqs, heads, head_dim, block_size, dtype, fp8, **kw):
    out, ref, plain, written, expected = run_fp8(reqs, heads, head_dim, block_size, dtype, fp8, **kw)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8)), "the FP8 cache write differs"
    tol = base.TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert (out - plain).abs().max() < CLOSE_TO_FLOAT[fp8] * plain.abs().max()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_fp8_cache(fp8, dtype, num_splits):
    check(base.MIXED, (4, 2), 32, 4, dtype, fp8, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("block_size,head_dim", [(16, 32), (32, 32), (16, 80)])
def test_fp8_cache_tiles_and_blocks(block_size, head_dim):
    """Tiles of whole blocks (16), a tile inside one block (32), a head dim padded to 128 (80)."""
    check(base.MIXED, (4, 2), head_dim, block_size, torch.bfloat16, torch.float8_e4m3fn, block_n=16)


@pytest.mark.parametrize("block_size,block_n", [(4, 16), (16, None), (32, 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_slots_past_the_sequences_do_not_reach_the_output(block_size, block_n, num_splits):
    """V is read in whole blocks: slots past every sequence hold whatever a block held before (here E4M3's largest
    values, +-448, in K and V): the output is bit-identical to the one with other values there. Decodes and prefill
    chunks whose last blocks are partly filled, split or not."""
    reqs = [(70, 1), (3, 1), (33, 1), (5, 9), (17, 30)]
    q, k, v, cache, layout = base.make_batch(reqs, 4, 2, 32, block_size, torch.bfloat16, seed=7)
    clean = torch.stack([quantize(cache[0], K_SCALE, FP8_E4M3), quantize(cache[1], V_SCALE, FP8_E4M3)])
    seen = torch.zeros(clean.shape[1] * block_size, dtype=torch.bool)
    for i, n in enumerate(layout.seq_lens):
        pos = torch.arange(int(n))
        seen[torch.from_numpy(layout.block_table[i])[pos // block_size] * block_size + pos % block_size] = True
    stale = clean.clone()
    flat = stale.view(2, -1, *clean.shape[3:]).view(torch.uint8)  # (fp8 tensors take no masked writes)
    flat[:, ~seen] = 0x7E  # E4M3's 448
    flat[1, ~seen, :, ::2] = 0xFE  # -448
    meta = triton_backend.build_metadata(
        BatchLayout(layout.query_start_loc, layout.seq_lens, layout.block_table, layout.slot_mapping.to(DEVICE),
                    block_size, DEVICE)
    )  # fmt: skip
    meta.num_splits, meta.block_n = num_splits, block_n
    outs = []
    for cache8 in (clean, stale):
        cache8 = triton_backend.slot_major_to_cache(cache8).to(DEVICE)
        args = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache8, meta, 32**-0.5)
        outs.append(triton_backend.forward(*args, k_scale=K_SCALE, v_scale=V_SCALE).cpu())
    assert outs[0].isfinite().all()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_cache_holds_no_nan_or_inf(fp8):
    """An FP8 cache starts zeroed, and both writes store NaN as 0 and inf as the format's largest value: V's whole
    blocks are read, so every byte must be a finite value."""
    cache = triton_backend.allocate_kv_cache(2, 4, 2, 64, fp8, DEVICE)
    assert torch.equal(cache.view(torch.uint8), torch.zeros_like(cache.view(torch.uint8)))
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]).repeat(2 * 64 // 4).view(1, 2, 64)
    slots = torch.tensor([5], device=DEVICE)
    triton_backend.write_kv(bad.to(DEVICE), bad.to(DEVICE), cache, slots, 1.0, 1.0)
    rows = triton_backend.read_kv(cache, slots, 64)
    rope = (torch.ones(1, 1, 32, device=DEVICE), torch.zeros(1, 1, 32, device=DEVICE))  # the identity rotation
    q = torch.zeros(1, 2, 64, device=DEVICE)
    triton_backend.rotary_write_kv(q, bad.to(DEVICE), bad.to(DEVICE), cache, slots + 1, rope, None, 1.0, 1.0)
    rotated_k, rotary_v = triton_backend.read_kv(cache, slots + 1, 64)
    assert rotated_k.float().isfinite().all()  # (the rotation makes NaN of inf * 0: stored as 0)
    for row in (*rows, rotary_v):
        assert row.float()[0, 0, :4].tolist() == [0.0, FP8[fp8], -FP8[fp8], 1.0]


def test_read_kv_gives_the_written_rows():
    """read_kv in the FP8 layout (V transposed within each block) gives back the rows the write stored."""
    k = torch.randn(5, 2, 32)
    v = torch.randn(5, 2, 32)
    cache = torch.zeros(2, 3, 4, 2, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.tensor([9, 0, 3, 4, 11])
    triton_backend.write_kv(k.to(DEVICE), v.to(DEVICE), cache, slots.to(DEVICE), K_SCALE, V_SCALE)
    got_k, got_v = triton_backend.read_kv(cache, slots.to(DEVICE), 32)
    assert torch.equal(got_k.cpu().view(torch.uint8), quantize(k, K_SCALE, FP8_E4M3).view(torch.uint8))
    assert torch.equal(got_v.cpu().view(torch.uint8), quantize(v, V_SCALE, FP8_E4M3).view(torch.uint8))


@pytest.mark.parametrize("head_dim", [32, 80])
def test_decode_only_fp8_cache_default_tiles(head_dim):
    check([(70, 1), (3, 1), (33, 1)], (8, 2), head_dim, 16, torch.bfloat16, torch.float8_e4m3fn, seed=3)


def test_write_saturates_and_skips_padding():
    """Values past the format's range are stored as +-max (not inf/NaN); slot -1 writes nothing."""
    k = torch.tensor([[[1000.0, -1000.0, 0.3, 447.0]], [[5.0, 5.0, 5.0, 5.0]]])  # [2 tokens, 1 head, 4]
    v = -k
    cache = torch.zeros(2, 2, 2, 1, 4, dtype=torch.float8_e4m3fn)  # [2, num_blocks, block_size, heads, dim]
    slots = torch.tensor([3, -1])
    triton_backend.write_kv(k.to(DEVICE), v.to(DEVICE), cache_d := cache.to(DEVICE), slots.to(DEVICE), 1.0, 2.0)
    got = triton_backend.cache_to_slot_major(cache_d.cpu()).float()
    assert got[0, 1, 1, 0].tolist() == [448.0, -448.0, 0.3125, 448.0]  # 447 rounds to 448 (E4M3's step is 32)
    assert got[1, 1, 1, 0].tolist() == [-448.0, 448.0, -0.15625, -224.0]  # v / 2
    assert got.abs().sum() == got[:, 1, 1].abs().sum()  # nothing else written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic shapes: compiled kernels on CUDA")
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_shapes_fp8_cache(fp8, dtype):
    """Llama-3.1-8B's attention shapes (32 / 8 heads of 128), prefill chunks and long decodes (split-K chosen).
    On compute capability 8.9+ the tiles widen to float16 (asserted, so that path is what ran)."""
    q = torch.empty(1, dtype=dtype, device="cuda")
    assert triton_backend.fp8_in_float16(fp8, q) == (torch.cuda.get_device_capability() >= (8, 9))
    check([(0, 300), (1000, 1), (2047, 1), (37, 64)], (32, 8), 128, 16, dtype, fp8, seed=5)


def test_float16_reads_only_where_they_compile():
    """Float16 reads of an FP8 cache are for half-precision queries on CUDA: never for float32 queries, a bfloat16
    cache, or CPU tensors (Triton's interpreter widens to the query's dtype)."""
    cpu = torch.empty(1, dtype=torch.bfloat16)
    assert not triton_backend.fp8_in_float16(torch.float8_e4m3fn, cpu)
    if torch.cuda.is_available():
        assert not triton_backend.fp8_in_float16(torch.float8_e4m3fn, torch.empty(1, device="cuda"))  # float32
        assert not triton_backend.fp8_in_float16(torch.bfloat16, torch.empty(1, dtype=torch.bfloat16, device="cuda"))
