"""vLLM's `vllm.v1.sample.logits_processor`: the interface of engine-wide logits processor classes
(pagedllm/sample/custom_logits.py)."""

from pagedllm.sample.custom_logits import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    load_logits_processors,
    process_dict_updates,
)

__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "RequestLogitsProcessor",
    "load_logits_processors",
    "process_dict_updates",
]
