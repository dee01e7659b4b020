"""Output tokens/s with and without n-gram speculative decoding on an input-grounded workload: a ~1k-token text made
here deterministically (seeded sentences), and chat prompts asking the model to repeat or lightly edit it, where
prompt lookup finds the continuation in the prompt. Greedy decoding, so both runs must produce the same tokens
(checked: same_outputs).

Workloads, one JSON line each on stdout (appended to benchmarks/results.jsonl unless --no-append):
  spec-decode-ngram-bs{B}   B prompts at once (batch 1 and 16): tokens/s without speculation (the engine's default
                            scheduling: asynchronous on a GPU), with n-gram drafts (synchronous), the speedup, the
                            drafts' acceptance rate and the mean tokens emitted per verifying step

    PYTHONPATH=. python benchmarks/spec_decode_bench.py                 # the bundled SmolLM2 (on a GPU)
    PYTHONPATH=. python benchmarks/spec_decode_bench.py --tiny --no-append   # a tiny random model on the CPU (smoke)
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time

import torch

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
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


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[list[list[int]], float]:
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def run_engine(args, spec: dict | None) -> dict[int, tuple[list[list[int]], float, tuple[int, int, int]]]:
    """batch size -> (outputs, seconds, (draft sequences, draft tokens, accepted)) for one engine configuration."""
    # a fixed KV cache (no memory profile): the engine built before may not have handed all of its memory back
    kwargs = dict(speculative_config=spec, kv_cache_memory_bytes=(64 << 20) if args.tiny else (8 << 30))
    if args.tiny:
        llm = LLM(tiny_model_path(), dtype="float32", skip_tokenizer_init=True, **kwargs)
    else:
        llm = LLM(args.model, dtype=args.dtype, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.tiny)
    results = {}
    for batch in args.batch_sizes:
        prompts = tiny_prompts(batch, 256) if args.tiny else chat_prompts(llm, batch, args.sentences)
        sched = llm.llm_engine.core.scheduler
        before = (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens)
        outputs, seconds = timed(llm, prompts, params)
        after = (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens)
        results[batch] = (outputs, seconds, tuple(a - b for a, b in zip(after, before)))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU (smoke run)")
    parser.add_argument("--dtype", default="auto", help="in half precision a verifying step's sums may round apart")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 512 (--tiny: 48)")
    parser.add_argument("--sentences", type=int, default=80, help="sentences of the text (~12 tokens each)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.max_tokens = args.max_tokens or (48 if args.tiny else 512)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    spec |= {"prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    base, fast = run_engine(args, None), run_engine(args, spec)
    machine, commit = machine_description(), git_commit()
    for batch in args.batch_sizes:
        (ref, t0, _), (out, t1, (steps, drafts, accepted)) = base[batch], fast[batch]
        tokens = sum(len(o) for o in out)
        record = make_record(
            f"spec-decode-ngram-bs{batch}", machine, commit, model="tiny-random" if args.tiny else args.model,
            spec=spec, max_tokens=args.max_tokens, output_tokens=tokens,
            tok_s_baseline=rounded(sum(len(o) for o in ref) / t0, 1), tok_s_ngram=rounded(tokens / t1, 1),
            speedup=rounded(t0 / t1, 3), acceptance_rate=rounded(accepted / drafts if drafts else None, 3),
            tokens_per_verify_step=rounded((accepted + steps) / steps if steps else None, 2),
            same_outputs=ref == out,
        )  # fmt: skip
        emit(record, append=not args.no_append)
        print(
            f"batch {batch}: {record['tok_s_baseline']} -> {record['tok_s_ngram']} tok/s (x{record['speedup']}), "
            f"acceptance {record['acceptance_rate']}, same outputs: {record['same_outputs']}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
