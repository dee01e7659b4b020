"""The AMX tile kernel of the bfloat16 linear layers (cpu_matmul.c) against a float64 reference of the same
bfloat16 inputs, rounded once to bfloat16: equal but for rare values where the float32 sums land on the other side of
a rounding edge (one bfloat16 ulp); and against oneDNN's matmul, which the layers use for larger batches."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.linear import TILE_ROWS, RowParallelLinear, TiledLinearMethod, pack_for_cpu, packed_linear


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles with bfloat16 (Linux's /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_tile" in flags and "amx_bf16" in flags


needs_amx = pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX tiles (the layers use oneDNN's matmul)")


def test_tiles_run_exactly_where_the_cpu_has_them():
    """On a CPU with AMX the kernels must be built for it and usable (a failed build would otherwise only show as
    slower linears); elsewhere nothing is packed for them."""
    if cpu_kernels.compiled() is None:
        pytest.fail("pagedllm.kernels.cpu_kernels did not build: it needs a C compiler (GCC 12+ or clang)")
    assert cpu_kernels.matmul_tiles() == cpu_has_amx()
    packed = cpu_kernels.pack_tiles(torch.ones(32, 32).bfloat16())
    assert (packed is not None) == cpu_has_amx()


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return (out if bias is None else out + bias.double()).to(torch.bfloat16)


def assert_rounded_alike(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one bfloat16 ulp everywhere, bit-equal almost everywhere."""
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-6, rtol=2**-7)
    assert (y == ref).float().mean() > 0.99, "more than 1% of the outputs differ from the rounded reference"


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 40, 64, 100, 300])
@pytest.mark.parametrize("n, k", [(32, 32), (96, 64), (576, 576), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiles_match_a_rounded_float64_reference(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    wide = torch.randn(rows, k + 40, generator=g).bfloat16()
    x = wide[:, 8 : 8 + k]  # rows of another stride than k
    bias = torch.randn(n, generator=g) if with_bias else None
    y = cpu_kernels.linear_tiles(x, cpu_kernels.pack_tiles(w), bias)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert_rounded_alike(y, reference(x, w, bias))


@needs_amx
def test_tiles_match_onednn():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(960, 576, generator=g).bfloat16(), torch.randn(64, 576, generator=g).bfloat16()
    packed = pack_for_cpu(w)
    if packed is None:
        pytest.skip("torch has no oneDNN here")
    assert_rounded_alike(cpu_kernels.linear_tiles(x, cpu_kernels.pack_tiles(w)), packed_linear(x, packed, None))


@needs_amx
def test_nan_and_inf_pass_through():
    w = torch.ones(32, 32).bfloat16()
    x = torch.zeros(3, 32).bfloat16()
    x[1, 4], x[2, 0] = float("nan"), float("inf")
    y = cpu_kernels.linear_tiles(x, cpu_kernels.pack_tiles(w))
    assert (y[0] == 0).all() and y[1].isnan().all() and (y[2] == float("inf")).all()


@needs_amx
def test_no_rows_and_bad_inputs():
    packed = cpu_kernels.pack_tiles(torch.ones(64, 32).bfloat16())
    assert cpu_kernels.linear_tiles(torch.ones(0, 32).bfloat16(), packed).shape == (0, 64)
    with pytest.raises(ValueError, match="bfloat16 CPU input"):
        cpu_kernels.linear_tiles(torch.ones(2, 32), packed)
    with pytest.raises(ValueError, match="bias"):
        cpu_kernels.linear_tiles(torch.ones(2, 32).bfloat16(), packed, torch.ones(64).bfloat16())


@pytest.mark.parametrize(
    "weight",
    [torch.ones(32, 32), torch.ones(48, 32).bfloat16(), torch.ones(32, 40).bfloat16(), torch.ones(0, 32).bfloat16()],
    ids=["float32", "n-48", "k-40", "empty"],
)
def test_weights_the_tiles_do_not_take(weight):
    assert cpu_kernels.pack_tiles(weight) is None


@needs_amx
@pytest.mark.parametrize("rows", [TILE_ROWS, TILE_ROWS + 1])
def test_layer_takes_the_tiles_up_to_tile_rows(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = RowParallelLinear(64, 96, bias=True)
        finally:
            torch.set_default_dtype(torch.float32)
    w, bias = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.process_weights_after_loading()
    assert layer.cpu_tiles is not None and isinstance(layer.quant_method, TiledLinearMethod)
    calls = []
    tiles = cpu_kernels.linear_tiles
    monkeypatch.setattr(cpu_kernels, "linear_tiles", lambda *a: calls.append(1) or tiles(*a))
    x = torch.randn(rows, 64, generator=g).bfloat16()
    assert_rounded_alike(layer(x), reference(x, w, bias))
    assert bool(calls) == (rows <= TILE_ROWS)
