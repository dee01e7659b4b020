"""LLM.chat on the bundled SmolLM2 against HF transformers: the prompt (text and token ids) equals
`tokenizer.apply_chat_template`, and greedy replies (float32) equal `model.generate` on those ids."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams

SYSTEM_USER = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi! Can you help me with maths?"},
    {"role": "assistant", "content": "Of course. What would you like to know?"},
    {"role": "user", "content": "What is 12 times 12?"},
]
NO_SYSTEM = [{"role": "user", "content": "Write a haiku about rain."}]
CONVERSATIONS = [SYSTEM_USER, MULTI_TURN, NO_SYSTEM]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city <today>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# A ChatML template that lists the tools (through tojson) and renders assistant tool calls.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that loops over content parts (vLLM's "openai" content format) and starts with the BOS token.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}[{{ message.role | upper }}] "
    "{% for part in message['content'] %}{{ part['text'] }}{% if not loop.last %} | {% endif %}{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% else %}<answer>{% endif %}"
)


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def hf_tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2))


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_copy):
    return smollm2_hf_copy  # (_hf_greedy sets its generation config)


def _hf_ids(hf_tok, conversation, **kwargs) -> list[int]:
    return list(hf_tok.apply_chat_template(conversation, tokenize=True, **kwargs)["input_ids"])


def _prompt(llm, conversation, **kwargs):
    out = llm.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)
    assert len(out) == 1
    return out[0].prompt, out[0].prompt_token_ids


def _check_prompt(llm, hf_tok, ours, theirs, ours_kwargs=None, hf_kwargs=None):
    """Our prompt for `ours` equals HF's apply_chat_template of the equivalent conversation `theirs`."""
    hf_kwargs = {"add_generation_prompt": True, **(hf_kwargs or {})}
    text, ids = _prompt(llm, ours, **(ours_kwargs or {}))
    assert text == hf_tok.apply_chat_template(theirs, tokenize=False, **hf_kwargs)
    assert ids == _hf_ids(hf_tok, theirs, **hf_kwargs)
    return text, ids


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["system+user", "multi-turn", "no-system"])
def test_prompt_ids_equal_hf(llm, hf_tok, conversation):
    text, ids = _check_prompt(llm, hf_tok, conversation, conversation)
    bos = hf_tok.bos_token_id
    assert text.startswith(hf_tok.bos_token) and ids[0] == bos and ids[1] != bos  # BOS from the template, once


def test_add_generation_prompt_false(llm, hf_tok):
    _check_prompt(
        llm, hf_tok, MULTI_TURN, MULTI_TURN, {"add_generation_prompt": False}, {"add_generation_prompt": False}
    )


def test_list_of_text_parts_joined_as_vllm(llm, hf_tok):
    # The model's template reads content as a string: text parts are joined with newlines (vLLM's "string" format).
    parts = [{"type": "text", "text": "Summarize this:"}, {"type": "text", "text": "Cats sleep a lot."}]
    ours = [{"role": "user", "content": parts}]
    theirs = [{"role": "user", "content": "Summarize this:\nCats sleep a lot."}]
    _check_prompt(llm, hf_tok, ours, theirs)


def test_continue_final_message(llm, hf_tok):
    conversation = MULTI_TURN + [{"role": "assistant", "content": "12 times 12 is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    text, _ = _check_prompt(llm, hf_tok, conversation, conversation, options, options)
    assert text.endswith("12 times 12 is")  # left open: no end-of-message token


def test_tools_reach_the_template(llm, hf_tok):
    ours_kwargs = {"tools": TOOLS, "chat_template": TOOL_TEMPLATE}
    text, _ = _check_prompt(llm, hf_tok, SYSTEM_USER, SYSTEM_USER, ours_kwargs, ours_kwargs)
    assert '"name": "get_weather"' in text and "<today>" in text  # tojson: plain JSON, HTML not escaped


def test_tool_call_arguments_parsed_from_json(llm, hf_tok):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ours = SYSTEM_USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "c1"},
    ]
    parsed = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    theirs = SYSTEM_USER + [
        {"role": "assistant", "content": "", "tool_calls": [parsed]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "c1"},
    ]
    kwargs = {"tools": TOOLS, "chat_template": TOOL_TEMPLATE}
    _check_prompt(llm, hf_tok, ours, theirs, kwargs, kwargs)


def test_custom_template_string_and_openai_content_format(llm, hf_tok):
    # The template loops over parts: "auto" detects it and string content arrives as one text part.
    ours = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "A"}, "B"]},
    ]
    theirs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    text, ids = _check_prompt(
        llm, hf_tok, ours, theirs, {"chat_template": PARTS_TEMPLATE}, {"chat_template": PARTS_TEMPLATE}
    )
    assert text.startswith(hf_tok.bos_token + "[SYSTEM] Be brief.") and ids.count(hf_tok.bos_token_id) == 1


def test_template_from_file_and_kwargs(llm, hf_tok, tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE, encoding="utf-8")
    for flag in (True, False):
        ours = {"chat_template": str(path), "chat_template_kwargs": {"enable_thinking": flag}}
        text, _ = _check_prompt(
            llm, hf_tok, NO_SYSTEM, NO_SYSTEM, ours, {"chat_template": THINKING_TEMPLATE, "enable_thinking": flag}
        )
        assert text.endswith("<think>" if flag else "<answer>")


def test_several_conversations_keep_order(llm, hf_tok):
    outputs = llm.chat(CONVERSATIONS, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [
        _hf_ids(hf_tok, c, add_generation_prompt=True) for c in CONVERSATIONS
    ]


def _hf_greedy(hf_model, ids: list[int], max_new_tokens: int, eos_token_id) -> list[int]:
    hf_model.generation_config.eos_token_id = eos_token_id
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_greedy_chat_equals_hf_generate(llm, hf_tok, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    for conversation, out in zip(CONVERSATIONS, outputs):
        ids = _hf_ids(hf_tok, conversation, add_generation_prompt=True)
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, ids, 48, None)


def test_greedy_chat_stops_at_eos_like_hf(llm, hf_tok, hf_model):
    out = llm.chat(SYSTEM_USER, SamplingParams(temperature=0.0, max_tokens=120), use_tqdm=False)[0].outputs[0]
    ids = _hf_ids(hf_tok, SYSTEM_USER, add_generation_prompt=True)
    reference = _hf_greedy(hf_model, ids, 120, hf_tok.eos_token_id)
    assert reference[-1] == hf_tok.eos_token_id  # the reply ends within the budget
    assert out.token_ids == reference and out.finish_reason == "stop"
    assert out.text == hf_tok.decode(reference, skip_special_tokens=True)


def test_continue_final_message_greedy_equals_hf(llm, hf_tok, hf_model):
    conversation = MULTI_TURN + [{"role": "assistant", "content": "12 times 12 is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    out = llm.chat(
        conversation, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False, **options
    )
    ids = _hf_ids(hf_tok, conversation, **options)
    assert out[0].outputs[0].token_ids == _hf_greedy(hf_model, ids, 16, None)


def test_reasoning_and_developer_messages(llm, hf_tok):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ours = [
        {"role": "developer", "content": "Answer with digits."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "two and two make four"},
        {"role": "user", "content": "3+3?"},
    ]
    theirs = [dict(m) for m in ours]
    theirs[2] = {"role": "assistant", "content": "4", "reasoning_content": "two and two make four"}
    text, _ = _check_prompt(llm, hf_tok, ours, theirs, {"chat_template": template}, {"chat_template": template})
    assert "<think>two and two make four</think>4" in text
