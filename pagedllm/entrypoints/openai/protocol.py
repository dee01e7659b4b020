"""Request bodies of the OpenAI-compatible server (pydantic models, OpenAI's field names plus vLLM's extra fields),
and the OpenAI error body. Responses are built as plain dicts in the serving modules, in OpenAI's exact layout."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error the client caused (or a missing resource): becomes {"error": {...}} with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_PARAM = re.compile(r"^(?:prompts\[\d+\]\.)?([a-z_]+)(?:=|\[|:)")


def from_value_error(e: BaseException, param: str | None = None) -> APIError:
    """A ValueError/TypeError of the engine (they name the field first: "temperature=-1 is out of range..."),
    else `param`: the request field the input came from."""
    message = str(e)
    match = _PARAM.match(message)
    return APIError(message, 400, param=match.group(1) if match else param)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    # An unknown field is a 400 naming it: a field silently dropped would answer 200 with other behaviour than the
    # client asked for. vLLM accepts and ignores unknown fields (it logs a warning); here only the fields below
    # that change nothing in the output are accepted and ignored: `user`, `metadata`, `store` and `service_tier`
    # (OpenAI's bookkeeping and billing fields, which clients send by habit).
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingExtras(_Request):
    """The sampling fields that completions, chat completions and responses share (OpenAI's, then vLLM's)."""

    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    priority: int = 0  # vLLM's priority scheduling; requests here are served first come, first served: only 0
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id is <kind>-<it>


class _SamplingFields(SamplingExtras):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extra sampling fields
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    # beam search (best_of beams, the n best returned); the other two apply only with it
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    # structured outputs (vLLM's fields; checked by serving_structured, a bad value is a 400 naming the field)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _n_null_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value  # "n": null is the default, as OpenAI and vLLM read it


class CompletionRequest(_SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = Field(None, examples=["The capital of France is"])
    prompt_embeds: str | list[str] | None = None  # base64 torch.save'd tensors (--enable-prompt-embeds)
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None  # structured outputs, as in chat completions


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(examples=[[{"role": "user", "content": "Say hello."}]])
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra chat fields
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    documents: list[dict[str, str]] | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = False  # the chat template writes the special tokens (vLLM's default)
    mm_processor_kwargs: dict[str, Any] | None = None  # for the model's multimodal processor (image parts)


PoolingInput = list[int] | list[list[int]] | str | list[str]


class ChatInputFields(_Request):
    """vLLM's chat-style input of the pooling endpoints: `messages` (one conversation, rendered with the chat
    template, then pooled as one prompt) instead of `input`, with the chat template's options."""

    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: True with input (the tokenizer's), False with messages (vLLM's)
    chat_template: str | None = None  # refused, as on chat completions: the server's --chat-template
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(ChatInputFields):
    model: str | None = None
    input: PoolingInput | None = Field(default=None, examples=["A sentence to embed."])  # or messages
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # given to the chat template with messages (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)
