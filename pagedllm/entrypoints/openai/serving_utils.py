"""What the endpoints share: the server's state and limits, model-name checks, SamplingParams from a request,
logprobs in OpenAI's two layouts, server-sent events, and ending work whose client went away."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedllm.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import APIError, StreamOptions, error_body, from_value_error, random_id
from pagedllm.entrypoints.openai.serving_structured import structured_outputs
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_MIN_LOGPROB = -9999.0  # -inf is not JSON; OpenAI clamps the same way


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    limits: ServerLimits = field(default_factory=ServerLimits)
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    tool_parser: str | None = None  # --tool-call-parser: reads tool calls from replies (tool_choice "auto")
    enable_auto_tools: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser: the <think> section goes to reasoning_content
    lora_modules: dict = field(default_factory=dict)  # served name -> LoRARequest (--lora-modules)
    metrics_prefixes: tuple[str, ...] = ()  # /metrics also shows each family under these prefixes (--metrics-prefix)
    response_role: str = "assistant"  # the reply's role with add_generation_prompt (--response-role)
    return_tokens_as_token_ids: bool = False  # the default of the request field (--return-tokens-as-token-ids)
    force_include_usage: bool = False  # streams end with usage without stream_options (--enable-force-include-usage)
    default_chat_template_kwargs: dict = field(default_factory=dict)  # --default-chat-template-kwargs
    server_load: int | None = None  # POST requests in flight; None: not counted (--enable-server-load-tracking)
    _max_prompt_chars: int | None = field(default=None, init=False, repr=False)

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a text prompt can have and still fit max_model_len tokens, so a far longer one is
        refused before tokenizing it (seconds of CPU for megabytes): no token covers more characters than the
        longest vocabulary entry has, doubled for normalizers that expand text. None without a vocabulary."""
        if self._max_prompt_chars is None:
            vocab = getattr(self.llm.get_tokenizer(), "get_vocab", None)
            if vocab is None:
                return None
            longest = max(map(len, vocab()), default=1)
            self._max_prompt_chars = 2 * longest * self.max_model_len
        return self._max_prompt_chars

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """ValueError for a text that cannot fit the context whatever its tokens (see max_prompt_chars)."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise ValueError(
                f"{param}: {num_chars} characters are far more than max_model_len={self.max_model_len} tokens can "
                f"hold (at most {limit} characters on this model)"
            )

    def apply_defaults(self, req: Any) -> None:
        """The server-wide defaults of a completions / chat request: --return-tokens-as-token-ids, and with
        --enable-force-include-usage a usage chunk at the end of every stream."""
        if req.return_tokens_as_token_ids is None:
            req.return_tokens_as_token_ids = self.return_tokens_as_token_ids
        options = req.stream_options
        if self.force_include_usage and req.stream and not (options and options.include_usage):
            continuous = bool(options and options.continuous_usage_stats)
            req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=continuous)

    @property
    def llm(self):
        return self.engine.llm

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.model.max_model_len

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; an unknown name is 404 as OpenAI does."""
        if name is None or name in self.served_model_names or name in self.lora_modules:
            return self.served_model_names[0] if name is None else name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")

    def lora_request(self, name: str | None):
        """The LoRARequest a request's model name selects (None: the base model)."""
        return self.lora_modules.get(name) if name is not None else None

    def require_generate(self) -> None:
        if not self.engine.generates:
            raise APIError("this server runs a pooling model: it serves /v1/embeddings, not text generation")


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


def check_limit(value: int | None, limit: int, param: str) -> None:
    if value is not None and value > limit:
        raise bad(f"{param}={value} is out of range: at most {limit} on this server", param)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out = {}
    for key, value in raw.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad(f"logit_bias key {key!r} is not a token id (an integer)", "logit_bias") from None
    return out


_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


MAX_REQUEST_ID_CHARS = 256


def response_id(prefix: str, req: Any, raw: Request | None = None) -> str:
    """The id of a response (and of its engine requests): `<prefix>-<id>` when the request names one (with
    --enable-request-id-headers its X-Request-Id header, else vLLM's request_id field; one still running with the
    same id is a 400), else a random one."""
    header = raw.scope.get("state", {}).get("request_id_header") if raw is not None else None
    if header is not None and len(header) > MAX_REQUEST_ID_CHARS:
        message = f"the X-Request-Id header has {len(header)} characters: at most {MAX_REQUEST_ID_CHARS}"
        raise bad(message, "X-Request-Id")
    given = header or req.request_id
    return f"{prefix}-{given}" if given else random_id(prefix)


def refuse_unsupported(req: Any) -> None:
    """Fields this server knows but does not honour in this combination: a 400 naming the field, never a 200 that
    ignores it."""
    if req.priority != 0:
        raise bad(
            f"priority={req.priority!r} is not supported: requests are served first come, first served "
            "(vLLM's --scheduling-policy fcfs); only 0 is allowed",
            "priority",
        )
    if not req.use_beam_search:
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(req, name) != default:
                raise bad(f"{name} applies only with use_beam_search=true", name)
    options = req.stream_options
    if options is not None and not req.stream:  # (vLLM's rule: the options of a stream that is not there)
        raise bad("stream_options applies only with stream=true", "stream_options")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise bad("stream_options.continuous_usage_stats needs stream_options.include_usage=true", "stream_options")


def _check_words(words: list[str] | None, most: int, longest: int, param: str) -> None:
    """Caps that keep one request's stop strings or bad words from costing every other request (they are checked
    at every step, or encoded before the request starts)."""
    if not words:
        return
    if len(words) > most:
        raise bad(f"{param} holds {len(words)} strings: at most {most} on this server", param)
    long = next((w for w in words if len(w) > longest), None)
    if long is not None:
        raise bad(f"{param} holds a string of {len(long)} characters: at most {longest} on this server", param)


def sampling_params(state: ServerState, req: Any, **fields: Any) -> SamplingParams:
    """SamplingParams from the request's sampling fields; omitted ones take the model's generation_config defaults
    (as vLLM). `fields` sets what differs between endpoints (max_tokens, logprobs, prompt_logprobs)."""
    limits = state.limits
    refuse_unsupported(req)
    constraint, _ = structured_outputs(req)
    check_limit(req.n, limits.max_n, "n")
    check_limit(req.best_of, limits.max_n, "best_of")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    _check_words(stop, limits.max_stop, limits.max_word_chars, "stop")
    _check_words(req.bad_words, limits.max_bad_words, limits.max_word_chars, "bad_words")
    defaults = state.engine.engine.default_sampling_fields
    if "max_tokens" in fields and fields["max_tokens"] is None:  # generation_config's max_new_tokens, as vLLM
        fields = {**fields, "max_tokens": defaults.get("max_tokens")}
    chosen = {name: getattr(req, name) for name in _DEFAULTED}
    chosen = {k: v if v is not None else defaults.get(k) for k, v in chosen.items()}
    values = dict(
        n=req.n,
        best_of=req.best_of,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias=logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty,
        early_stopping=req.early_stopping,
        structured_outputs=constraint,
        output_kind=RequestOutputKind.CUMULATIVE,  # the server computes its stream's deltas itself
        **{k: v for k, v in chosen.items() if v is not None},
        **fields,
    )
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise from_value_error(e) from None


def context_check(max_model_len: int, max_tokens: int | None, truncate: int | None):
    """A check for the prepared prompts: max_tokens beyond what the context leaves is a 400 (vLLM's message), not
    a silent cut. A prompt longer than the context is left to the engine's own message."""

    def check(prompts: list[tuple[str | None, list[int]]]) -> None:
        if not max_tokens:
            return
        for _, ids in prompts:
            n = len(ids) if truncate is None or truncate == -1 else min(len(ids), truncate)
            if n <= max_model_len < n + max_tokens:
                raise bad(
                    f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                    f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). Please reduce "
                    "the length of the messages or completion.",
                    "max_tokens",
                )

    return check


# -- logprobs ---------------------------------------------------------------------------------------------------
def _clamp(value: float) -> float:
    return max(value, _MIN_LOGPROB) if not math.isnan(value) else _MIN_LOGPROB


def token_text(tokenizer, token_id: int, entry: Logprob | None, as_ids: bool = False) -> str:
    """A logprob entry's token as text, or as "token_id:N" (return_tokens_as_token_ids: exact for tokens that are
    not whole UTF-8 characters)."""
    if as_ids:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def legacy_logprobs(tokenizer, token_ids: list[int], entries: list, text_offset: int = 0, as_ids: bool = False) -> dict:
    """Completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (None entries: no logprob, as the
    first prompt token)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id) if entry is not None else None
        text = token_text(tokenizer, token_id, chosen, as_ids)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None or chosen is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_clamp(chosen.logprob))
        top.append({token_text(tokenizer, tid, lp, as_ids): _clamp(lp.logprob) for tid, lp in entry.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, num_top: int, as_ids: bool = False) -> list[dict]:
    """Chat logprobs content: [{token, logprob, bytes, top_logprobs: the num_top most likely tokens}]."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        if chosen is None:
            continue
        ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
        top = [
            _chat_entry(token_text(tokenizer, tid, lp, as_ids), lp.logprob)
            for tid, lp in ranked
            if lp.rank is not None and 1 <= lp.rank <= num_top
        ]
        text = token_text(tokenizer, token_id, chosen, as_ids)
        content.append({**_chat_entry(text, chosen.logprob), "top_logprobs": top})
    return content


def prompt_logprobs_json(entries: list | None) -> list | None:
    """prompt_logprobs as vLLM writes them: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in e.items()
        }
        for e in entries
    ]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; cached_tokens (prompt tokens served from the prefix cache) where known."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


# -- transport --------------------------------------------------------------------------------------------------
def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of the chunks, then `data: [DONE]`; an engine failure ends the stream with an error
    event (the status line was already sent)."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as e:
        yield sse(e.body())
    except EngineDeadError as e:
        yield sse(error_body(str(e), "server_error"))
    yield sse("[DONE]")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def _disconnected(request: Request) -> None:
    while True:  # the body was read already, so the next message is the disconnect
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Awaits `work`; if the client disconnects first, cancels it (its RequestStream aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()
