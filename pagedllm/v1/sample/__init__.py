"""vLLM's `vllm.v1.sample` import paths (pagedllm's sampler lives in pagedllm/sample/)."""
