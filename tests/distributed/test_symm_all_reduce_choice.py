"""Which Triton all-reduce SymmAllReduce picks (distributed/symm_all_reduce.py): one-shot, two-shot (groups of four
from TWO_SHOT_BYTES on) or none (NCCL), with and without the fused RMSNorm. The kernels themselves are checked in
tests/kernels/test_triton_all_reduce.py (CPU) and tests/distributed/test_collectives.py (GPUs); here they are
replaced by recorders, so this runs anywhere."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import symm_all_reduce as sar

pytest.importorskip("triton")


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def all_reduce(self, x, bufs, calls, rank, world, max_bytes, two_shot=False):
        self.calls.append(("plain", two_shot))

    def all_reduce_rms_norm(self, x, residual, weight, eps, bufs, calls, rank, world, max_bytes, two_shot=False):
        self.calls.append(("norm", two_shot))
        return x, residual


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    kernel = sar.all_reduce_kernel
    for name in ("all_reduce", "all_reduce_rms_norm"):
        monkeypatch.setattr(kernel, name, getattr(rec, name))
    return rec


def _symm(size: int) -> sar.SymmAllReduce:
    return sar.SymmAllReduce("t", torch.empty(0, dtype=torch.uint8), sar.MAX_BYTES[size], 0, size, torch.zeros(size))


@pytest.mark.parametrize(
    ("size", "rows", "taken", "two_shot"),
    [(4, 1, True, False), (4, 63, True, False), (4, 64, True, True), (4, 1024, True, True), (4, 1025, False, None),
     (2, 256, True, False), (2, 512, True, False), (2, 513, False, None)],
)  # fmt: skip
def test_plain_all_reduce_choice(recorder, size, rows, taken, two_shot):
    x = torch.zeros(rows, 4096, dtype=torch.bfloat16)  # 8 KB a row: 64 rows are 512 KB, 1024 rows 8 MB
    assert _symm(size).all_reduce(x) is taken
    assert recorder.calls == ([("plain", two_shot)] if taken else [])


@pytest.mark.parametrize(
    ("size", "rows", "cols", "result"),
    [(4, 256, 4096, ("norm", True)), (4, 8, 4096, ("norm", False)),
     (4, 64, 4104, ("norm", False)),  # 513 KB, 1026 columns a rank (not 16-byte pieces): one-shot, within its 1 MB
     (4, 256, 4104, None),  # 2 MB and no two-shot: not fused (the plain two-shot, then the norm)
     (2, 256, 4096, ("norm", False))],
)  # fmt: skip
def test_fused_norm_choice(recorder, size, rows, cols, result):
    x = torch.zeros(rows, cols, dtype=torch.bfloat16)
    got = _symm(size).all_reduce_rms_norm(x, torch.zeros_like(x), torch.zeros(cols, dtype=torch.bfloat16), 1e-5)
    assert (got is not None) == (result is not None)
    assert recorder.calls == ([result] if result else [])
