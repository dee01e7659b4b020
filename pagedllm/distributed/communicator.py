"""A process group of ranks and the collectives pagedllm uses on it, through torch.distributed (NCCL between GPUs,
gloo between CPU processes).

The groups are torch ProcessGroup objects built directly on a store (no `init_process_group`): a process may hold
several engines. Only an NCCL group is named in c10d's registry (torch's symmetric-memory ops look it up there),
under a name unique to its engine. A group of one rank needs no process group at all: every
collective is then the identity, so single-process code paths never touch torch.distributed."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from pagedllm.distributed.symm_all_reduce import SymmAllReduce, registered_group, unregister


class Communicator:
    """Collectives over `ranks` (global ranks, in group order) for the process at group rank `rank`."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        rank: int,
        ranks: list[int],
        device: torch.device,
        name: str | None = None,
        symm: SymmAllReduce | None = None,
    ) -> None:
        self.pg, self.rank, self.ranks, self.device = pg, rank, list(ranks), device
        self.size = len(self.ranks)
        self.name = name  # the c10d registry name of an NCCL group (None: not registered)
        self.symm = symm  # the one-shot all-reduce of small tensors (None: every all-reduce through pg)

    @classmethod
    def single(cls, device: torch.device) -> Communicator:
        return cls(None, 0, [0], device)

    @classmethod
    def create(
        cls,
        store: dist.Store,
        name: str,
        rank: int,
        ranks: list[int],
        device: torch.device,
        timeout_s: float,
        custom_all_reduce: bool = True,
    ) -> Communicator:
        """The group `name` of global `ranks`, this process being group rank `rank`; every member calls this.
        custom_all_reduce: small all-reduces of an NCCL group take the one-shot kernel (symm_all_reduce.py)."""
        if len(ranks) == 1:
            return cls(None, 0, ranks, device)
        store = dist.PrefixStore(f"pagedllm/{name}/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        quiet_flight_recorder(os.environ)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(store, rank, len(ranks), options)
            pg, registered = registered_group(store, backend, rank, len(ranks), device, name)
            symm = SymmAllReduce.create(store, pg, registered, rank, len(ranks), device) if custom_all_reduce else None
            return cls(pg, rank, ranks, device, registered, symm)
        else:
            pg = dist.ProcessGroupGloo(store, rank, len(ranks), timeout)
        return cls(pg, rank, ranks, device)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the group, in place (also inside CUDA graphs: the collective is queued on the stream)."""
        if self.symm is not None and self.symm.all_reduce(x):
            return x
        if self.pg is not None:
            self.pg.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise max of x over the group, in place."""
        if self.pg is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.pg.allreduce([x], opts).wait()
        return x

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(s + residual) * weight, s + residual), s = x summed over the group, in one fused kernel; None where
        the group has none for these tensors (the caller then all-reduces and normalizes)."""
        return None if self.symm is None else self.symm.all_reduce_rms_norm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[*, d] on each rank -> [*, size * d], the ranks' parts in rank order along the last dim."""
        if self.pg is None:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [size * n, *]
        self.pg._allgather_base(out, x).wait()
        out = out.view(self.size, *x.shape)  # [size, n, ..., d]
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x from group rank `src` on every rank, in place."""
        if self.pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self.pg.broadcast([x], opts).wait()
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        self.pg.send([x.contiguous()], dst, 0).wait()

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fills x (its shape and dtype agreed beforehand) with what group rank `src` sends."""
        self.pg.recv([x], src, 0).wait()
        return x

    def isend(self, x: torch.Tensor, dst: int):
        """Starts sending x (contiguous; kept alive by the caller until the returned work is waited for)."""
        return self.pg.send([x], dst, 0)

    def irecv(self, x: torch.Tensor, src: int):
        """Starts filling x with what group rank `src` sends; x is valid once the returned work is waited for."""
        return self.pg.recv([x], src, 0)

    def barrier(self) -> None:
        if self.pg is not None:
            self.all_reduce(torch.zeros(1, device=self.device))

    def shutdown(self) -> None:
        """Drops the group. An NCCL group is kept alive until the process exits instead (in _RETIRED): its
        shutdown, abort and destructor all blocked on the peers' communicators in a running process, while at exit
        it ends cleanly; the cost is its buffers, once per engine built and shut down."""
        if self.pg is not None and self.device.type == "cuda":
            _RETIRED.append((self.pg, self.symm))
        if self.name is not None:
            unregister(self.name)
        self.pg, self.symm, self.name = None, None, None


def quiet_flight_recorder(environ) -> None:
    """Turns torch's flight recorder off (a buffer size of 0) unless the user sized it: it records every collective
    (NCCL and gloo) with its call stack, which cost 60 us of host time per eager logits all-gather and 24 us per
    token broadcast on 2x H100 (112 -> 51 us and 48 -> 25 us), on the host path of every tensor-parallel step. Set
    TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) to keep it; torch reads it once, when the process's first
    process group is made."""
    if "TORCH_FR_BUFFER_SIZE" not in environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:
        environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "0"  # (the older name: torch 2.11 reads only it, 2.13 both)


_RETIRED: list = []  # NCCL process groups (and their symmetric buffers) of engines shut down (see shutdown)
