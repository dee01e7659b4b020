"""One-shot and two-shot all-reduces of small tensors over peer-mapped (symmetric) GPU memory, in Triton, optionally
fused with the residual add and RMSNorm that follow them in a decoder layer: one kernel, launched with programmatic
dependent launch like the decode path's other kernels (kernels/__init__.py: pdl).

Each rank's buffer (set up by distributed/symm_all_reduce.py) holds data slots [2][world][capacity]. The data carry
their own arrival (a Lamport-style buffer, no flags): every slot starts filled with EMPTY, a bit pattern no value
sent ever has (-0.0 in 16-bit dtypes, which is sent as +0.0; a negative denormal in float32, sent as -0.0). The
tensor is cut into units (rows with the norm, CHUNK_BYTES chunks without) and program p of the fixed grid of
MAX_PROGRAMS owns units p, p + P, ...: it stores each unit into slot `rank` of every peer's buffer (slot set e % 2,
e counting the program's calls), then polls its own buffer's peer slots until no element is EMPTY, sums the ranks in
rank order (every rank gets the same bits), and fills the slots it read with EMPTY again.

The two-shot form sends 2 (world - 1) / world of the tensor instead of (world - 1) times it (larger tensors, groups
of four or more): a unit is `world` shards, rank q sums the q-th shard of every unit. Each rank stores shard q of its
units into slot `rank` of rank q's buffer; rank q waits for its shards, sums them in rank order and stores the sums
into a gather region of every rank's buffer (its own included); every rank then waits for its gather region's units
and takes them whole (the sum, or with the norm the row's residual add and RMSNorm).

Alternating slot sets (and gather regions) is safe: a peer writes set e % 2 again only in call e + 2, which it starts
after finishing call e + 1, which needed this rank's call e + 1 data (every call, either form, has every rank wait
for data from every peer: the two-shot needs every rank to own part of the first unit), which this rank sends only
after its call e (reads and refills included) finished: stream order, and under PDL every kernel waits for the whole
kernel before it. Every call refills all it read, so units may change size between calls. An empty tensor launches
nothing: a call without units would count without the exchange that makes the reuse safe. Calls are counted per
program on the device (the grid is always MAX_PROGRAMS, so every count is the call count), so every rank must run
the same sequence of all-reduces, as tensor-parallel ranks do; parity survives the int32 wrap. A wait that outlasts
MAX_SPINS polls (a peer that skipped an all-reduce, or died) traps: the kernel fails with a CUDA error instead of
hanging. A program waits only for what its peers' same-numbered programs send before they wait (or, two-shot, after
waiting only for what was sent first), so no wait depends on one that cannot end, even where the grid is not
resident all at once (rows past 4096 columns take one program an SM)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import pdl
from pagedllm.kernels.fused_ops import wait_previous_kernel

CHUNK_BYTES = 2048  # bytes of a unit without the norm
MAX_PROGRAMS = 128
MAX_SPINS = 1 << 26  # polls of one unit before the kernel gives up (tens of seconds)
MAX_NORM_ELEMENTS = 16384  # the longest row the fused norm takes (one program holds a row)
EMPTY_16 = tl.constexpr(-32768)  # 0x8000: -0.0 in float16 and bfloat16
EMPTY_32 = tl.constexpr(-2147450880)  # 0x80008000: two 16-bit EMPTYs, so one refill pattern serves every dtype
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _trap(token):
    """Ends the kernel with an error (a wait that cannot end)."""
    return tl.inline_asm_elementwise("trap; mov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _empty(v, WIDE: tl.constexpr):
    """Where v holds the EMPTY pattern."""
    if WIDE:
        empty = v.to(tl.int32, bitcast=True) == EMPTY_32
    else:
        empty = v.to(tl.int16, bitcast=True) == EMPTY_16
    return empty


@triton.jit
def _sendable(x, WIDE: tl.constexpr):
    """x with the EMPTY pattern replaced (by +0.0 in 16-bit dtypes, by -0.0 in float32)."""
    if WIDE:
        replacement = tl.full(x.shape, -2147483648, tl.int32).to(x.dtype, bitcast=True)
    else:
        replacement = tl.zeros_like(x)
    return tl.where(_empty(x, WIDE), replacement, x)


@triton.jit
def _arrived(v, ok, WIDE: tl.constexpr):
    """1 when no element of v (where ok) is EMPTY."""
    return 1 - tl.max((_empty(v, WIDE) & ok).to(tl.int32), 0)


@triton.jit
def all_reduce_kernel(
    x_ptr,  # [num_units * UNIT] this rank's input; without NORM replaced by the sum
    res_ptr,  # [num_units * UNIT] the residual (NORM)
    w_ptr,  # [UNIT] the norm's weight (NORM)
    out_ptr,  # [num_units * UNIT] norm(sum + residual) * weight (NORM)
    res_out_ptr,  # [num_units * UNIT] sum + residual (NORM)
    bufs_ptr,  # [WORLD] int64: each rank's buffer address (as mapped in this process)
    calls_ptr,  # [MAX_PROGRAMS] int32: calls so far of each program (this rank's)
    numel,
    num_units,
    eps,
    UNIT: tl.constexpr,  # elements of a unit: a row (NORM) or CHUNK_BYTES
    BLOCK: tl.constexpr,  # UNIT rounded up to a power of two
    CAPACITY: tl.constexpr,  # elements per data slot
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    NORM: tl.constexpr,
    WIDE: tl.constexpr,  # 32-bit dtype
    PROGRAMS: tl.constexpr,  # the grid (MAX_PROGRAMS)
    MAX_SPINS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    e = tl.load(calls_ptr + pid) + 1  # wraps from 2**31 - 1 to -2**31: parity kept
    slots = (e & 1) * WORLD  # this call's slot set
    offs = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    for first in range(0, num_units, PROGRAMS):
        start = (first + pid) * UNIT  # past the tensor (all masked) in a program without a unit this round
        ok = (offs < UNIT) & (start + offs < numel)
        x = _sendable(tl.load(x_ptr + start + offs, mask=ok, other=0.0), WIDE)
        for p in tl.static_range(WORLD):
            if p != RANK:
                tl.store(_buffer(bufs_ptr, p, dtype) + (slots + RANK) * CAPACITY + start + offs, x, mask=ok)
    mine = _buffer(bufs_ptr, RANK, dtype)
    for first in range(0, num_units, PROGRAMS):
        start = (first + pid) * UNIT  # past the tensor (all masked) in a program without a unit this round
        ok = (offs < UNIT) & (start + offs < numel)
        acc = _sum_ranks(x_ptr, mine, slots, start, offs, ok, BLOCK, CAPACITY, RANK, WORLD, WIDE, MAX_SPINS)
        total = acc.to(dtype)  # the sum in the tensor's dtype, as the unfused all-reduce leaves it
        _finish(total, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, start, offs, ok, eps, UNIT, NORM)
    tl.store(calls_ptr + pid, e)


@triton.jit
def two_shot_kernel(
    x_ptr,  # [num_units * UNIT] this rank's input; without NORM replaced by the sum
    res_ptr,  # [num_units * UNIT] the residual (NORM)
    w_ptr,  # [UNIT] the norm's weight (NORM)
    out_ptr,  # [num_units * UNIT] norm(sum + residual) * weight (NORM)
    res_out_ptr,  # [num_units * UNIT] sum + residual (NORM)
    bufs_ptr,  # [WORLD] int64: each rank's buffer address (as mapped in this process)
    calls_ptr,  # [MAX_PROGRAMS] int32: calls so far of each program (this rank's)
    numel,
    num_units,
    eps,
    UNIT: tl.constexpr,  # elements of a unit: a row (NORM) or WORLD * SHARD
    SHARD: tl.constexpr,  # elements of a unit that each rank sums (rank q: the q-th SHARD)
    SBLOCK: tl.constexpr,  # SHARD rounded up to a power of two
    BLOCK: tl.constexpr,  # UNIT rounded up to a power of two
    CAPACITY: tl.constexpr,  # elements per data slot
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    NORM: tl.constexpr,
    WIDE: tl.constexpr,  # 32-bit dtype
    PROGRAMS: tl.constexpr,  # the grid (MAX_PROGRAMS)
    MAX_SPINS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    e = tl.load(calls_ptr + pid) + 1  # wraps from 2**31 - 1 to -2**31: parity kept
    slots = (e & 1) * WORLD  # this call's scatter slot set
    gathered = (2 * WORLD + (e & 1)) * CAPACITY  # this call's gather region
    dtype = x_ptr.dtype.element_ty
    mine = _buffer(bufs_ptr, RANK, dtype)
    soffs = tl.arange(0, SBLOCK)
    # (a program past the last unit is all masked: num_units * UNIT >= numel)
    for first in range(0, num_units, PROGRAMS):  # 1. each unit's q-th shard to rank q (slot `RANK`)
        for q in tl.static_range(WORLD):
            if q != RANK:
                start = (first + pid) * UNIT + q * SHARD
                ok = (soffs < SHARD) & (start + soffs < numel)
                x = _sendable(tl.load(x_ptr + start + soffs, mask=ok, other=0.0), WIDE)
                tl.store(_buffer(bufs_ptr, q, dtype) + (slots + RANK) * CAPACITY + start + soffs, x, mask=ok)
    for first in range(0, num_units, PROGRAMS):  # 2. this rank's shards summed, the sums to every rank's region
        start = (first + pid) * UNIT + RANK * SHARD
        ok = (soffs < SHARD) & (start + soffs < numel)
        acc = _sum_ranks(x_ptr, mine, slots, start, soffs, ok, SBLOCK, CAPACITY, RANK, WORLD, WIDE, MAX_SPINS)
        total = _sendable(acc.to(dtype), WIDE)
        for q in tl.static_range(WORLD):
            tl.store(_buffer(bufs_ptr, q, dtype) + gathered + start + soffs, total, mask=ok)
    offs = tl.arange(0, BLOCK)
    for first in range(0, num_units, PROGRAMS):  # 3. the units whole, from this rank's gather region
        start = (first + pid) * UNIT
        ok = (offs < UNIT) & (start + offs < numel)
        total = _receive(mine + gathered + start + offs, ok, BLOCK, WIDE, MAX_SPINS)
        _finish(total, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, start, offs, ok, eps, UNIT, NORM)
    tl.store(calls_ptr + pid, e)


@triton.jit
def _buffer(bufs_ptr, rank, dtype: tl.constexpr):
    """Rank `rank`'s buffer, as mapped in this process, holding `dtype`."""
    return tl.multiple_of(tl.load(bufs_ptr + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _sum_ranks(
    x_ptr, mine, slots, start, offs, ok, BLOCK: tl.constexpr, CAPACITY: tl.constexpr, RANK: tl.constexpr,
    WORLD: tl.constexpr, WIDE: tl.constexpr, MAX_SPINS: tl.constexpr,
):  # fmt: skip
    """The float32 sum over the ranks, in rank order, of x[start + offs] (this rank's, as sent) and the peers' parts
    in this rank's slots of set `slots` (each received, then refilled)."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            v = _sendable(tl.load(x_ptr + start + offs, mask=ok, other=0.0), WIDE)
        else:
            v = _receive(mine + (slots + q) * CAPACITY + start + offs, ok, BLOCK, WIDE, MAX_SPINS)
        acc += v.to(tl.float32)
    return acc


@triton.jit
def _receive(slot, ok, BLOCK: tl.constexpr, WIDE: tl.constexpr, MAX_SPINS: tl.constexpr):
    """slot's values once none (where ok) is EMPTY; the slot is filled with EMPTY again. Traps after MAX_SPINS."""
    v = tl.load(slot, mask=ok, other=0.0, volatile=True)
    spins = 0
    while _arrived(v, ok, WIDE) == 0:
        v = tl.load(slot, mask=ok, other=0.0, volatile=True)
        spins += 1
        if spins > MAX_SPINS:
            _trap(spins)
    if WIDE:
        tl.store(slot.to(tl.pointer_type(tl.int32)), tl.full((BLOCK,), EMPTY_32, tl.int32), mask=ok)
    else:
        tl.store(slot.to(tl.pointer_type(tl.int16)), tl.full((BLOCK,), EMPTY_16, tl.int16), mask=ok)
    return v


@triton.jit
def _finish(
    total, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, start, offs, ok, eps, UNIT: tl.constexpr, NORM: tl.constexpr
):
    """A unit's sum into x, or (NORM) its residual add and RMSNorm into res_out and out."""
    dtype = x_ptr.dtype.element_ty
    if NORM:
        r = tl.load(res_ptr + start + offs, mask=ok, other=0.0)
        h = (total.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the new residual, rounded to the dtype
        tl.store(res_out_ptr + start + offs, h, mask=ok)
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, 0) / UNIT + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = (hf * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_ptr + start + offs, y.to(dtype), mask=ok)
    else:
        tl.store(x_ptr + start + offs, total, mask=ok)


def buffer_bytes(world: int, max_bytes: int, two_shot: bool) -> int:
    """A rank's buffer: two sets of `world` data slots (one-shot; the two-shot's scatter), then, where the two-shot
    kernel may run, two gather regions, each of max_bytes."""
    return (2 * world + (2 if two_shot else 0)) * max_bytes


def fill_empty(buffer: torch.Tensor) -> None:
    """Fills a (uint8) buffer with the EMPTY pattern: every slot starts empty."""
    buffer.view(torch.int16).fill_(EMPTY_16.value)


def two_shot_fits(x: torch.Tensor, world: int, norm: bool) -> bool:
    """Whether the two-shot kernel takes x (contiguous; [M, N] with norm): every rank must own part of the first
    unit (it then hears from every peer in every call, which makes the slot sets' reuse safe), in 16-byte pieces."""
    if norm:
        n = x.shape[-1]
        return n % world == 0 and (n // world * x.element_size()) % 16 == 0
    return x.numel() * x.element_size() >= world * CHUNK_BYTES


def all_reduce(
    x: torch.Tensor, bufs: torch.Tensor, calls: torch.Tensor, rank: int, world: int, max_bytes: int,
    two_shot: bool = False,
) -> None:  # fmt: skip
    """Sums contiguous x (numel * itemsize <= max_bytes, a multiple of 16 bytes) over the ranks in place; bufs
    [world] int64 the buffers' addresses, calls [MAX_PROGRAMS] int32 (zeros at first, then the kernel's). two_shot:
    each rank sums a 1 / world share and gathers the others' (where two_shot_fits), else every rank sums it all."""
    chunk = CHUNK_BYTES // x.element_size()
    unit = world * chunk if two_shot else chunk
    shard = chunk if two_shot else None
    _launch(x, None, None, None, None, bufs, calls, triton.cdiv(x.numel(), unit), unit, shard, 0.0, rank, world,
            max_bytes)  # fmt: skip


def all_reduce_rms_norm(
    x: torch.Tensor,  # [M, N] this rank's partial sums
    residual: torch.Tensor,  # [M, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    bufs: torch.Tensor,
    calls: torch.Tensor,
    rank: int,
    world: int,
    max_bytes: int,
    two_shot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s + residual) * weight, s + residual), s the sum of x over the ranks; x, residual and weight contiguous,
    one dtype, M * N * itemsize <= max_bytes, N * itemsize a multiple of 16, N <= MAX_NORM_ELEMENTS. two_shot: as
    all_reduce's (each rank sums N / world columns of every row)."""
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    m, n = x.shape
    _launch(x, residual, weight, out, res_out, bufs, calls, m, n, n // world if two_shot else None, eps, rank, world,
            max_bytes)  # fmt: skip
    return out, res_out


def _launch(x, res, w, out, res_out, bufs, calls, num_units, unit, shard, eps, rank, world, max_bytes) -> None:
    if x.numel() == 0:  # nothing to sum; and a call without units must not count (see the module's docstring)
        return
    norm = res is not None
    block = triton.next_power_of_2(unit)
    args = (x, res if norm else x, w if norm else x, out if norm else x, res_out if norm else x, bufs, calls,
            x.numel(), num_units, eps)  # fmt: skip
    common = dict(
        UNIT=unit, BLOCK=block, CAPACITY=max_bytes // x.element_size(), RANK=rank, WORLD=world, NORM=norm,
        WIDE=x.element_size() == 4, PROGRAMS=MAX_PROGRAMS, MAX_SPINS=MAX_SPINS, num_warps=4 if block <= 4096 else 8,
        **pdl(x),
    )  # fmt: skip
    if shard is None:
        all_reduce_kernel[(MAX_PROGRAMS,)](*args, **common)
    else:
        two_shot_kernel[(MAX_PROGRAMS,)](*args, SHARD=shard, SBLOCK=triton.next_power_of_2(shard), **common)
