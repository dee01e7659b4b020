"""One-shot all-reduce over symmetric GPU memory: pagedllm's Triton kernel (kernels/all_reduce.py) on buffers that
torch's symmetric memory maps into every rank, or torch's own one-shot op where Triton is missing.

A decode step's all-reduces are small (batch x hidden, a few KB to a few MB) and bound by latency, not bandwidth. The
Triton kernel stores each rank's input into its slot of every peer's buffer over NVLink and sums the slots as their data
arrive (no flags: the data carry their arrival); in groups of four or more, larger tensors take its two-shot form (each
rank sums a 1 / size share of the tensor and sends the sums to every rank), which sends less. One kernel, capturable in
CUDA graphs, launched with programmatic dependent launch like the kernels around it, and optionally fused with the
residual add and RMSNorm after it (`all_reduce_rms_norm`: the decoder layers' row-parallel outputs, models/llama.py).
torch's op (without Triton) copies its input into its own buffer, meets the peers at a barrier and reads their buffers,
without PDL. Larger tensors, float16 on torch's op (it sums float32 and bfloat16 only) and any failure to set the
buffers up fall back to NCCL.

torch's op finds the group by name in c10d's registry, so the NCCL group is wrapped in a `ProcessGroup` and
registered under a name unique to its engine (the only entry pagedllm puts there; removed at shutdown).

One group per process sets symmetric memory up: torch's allocator keeps per-process state, and a second engine's
rendezvous in the same process failed on GPUs while its fresh worker processes waited. A later engine in a process
that already had one (the driver's process, when a program builds several engines) runs on NCCL only; the ranks
agree on that before any rendezvous, so none waits."""

from __future__ import annotations

import atexit
import logging
import uuid

import torch
import torch.distributed as dist

try:
    from pagedllm.kernels import all_reduce as all_reduce_kernel
except ImportError:  # no Triton: torch's one-shot op
    all_reduce_kernel = None

logger = logging.getLogger(__name__)

# the largest all-reduce a one-shot kernel takes where the two-shot one does not: torch's op (without Triton), and
# the Triton kernel's fused RMSNorm over rows that do not split into 16-byte shards
ONE_SHOT_BYTES = {2: 4 << 20, 4: 1 << 20, 8: 256 << 10}
TWO_SHOT_BYTES = {4: 512 << 10}
# the largest all-reduce taken by the Triton kernels, by group size (TP=2: a decode batch of 256 rows of hidden 4096
# in bfloat16 is 2 MB; 2x and 4x H100, benchmarks in tests/distributed/test_collectives.py). One-shot, each rank
# sends (size - 1) x bytes; two-shot (from TWO_SHOT_BYTES on), 2 (size - 1) / size x bytes, in two hops
MAX_BYTES = {**ONE_SHOT_BYTES, 4: 8 << 20}
DTYPES = (torch.bfloat16, torch.float32)  # torch's op (the Triton kernel's: all_reduce_kernel.DTYPES)
_SET_UP: list[str] = []  # the group that set symmetric memory up in this process (at most one; see above)


def registered_group(
    store: dist.Store, backend: dist.ProcessGroup, rank: int, size: int, device: torch.device, tag: str
) -> tuple[dist.ProcessGroup, str]:
    """`backend` (a ProcessGroupNCCL, or ProcessGroupGloo on CPU) wrapped in a ProcessGroup registered under a name
    the group's ranks agree on (rank 0 draws it and publishes it in the store)."""
    if rank == 0:
        store.set("group_name", f"pagedllm-{tag}-{uuid.uuid4().hex[:12]}")
    name = store.get("group_name").decode()
    pg = dist.ProcessGroup(store, rank, size)
    kind = dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, backend)
    pg._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, pg)
    # an engine never shut down: its group must leave the registry before exit (a registered NCCL group destroyed
    # with C++'s statics aborts the process)
    atexit.register(unregister, name)
    return pg, name


def unregister(name: str) -> None:
    try:
        torch._C._distributed_c10d._unregister_process_group(name)
    except Exception:  # already gone (process exit)
        pass


class SymmAllReduce:
    """The one-shot path of one group: `all_reduce(x)` sums x in place and says True, or says False (x untouched)
    when x is not for this path."""

    def __init__(
        self, name: str, buffer: torch.Tensor, max_bytes: int, rank: int, size: int, bufs: torch.Tensor | None
    ) -> None:
        self.name, self.buffer, self.max_bytes = name, buffer, max_bytes  # buffer: uint8, symmetric
        self.rank, self.size = rank, size
        self.bufs = bufs  # [size] int64: every rank's buffer address here (the Triton kernel), or None (torch's op)
        self.calls = (
            None if bufs is None else torch.zeros(all_reduce_kernel.MAX_PROGRAMS, dtype=torch.int32, device=bufs.device)
        )

    @classmethod
    def create(
        cls, store: dist.Store, pg: dist.ProcessGroup, name: str, rank: int, size: int, device: torch.device
    ) -> SymmAllReduce | None:
        """Every rank of the group calls this; None on every rank unless every rank set its buffer up."""
        max_bytes = MAX_BYTES.get(size)
        buffer = None
        ok = max_bytes is not None and not _SET_UP and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        kernel = all_reduce_kernel is not None
        if ok:
            try:
                from torch._C._distributed_c10d import _SymmetricMemory
                from torch.distributed import _symmetric_memory as symm_mem

                _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore("symm/", store))
                if kernel:
                    nbytes = all_reduce_kernel.buffer_bytes(size, max_bytes, size in TWO_SHOT_BYTES)
                else:
                    max_bytes = nbytes = ONE_SHOT_BYTES[size]
                buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
                if kernel:  # every slot starts empty (every rank fills its own before the agreement below)
                    all_reduce_kernel.fill_empty(buffer)
            except Exception as e:  # no symmetric memory in this torch build or driver
                logger.info("one-shot all-reduce unavailable (%s: %s); NCCL only", type(e).__name__, e)
                ok = False
        if not _all_agree(pg, ok, device):
            return None
        bufs = None
        try:
            handle = symm_mem.rendezvous(buffer, name)
            if kernel:
                bufs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        except Exception as e:
            logger.warning("one-shot all-reduce rendezvous failed (%s: %s); NCCL only", type(e).__name__, e)
            ok = False
        if not _all_agree(pg, ok, device):
            return None
        _SET_UP.append(name)
        return cls(name, buffer, max_bytes, rank, size, bufs)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """The choice depends only on x's dtype, size and layout, which every rank shares (a rank taking NCCL
        while another takes the one-shot kernel would wait forever)."""
        nbytes = x.numel() * x.element_size()
        dtypes = DTYPES if self.bufs is None else all_reduce_kernel.DTYPES
        if x.dtype not in dtypes or nbytes > self.max_bytes or nbytes % 16 or not x.is_contiguous():
            return False
        flat = x.view(-1)
        if self.bufs is not None:
            two_shot = self._two_shot(nbytes) and all_reduce_kernel.two_shot_fits(flat, self.size, norm=False)
            all_reduce_kernel.all_reduce(flat, self.bufs, self.calls, self.rank, self.size, self.max_bytes, two_shot)
            return True
        symm = self.buffer[:nbytes].view(x.dtype)  # [numel] this rank's peer-mapped staging
        if x.data_ptr() % 16 == 0:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.name, flat)
        else:  # the kernel's vector loads and stores need 16-byte alignment: staged through aligned tensors
            symm.copy_(flat)
            flat.copy_(torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", self.name))
        return True

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(s + residual) * weight, s + residual), s the sum of [M, N] x over the ranks, in one kernel; None
        (nothing done) where the Triton kernel does not take these tensors. Like all_reduce, the choice depends only
        on what every rank shares (shapes, dtypes, layouts)."""
        if self.bufs is None or x.dim() != 2 or residual.shape != x.shape or weight.shape != x.shape[-1:]:
            return None
        n, size = x.shape[-1], x.element_size()
        if (
            x.dtype not in all_reduce_kernel.DTYPES
            or residual.dtype != x.dtype
            or weight.dtype != x.dtype
            or x.numel() * size > self.max_bytes
            or (n * size) % 16
            or n > all_reduce_kernel.MAX_NORM_ELEMENTS
            or not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous())
        ):
            return None
        two_shot = self._two_shot(x.numel() * size)
        if two_shot and not all_reduce_kernel.two_shot_fits(x, self.size, norm=True):
            if x.numel() * size > ONE_SHOT_BYTES[self.size]:  # too large for one-shot: plain two-shot, then norm
                return None
            two_shot = False
        return all_reduce_kernel.all_reduce_rms_norm(
            x, residual, weight, eps, self.bufs, self.calls, self.rank, self.size, self.max_bytes, two_shot
        )

    def _two_shot(self, nbytes: int) -> bool:
        return nbytes >= TWO_SHOT_BYTES.get(self.size, self.max_bytes + 1)


def _all_agree(pg: dist.ProcessGroup, ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    pg.allreduce([flag], opts).wait()
    return bool(flag.item())
