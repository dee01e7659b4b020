"""A one-shot all-reduce of small tensors over peer-mapped (symmetric) GPU memory, in Triton: one kernel, launched
with programmatic dependent launch like the decode path's other kernels (kernels/__init__.py: pdl).

Each rank's buffer (set up by distributed/symm_all_reduce.py) holds data slots [2][world][capacity] in the tensor's
dtype, then int32 flags [world][MAX_PROGRAMS]. Program p on rank r owns the chunks p, p + P, ... of the flat
tensor (P programs): it stores them into slot r of every rank's buffer (slot set e % 2, e counting the program's
calls), raises its flag to e at every rank (a system-scope release after a system fence), waits until the flag of
every rank's program p at r reaches e (acquire), then sums the world slots in rank order into the tensor: every rank
gets the same bits.

A chunk is CHUNK_BYTES whatever the dtype, so program p owns the same bytes of every slot in every call (chunk c
belongs to program c % MAX_PROGRAMS). Reusing a slot set every other call is then safe: a rank starts call e + 2 of
program p only after each peer's program p raised its flag for call e + 1, which (stream order; PDL waits for the
whole kernel before) follows that peer's reads of call e. Calls are counted per program on the device, so every rank
must run the same sequence of all-reduces, as tensor-parallel ranks do; the int32 counts wrap around, so parity and
"reached" are taken modulo 2**32. A wait that outlasts MAX_SPINS polls (a peer that skipped an all-reduce, or died)
traps: the kernel fails with a CUDA error instead of hanging. The grid stays at MAX_PROGRAMS programs or fewer (all
resident at once, so no program waits on a peer program that cannot be scheduled)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import pdl
from pagedllm.kernels.fused_ops import wait_previous_kernel

CHUNK_BYTES = 2048  # bytes a program moves per step
MAX_PROGRAMS = 64
MAX_SPINS = 1 << 26  # polls of one flag before the kernel gives up (tens of seconds)


@triton.jit
def _fence_system(token):
    """fence.acq_rel.sys: this thread's stores (to peers' memory too) are ordered before its later ones."""
    return tl.inline_asm_elementwise(
        "fence.acq_rel.sys; mov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _trap(token):
    """Ends the kernel with an error (a wait that cannot end)."""
    return tl.inline_asm_elementwise("trap; mov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def one_shot_all_reduce_kernel(
    x_ptr,  # [numel] this rank's input, replaced by the sum
    bufs_ptr,  # [WORLD] int64: each rank's buffer address (as mapped in this process)
    calls_ptr,  # [MAX_PROGRAMS] int32: calls so far of each program (this rank's)
    numel,
    CAPACITY: tl.constexpr,  # elements per data slot
    FLAGS_OFFSET: tl.constexpr,  # bytes from a buffer's start to its flags
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,  # elements: CHUNK_BYTES of the dtype
    MAX_PROGRAMS: tl.constexpr,
    MAX_SPINS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * CHUNK
    e = tl.load(calls_ptr + pid) + 1  # wraps from 2**31 - 1 to -2**31
    slots = (e & 1) * WORLD  # this call's slot set
    offs = tl.arange(0, CHUNK)
    dtype = x_ptr.dtype.element_ty
    for start in range(pid * CHUNK, numel, step):
        start = tl.multiple_of(start, CHUNK)
        mask = start + offs < numel
        x = tl.load(x_ptr + start + offs, mask=mask)
        for p in tl.static_range(WORLD):
            peer = tl.multiple_of(tl.load(bufs_ptr + p).to(tl.pointer_type(dtype)), 16)
            tl.store(peer + (slots + RANK) * CAPACITY + start + offs, x, mask=mask)
    _fence_system(e)
    tl.debug_barrier()  # every thread's stores fenced before the flags go up
    for p in tl.static_range(WORLD):
        flags = (tl.load(bufs_ptr + p) + FLAGS_OFFSET).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + RANK * MAX_PROGRAMS + pid, e, sem="release", scope="sys")
    mine = tl.load(bufs_ptr + RANK)
    flags = (mine + FLAGS_OFFSET).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        seen = tl.atomic_add(flags + q * MAX_PROGRAMS + pid, 0, sem="acquire", scope="sys")
        spins = 0
        while seen - e < 0:  # not reached e yet, modulo 2**32 (flags are never more than one call apart)
            seen = tl.atomic_add(flags + q * MAX_PROGRAMS + pid, 0, sem="acquire", scope="sys")
            spins += 1
            if spins > MAX_SPINS:
                _trap(spins)
    tl.debug_barrier()  # the peers' data visible to every thread
    data = tl.multiple_of(mine.to(tl.pointer_type(dtype)), 16)
    for start in range(pid * CHUNK, numel, step):
        start = tl.multiple_of(start, CHUNK)
        mask = start + offs < numel
        acc = tl.zeros((CHUNK,), dtype=tl.float32)
        for q in tl.static_range(WORLD):
            acc += tl.load(data + (slots + q) * CAPACITY + start + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + start + offs, acc.to(dtype), mask=mask)
    tl.store(calls_ptr + pid, e)


def buffer_bytes(world: int, max_bytes: int) -> int:
    """A rank's buffer: two slot sets of `world` slots of max_bytes, then the flags."""
    return 2 * world * max_bytes + world * MAX_PROGRAMS * 4


def one_shot_all_reduce(
    x: torch.Tensor, bufs: torch.Tensor, calls: torch.Tensor, rank: int, world: int, max_bytes: int
) -> None:
    """Sums contiguous x (numel * itemsize <= max_bytes) over the ranks in place; bufs [world] int64 the buffers'
    addresses, calls [MAX_PROGRAMS] int32 (zeros at first, then the kernel's)."""
    numel, chunk = x.numel(), CHUNK_BYTES // x.element_size()
    grid = min(MAX_PROGRAMS, triton.cdiv(numel, chunk))
    one_shot_all_reduce_kernel[(grid,)](
        x, bufs, calls, numel, CAPACITY=max_bytes // x.element_size(), FLAGS_OFFSET=2 * world * max_bytes,
        RANK=rank, WORLD=world, CHUNK=chunk, MAX_PROGRAMS=MAX_PROGRAMS, MAX_SPINS=MAX_SPINS, num_warps=4, **pdl(x),
    )  # fmt: skip
