"""Engine-wide logits processor classes, vLLM v1's interface: `LLM(logits_processors=[Cls or "pkg.mod:Cls"])`
builds each class once per engine, keeps it told of the batch's changes (BatchUpdate: requests added, removed and
moved between the rows of the step's logits) and calls its `apply(logits)` before sampling. A request's own
arguments reach it in `SamplingParams.extra_args` (pagedllm never reads them). The engine side is
sample/custom_batch.py; user code imports these names from `pagedllm.v1.sample.logits_processor`."""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import Any

import torch

from pagedllm.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at index a goes to index b (b held no request)
    SWAP = auto()  # the requests at indices a and b trade places


# (index, params, prompt token ids, output token ids): a request that joins the batch at `index`. The output list is
# the engine's own, extended in place as the request generates, so a processor that keeps it sees every new token.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
RemovedRequest = int  # the index of a request that left the batch
MovedRequest = tuple[int, int, MoveDirectionality]  # (index a, index b, directionality)
# a per-request logits processor: (output_ids, logits) -> logits or (prompt_ids, output_ids, logits) -> logits
RequestLogitsProcessor = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous update; apply in this order: removed, added, moved. Index i is row
    i of the logits that `apply` gets next; an added or moved request may take an index another one just left."""

    batch_size: int  # the requests in the batch after the change (the rows of the next logits)
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor. The engine builds one instance per class, calls `update_state` before each
    step that samples (None: the batch did not change) and `apply` on that step's logits [batch_size, vocab]."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Checks a request's parameters (its extra_args) when it is made: raise ValueError to refuse it."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """vllm_config: the engine's config (pagedllm's EngineConfig, with vLLM's `model_config` name)."""
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The changed logits [batch_size, vocab]; changing them in place and returning them is fine."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the largest logit: it is then skipped in a step
        where every request is greedy."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step's apply; batch_update is None when the batch did not change."""
        raise NotImplementedError


def process_dict_updates(
    req_entries: dict[int, Any],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], Any],
) -> bool:
    """Keeps a dict index -> per-request state in step with the batch: new_state(params, prompt_ids, output_ids)
    gives an added request's state (None: the processor does not apply to it). Returns whether the dict changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        else:
            changed |= req_entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        at_a, at_b = req_entries.pop(a, None), req_entries.pop(b, None)
        if at_a is not None:
            req_entries[b] = at_a
        if direction == MoveDirectionality.SWAP and at_b is not None:
            req_entries[a] = at_b
        changed |= at_a is not None or at_b is not None
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor made of per-request callables: a subclass implements `is_argmax_invariant` and
    `new_req_logits_processor(params)`, which returns the request's callable or None (not applied to it). A
    subclass's own __init__ must call super().__init__(vllm_config, device, is_pin_memory)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # index -> the bound callable

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _bind(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]):
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        takes_prompt = len(inspect.signature(fn).parameters) == 3
        return partial(fn, prompt_ids, output_ids) if takes_prompt else partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._bind)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            row = logits[index]
            out = fn(row)
            if out is not row:
                logits[index] = out
        return logits


def load_logits_processors(specs: Sequence[type | str] | None) -> tuple[type[LogitsProcessor], ...]:
    """LogitsProcessor subclasses, or "package.module:Class" (also "package.module.Class") import strings, as
    classes; anything else is a ValueError naming it."""
    classes = []
    for spec in specs or ():
        cls = _import(spec) if isinstance(spec, str) else spec
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(
                f"logits_processors: {spec!r} is not a LogitsProcessor subclass "
                "(pagedllm.v1.sample.logits_processor.LogitsProcessor) or an import string of one"
            )
        classes.append(cls)
    return tuple(classes)


def _import(spec: str) -> Any:
    module, sep, qualname = spec.partition(":")
    if not sep:
        module, _, qualname = spec.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for name in qualname.split("."):
            obj = getattr(obj, name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"logits_processors: cannot import {spec!r} ({e})") from None
    return obj


def engine_processors(specs: Sequence[type | str] | None, speculative: Any, parallel: Any, model: Any) -> tuple:
    """LLM(logits_processors=) as classes, with the engine modes they do not run in refused when the engine is
    made (speculative: its SpeculativeConfig or None, parallel: its ParallelConfig, model: its ModelConfig)."""
    classes = load_logits_processors(specs)
    if not classes:
        return classes
    if model.runner == "pooling":
        raise ValueError("logits_processors: a pooling model samples no tokens (no logits processors)")
    if speculative is not None:
        raise ValueError(
            "logits_processors cannot be combined with speculative_config: a draft position's logits would need "
            "the processors' state after the drafts before it"
        )
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("logits_processors need pipeline_parallel_size=1 (pipelined steps sample disjoint batches)")
    return classes
