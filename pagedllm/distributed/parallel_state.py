"""Where a worker stands among the ranks: global rank = pp_rank * tp_size + tp_rank, and the two groups it talks
in (its tensor-parallel group: the ranks of its stage; its pipeline group: the ranks of its tp_rank across stages).

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

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroups:
        return cls(RankInfo(0, 1, 1), Communicator.single(device), Communicator.single(device))

    @classmethod
    def create(cls, store: dist.Store, info: RankInfo, device: torch.device, timeout_s: float) -> ParallelGroups:
        """Every rank of the world calls this with the same store (the collectives of the groups it is not in are
        not created on it)."""
        tp_ranks = [info.pp_rank * info.tp_size + r for r in range(info.tp_size)]
        pp_ranks = [s * info.tp_size + info.tp_rank for s in range(info.pp_size)]
        tp = Communicator.create(store, f"tp{info.pp_rank}", info.tp_rank, tp_ranks, device, timeout_s)
        pp = Communicator.create(store, f"pp{info.tp_rank}", info.pp_rank, pp_ranks, device, timeout_s)
        return cls(info, tp, pp)

    def build_context(self) -> BuildContext:
        i = self.info
        return BuildContext(i.tp_rank, i.tp_size, self.tp if i.tp_size > 1 else None, i.pp_rank, i.pp_size)

    def shutdown(self) -> None:
        self.tp.shutdown()
        self.pp.shutdown()


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """The KV heads each rank holds: an equal share, or one (replicated) with more ranks than heads."""
    return max(1, num_kv_heads // tp_size)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers stage pp_rank runs: equal parts, the first num_layers % pp_size stages one more
    (8 layers on 3 stages: 3, 3, 2)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds num_hidden_layers={num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)
