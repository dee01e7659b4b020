"""LLM.chat rejects bad conversations and options with a ValueError/TypeError that names the problem, before
anything enters the engine, and the same LLM serves the next call. Chat templates run in a sandbox."""

from __future__ import annotations

import datetime
import json
import os
import re

import pytest
from jinja2.exceptions import SecurityError

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.chat_utils import apply_chat_template

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
GOOD = [{"role": "user", "content": "Name a fruit."}]
USER = {"role": "user", "content": "Hi"}
ROLES = "system, developer, user, assistant, tool"


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, max_model_len=256, num_gpu_blocks_override=16)


@pytest.fixture(scope="module")
def hf_tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2))


@pytest.fixture(scope="module")
def baseline(llm):
    """The reply to GOOD before any bad call (the engine must give the same one after each)."""
    return llm.chat(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _still_serves(llm, hf_tok, baseline):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.output_processor.states
    out = llm.chat(GOOD, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(hf_tok.apply_chat_template(GOOD, add_generation_prompt=True)["input_ids"])
    assert out.outputs[0].token_ids == baseline


BAD_MESSAGES = [
    ([{"content": "Hi"}], ValueError, r"messages\[0\]: missing 'role'"),
    ([USER, {"role": "wizard", "content": "Hi"}], ValueError, rf"messages\[1\]: role 'wizard' is not one of {ROLES}"),
    ([{"role": "user"}], ValueError, r"messages\[0\]: 'content' is missing or None"),
    ([{"role": "user", "content": None}], ValueError, r"messages\[0\]: 'content' is missing or None"),
    ([USER, {"role": "assistant"}], ValueError, r"messages\[1\]: 'content' is missing .*tool_calls"),
    ([{"role": "user", "content": 42}], TypeError, r"messages\[0\]\.content has type int; expected a str or a list"),
    ([{"role": "user", "content": {"text": "Hi"}}], TypeError, r"messages\[0\]\.content has type dict"),
    (["Hi"], TypeError, r"messages\[0\] has type str; expected a dict with 'role' and 'content'"),
    (
        [{"role": "user", "content": [{"type": "banana", "text": "Hi"}]}],
        ValueError,
        r"messages\[0\]\.content\[0\]: type 'banana' is not one of text, input_text",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {}}]}],
        ValueError,
        r"messages\[0\]\.content\[1\]: a 'image_url' part is multimodal input, which is not supported",
    ),
    (
        [{"role": "user", "content": [{"image_url": {"url": "http://x/y.png"}}]}],
        ValueError,
        r"messages\[0\]\.content\[0\]: a 'image_url' part is multimodal",
    ),
    ([{"role": "user", "content": [{"type": "text"}]}], ValueError, r"content\[0\]: a 'text' part needs a str 'text'"),
    ([{"role": "user", "content": [7]}], TypeError, r"messages\[0\]\.content\[0\] has type int"),
    ([], ValueError, r"messages is empty"),
    ([[USER], []], ValueError, r"messages is empty: a conversation needs at least one message"),
    ([[USER], "Hi"], TypeError, r"messages\[1\] has type str; in a list of conversations each must be a list"),
    ({"role": "user", "content": "Hi"}, TypeError, r"messages has type dict; expected a list of message dicts"),
]


@pytest.mark.parametrize("messages, error, pattern", BAD_MESSAGES)
def test_bad_messages(llm, hf_tok, baseline, messages, error, pattern):
    with pytest.raises(error, match=pattern):
        llm.chat(messages, GREEDY, use_tqdm=False)
    _still_serves(llm, hf_tok, baseline)


def test_bad_second_conversation_admits_nothing(llm, hf_tok, baseline):
    with pytest.raises(ValueError, match=r"messages\[0\]: role 'robot'"):
        llm.chat([GOOD, [{"role": "robot", "content": "beep"}]], GREEDY, use_tqdm=False)
    _still_serves(llm, hf_tok, baseline)


BAD_OPTIONS = [
    (
        {"continue_final_message": True, "add_generation_prompt": True},
        ValueError,
        r"continue_final_message=True and add_generation_prompt=True cannot be combined",
    ),
    ({"chat_template_content_format": "xml"}, ValueError, r"chat_template_content_format='xml' is not one of 'auto'"),
    (
        {"mm_processor_kwargs": {"num_crops": 4}},
        ValueError,
        r"mm_processor_kwargs: multimodal inputs are not supported",
    ),
    ({"chat_template": "no/such/template.jinja"}, ValueError, r"chat_template='no/such/template.jinja' looks like a"),
    ({"chat_template": 3}, TypeError, r"chat_template has type int"),
    ({"chat_template": "{% for m in messages %}{{ m.role "}, ValueError, r"chat_template is not valid Jinja"),
    ({"tools": "get_weather"}, TypeError, r"tools must be a list of tool dicts"),
    ({"chat_template_kwargs": {"messages": []}}, ValueError, r"chat_template_kwargs: \['messages'\] are set by chat"),
    ({"chat_template_kwargs": ["enable_thinking"]}, TypeError, r"chat_template_kwargs has type list"),
    ({"lora_request": object()}, ValueError, r"lora_request: LoRA is off; create the engine with enable_lora=True"),
    (
        {"chat_template": "{{ raise_exception('only user messages, please') }}"},
        ValueError,
        r"chat_template: rendering failed: only user messages, please",
    ),
]


@pytest.mark.parametrize("kwargs, error, pattern", BAD_OPTIONS)
def test_bad_options(llm, hf_tok, baseline, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        llm.chat(GOOD, GREEDY, use_tqdm=False, **kwargs)
    _still_serves(llm, hf_tok, baseline)


def test_continue_final_message_needs_content_in_template(llm):
    with pytest.raises(ValueError, match=r"continue_final_message=True needs a chat template that writes"):
        llm.chat(
            GOOD, add_generation_prompt=False, continue_final_message=True, chat_template="{{ messages | length }}"
        )


def test_assistant_with_tool_calls_may_omit_content(llm):
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation = GOOD + [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    assert llm.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{{ messages[0].update({'content': 'changed'}) }}",
    "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",
    "{{ dict.__class__ }}{{ dict.__call__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_refuses_python_internals_and_mutation(llm, hf_tok, baseline, template):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="sandbox refused an unsafe operation") as info:
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert isinstance(info.value.__cause__, SecurityError)
    assert messages == [{"role": "user", "content": "Hi"}]  # the caller's conversation is untouched
    _still_serves(llm, hf_tok, baseline)


def test_template_helpers_render_as_hf(llm, hf_tok):
    template = (
        "{{ strftime_now('%Y') }}|{{ tools | tojson }}|{{ dict(a=1) | tojson }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}"
        "|{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% if loop.index == 1 %}"
        "{% break %}{% endif %}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&</b> é"}}]
    text, ids = apply_chat_template(llm.get_tokenizer(), [USER, USER], chat_template=template, tools=tools)
    year = str(datetime.datetime.now().year)
    assert text == f'{year}|{json.dumps(tools, ensure_ascii=False)}|{{"a": 1}}|2|Hi'
    assert text == hf_tok.apply_chat_template([USER, USER], chat_template=template, tools=tools, tokenize=False)
    assert ids == hf_tok.encode(text, add_special_tokens=False)


def _nested(depth: int, leaf):
    """A JSON-schema-like dict `depth` levels deep."""
    for _ in range(depth):
        leaf = {"type": "object", "properties": {"a": leaf}}
    return leaf


def _call(arguments) -> dict:
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


@pytest.mark.parametrize(
    "where, kwargs",
    [
        ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(600, {})}}])),
        ("chat_template_kwargs", dict(chat_template_kwargs={"x": _nested(600, 1)})),
        ("messages[1]", dict(messages=[USER, _call(_nested(600, 1))])),
        ("messages[1].tool_calls[0].function.arguments", dict(messages=[USER, _call("[" * 5000 + "]" * 5000)])),
    ],
)
def test_data_nested_too_deep_is_refused(llm, hf_tok, baseline, where, kwargs):
    messages = kwargs.pop("messages", GOOD)
    with pytest.raises(ValueError, match=rf"{re.escape(where)} is nested too deep: at most 64 levels"):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    _still_serves(llm, hf_tok, baseline)


def test_data_nested_up_to_the_limit_renders(llm):
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(30, {})}}]  # 64 levels in all
    template = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    text, _ = apply_chat_template(llm.get_tokenizer(), GOOD, tools=tools, chat_template=template)
    assert json.loads(text[: -len(GOOD[0]["content"])]) == tools
    tools[0]["function"]["parameters"] = _nested(31, {})  # 66 levels
    with pytest.raises(ValueError, match="tools is nested too deep"):
        apply_chat_template(llm.get_tokenizer(), GOOD, tools=tools, chat_template=template)
