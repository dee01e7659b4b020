"""Prompt types accepted by `LLM.generate`: a str, a TextPrompt, a TokensPrompt or a list of token ids."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[object]
    cache_salt: NotRequired[str]  # only requests with the same salt share prefix-cache blocks


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt | list[int]
