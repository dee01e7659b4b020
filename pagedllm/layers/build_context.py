"""What the layers need to know while a model is built: this worker's tensor-parallel rank, group size and group
(the Communicator the parallel layers sum or gather over), and its pipeline stage.

Set once around a model's construction (`with building(BuildContext(...)):`); the parallel layers read it in their
constructors to size their shards. With one rank (the default) every layer holds its whole weight."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BuildContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a distributed.Communicator over the tensor-parallel ranks (None: one rank)
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={self.pp_rank} must be in [0, pp_size={self.pp_size})")


_ONE_RANK = BuildContext()
_CURRENT: contextvars.ContextVar[BuildContext | None] = contextvars.ContextVar("build_context", default=None)


@contextlib.contextmanager
def building(context: BuildContext) -> Iterator[BuildContext]:
    """The layers constructed inside this block take their shard from `context`."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage pp_rank runs: equal parts, the first num_layers % pp_size stages
    one more (10 layers on 4 stages: 3, 3, 2, 2)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds num_hidden_layers={num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def current_build_context() -> BuildContext:
    return _CURRENT.get() or _ONE_RANK


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} must be divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def sharded_if_divisible(*sizes: int) -> contextlib.AbstractContextManager:
    """A block whose layers shard as the current context says when every size (head counts, hidden sizes) splits
    evenly over its tensor-parallel ranks, else are built whole on every rank (replicated, no collectives): for a
    part of a model, such as a vision tower, that may run either way."""
    context = current_build_context()
    if all(size % context.tp_size == 0 for size in sizes):
        return contextlib.nullcontext(context)
    return building(BuildContext())
