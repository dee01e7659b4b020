"""vLLM's `vllm.v1.engine.llm_engine` import path: pagedllm's LLMEngine."""

from pagedllm.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
