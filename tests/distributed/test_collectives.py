"""The Communicator's collectives across spawned ranks: gloo on CPU (every CI run), and on GPUs NCCL plus the
one-shot symmetric-memory all-reduce, checked against the exact sum of the ranks' inputs (within the rounding of
the additions in the tensor's dtype), eagerly and inside a CUDA graph.

`python tests/distributed/test_collectives.py N [cpu|cuda] [bench]` runs the same check (and, with bench, a latency
table per message size) outside pytest. On GPUs the one-shot path is pagedllm's Triton kernel (kernels/all_reduce.py)
wherever Triton is installed; the report says which ran (`triton`)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.distributed.communicator import Communicator
from pagedllm.distributed.symm_all_reduce import MAX_BYTES

HIDDEN = 4096


def _sizes(world: int) -> list[int]:
    """Element counts of bfloat16 all-reduces: decode-sized rows (one-shot, two-shot) up to prefill-sized (NCCL)."""
    top = MAX_BYTES.get(world, 1 << 20) // 2
    rows = [1, 8, 64, 128, 256, 512]
    return sorted({*(r * HIDDEN for r in rows if r * HIDDEN < top), top, 4 * (1 << 20), 8 * (1 << 20)})


def _check(rank: int, world: int, port: int, device_type: str, bench: bool, out: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    comm = Communicator.create(store, "tp0", rank, list(range(world)), device, 60.0)
    plain = Communicator.create(store, "plain", rank, list(range(world)), device, 60.0, custom_all_reduce=False)
    report = {"rank": rank, "one_shot": comm.symm is not None, "errors": []}
    report["triton"] = comm.symm is not None and comm.symm.bufs is not None
    assert plain.symm is None
    if device_type == "cpu":
        assert comm.symm is None  # no symmetric memory on CPU: every all-reduce is gloo's
    dtypes = (torch.bfloat16, torch.float32) if device_type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for n in _sizes(world):
            inputs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)) for r in range(world)]
            x = inputs[rank].to(device, dtype)
            for name, c in (("one-shot", comm), ("nccl", plain)):
                error = _sum_error(c.all_reduce(x.clone()), inputs, dtype)
                if error:
                    report["errors"].append(f"{name} {dtype} n={n}: {error}")
    if device_type == "cuda":
        report["errors"] += _sequence_check(comm, device)
        report["errors"] += _graph_check(comm, device)
        report["errors"] += _fused_check(comm, device)
        if bench:
            report["latency_us"] = _latency(comm, plain, device, world)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(report, f)


def _sum_error(got: torch.Tensor, inputs: list[torch.Tensor], dtype: torch.dtype) -> str | None:
    """None when got is the exact sum of the ranks' inputs (as `dtype` holds them) up to the rounding of
    len(inputs) - 1 additions in `dtype`, else what is wrong."""
    if got.numel() == 0:
        return None if all(x.numel() == 0 for x in inputs) else "empty result"
    held = torch.stack([x.to(dtype).double() for x in inputs])  # [world, n]
    exact, scale = held.sum(0), held.abs().sum(0)
    bound = len(inputs) * torch.finfo(dtype).eps * scale + 1e-30
    excess = ((got.double().cpu() - exact).abs() / bound).max().item()
    return None if excess <= 1.0 else f"error {excess:.2f}x the rounding bound"


def _sequence_check(comm: Communicator, device: torch.device) -> list[str]:
    """All-reduces back to back with no other collective between them, sizes and dtypes mixed (a chunk owns the same
    bytes whatever the dtype), first from the counts so far, then from call counts just below the int32 wrap."""
    plan = [(torch.bfloat16, HIDDEN), (torch.float32, HIDDEN), (torch.bfloat16, 16 * HIDDEN), (torch.float32, 256)]
    plan += [(torch.bfloat16, 8), (torch.float32, 32 * HIDDEN), (torch.bfloat16, 0), (torch.bfloat16, 2 * HIDDEN)] * 2
    plan += [(torch.bfloat16, 256 * HIDDEN), (torch.bfloat16, HIDDEN), (torch.float32, 96 * HIDDEN)]  # two-shot (TP=4)
    errors = []
    for start in ("as is", "near the wrap"):
        if start == "near the wrap" and comm.symm is not None and comm.symm.calls is not None:
            comm.symm.calls.fill_(2**31 - 3)  # every rank alike: the counts stay in step
        results = []
        for i, (dtype, n) in enumerate(plan):
            inputs = [torch.randn(n, generator=torch.Generator().manual_seed(50 * i + r)) for r in range(comm.size)]
            results.append((comm.all_reduce(inputs[comm.rank].to(device, dtype)), inputs, dtype, n))
        for got, inputs, dtype, n in results:
            error = _sum_error(got, inputs, dtype)
            if error:
                errors.append(f"sequence ({start}) {dtype} n={n}: {error}")
    return errors


def _graph_check(comm: Communicator, device: torch.device) -> list[str]:
    """Eight decode-row all-reduces and two of 256 rows (two-shot at TP=4) captured in one CUDA graph, replayed on
    fresh inputs, give the exact sums."""
    x = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device=device)
    big = torch.zeros(2, 256, HIDDEN, dtype=torch.bfloat16, device=device)
    graph = torch.cuda.CUDAGraph()
    comm.all_reduce(x[0].clone())  # warm-up outside capture
    comm.all_reduce(big[0].clone())
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for i in range(8):
            comm.all_reduce(x[i])
            if i % 4 == 1:
                comm.all_reduce(big[i // 4])
    errors = []
    for trial in range(3):
        inputs = {}
        for name, t in (("rows", x), ("256 rows", big)):
            g = torch.Generator().manual_seed(trial)
            inputs[name] = [torch.randn(t.shape, generator=g) for _ in range(comm.size)]
            t.copy_(inputs[name][comm.rank].to(device, torch.bfloat16))
        graph.replay()
        for name, t in (("rows", x), ("256 rows", big)):
            error = _sum_error(t, inputs[name], torch.bfloat16)
            if error:
                errors.append(f"graph replay {trial} ({name}): {error}")
    return errors


def _fused_check(comm: Communicator, device: torch.device) -> list[str]:
    """all_reduce_rms_norm against all_reduce then rms_norm: the new residual bit for bit, the output within the
    norm's rounding, eagerly and (interleaved with plain all-reduces) replayed from a CUDA graph."""
    from pagedllm.kernels.fused_ops import rms_norm

    if comm.symm is None or comm.symm.bufs is None:
        return []
    errors = []
    cases = [(torch.bfloat16, 1, HIDDEN), (torch.bfloat16, 7, HIDDEN), (torch.float32, 3, 1000)]
    cases += [(torch.bfloat16, 2, 8192), (torch.bfloat16, 256, HIDDEN), (torch.float32, 160, 1024)]  # two-shot (TP=4)
    for dtype, m, n in cases:
        g = torch.Generator().manual_seed(m * n)
        x = torch.randn(comm.size, m, n, generator=g)[comm.rank].to(device, dtype)
        res, w = torch.randn(m, n, generator=g).to(device, dtype), torch.randn(n, generator=g).to(device, dtype)
        fused = comm.all_reduce_rms_norm(x.clone(), res, w, 1e-5)
        if fused is None:
            errors.append(f"fused {dtype} {m}x{n}: not taken")
            continue
        want = rms_norm(comm.all_reduce(x.clone()), w, 1e-5, res)
        errors += _norm_mismatch(fused, want, f"fused {dtype} {m}x{n}")
    x = torch.randn(4, HIDDEN, device=device).to(torch.bfloat16)
    res, w = torch.randn_like(x), torch.randn(HIDDEN, device=device).to(torch.bfloat16)
    comm.all_reduce_rms_norm(x.clone(), res, w, 1e-5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused = comm.all_reduce_rms_norm(x.clone(), res, w, 1e-5)
        plain = comm.all_reduce(x.clone())
        again = comm.all_reduce_rms_norm(x.clone(), res, w, 1e-5)
    for trial in range(3):
        x.copy_(torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(trial * 9 + comm.rank)).to(device))
        graph.replay()
        total = comm.all_reduce(x.clone())
        want = rms_norm(total, w, 1e-5, res)
        errors += _norm_mismatch(fused, want, f"graph {trial}") + _norm_mismatch(again, want, f"graph {trial} again")
        if not torch.equal(plain, total):
            errors.append(f"graph {trial}: the plain all-reduce between the fused ones")
    return errors


def _norm_mismatch(got: tuple, want: tuple, what: str) -> list[str]:
    errors = [] if torch.equal(got[1], want[1]) else [f"{what}: residual not bit for bit"]
    tol = 1e-5 if got[0].dtype == torch.float32 else 2e-2
    if not torch.allclose(got[0].float(), want[0].float(), rtol=tol, atol=tol):
        errors.append(f"{what}: norm off by {(got[0].float() - want[0].float()).abs().max().item():.3g}")
    return errors


def _latency(comm: Communicator, plain: Communicator, device: torch.device, world: int) -> dict:
    """Microseconds per all-reduce inside a CUDA graph of 64 per message size: the one-shot path (pagedllm's Triton
    kernel where it set up), torch's one-shot op on the same buffers, NCCL."""
    table = {}
    bufs = comm.symm.bufs if comm.symm is not None else None
    for n in _sizes(world):
        row = {}
        for name, c in (("custom", comm), ("torch-one-shot", comm), ("nccl", plain)):
            if name == "torch-one-shot" and bufs is None:
                continue
            if comm.symm is not None:
                comm.symm.bufs = None if name == "torch-one-shot" else bufs
            x = torch.randn(64, n, device=device).to(torch.bfloat16)
            row[name] = _graph_us(lambda i, c=c, x=x: c.all_reduce(x[i]), plain)
        if comm.symm is not None:
            comm.symm.bufs = bufs
            if bufs is not None:  # torch's op staged data in the buffer: empty again for the Triton kernel
                from pagedllm.kernels.all_reduce import fill_empty

                torch.cuda.synchronize()
                fill_empty(comm.symm.buffer)
                torch.cuda.synchronize()
                plain.barrier()
        table[f"{n * 2 // 1024}KB"] = row
    if bufs is not None:
        table["8KB fused with RMSNorm"] = _norm_latency(comm, plain, device)
    return table


def _norm_latency(comm: Communicator, plain: Communicator, device: torch.device) -> dict:
    """Microseconds per decode-sized all-reduce + residual add + RMSNorm (64 in a CUDA graph): fused, and as two
    kernels."""
    from pagedllm.kernels.fused_ops import rms_norm

    row = {}
    x = torch.randn(64, 1, HIDDEN, device=device).to(torch.bfloat16)
    res, w = torch.randn(1, HIDDEN, device=device).to(torch.bfloat16), torch.ones(HIDDEN, device=device)
    w = w.to(torch.bfloat16)
    for name in ("fused", "two kernels"):

        def step(i, fused=name == "fused"):
            if fused:
                return comm.all_reduce_rms_norm(x[i], res, w, 1e-5)
            return rms_norm(comm.all_reduce(x[i]), w, 1e-5, res)

        row[name] = _graph_us(step, plain)
    return row


def _graph_us(step, plain: Communicator) -> float:
    """Microseconds per step(i) in a CUDA graph of step(0..63), replayed 20 times after the ranks meet (step(0) run
    once first, outside the capture)."""
    step(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(64):
            step(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    plain.barrier()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / (20 * 64) * 1e6, 2)


def run(world: int, device_type: str, bench: bool, tmp: str) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_check, args=(world, port, device_type, bench, tmp), nprocs=world, start_method="spawn")
    reports = []
    for rank in range(world):
        with open(f"{tmp}.{rank}") as f:
            reports.append(json.load(f))
    return reports


def test_gloo_collectives_and_no_one_shot_on_cpu(tmp_path):
    reports = run(2, "cpu", False, str(tmp_path / "r"))
    assert all(not r["errors"] and not r["one_shot"] for r in reports), reports


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_one_shot_all_reduce_equals_nccl(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    reports = run(world, "cuda", False, str(tmp_path / "r"))
    assert all(r["one_shot"] for r in reports), "symmetric memory did not set up"
    if importlib.util.find_spec("triton") is not None:
        assert all(r["triton"] for r in reports), "the Triton one-shot kernel did not set up (torch's op ran)"
    assert all(not r["errors"] for r in reports), reports


if __name__ == "__main__":
    world, kind = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda"
    print(json.dumps(run(world, kind, "bench" in sys.argv, os.path.join("/tmp", f"collectives-{os.getpid()}"))))
