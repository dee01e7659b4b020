"""`pagedllm chat`: the conversation is kept across turns, replies stream while they are generated and equal
LLM.chat's greedy replies, Ctrl-C stops a reply cleanly, and a stop string is never shown in part."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import stop_prefix_length
from pagedllm.entrypoints.chat_cli import run_chat, stream_reply

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SYSTEM = "You are a concise assistant."
QUESTIONS = ["What is the capital of France?", "And of Italy?"]


class Recorder(io.StringIO):
    """A stdout that keeps each write; optionally raises KeyboardInterrupt at its n-th non-empty write."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.interrupt_at = interrupt_at

    def write(self, s: str) -> int:
        if s:
            self.writes.append(s)
            if self.interrupt_at is not None and len(self.writes) == self.interrupt_at:
                self.interrupt_at = None
                raise KeyboardInterrupt
        return super().write(s)


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=256 << 20)


def _chat_reply(llm, conversation, params=GREEDY) -> str:
    return llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text


def test_replies_equal_llm_chat_and_history_is_kept(llm):
    out = Recorder()
    stdin = io.StringIO(f"{QUESTIONS[0]}\n\n{QUESTIONS[1]}\n/exit\nnot read\n")
    conversation = run_chat(llm, GREEDY, system=SYSTEM, stdin=stdin, stdout=out)
    expected = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS:  # each reply is LLM.chat's greedy reply to the whole history so far
        expected.append({"role": "user", "content": question})
        expected.append({"role": "assistant", "content": _chat_reply(llm, expected)})
    assert conversation == expected
    assert out.getvalue() == "".join(m["content"] + "\n" for m in expected[2::2])
    assert len(out.writes) > 2 * len(QUESTIONS) + 2  # streamed in pieces, not one write per reply


def test_end_of_input_quits(llm):
    conversation = run_chat(llm, GREEDY, stdin=io.StringIO(QUESTIONS[0]), stdout=Recorder())
    assert [m["role"] for m in conversation] == ["user", "assistant"]


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(llm):
    out = Recorder(interrupt_at=3)
    stdin = io.StringIO(f"{QUESTIONS[0]}\n{QUESTIONS[1]}\n")
    conversation = run_chat(llm, GREEDY, stdin=stdin, stdout=out)
    partial = conversation[1]["content"]
    assert partial == "".join(out.writes[:2])  # the reply ends where it was interrupted
    assert len(partial) < len(_chat_reply(llm, conversation[:1]))
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine.output_processor.states
    assert conversation[3]["content"] == _chat_reply(llm, conversation[:3])


def test_stop_prefix_length_matches_brute_force():
    stops = ["</s>", "Paris", "ss", "a"]
    for text in ["", "x", "Par", "the city of Pari", "ab</", "</s", "mass", "Pa", "pizza"]:
        expected = max(
            (len(s[:k]) for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
            default=0,
        )
        assert stop_prefix_length(text, stops) == expected, text


def _stream(llm, conversation, params) -> list[str]:
    out = Recorder()
    reply = stream_reply(llm, conversation, params, out)
    assert out.writes[-1] == "\n" and "".join(out.writes[:-1]) == reply
    return ["".join(out.writes[: i + 1]) for i in range(len(out.writes) - 1)]


def test_stop_string_is_never_shown_in_part(llm):
    conversation = [{"role": "user", "content": "Tell me about Paris in two sentences."}]
    plain = _stream(llm, conversation, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    full = plain[-1]
    # A stop string that starts 2 characters before the end of a streamed piece: without hold-back those 2
    # characters would be shown before the engine knows whether the stop string completes.
    end = next(
        len(t)
        for t in plain[1:]
        if len(t) >= 3 and len(full) >= len(t) + 3 and full.find(full[len(t) - 2 : len(t) + 3]) == len(t) - 2
    )
    stop = full[end - 2 : end + 3]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    shown = _stream(llm, conversation, params)
    assert shown[-1] == full[: end - 2]
    assert all(full[: end - 2].startswith(t) for t in shown)
    assert _chat_reply(llm, conversation, params) == full[: end - 2]


def test_command_line_chat(smollm2, llm):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "chat", "--model", smollm2, "--dtype", "float32", "--max-tokens", "24"],
        input=f"{QUESTIONS[0]}\n/exit\n",
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    expected = _chat_reply(
        llm, [{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=24)
    )
    assert proc.stdout == expected + "\n"


def test_command_line_rejects_bad_sampling_values():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "chat", "--temperature", "-1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "temperature" in proc.stderr
