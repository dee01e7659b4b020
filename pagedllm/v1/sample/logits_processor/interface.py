"""vLLM's `vllm.v1.sample.logits_processor.interface` (pagedllm/sample/custom_logits.py)."""

from pagedllm.sample.custom_logits import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]
