"""HF architecture name -> pagedllm model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "OlmoForCausalLM": ("olmo", "OlmoForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GPTBigCodeForCausalLM": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "GPTJForCausalLM": ("gptj", "GPTJForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "BloomForCausalLM": ("bloom", "BloomForCausalLM"),
    "MPTForCausalLM": ("mpt", "MPTForCausalLM"),
    "MptForCausalLM": ("mpt", "MPTForCausalLM"),
    "FalconForCausalLM": ("falcon", "FalconForCausalLM"),
    "InternLM2ForCausalLM": ("internlm2", "InternLM2ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_supported(architecture: str) -> None:
    """One clear error for an architecture with no model class, before anything is loaded."""
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {supported_architectures()}")


def get_model_class(architecture: str) -> type:
    check_supported(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), name)
