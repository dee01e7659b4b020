"""The GGUF-quantized linear kernels (pagedllm/kernels/cpu_quant.c) against float64 products of the dequantized
weights: 4-bit (Q4_0 / Q4_1 groups) and 8-bit (Q8_0), float32 and bfloat16 inputs, shapes with padding (n not a
multiple of 4, k not a multiple of 64) and batches that take every row split of the kernel."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler for the CPU kernels")


def _weights(bits: int, n: int, k: int, gen: torch.Generator):
    """(QuantWeight, the same weight dequantized [n, k] float64)."""
    groups = k // 32
    scale = torch.rand(n, groups, generator=gen) / 8
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zero = torch.randn(n, groups, generator=gen) / 8
        dense = (q.double() - 8) * scale.double().repeat_interleave(32, 1) + zero.double().repeat_interleave(32, 1)
        return cpu_quant.pack_q4(q, scale, zero), dense
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return cpu_quant.pack_q8(q, scale), q.double() * scale.double().repeat_interleave(32, 1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", [(8, 64), (7, 96), (13, 32)])
def test_quant_linear_matches_the_dequantized_product(bits, n, k):
    gen = torch.Generator().manual_seed(bits * 100 + n)
    w, dense = _weights(bits, n, k, gen)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 5, 9):
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ dense.t() + bias.double()  # [m, n]
        got = cpu_quant.quant_linear(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()  # the bfloat16 kernel: the product of the bfloat16 input, rounded once
        ref = (xb.double() @ dense.t() + bias.double()).bfloat16().double()
        got = cpu_quant.quant_linear(xb, w, bias)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref, rtol=8e-3, atol=1e-2)


def test_quant_linear_refuses_a_wrong_input():
    w, _ = _weights(4, 4, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="64"):
        cpu_quant.quant_linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="float16"):
        cpu_quant.quant_linear(torch.randn(1, 64).half(), w)


def test_a_q8_lm_head_reads_its_8bit_rows():
    """A tied LM head whose embedding came from a GGUF Q8_0 table (the loader's `gguf_q8`) computes the logits of a
    decode batch from the 8-bit rows: the product of the exact dequantized weight, not of its bfloat16 copy."""
    from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    gen = torch.Generator().manual_seed(7)
    q = torch.randint(-128, 128, (40, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(40, 2, generator=gen) / 64
    dense = q.float() * scale.repeat_interleave(32, 1)  # [vocab, hidden] as the loader dequantizes it
    dense.gguf_q8 = (q, scale)
    embedding, head = VocabParallelEmbedding(40, 64), ParallelLMHead(40, 64)
    embedding.weight.weight_loader(embedding.weight, dense)
    head.tie(embedding)
    head.process_weights_after_loading()
    assert head.q8_weight is not None
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(head.compute_logits(x).double(), x.double() @ dense.double().t(), rtol=1e-5, atol=1e-5)
