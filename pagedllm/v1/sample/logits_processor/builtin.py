"""vLLM's `vllm.v1.sample.logits_processor.builtin`, for its helper `process_dict_updates` (pagedllm's built-in
sampling rules are the sampler's own: pagedllm/sample/)."""

from pagedllm.sample.custom_logits import process_dict_updates

__all__ = ["process_dict_updates"]
