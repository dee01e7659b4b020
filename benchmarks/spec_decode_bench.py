"""Output tokens/s with and without speculative decoding, in the same run. Greedy decoding, so both runs must
produce the same tokens (checked: same_outputs; in half precision a verifying step's sums may round a near-tie
apart, after which the row goes its own way: rows_differing and first_divergence say how many and how early). Each
batch size is timed --repeats times (default 3), each run from an empty prefix cache, and the median run counts
(runs_s_*: every run's seconds); the time split covers all the runs.

--method ngram (default): an input-grounded workload, a ~1k-token text made here deterministically (seeded
sentences) and chat prompts asking the model to repeat or lightly edit it, where prompt lookup finds the
continuation in the prompt.

--method draft: Llama-3.1-8B shapes with a Llama-3.2-1B-shaped draft (benchmarks/configs), dummy weights, random
prompts of 128 tokens. The dummy target is given a next-token map (spec_decode_forcing.py): its embedding row t is a
seeded random vector e_t of norm sqrt(H) and its LM head row P[t] is e_t, P a seeded permutation, so its greedy
continuation after a token t is P(t), P(P(t)), ..., known without a run. The margin: dummy weights are U(-0.01,
0.01) (norms 1 + that), so on a normed input of RMS 1 a layer's attention adds at most ~0.14 RMS to the residual (v
~0.37, o_proj x0.37; less once averaged over positions) and its MLP ~0.05: after 32 layers h is e_t plus at most
~0.8 RMS of other directions (rms(h) <= ~1.3). The logit of P[t] is e_t . h / rms(h) >= ~H / 1.3, any other a random
product ~N(0, H) whose largest over 128k tokens is ~5 sqrt(H): a gap of ~2800 at H = 4096. Measured smallest top-2
gaps: 3764 (8B widths, 2 layers, bf16, CPU) and 32.5 (--tiny: H = 64, float32 and bf16); bf16 rounds a logit near
4096 by at most 16. The run without drafts must produce that continuation (checked: the benchmark stops otherwise),
and an untimed run with logprobs reports its smallest top-2 gap (min_top2_logit_margin).
A dummy draft never agrees with the target, so its agreement is forced: the draft model runs its K forward passes
as usual (their cost is measured), but the tokens each proposal feeds on and proposes are the target's
continuation up to a first disagreeing one, whose place follows the law of K drafts each agreeing independently
with probability `agree` (drawn on a golden-ratio sequence per request, so that a short run hits the rate): the
draft's cache then holds what a draft agreeing at that rate would have written. Verification accepts a draft while
it and those before it agree, so the acceptance rate (accepted / proposed, as vLLM counts it) is (agree + agree^2 +
... + agree^K) / K: --acceptance sets it and `agree` follows. forced_share: the share of proposals forced (1.0
unless the target left its continuation). disable_by_batch_size (default 32) turns drafts off at batch 64.

--method eagle | eagle3: the same 8B target with a dummy EAGLE head of its shapes (one Llama layer of the 8B's sizes
and fc over concat(embedding, hidden state), sharing the target's embedding and LM head: the layout of
yuhuili/EAGLE-LLaMA3-Instruct-8B; eagle3: fc over three target layers' hidden states, its own LM head over a 32000-token
draft vocabulary). Agreement is forced the same way: the head consumes each step's hidden states and runs its K chain
steps as usual (their cost is measured), but the tokens it feeds on and proposes are the forced ones.

Workloads, one JSON line each on stdout (appended to benchmarks/results.jsonl unless --no-append):
  spec-decode-{method}-bs{B}   B prompts at once: tokens/s without speculation (the engine's default scheduling:
                            asynchronous on a GPU), with drafts (synchronous), the speedup, the drafts' acceptance
                            rate, the mean tokens emitted per verifying row, the steps of each kind, and the time
                            split of each run in ms per target step: step (wall), propose (the proposals, host wall
                            time: a draft model's passes run on after it, their drafts staying on the device; and an
                            EAGLE head's pass over each step's hidden states), verify (the target's forwards),
                            sample (logits, sampler, verification), other (the rest: scheduling, inputs, commit, and
                            the wait for draft passes still running), and the mean forward and
                            sampling of each kind of step (decode_*, verify_*). Forwards, sampling and the EAGLE
                            pass are device time on a GPU (CUDA events, no synchronisation), wall time on a CPU.

    PYTHONPATH=. python benchmarks/spec_decode_bench.py                 # the bundled SmolLM2 (on a GPU)
    PYTHONPATH=. python benchmarks/spec_decode_bench.py --method draft  # 8B target, 1B draft, dummy (on a GPU)
    PYTHONPATH=. python benchmarks/spec_decode_bench.py --tiny --no-append   # a tiny random model on the CPU (smoke)
    PYTHONPATH=. python benchmarks/spec_decode_bench.py --method draft --tiny --dtype bfloat16 --no-append
    PYTHONPATH=. python benchmarks/spec_decode_bench.py --method eagle  # 8B target, dummy EAGLE head (on a GPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

try:
    from benchmarks import spec_decode_forcing as forcing
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import spec_decode_forcing as forcing
    from common import emit, git_commit, machine_description, make_record, rounded

from pagedllm import LLM, SamplingParams

SUBJECTS = ["The river", "Our committee", "The old engine", "A quiet village", "The new library", "Each student"]
VERBS = ["carried", "reviewed", "replaced", "welcomed", "measured", "described", "protected", "announced"]
OBJECTS = ["the northern bridge", "a detailed budget", "three wooden boats", "the morning train", "every report"]
ENDINGS = ["before the winter storms.", "after a long debate.", "with great care.", "for the first time.", "at dawn."]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word.",
    "Copy the following text, but replace every occurrence of 'the' with 'THE'.",
    "Rewrite the following text with each sentence on its own line.",
    "Repeat the following text, then stop.",
]


def make_text(seed: int, num_sentences: int) -> str:
    """A deterministic text of num_sentences sentences (about 12 tokens each)."""
    rng = random.Random(seed)
    parts = [rng.choice(p) for _ in range(num_sentences) for p in (SUBJECTS, VERBS, OBJECTS, ENDINGS)]
    return " ".join(" ".join(parts[i : i + 4]) for i in range(0, len(parts), 4))


def chat_prompts(llm: LLM, count: int, num_sentences: int) -> list[dict]:
    tok = llm.get_tokenizer()
    prompts = []
    for i in range(count):
        message = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{make_text(i, num_sentences)}"
        chat = [{"role": "user", "content": message}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompts.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
    return prompts


def tiny_model_path() -> str:
    """A tiny random Llama (no tokenizer): the benchmark's code path on a CPU, not a meaningful speed."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=1024,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked outputs: it falls into cycles that prompt lookup predicts
    path = tempfile.mkdtemp(prefix="spec-bench-tiny")
    model.save_pretrained(path)
    return path


def tiny_prompts(count: int, length: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(320) for _ in range(length // 4)] * 4} for _ in range(count)]


MODEL_METHODS = ("draft", "eagle", "eagle3")  # a draft model or head with dummy weights, agreement forced
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_TARGET = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
TINY_DRAFT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, head_dim=16)


def dummy_config_dir(base: str, **overrides) -> str:
    """A folder with base's config.json (overrides applied): for load_format="dummy"."""
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f) | overrides
    path = tempfile.mkdtemp(prefix="spec-bench-config")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def draft_paths(tiny: bool) -> tuple[str, str]:
    """(target, draft) config folders: Llama-3.1-8B and Llama-3.2-1B shapes, or tiny ones of their layout."""
    target, draft = (os.path.join(BENCH_DIR, "configs", name) for name in ("llama-3.1-8b", "llama-3.2-1b"))
    if not tiny:
        return target, draft
    small = dict(num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024, rope_scaling=None)
    return dummy_config_dir(target, **TINY_TARGET, **small), dummy_config_dir(draft, **TINY_DRAFT, **small)


def eagle_paths(tiny: bool, method: str) -> tuple[str, str]:
    """(target, head) config folders: the Llama-3.1-8B target (tiny: 4 layers of the tiny shapes) and an EAGLE /
    EAGLE-3 head of its shapes (one layer)."""
    target = os.path.join(BENCH_DIR, "configs", "llama-3.1-8b")
    if tiny:
        small = dict(num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024, rope_scaling=None)
        target = dummy_config_dir(target, **(TINY_TARGET | small | dict(num_hidden_layers=4)))
    head = dict(num_hidden_layers=1)
    if method == "eagle3":
        head |= dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=64 if tiny else 32000)
        head |= dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3]) if tiny else {}
    return target, dummy_config_dir(target, **head)


def agreement_for(acceptance: float, k: int) -> float:
    """The per-draft agreement a with (a + a^2 + ... + a^k) / k == acceptance (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, k + 1)) / k < acceptance else (lo, mid)
    return (lo + hi) / 2


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(length)]} for _ in range(count)]


def make_llm(args, spec: dict | None) -> LLM:
    # a fixed KV cache (no memory profile): the engine built before may not have handed all of its memory back
    kwargs = dict(speculative_config=spec, kv_cache_memory_bytes=(64 << 20) if args.tiny else (8 << 30))
    dtype = args.dtype if args.dtype != "auto" or not args.tiny else "float32"
    if args.method in MODEL_METHODS:
        kwargs |= dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len)
        llm = LLM(args.target, dtype=dtype, **kwargs)
        forcing.install_successor_map(llm, forcing.successor_map(llm.llm_engine.config.model.vocab_size))
        return llm
    if args.tiny:
        return LLM(tiny_model_path(), dtype=dtype, skip_tokenizer_init=True, **kwargs)
    return LLM(args.model, dtype=dtype, **kwargs)


def workload(args, llm: LLM, batch: int) -> list[dict]:
    if args.method in MODEL_METHODS:
        vocab = llm.llm_engine.config.model.vocab_size
        return random_prompts(batch, args.prompt_len, vocab, seed=batch)
    return tiny_prompts(batch, 256) if args.tiny else chat_prompts(llm, batch, args.sentences)


def run_engine(args, spec: dict | None) -> dict:
    """batch size -> the figures of one engine configuration (outputs, seconds, draft counts, the step split). With
    a draft model or EAGLE head its tokens are forced to agree with the target's at the rate asked for."""
    llm = make_llm(args, spec)
    runner = llm.llm_engine.core.executor.runner
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.tiny or args.method != "ngram")
    drafter = getattr(runner, "drafter", None)
    perm = forcing.successor_map(llm.llm_engine.config.model.vocab_size) if args.method in MODEL_METHODS else None
    split, sched, results = forcing.StepSplit(llm.llm_engine.core), llm.llm_engine.core.scheduler, {}
    for batch in args.batch_sizes:
        prompts, r = workload(args, llm, batch), {}
        if drafter is not None:
            drafter.force_drafts = forced = forcing.ForcedAgreement(prompts, perm, args.max_tokens, args.agree, args.k)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
        before = (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens)
        split.take()
        runs = []
        for _ in range(args.repeats):  # each from an empty prefix cache: the same work every time
            llm.llm_engine.reset_prefix_cache()
            if drafter is not None:
                forced.reset()
            start = time.perf_counter()
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            runs.append(time.perf_counter() - start)
            r.setdefault("outputs", outs)
        r["runs"], r["seconds"] = runs, statistics.median(runs)
        r["steps"], r["split"] = split.take()  # (over all the runs)
        after = (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens)
        r["drafts"] = tuple(a - b for a, b in zip(after, before))
        if drafter is not None:
            r["followed"] = forced.num_followed / forced.num_calls if forced.num_calls else None
        elif perm is not None:  # (after the timed run: its prompts were not cached before it, as with drafts)
            forcing.check_follows_map(r["outputs"], prompts, perm)
            r["margin"] = forcing.top2_margin(llm, prompts, args.max_tokens)  # untimed: the top-2 logits' gap
        results[batch] = r
    del llm, runner, drafter, split
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["ngram", *MODEL_METHODS], default="ngram")
    parser.add_argument("--model", default=None, help="ngram: model (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (smoke run)")
    parser.add_argument("--dtype", default="auto", help="model dtype (--tiny: float32 unless given)")
    parser.add_argument("--batch-sizes", default=None, help="default: 1,16 (draft: 1,16,64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 512 (draft 256; --tiny: 48)")
    parser.add_argument("--sentences", type=int, default=80, help="ngram: sentences of the text (~12 tokens each)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--acceptance", type=float, default=0.7, help="draft: the forced acceptance rate")
    parser.add_argument("--disable-by-batch-size", type=int, default=32, help="draft: no drafts above this batch")
    parser.add_argument("--prompt-len", type=int, default=None, help="draft: prompt tokens (default 128; tiny 32)")
    parser.add_argument("--max-model-len", type=int, default=None, help="draft (default 2048; tiny 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (the median is reported)")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    draft = args.method in MODEL_METHODS
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,16,64" if draft else "1,16")).split(",")]
    args.max_tokens = args.max_tokens or (48 if args.tiny else 256 if draft else 512)
    args.prompt_len = args.prompt_len or (32 if args.tiny else 128)
    args.max_model_len = args.max_model_len or (512 if args.tiny else 2048)
    if draft:
        paths = draft_paths(args.tiny) if args.method == "draft" else eagle_paths(args.tiny, args.method)
        args.target, draft_path = paths
        args.agree = agreement_for(args.acceptance, args.k)
        method = "draft_model" if args.method == "draft" else args.method
        spec = {"method": method, "model": draft_path, "num_speculative_tokens": args.k}
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.k}
        spec |= {"prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    base = run_engine(args, None)
    fast = run_engine(args, spec)
    report(args, spec, base, fast)
    return 0


def divergence(ref: list[list[int]], out: list[list[int]]) -> dict:
    """How far apart two runs' greedy outputs are: the rows that differ and the earliest position where one does (in
    half precision a verify step's sums may round a near-tie the other way, after which the row goes its own way)."""
    firsts = [  # each differing row's first position that differs (or where the shorter one stopped)
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        for x, y in zip(ref, out)
        if x != y
    ]
    return dict(rows_differing=len(firsts), first_divergence=min(firsts, default=None))


PARTS = {"propose": "propose", "verify": "forward", "sample": "sample"}  # the split's names -> StepSplit's parts


def time_split(r: dict) -> dict:
    """ms per target step of a run: the whole step, proposing, the target's forwards, sampling (logits, sampler,
    verification) and the rest (scheduling, inputs, commit); and the mean forward / sampling of each kind of step."""
    steps, sec = r["steps"], r["split"]
    total = max(sum(steps.values()), 1)
    parts = {name: sum(v for (_, p), v in sec.items() if p == part) for name, part in PARTS.items()}
    split = {"step": sum(r["runs"]) / total * 1e3} | {k: v / total * 1e3 for k, v in parts.items()}
    split["other"] = split["step"] - sum(split[k] for k in parts)
    per_kind = {
        f"{kind}_{part}": sec.get((kind, part), 0.0) / n * 1e3
        for kind, n in steps.items()
        if kind != "prefill"
        for part in ("forward", "sample")
    }
    return {k: rounded(v, 3) for k, v in (split | per_kind).items()}


def report(args, spec: dict, base: dict, fast: dict) -> None:
    machine, commit = machine_description(), git_commit()
    draft = args.method in MODEL_METHODS
    big = {"draft": "8B+1B", "eagle": "8B+EAGLE", "eagle3": "8B+EAGLE-3"}.get(args.method)
    model = ("tiny-random" if args.tiny else args.model) if not draft else ("tiny-dummy" if args.tiny else big)
    for batch in args.batch_sizes:
        b, f = base[batch], fast[batch]
        ref, out, (rows, drafts, accepted) = b["outputs"], f["outputs"], f["drafts"]
        tokens = sum(len(o) for o in out)
        extra = {}
        if draft:  # the target followed its successor map without drafts (checked), the drafts were forced
            extra = dict(forced_agreement=rounded(args.agree, 3), forced_share=rounded(f["followed"], 3))
            extra |= dict(target_follows_map=True, min_top2_logit_margin=rounded(b["margin"], 2))
        record = make_record(
            f"spec-decode-{args.method}-bs{batch}", machine, commit, model=model, dtype=args.dtype,
            spec={k: v for k, v in spec.items() if k != "model"}, max_tokens=args.max_tokens, output_tokens=tokens,
            tok_s_baseline=rounded(sum(len(o) for o in ref) / b["seconds"], 1),
            tok_s_spec=rounded(tokens / f["seconds"], 1), speedup=rounded(b["seconds"] / f["seconds"], 3),
            acceptance_rate=rounded(accepted / drafts if drafts else None, 3),
            tokens_per_verify_step=rounded((accepted + rows) / rows if rows else None, 2),
            runs_s_baseline=[rounded(x, 4) for x in b["runs"]], runs_s_spec=[rounded(x, 4) for x in f["runs"]],
            same_outputs=ref == out, **divergence(ref, out), steps_baseline=b["steps"], steps_spec=f["steps"],
            time_split_ms_baseline=time_split(b), time_split_ms_spec=time_split(f), **extra,
        )  # fmt: skip
        emit(record, append=not args.no_append)
        split = record["time_split_ms_spec"]
        print(
            f"batch {batch}: {record['tok_s_baseline']} -> {record['tok_s_spec']} tok/s (x{record['speedup']}), "
            f"acceptance {record['acceptance_rate']}, same outputs: {record['same_outputs']}; ms a step: "
            f"{record['time_split_ms_baseline']['step']} -> {split['step']} (propose {split['propose']}, "
            f"verify {split['verify']}, sample {split['sample']}, other {split['other']})",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
