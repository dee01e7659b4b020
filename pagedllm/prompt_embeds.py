"""Prompts given as input embeddings (`{"prompt_embeds": tensor [seq_len, hidden]}`, engine arg
enable_prompt_embeds), the engine's side: which engines take them, the checks of a prompt, and the prefix-cache
keys of its blocks.

A request of embeddings carries placeholder token ids (0, as vLLM's) at its prompt positions: the scheduler, the
KV cache and the sampler see an ordinary prompt of that length. The runner (worker/prompt_embeds.py) feeds the
embeddings instead of the token embeddings at those positions; generated tokens are ids as usual. As in vLLM, the
placeholders are what repetition_penalty and prompt_logprobs see at the prompt positions, and RequestOutput's
prompt_token_ids is None."""

from __future__ import annotations

import hashlib

import torch

PLACEHOLDER_ID = 0
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_engine(config) -> None:
    """ValueError when enable_prompt_embeds=True is asked of an engine that cannot take embeddings: a pooling model,
    a vision-language model, the transformers fallback, pipeline stages, or a decoder family that does not take
    input embeddings through the shared seam (LlamaModel.embed_inputs)."""
    model = config.model
    if not model.enable_prompt_embeds:
        return
    where = f"enable_prompt_embeds=True: {model.architecture}"
    if model.runner == "pooling":
        raise ValueError(f"{where} is a pooling model; prompt embeddings are for generation only")
    from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES

    if model.architecture in MULTIMODAL_ARCHITECTURES:
        raise ValueError(f"{where} is a vision-language model; prompt embeddings are supported for text decoders")
    if model.model_impl == "transformers":
        raise ValueError(f"{where} runs through the transformers fallback, which takes no prompt embeddings")
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError("enable_prompt_embeds=True: not supported with pipeline_parallel_size > 1")
    from pagedllm.models.llama import LlamaModel
    from pagedllm.models.registry import get_model_class

    decoder = getattr(get_model_class(model.architecture, model.model_impl), "model_cls", None)
    if not (isinstance(decoder, type) and issubclass(decoder, LlamaModel)):
        raise ValueError(
            f"{where}: its decoder takes no input embeddings; supported: the Llama-style decoders (Llama, Mistral, "
            "Qwen2/3, Gemma 1-3, Granite, Phi-3, OLMo, Mixtral, DeepSeek-V2/V3, Cohere, InternLM2, StarCoder2, ...)"
        )


def embeds_of(prompt: dict, enabled: bool, where: str = "prompt"):
    """A prompt dict's prompt_embeds, or None for a text or token prompt; ValueError where the engine takes none or
    the dict gives the prompt twice."""
    if prompt.get("prompt_embeds") is None:
        return None
    if not enabled:
        raise ValueError(f"{where}.prompt_embeds: prompt embeddings need the engine arg enable_prompt_embeds=True")
    other = [k for k in ("prompt", "prompt_token_ids", "multi_modal_data") if prompt.get(k) is not None]
    if other:
        raise ValueError(f"{where}: give either prompt_embeds or {other[0]}, not both")
    return prompt["prompt_embeds"]


def check_embeds(embeds, hidden_size: int, truncate: int | None, max_model_len: int) -> torch.Tensor:
    """The prompt's embeddings as a contiguous CPU tensor [seq_len, hidden_size] (a leading batch dim of 1 is
    dropped), the last `truncate` rows kept (truncate_prompt_tokens; -1: max_model_len); ValueError naming what is
    wrong."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds has type {type(embeds).__name__}; expected a torch.Tensor [seq_len, hidden]")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds has shape {tuple(embeds.shape)}; expected [seq_len, {hidden_size}] (the model's hidden)"
        )
    if embeds.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"prompt_embeds has dtype {embeds.dtype}; allowed: float32, float16, bfloat16")
    if embeds.shape[0] == 0:
        raise ValueError("prompt_embeds is empty: a prompt needs at least one position")
    if truncate is not None:
        embeds = embeds[-(max_model_len if truncate == -1 else truncate) :]
    return embeds.detach().to("cpu").contiguous()


def block_keys(embeds: torch.Tensor, start: int, end: int) -> tuple:
    """The prefix-cache extra key of a block whose positions [start, end) reach into the prompt: a digest of the
    embeddings' bytes there, so a block of embeddings never matches a block of tokens (nor other embeddings)."""
    rows = embeds[start:end]
    data = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows  # (bfloat16 has no numpy dtype)
    return (("prompt_embeds", str(rows.dtype), hashlib.sha256(data.numpy().tobytes()).hexdigest()),)


class EmbedsPair(tuple):
    """The server's (text, token ids) pair of a prompt of embeddings: no text, placeholder ids (their count is the
    prompt's length, which the context check reads), the tensor in `prompt_embeds`."""

    def __new__(cls, embeds: torch.Tensor) -> EmbedsPair:
        pair = super().__new__(cls, (None, [PLACEHOLDER_ID] * len(embeds)))
        pair.prompt_embeds = embeds
        return pair
