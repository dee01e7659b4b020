"""The grouped LoRA kernels (shrink then expand, and the one-launch fused kernel) against a per-row torch reference,
for mixes of adapters, base rows, ranks and slice layouts, over an eager step's block table and over the graphs'
static one (a fixed grid with empty blocks); and one compiled variant per layer whatever the step's tokens. Without
CUDA they run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from lora_variants import record_variants

from pagedllm.lora.mapping import StaticLoRAMapping, build_mapping

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")

ops = importlib.import_module("pagedllm.kernels.lora")
if DEVICE.type == "cpu" and type(ops.lora_shrink_kernel).__name__ != "InterpretedFunction":
    ops = importlib.reload(ops)  # imported before the interpreter was switched on


def reference(x, a, b, y, token_slots, slices, rank):
    """y + each adapter row's x @ A[slot].T @ B[slot].T, one row at a time, slice by slice (float64)."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s, (start, size) in enumerate(slices):
            shrunk = x[t].double() @ a[slot, s * rank : (s + 1) * rank].double().T  # [rank]
            out[t, start : start + size] += shrunk @ b[slot, start : start + size].double().T
    return out


CASES = [  # (token slots, rank, slice sizes, input features)
    ([0], 8, [48], 40),  # decode, one adapter
    ([1, -1, 0], 16, [24, 8], 1000),  # input features split over 4 programs of 256 (the last one short)
    ([-1, 1, 0, 1, -1, 2, 0], 8, [32, 16, 16], 40),  # adapters and base rows interleaved, q/k/v-like slices
    ([2] * 20 + [-1] * 3 + [0] * 17, 16, [40, 40], 40),  # groups over a token block, gate/up-like slices
    ([1, 1, 1, 1], 32, [24], 40),  # a larger rank
    ([-1, 0, -1], 16, [72, 8, 8], 40),  # slices of unequal sizes (one over the column block)
    ([0, 1, -1, 1], 256, [24], 1000),  # rank 256: the expand sums its 4 split parts in two loads
]


def mapping(token_slots: np.ndarray, static: bool):
    if not static:
        return build_mapping(token_slots, DEVICE)
    m = StaticLoRAMapping(len(token_slots) + 5, 3, DEVICE)  # buffers larger than the batch, as a graph's are
    m.load(token_slots, len(token_slots))
    return m.view(len(token_slots))


def run_kernels(fused: bool, x, a, b, y, m, slices, sync=None) -> None:
    """y += the adapter term through lora_fused or lora_shrink + lora_expand."""
    starts = torch.tensor([s for s, _ in slices], device=DEVICE)
    sizes = torch.tensor([n for _, n in slices], device=DEVICE)
    max_slice = max(n for _, n in slices)
    if fused:
        sync = torch.zeros(3, dtype=torch.int32, device=DEVICE) if sync is None else sync
        ops.lora_fused(x, a, b, y, m.sorted_tokens, m.blocks, m.num_blocks, starts, sizes, max_slice, sync)
        assert not sync.any(), "the fused kernel leaves its counters at zero for the next launch"
        return
    t = ops.lora_shrink(x, a, m.sorted_tokens, m.blocks, m.num_blocks)
    ops.lora_expand(
        t, b, y, m.sorted_tokens, m.blocks, m.num_blocks, starts, sizes, max_slice, ops.max_split(x.shape[1])
    )


@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots,rank,sizes,in_features", CASES)
def test_kernels_match_per_row_reference(slots, rank, sizes, in_features, dtype, static, fused):
    g = torch.Generator().manual_seed(len(slots) * 31 + rank)
    max_loras, out_features = 3, sum(sizes)
    slices = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
    token_slots = np.array(slots, dtype=np.int64)
    x = torch.randn(len(slots), in_features, generator=g).to(dtype)
    a = (0.3 * torch.randn(max_loras, len(sizes) * rank, in_features, generator=g)).to(dtype)
    b = (0.3 * torch.randn(max_loras, out_features, rank, generator=g)).to(dtype)
    y = torch.randn(len(slots), out_features, generator=g).to(dtype)
    expected = reference(x, a, b, y, token_slots, slices, rank)
    m = mapping(token_slots, static)
    out = y.to(DEVICE)
    run_kernels(fused, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), out, m, slices)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)
    base = token_slots < 0
    assert torch.equal(out.cpu()[base], y[base]), "base rows are left as they are"


@pytest.fixture
def variants(monkeypatch):
    return record_variants(monkeypatch, ops)


STEPS = [  # (token slots, eager or the graphs' static mapping): steps of one layer, as prefills and decodes come
    ([0], False),  # one token: a block table of stride 1
    ([0] * 16, False),  # one full block
    ([0] * 5 + [-1] * 2 + [1] * 6, False),  # an odd number of adapter tokens, two blocks
    ([1] * 37 + [0] * 3, False),  # several blocks: a smaller split of the input features
    ([0], True),
    ([0, 1, -1, 0, 2, 2, 1], True),
    ([2] * 24, True),
]


@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
def test_one_compiled_variant_per_layer_whatever_the_step(variants, fused):
    """Every argument that follows the step's tokens (block count, strides of the step's buffers, the split, the
    mapping's addresses) is left unspecialized: a layer's first steps compile its kernels, later steps of other
    sizes never do (a one-token step used to compile another variant: its block table's stride was 1)."""
    rank, sizes, in_features = 8, [32, 16, 16], 600  # shrink columns 24: token strides of t not multiples of 16
    slices = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
    g = torch.Generator().manual_seed(7)
    a = (0.3 * torch.randn(3, len(sizes) * rank, in_features, generator=g)).to(DEVICE)
    b = (0.3 * torch.randn(3, sum(sizes), rank, generator=g)).to(DEVICE)
    sync = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for slots, static in STEPS:
        token_slots = np.array(slots, dtype=np.int64)
        x = torch.randn(len(slots), in_features, generator=g).to(DEVICE)
        y = torch.zeros(len(slots), sum(sizes), device=DEVICE)
        run_kernels(fused, x, a, b, y, mapping(token_slots, static), slices, sync)
        expected = reference(x.cpu(), a.cpu(), b.cpu(), torch.zeros_like(y.cpu()), token_slots, slices, rank)
        torch.testing.assert_close(y.cpu().double(), expected, atol=1e-4, rtol=1e-4)
    names = ["lora_fused_kernel"] if fused else ["lora_expand_kernel", "lora_shrink_kernel"]
    assert sorted(name for name, _ in variants) == names
    for key, specs in variants.items():
        assert len(specs) == 1, (key, specs)
