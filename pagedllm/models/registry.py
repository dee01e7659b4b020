"""HF architecture name -> pagedllm model class, imported lazily; `ModelRegistry` adds out-of-tree models (vLLM's
API): `ModelRegistry.register_model("MyForCausalLM", "my_pkg.my_model:MyForCausalLM")` or `(name, cls)`."""

from __future__ import annotations

import importlib
import re

# architecture -> (module under pagedllm.models, class name) for the native models
_NATIVE = {
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
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
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
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaModel": ("roberta", "RobertaModel"),
    "RobertaForSequenceClassification": ("roberta", "RobertaForSequenceClassification"),
    "XLMRobertaModel": ("roberta", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": ("roberta", "XLMRobertaForSequenceClassification"),
    "LlamaModel": ("decoder_embedding", "LlamaEmbeddingModel"),
    "MistralModel": ("decoder_embedding", "LlamaEmbeddingModel"),
    "Qwen2Model": ("decoder_embedding", "Qwen2EmbeddingModel"),
    "Qwen3Model": ("decoder_embedding", "Qwen3EmbeddingModel"),
    "LlamaForSequenceClassification": ("decoder_classifier", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("decoder_classifier", "MistralForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("decoder_classifier", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("decoder_classifier", "Qwen3ForSequenceClassification"),
    "GemmaForSequenceClassification": ("decoder_classifier", "GemmaForSequenceClassification"),
    "Phi3ForSequenceClassification": ("decoder_classifier", "Phi3ForSequenceClassification"),
    "Starcoder2ForSequenceClassification": ("decoder_classifier", "Starcoder2ForSequenceClassification"),
    "BertForTokenClassification": ("bert", "BertForTokenClassification"),
    "RobertaForTokenClassification": ("roberta", "RobertaForTokenClassification"),
    "XLMRobertaForTokenClassification": ("roberta", "XLMRobertaForTokenClassification"),
}


# architecture -> "module.path:ClassName" (imported when first used) or the class itself; the registry's one table
_MODELS: dict[str, str | type] = {arch: f"pagedllm.models.{mod}:{name}" for arch, (mod, name) in _NATIVE.items()}
_QUALNAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def native_architectures() -> list[str]:
    """The architectures pagedllm implements itself (without out-of-tree registrations)."""
    return sorted(_NATIVE)


MODEL_IMPLS = ("auto", "pagedllm", "vllm", "transformers")  # "vllm": vLLM's name of the native implementation


def resolve_model_impl(architecture: str, model_impl: str = "auto") -> str:
    """ "pagedllm" (the registered class) or "transformers" (models/transformers_fallback.py): "auto" takes the
    registered class where there is one, else the fallback where transformers ships the architecture. One clear
    error, before anything is loaded, where neither runs it."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl={model_impl!r} must be one of {MODEL_IMPLS}")
    from pagedllm.models.transformers_fallback import check_transformers_supported, transformers_class

    if model_impl == "transformers":
        check_transformers_supported(architecture)
        return "transformers"
    if architecture in _MODELS:
        return "pagedllm"
    if model_impl == "auto" and transformers_class(architecture) is not None:
        check_transformers_supported(architecture)
        return "transformers"
    raise ValueError(
        f"architecture {architecture!r} is not supported; supported: {supported_architectures()}; for a causal LM "
        'that transformers ships (its attention through the attention interface), try model_impl="transformers"'
    )


def check_supported(architecture: str, model_impl: str = "auto") -> None:
    """One clear error for an architecture with no model class, before anything is loaded."""
    resolve_model_impl(architecture, model_impl)


def get_model_class(architecture: str, model_impl: str = "auto") -> type:
    if resolve_model_impl(architecture, model_impl) == "transformers":
        from pagedllm.models.transformers_fallback import TransformersForCausalLM

        return TransformersForCausalLM
    entry = _MODELS[architecture]
    if isinstance(entry, type):
        return entry
    module, name = entry.split(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"architecture {architecture!r}: model class {entry!r} cannot be imported: {e}") from e
    _MODELS[architecture] = cls
    return cls


class ModelRegistry:
    """vLLM's ModelRegistry over this module's table: register out-of-tree model classes by architecture name."""

    @staticmethod
    def register_model(model_arch: str, model_cls: str | type) -> None:
        """model_cls: the class, or "module.path:ClassName" imported when the architecture is first loaded."""
        if not isinstance(model_arch, str) or not model_arch:
            raise ValueError(f"model_arch={model_arch!r}: expected a non-empty architecture name")
        if isinstance(model_cls, str):
            if not _QUALNAME.match(model_cls):
                raise ValueError(f"model_cls={model_cls!r}: expected 'module.path:ClassName' or a class")
        elif not isinstance(model_cls, type):
            raise ValueError(f"model_cls={model_cls!r}: expected 'module.path:ClassName' or a class")
        _MODELS[model_arch] = model_cls

    @staticmethod
    def get_supported_archs() -> list[str]:
        return supported_architectures()

    @staticmethod
    def is_registered(model_arch: str) -> bool:
        return model_arch in _MODELS
