"""Where a worker stands among the ranks: global rank = pp_rank * tp_size + tp_rank, and the groups it talks in:
its tensor-parallel group (the ranks of its stage), its pipeline groups (the ranks of its tp_rank across stages: `pp`
carries each stage's activations to the next, `pp_back` the last stage's hidden states to the first, so that the two
directions never share a channel) and the world (every rank).

Built once per worker and handed down (to the model's build context and to the runner), never kept globally."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.communicator import Communicator
from pagedllm.layers.build_context import BuildContext


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        """The engine's rank: it samples and returns the step's output."""
        return self.rank == 0


@dataclass
class ParallelGroups:
    info: RankInfo
    tp: Communicator
    pp: Communicator
    world: Communicator
    pp_back: Communicator | None = None  # (None: pp itself, with one stage)

    def __post_init__(self) -> None:
        if self.pp_back is None:
            self.pp_back = self.pp

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroups:
        one = Communicator.single(device)
        return cls(RankInfo(0, 1, 1), one, one, one)

    @classmethod
    def create(
        cls, store: dist.Store, info: RankInfo, device: torch.device, timeout_s: float, custom_all_reduce: bool = True
    ) -> ParallelGroups:
        """Every rank of the world calls this with the same store (the collectives of the groups it is not in are
        not created on it). custom_all_reduce: the tensor-parallel group's small all-reduces take the one-shot
        kernel on GPUs."""
        tp_ranks = [info.pp_rank * info.tp_size + r for r in range(info.tp_size)]
        pp_ranks = [s * info.tp_size + info.tp_rank for s in range(info.pp_size)]
        tp = Communicator.create(
            store, f"tp{info.pp_rank}", info.tp_rank, tp_ranks, device, timeout_s, custom_all_reduce
        )
        pp = Communicator.create(store, f"pp{info.tp_rank}", info.pp_rank, pp_ranks, device, timeout_s, False)
        pp_back = pp
        if info.pp_size > 1:
            pp_back = Communicator.create(
                store, f"ppback{info.tp_rank}", info.pp_rank, pp_ranks, device, timeout_s, False
            )
        if info.pp_size == 1:
            world = tp
        elif info.tp_size == 1:
            world = pp
        else:
            ranks = list(range(info.world_size))
            world = Communicator.create(store, "world", info.rank, ranks, device, timeout_s, False)
        return cls(info, tp, pp, world, pp_back)

    def build_context(self) -> BuildContext:
        i = self.info
        return BuildContext(i.tp_rank, i.tp_size, self.tp if i.tp_size > 1 else None, i.pp_rank, i.pp_size)

    def shutdown(self) -> None:
        for comm in {id(c): c for c in (self.tp, self.pp, self.world, self.pp_back)}.values():
            comm.shutdown()


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """The KV heads each rank holds: an equal share, or one (replicated) with more ranks than heads."""
    return max(1, num_kv_heads // tp_size)
