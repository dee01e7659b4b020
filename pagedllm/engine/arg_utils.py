"""vLLM's `vllm.engine.arg_utils` import path: EngineArgs and AsyncEngineArgs."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine_args import EngineArgs


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLMEngine (the same fields; vLLM's name)."""


__all__ = ["AsyncEngineArgs", "EngineArgs"]
