"""vLLM's `vllm.v1` import paths that user scripts name, mapped onto pagedllm's own modules."""
