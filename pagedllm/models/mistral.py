"""Mistral: the Llama architecture with a sliding attention window (config.sliding_window) and explicit head_dim."""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same layers and weight names as Llama; the window comes from the config through the shared attention."""
