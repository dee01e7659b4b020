"""The grouped LoRA kernels (shrink, expand) against a per-row torch reference, for mixes of adapters, base rows,
ranks and slice layouts, over an eager step's block table and over the graphs' static one (a fixed grid with empty
blocks). Without CUDA they run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

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
]


def mapping(token_slots: np.ndarray, static: bool):
    if not static:
        return build_mapping(token_slots, DEVICE)
    m = StaticLoRAMapping(len(token_slots) + 5, 3, DEVICE)  # buffers larger than the batch, as a graph's are
    m.load(token_slots, len(token_slots))
    return m.view(len(token_slots))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots,rank,sizes,in_features", CASES)
def test_shrink_expand_match_per_row_reference(slots, rank, sizes, in_features, dtype, static):
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
    t = ops.lora_shrink(x.to(DEVICE), a.to(DEVICE), m.sorted_tokens, m.blocks, m.num_blocks)
    starts = torch.tensor([s for s, _ in slices], device=DEVICE)
    counts = torch.tensor(sizes, device=DEVICE)
    ops.lora_expand(t, b.to(DEVICE), out, m.sorted_tokens, m.blocks, m.num_blocks, starts, counts, max(sizes))
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)
    base = token_slots < 0
    assert torch.equal(out.cpu()[base], y[base]), "base rows are left as they are"


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17, 40])
def test_step_buffers_keep_one_specialization(num_tokens):
    """Whatever the step's token count, the kernels get the same integer and alignment specializations (Triton compiles
    a new variant when an integer argument is 1 or stops being a multiple of 16, or a pointer loses 16-byte alignment):
    the block table's stride and address, and the partial sums' split stride, stay multiples of 16."""
    from pagedllm.kernels.lora import lora_shrink
    from pagedllm.lora.mapping import build_mapping

    slots = np.zeros(num_tokens, dtype=np.int64)
    mapping = build_mapping(slots, DEVICE)
    assert mapping.blocks.stride(0) % 16 == 0 and mapping.blocks.stride(0) > 1
    assert mapping.blocks.data_ptr() % 16 == 0 and mapping.sorted_tokens.data_ptr() % 16 == 0
    assert (mapping.blocks[1, : mapping.num_blocks] > 0).all()
    x, a = torch.randn(num_tokens, 64, device=DEVICE), torch.randn(1, 8, 64, device=DEVICE)
    t = lora_shrink(x, a, mapping.sorted_tokens, mapping.blocks, mapping.num_blocks)
    assert t.stride(0) % 16 == 0
    expected = (x.double() @ a[0].double().T).float()  # (float32 weights: IEEE products in the kernel)
    torch.testing.assert_close(t.sum(0), expected, rtol=1e-4, atol=1e-4)
