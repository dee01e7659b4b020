"""benchmarks/spec_decode_bench.py's forced agreement (--method draft | eagle) on the CPU: the dummy target follows
its successor map exactly in float32 and bfloat16, the forced drafts agree by the law asked for, and a tiny run
measures the acceptance rate asked for with the same tokens as without drafts. (The GPU runs are the benchmark's.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import spec_decode_bench as bench  # noqa: E402
from benchmarks import spec_decode_forcing as forcing  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_target_follows_its_successor_map(dtype):
    target, _ = bench.draft_paths(tiny=True)
    llm = LLM(target, dtype=dtype, load_format="dummy", skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    perm = forcing.successor_map(320)
    forcing.install_successor_map(llm, perm)
    prompts = bench.random_prompts(3, 16, 320, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, out in zip(prompts, outputs):
        token, expected = prompt["prompt_token_ids"][-1], []
        for _ in range(24):
            token = int(perm[token])
            expected.append(token)
        assert out == expected
    forcing.check_follows_map(outputs, prompts, perm)
    with pytest.raises(RuntimeError, match="successor map"):
        forcing.check_follows_map(outputs, prompts, forcing.successor_map(320, seed=1))
    assert forcing.top2_margin(llm, prompts, 8) > 10  # logits far apart: rounding cannot flip the argmax


def test_forced_drafts_agree_by_the_law_asked_for():
    k, vocab, acceptance = 4, 50, 0.7
    agree = bench.agreement_for(acceptance, k)
    prompt = [1, 2, 3]
    perm = forcing.successor_map(vocab)
    hook = forcing.ForcedAgreement([{"prompt_token_ids": prompt}], perm, 4000, agree, k)
    seq = prompt + forcing.continuation(prompt, perm, 4000 + k)
    tokens, runs = list(prompt), []
    while len(tokens) < 3000:  # a verifier: accept drafts while they match, then the target's token
        drafts = hook([tokens])[0].tolist()
        n = len(tokens)
        run = next((j for j in range(k) if drafts[j] != seq[n + j]), k)
        runs.append(run)
        tokens = seq[: n + run + 1]
    law = [agree**j * (1 - agree) for j in range(k)] + [agree**k]
    freq = np.bincount(runs, minlength=k + 1) / len(runs)
    assert np.abs(freq - law).max() < 0.01
    assert sum(runs) / (k * len(runs)) == pytest.approx(acceptance, abs=0.005)
    assert hook.num_followed == hook.num_calls == len(runs)
    off = hook([[*prompt, (seq[3] + 1) % vocab]])  # a history that left the continuation: the draft's own tokens
    assert off.tolist() == [[-1] * k] and hook.num_followed == len(runs)
    history = [*prompt, seq[3]]  # one request's list, which grows: each call checks its new tokens
    assert (hook([history]) >= 0).all()
    history.append((seq[4] + 1) % vocab)
    assert hook([history]).tolist() == [[-1] * k]
    history.append(seq[5])
    assert hook([history]).tolist() == [[-1] * k]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_tiny_run_measures_the_acceptance_asked_for(method, capsys):
    args = ["--method", method, "--tiny", "--no-append", "--batch-sizes", "1,8", "--max-tokens", "96", "--repeats", "2"]
    assert bench.main([*args, "--dtype", "bfloat16"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["workload"] for r in lines] == [f"spec-decode-{method}-bs1", f"spec-decode-{method}-bs8"]
    for r in lines:
        assert r["same_outputs"] and r["target_follows_map"] and r["forced_share"] == 1.0
        assert r["rows_differing"] == 0 and r["first_divergence"] is None
        assert len(r["runs_s_baseline"]) == len(r["runs_s_spec"]) == 2  # each run forced afresh: the same rate
        assert r["acceptance_rate"] == pytest.approx(0.7, abs=0.03)
        assert r["min_top2_logit_margin"] > 10
        split = r["time_split_ms_spec"]
        assert r["steps_spec"]["verify"] > 0 and split["verify_forward"] > 0
        parts = split["propose"] + split["verify"] + split["sample"]
        assert split["propose"] > 0 and split["sample"] > 0 and parts <= split["step"] + 1e-3


def test_divergence_reports_rows_and_first_position():
    assert bench.divergence([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == dict(rows_differing=0, first_divergence=None)
    apart = bench.divergence([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 7]])
    assert apart == dict(rows_differing=2, first_divergence=1)
    assert bench.divergence([[1, 2]], [[1, 2, 3]]) == dict(rows_differing=1, first_divergence=2)  # one stopped early
