"""vLLM's `vllm.v1.engine.async_llm` import path: AsyncLLM is pagedllm's AsyncLLMEngine (`from_engine_args`,
`generate(prompt, sampling_params, request_id)` streaming as each request's output_kind asks, `abort`, `shutdown`)."""

from pagedllm.entrypoints.async_llm_engine import AsyncLLMEngine

AsyncLLM = AsyncLLMEngine

__all__ = ["AsyncLLM"]
