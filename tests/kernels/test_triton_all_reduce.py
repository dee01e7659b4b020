"""The one-shot and two-shot all-reduce kernels (kernels/all_reduce.py) and their fused residual-add + RMSNorm form,
on CPU: the ranks are forked processes running Triton's interpreter over shared-memory buffers (each maps every
rank's buffer, as GPUs map their peers'), so the protocol itself is checked: the sums, the norm, the EMPTY pattern
restored after every call, the slot sets alternating, inputs that hold the EMPTY pattern, one-shot and two-shot
calls mixed on the same buffers. On GPUs the same kernels run across processes in
tests/distributed/test_collectives.py."""

from __future__ import annotations

import ctypes
import multiprocessing
import random
import time

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():  # compiled kernels take GPU memory: test_collectives.py runs them across GPUs
    pytest.skip("the interpreter's check; on GPUs see tests/distributed/test_collectives.py", allow_module_level=True)
from pagedllm.kernels import all_reduce as ar  # noqa: E402

MAX_BYTES = 1 << 16


@pytest.fixture(autouse=True)
def few_programs(monkeypatch):
    """A smaller fixed grid: the interpreter runs programs one after another, and with few programs each one takes
    several units (the protocol is the same for any grid)."""
    monkeypatch.setattr(ar, "MAX_PROGRAMS", 4)


class Ranks:
    """`world` ranks as forked processes sharing their buffers (each maps them at its own addresses, as GPUs map
    their peers'), with call counters that persist from one `run` to the next."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.buffers = [
            torch.empty(ar.buffer_bytes(world, MAX_BYTES, two_shot=True), dtype=torch.uint8) for _ in range(world)
        ]
        for b in self.buffers:
            ar.fill_empty(b)
            b.share_memory_()
        self.calls = [torch.zeros(ar.MAX_PROGRAMS, dtype=torch.int32).share_memory_() for _ in range(world)]

    def run(self, fn) -> list:
        """fn(rank, ptrs, calls) -> tensors, on every rank at once; their results in rank order."""
        ctx = multiprocessing.get_context("fork")  # no CUDA here; the interpreter is not thread-safe
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(self, fn, r, queue)) for r in range(self.world)]
        for p in procs:
            p.start()
        try:
            got = dict(queue.get(timeout=300) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        assert all(not isinstance(v, str) for v in got.values()), got
        return [[_tensor(*t) for t in got[r]] for r in range(self.world)]

    def all_empty(self) -> bool:
        return all(bool((b.view(torch.int16) == ar.EMPTY_16.value).all()) for b in self.buffers)


def _one_access_an_element() -> None:
    """Interpreted loads and stores that read and write each element with one access of its width, as a GPU's do.
    The interpreter copies an element with memcpy, which glibc does for two bytes as a byte and a word: a load may
    take its low byte before a peer's store and its high byte after (an EMPTY slot read as a half-arrived value), and
    a store writes its low byte twice (once more after the reader may have refilled the slot)."""
    from triton.runtime import interpreter

    def elements(addrs: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
        base = int(addrs.min())
        offsets = addrs - np.uint64(base)
        assert base % itemsize == 0 and not (offsets % np.uint64(itemsize)).any()
        span = int(offsets.max()) + itemsize
        memory = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(base)).view(f"u{itemsize}")
        return memory, (offsets // np.uint64(itemsize)).astype(np.intp)

    def load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        dtype = ptrs.get_element_ty()
        np_dtype = interpreter._get_np_dtype(dtype)
        shape = ptrs.data.shape
        out = np.zeros(shape, np_dtype) if other is None else np.array(np.broadcast_to(other.data, shape), np_dtype)
        m = np.broadcast_to(mask.data, shape).astype(bool)
        if m.any():
            itemsize = out.itemsize
            memory, idx = elements(ptrs.data[m], itemsize)
            out.view(f"u{itemsize}")[m] = memory[idx]
        return interpreter.TensorHandle(out, dtype)

    def store(self, ptrs, value, mask, cache_modifier, eviction_policy):
        shape = ptrs.data.shape
        m = np.broadcast_to(mask.data, shape).astype(bool)
        if m.any():
            values = np.ascontiguousarray(np.broadcast_to(value.data, shape)[m])
            memory, idx = elements(ptrs.data[m], values.itemsize)
            memory[idx] = values.view(f"u{values.itemsize}")

    interpreter.InterpreterBuilder.create_masked_load = load
    interpreter.InterpreterBuilder.create_masked_store = store


def _tensor(dtype: torch.dtype, shape: torch.Size, data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _rank_main(ranks: Ranks, fn, rank: int, queue) -> None:
    try:
        _one_access_an_element()
        ptrs = torch.tensor([b.data_ptr() for b in ranks.buffers], dtype=torch.int64)
        out = fn(rank, ptrs, ranks.calls[rank])
        queue.put((rank, [(t.dtype, t.shape, t.contiguous().view(torch.uint8).numpy().tobytes()) for t in out]))
    except Exception as e:
        queue.put((rank, f"{type(e).__name__}: {e}"))


def _inputs(world: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    xs[0].view(-1)[:3] = -0.0  # the 16-bit EMPTY pattern, sent as +0.0
    if dtype == torch.float32 and xs[-1].numel() >= 7:  # float32's EMPTY pattern (a negative denormal), sent as -0.0
        xs[-1].view(-1)[5:7] = torch.tensor([ar.EMPTY_32.value] * 2, dtype=torch.int32).view(torch.float32)
    return xs


def _reference_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_reduce_sums_and_leaves_buffers_empty(world, dtype):
    ranks = Ranks(world)
    # sizes that change between calls (units refilled whatever their size), an odd last chunk, both slot sets, an
    # empty tensor (no launch, not counted); one-shot and two-shot calls mixed on the same buffers
    counted = 0
    calls = [(1024, False), (3000, False), (0, False), (8, False), (7000, True), (1024, False), (4104, True)]
    calls += [(16000, False), (16000, True)]  # more units than programs
    for call, (numel, two_shot) in enumerate(calls):
        xs = _inputs(world, (numel,), dtype, seed=call)
        if two_shot:
            assert ar.two_shot_fits(xs[0], world, norm=False)

        def fn(rank, ptrs, calls, xs=xs, two_shot=two_shot):
            x = xs[rank].clone()
            ar.all_reduce(x, ptrs, calls, rank, world, MAX_BYTES, two_shot=two_shot)
            return [x]

        outs = ranks.run(fn)
        ref = _reference_sum(xs)
        for (out,) in outs:
            assert torch.equal(out, outs[0][0])  # same bits on every rank
            torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=1e-30 if dtype == torch.float32 else 0)
        assert ranks.all_empty()
        counted += numel > 0
        assert all(int(c[0]) == counted for c in ranks.calls)


def test_two_shot_fits_only_where_every_rank_owns_part_of_the_first_unit():
    assert ar.two_shot_fits(torch.empty(4 * ar.CHUNK_BYTES // 2, dtype=torch.bfloat16), 4, norm=False)
    assert not ar.two_shot_fits(torch.empty(4 * ar.CHUNK_BYTES // 2 - 8, dtype=torch.bfloat16), 4, norm=False)
    assert ar.two_shot_fits(torch.empty(3, 4096, dtype=torch.bfloat16), 4, norm=True)
    assert not ar.two_shot_fits(torch.empty(3, 252, dtype=torch.bfloat16), 3, norm=True)  # 84 columns: 168 bytes
    assert not ar.two_shot_fits(torch.empty(3, 4100, dtype=torch.bfloat16), 4, norm=True)


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_rms_norm_matches_the_unfused_ops(world):
    dtype, eps = torch.bfloat16, 1e-5
    ranks = Ranks(world)
    shapes = [(1, 528, False), (3, 264, False), (2, 528, True), (5, 48 * world, True), (2, 528, False)]
    for call, (m, n, two_shot) in enumerate(shapes):
        xs = _inputs(world, (m, n), dtype, seed=10 + call)
        g = torch.Generator().manual_seed(call)
        residual = torch.randn(m, n, generator=g).to(dtype)
        weight = torch.randn(n, generator=g).to(dtype)
        assert not two_shot or ar.two_shot_fits(xs[0], world, norm=True)

        def fn(rank, ptrs, calls, xs=xs, residual=residual, weight=weight, two_shot=two_shot):
            x = xs[rank].clone()
            return ar.all_reduce_rms_norm(x, residual, weight, eps, ptrs, calls, rank, world, MAX_BYTES, two_shot)

        outs = ranks.run(fn)
        total = _reference_sum(xs)
        h = (total.float() + residual.float()).to(dtype)
        hf = h.float()
        y = ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float() * weight.float()).to(dtype)
        for out, res_out in outs:
            assert torch.equal(res_out, h)
            torch.testing.assert_close(out.float(), y.float(), rtol=0.02, atol=0.02)  # rsqrt / sum order vs torch
            assert torch.equal(out, outs[0][0])
        assert ranks.all_empty()


def _drift(rank: int) -> None:
    """Random pauses (longer than a kernel launch in the interpreter) before the interpreted stores of every rank but
    the first: the first rank runs ahead and starts its next call while a peer has read but not yet refilled the
    last one's slots, which the alternating slot sets keep apart."""
    from triton.runtime import interpreter

    if rank == 0:
        return
    rnd = random.Random(rank)
    original = interpreter.InterpreterBuilder.create_masked_store

    def paused(self, *args, **kwargs):
        if rnd.random() < 0.3:
            time.sleep(rnd.random() * 0.3)
        return original(self, *args, **kwargs)

    interpreter.InterpreterBuilder.create_masked_store = paused


@pytest.mark.parametrize("world", [2, 4])
def test_call_sequences_without_barriers(world):
    """Each rank runs the whole sequence in one process, drifting: plain and fused, one-shot and two-shot, sizes and
    dtypes changing from call to call, and a float32 two-shot sum that is the EMPTY pattern itself (sent as -0.0)."""
    ranks, eps = Ranks(world), 1e-5
    empty = torch.tensor([ar.EMPTY_32.value], dtype=torch.int32).view(torch.float32)
    # back-to-back calls of one unit: a rank done with its only program starts the next call while its peer still
    # reads the same unit's slot (the parity keeps them apart)
    plan = [("plain", torch.bfloat16, (1000,), False)] * 3 + [("norm", torch.bfloat16, (1, 64 * world), True)] * 2
    plan += [("plain", torch.bfloat16, (3000,), False), ("plain", torch.bfloat16, (world * 1024 + 40,), True)]
    plan += [("norm", torch.bfloat16, (3, 64 * world), True), ("plain", torch.float32, (2048,), True)]
    plan += [("norm", torch.float32, (2, 48), False), ("plain", torch.bfloat16, (8,), False)]
    plan += [("norm", torch.bfloat16, (5, 32 * world), True), ("plain", torch.bfloat16, (8 * world * 1024,), True)]
    inputs = []
    for i, (kind, dtype, shape, two_shot) in enumerate(plan):
        xs = _inputs(world, shape, dtype, seed=100 + i)
        if kind == "plain" and dtype == torch.float32 and two_shot:  # halves of EMPTY: their sum is EMPTY
            for x in xs[:2]:
                x.view(-1)[:4] = empty / 2
            for x in xs[2:]:
                x.view(-1)[:4] = 0.0
        g = torch.Generator().manual_seed(i)
        inputs.append((xs, torch.randn(shape, generator=g).to(dtype), torch.randn(shape[-1:], generator=g).to(dtype)))
        assert not two_shot or ar.two_shot_fits(xs[0], world, norm=kind == "norm")

    def fn(rank, ptrs, calls):
        _drift(rank)
        out = []
        for (kind, _, _, two_shot), (xs, residual, weight) in zip(plan, inputs):
            x = xs[rank].clone()
            if kind == "plain":
                ar.all_reduce(x, ptrs, calls, rank, world, MAX_BYTES, two_shot=two_shot)
                out += [x, x]
            else:
                out += ar.all_reduce_rms_norm(x, residual, weight, eps, ptrs, calls, rank, world, MAX_BYTES, two_shot)
        return out

    outs = ranks.run(fn)
    for i, ((kind, dtype, _, _), (xs, residual, _)) in enumerate(zip(plan, inputs)):
        for rank_out in outs:
            assert torch.equal(rank_out[2 * i], outs[0][2 * i]) and torch.equal(rank_out[2 * i + 1], outs[0][2 * i + 1])
        total = _reference_sum(xs)
        if kind == "plain":
            torch.testing.assert_close(outs[0][2 * i].float(), total.float(), rtol=0, atol=1e-30)
        else:
            assert torch.equal(outs[0][2 * i + 1], (total.float() + residual.float()).to(dtype))
    assert ranks.all_empty()
    assert all(int(c[0]) == len(plan) for c in ranks.calls)
