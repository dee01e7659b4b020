"""Prompt types accepted by `LLM.generate`: a str, a TextPrompt, a TokensPrompt, an EmbedsPrompt or a list of token
ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[object]
    cache_salt: NotRequired[str]  # only requests with the same salt share prefix-cache blocks


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """The prompt as the model's input embeddings, [seq_len, hidden_size] (e.g. `get_input_embeddings()(ids)` of
    the HF model): the engine must be built with enable_prompt_embeds=True."""

    prompt_embeds: torch.Tensor
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt | list[int]
