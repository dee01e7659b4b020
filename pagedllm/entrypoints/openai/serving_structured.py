"""Structured outputs on the server: vLLM's request fields (`structured_outputs`, the older `guided_*`) and
OpenAI's `response_format` become one StructuredOutputsParams; a bad one is a 400 naming the field it came in."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "xgrammar", "guidance")


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param)


def _from_response_format(fmt: Any) -> dict | None:
    """OpenAI's response_format as StructuredOutputsParams fields (None for plain text)."""
    if not isinstance(fmt, dict):
        raise _bad("response_format must be an object with a `type`", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _bad("response_format.json_schema.schema: a JSON schema object is required", "response_format")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise _bad("response_format.json_schema.strict must be a boolean", "response_format")
        return {"json": spec["schema"]}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in fmt.items() if k != "type"})}
    raise _bad(
        f"response_format.type={kind!r} is not supported: 'text', 'json_object', 'json_schema' or 'structural_tag'",
        "response_format",
    )


def _given(req: Any) -> list[tuple[str, dict]]:
    """(request field, StructuredOutputsParams fields) of each constraint the request carries."""
    given = []
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise _bad("structured_outputs must be an object", "structured_outputs")
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        if getattr(req, name) is not None:
            given.append((name, {kind: getattr(req, name)}))
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        fields = _from_response_format(fmt)
        if fields is not None:
            given.append(("response_format", fields))
    return given


def structured_outputs(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came in (None, None without one). `guided_decoding_backend` and
    `guided_whitespace_pattern` apply to it where its own fields do not say otherwise."""
    if req.guided_decoding_backend not in _BACKENDS:
        raise _bad(
            f"guided_decoding_backend={req.guided_decoding_backend!r} is not supported: 'xgrammar', 'guidance' or "
            "'auto'",
            "guided_decoding_backend",
        )
    given = _given(req)
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise _bad(f"give one structured output constraint, not several ({names})", given[1][0])
    field, values = given[0]
    if req.guided_decoding_backend is not None:
        values.setdefault("backend", req.guided_decoding_backend)
    if req.guided_whitespace_pattern is not None:
        values.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    try:
        return StructuredOutputsParams(**values), field
    except (ValueError, TypeError) as e:
        raise _bad(f"{field}: {e}", field) from None


def grammar_check(engine, params, field: str | None, check):
    """`check` for the preparation thread, followed by a parse of the constraint (its compilation starts there and
    is cached for the request), so a bad schema, regex or grammar is a 400 naming its field."""
    if params.structured_outputs is None:
        return check

    def checked(prompts) -> None:
        if check is not None:
            check(prompts)
        try:
            engine.structured_output_manager().grammar(params.structured_outputs, field)
        except ValueError as e:
            raise _bad(str(e), field) from None

    return checked
