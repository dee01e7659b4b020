"""LLM.generate's inputs and outputs: prompt forms, order, defaults, stop conditions, seeds, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm import LLM, CompletionOutput, RequestOutput, SamplingParams, TextPrompt, TokensPrompt


@pytest.fixture(scope="module")
def llm(smollm2):
    # float32: seeded sampling reproduces exactly only where the arithmetic does not depend on the batch
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=128 << 20)


def test_prompt_forms_agree(llm):
    tok = llm.get_tokenizer()
    text = "The three primary colors are"
    ids = tok.encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    forms = [text, [text], TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), ids, [ids]]
    outs = [llm.generate(f, greedy, use_tqdm=False) for f in forms]
    for out in outs:
        assert len(out) == 1 and isinstance(out[0], RequestOutput)
        assert out[0].prompt_token_ids == ids
        assert out[0].outputs[0].token_ids == outs[0][0].outputs[0].token_ids
    assert outs[0][0].prompt == text and outs[4][0].prompt is None


def test_results_in_input_order_and_default_max_tokens(llm):
    prompts = ["Hi", "Tell me a very long story about a dragon who " * 3, "1 2 3", "Why?"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0 and o.finished
        assert len(c.token_ids) == 16 and c.finish_reason == "length" and c.stop_reason is None


def test_list_of_sampling_params(llm):
    outs = llm.generate(
        ["a", "b"],
        [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]


def test_stop_string_cut_and_reported(llm):
    base = llm.generate(
        ["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = base.text[4:7]  # a stop string taken from the middle of the free-running text
    assert stop
    out = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.find(stop)]
    kept = llm.generate(
        ["Count: 1, 2, 3,"],
        SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == base.text[: base.text.find(stop) + len(stop)]


def test_stop_token_ids(llm):
    base = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    target = base.token_ids[5]
    out = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]), use_tqdm=False
    )[0].outputs[0]
    first = base.token_ids.index(target)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_seeded_sampling_reproduces_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        ["Hello", "Once upon a time", "Why is the sky blue?"], [others, seeded, others], use_tqdm=False
    )
    assert alone == again == batch[1].outputs[0].token_ids
    other_seed = llm.generate(["Once upon a time"], seeded.clone(), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=999, max_tokens=16, ignore_eos=True)
    assert llm.generate(["Once upon a time"], different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_progress_bar_runs(llm, capsys):
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_cli_generate_writes_jsonl(smollm2, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n" + json.dumps("The sky is") + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "pagedllm",
        "generate",
        "First prompt",
        "--model",
        smollm2,
        "--max-tokens",
        "4",
        "--input",
        str(prompts),
        "--output",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["First prompt", "Hello", "The sky is"]
    assert all(r["num_output_tokens"] <= 4 and isinstance(r["text"], str) for r in rows)


def test_cli_reports_bad_input_cleanly(smollm2):
    cmd = [sys.executable, "-m", "pagedllm", "generate", "Hi", "--model", smollm2, "--temperature", "-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_seeded_sampling_survives_preemption(smollm2):
    prompts = [f"Tell me about the number {i}." for i in range(8)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(8)]
    roomy = LLM(smollm2, dtype="float32", kv_cache_memory_bytes=64 << 20)
    tight = LLM(smollm2, dtype="float32", num_gpu_blocks_override=10)  # 8 requests x 4 blocks do not fit
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    assert got == expected


def test_min_tokens_holds_back_eos(llm):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    free = llm.generate([chat], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert free.token_ids[-1] == eos and len(free.token_ids) < 90
    n = len(free.token_ids) + 8
    held = llm.generate([chat], SamplingParams(temperature=0, max_tokens=100, min_tokens=n), use_tqdm=False)[0].outputs[
        0
    ]
    assert len(held.token_ids) >= n and eos not in held.token_ids[:n]
    assert held.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]  # the same text up to where EOS was


def test_stop_token_text_is_not_in_the_output(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    target = base.token_ids[4]
    out = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids[-1] == target
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)


def test_huge_top_k_and_bad_seed(llm):
    out = llm.generate(["Hi"], SamplingParams(top_k=10**12, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_a_failing_step_ends_its_requests_and_the_engine_serves_on(llm, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "A long shared prefix that fills a few blocks of the cache: " * 4
    expected = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.reset_prefix_cache()
    runner = llm.llm_engine.core.executor.runner

    def broken(so):
        raise RuntimeError("simulated failure inside the model")

    monkeypatch.setattr(runner, "execute_model", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate([prompt], greedy, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.core.scheduler.kv.pool.cached == {}  # nothing half-written is findable
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_stop_string_spanning_two_tokens_is_caught(llm):
    tok = llm.get_tokenizer()
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm.generate(["Once upon a time, in a land far away,"], SamplingParams(**greedy), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    ends = [len(tok.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)]
    # a boundary with at least two characters of text on each side
    j = next(j for j in range(2, len(ids) - 1) if ends[j] - ends[j - 1] >= 2 and ends[j + 1] - ends[j] >= 2)
    text = base.outputs[0].text
    stop = text[ends[j] - 2 : ends[j] + 2]
    out = llm.generate(
        ["Once upon a time, in a land far away,"], SamplingParams(stop=[stop], **greedy), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)] and stop not in out.text
