"""Structured outputs' cost: a batch of 64 requests with a JSON schema against the same 64 unconstrained, same
prompts, same run, alternating (unconstrained, schema, unconstrained, schema, ...) so both see the same machine.

  time per output token   wall time of generate(64 prompts) / output tokens, best of --repeats runs each
  time to first token     generate(prompt, max_tokens=1): one request (median of --ttft-repeats) and all 64 at once,
                          with the schema already compiled (cached) and unconstrained; plus a fresh schema's first
                          request (compilation included)

CPU (default without CUDA): the bundled SmolLM2-135M-Instruct. GPU (with CUDA): --model's shapes (a folder of
benchmarks/configs, default qwen3-0.6b, or a config directory) with dummy weights in bfloat16, and the bundled
SmolLM2 tokenizer (its 49,152 tokens padded to the model's vocab: the masked ids past them are never allowed); no
network. Backends: those given, else every installed one. Output: one JSON line (figures per backend) on stdout and
in results.jsonl (unless --no-append).

    python benchmarks/structured_output_bench.py [--model llama-3.1-8b] [--backend xgrammar] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded  # noqa: E402

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["engineer", "doctor", "artist", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
}
SUBJECTS = ["a doctor", "an engineer", "a painter", "a pilot", "a teacher", "a chef", "a farmer", "a poet"]


def prompts(num: int) -> list[str]:
    return [
        f"Describe {SUBJECTS[i % len(SUBJECTS)]} number {i} as a JSON record with name, age and skills:\n"
        for i in range(num)
    ]


def model_dir(name: str) -> str:
    """A folder of benchmarks/configs by name, or a config directory."""
    path = BENCH_DIR / "configs" / name
    return str(path if path.is_dir() else Path(name))


def build_llm(device: str, model: str, tokenizer: str | None = None) -> LLM:
    if device == "cuda":
        from pagedllm.model_loader.resolve import default_model_path

        path, tokenizer = model_dir(model), tokenizer or default_model_path()
        return LLM(path, load_format="dummy", dtype="bfloat16", tokenizer=tokenizer, max_model_len=4096)
    return LLM(max_model_len=2048)


def installed_backends() -> list[str]:
    import importlib.util

    return [
        name for name, pkg in (("xgrammar", "xgrammar"), ("guidance", "llguidance")) if importlib.util.find_spec(pkg)
    ]


def params(max_tokens: int, backend: str | None, schema: dict | None = SCHEMA) -> SamplingParams:
    # ignore_eos: unconstrained rows run to max_tokens; constrained rows end where their JSON does (or at max_tokens)
    constraint = None if backend is None else StructuredOutputsParams(json=schema, backend=backend)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint)


def timed(llm: LLM, batch: list[str], sp: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    return time.perf_counter() - start, outs


def per_token(llm: LLM, batch: list[str], args, backend: str) -> dict:
    """Best-of-repeats seconds per output token, unconstrained and with the schema (alternating runs)."""
    timed(llm, batch[:4], params(4, backend))  # warm-up (and the schema compiled into the cache)
    best: dict[str, float] = {}
    tokens: dict[str, int] = {}
    valid = finished = 0
    for _ in range(args.repeats):
        for mode, be in (("unconstrained", None), ("schema", backend)):
            wall, outs = timed(llm, batch, params(args.max_tokens, be))
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            best[mode] = min(best.get(mode, float("inf")), wall / n)
            tokens[mode] = n
            if be is not None:
                finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)
                ended = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
                invalid = [c for c in ended if not _valid(c.text)]
                valid = len(ended) - len(invalid)
                for c in invalid[:2]:  # (a row the grammar ended must validate: show what did not)
                    print(f"invalid output ({len(c.token_ids)} tokens): {c.text!r}", file=sys.stderr)
    return {
        "unconstrained_ms_per_token": rounded(best["unconstrained"] * 1e3, 3),
        "schema_ms_per_token": rounded(best["schema"] * 1e3, 3),
        "tpot_ratio": rounded(best["schema"] / best["unconstrained"], 3),
        "output_tokens": tokens,
        "schema_rows_finished": finished,
        "schema_rows_finished_valid": valid,
    }


def _valid(text: str) -> bool:
    """Validates against SCHEMA (jsonschema where installed, else only the required keys are checked)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and all(k in value for k in SCHEMA["required"])
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def first_token(llm: LLM, batch: list[str], args, backend: str) -> dict:
    """Time to first token (max_tokens=1) for a cached schema and unconstrained: one request and the whole batch."""
    one: dict[str, list[float]] = {"unconstrained": [], "schema": []}
    for _ in range(args.ttft_repeats):
        for mode, be in (("unconstrained", None), ("schema", backend)):
            one[mode].append(timed(llm, batch[:1], params(1, be))[0])
    full = {mode: timed(llm, batch, params(1, be))[0] for mode, be in (("unconstrained", None), ("schema", backend))}
    fresh = dict(SCHEMA, title=f"fresh-{time.time_ns()}")  # a schema not in the cache: compiled on this request
    fresh_s = timed(llm, batch[:1], params(1, backend, fresh))[0]
    med = {mode: statistics.median(v) for mode, v in one.items()}
    return {
        "ttft_1_unconstrained_ms": rounded(med["unconstrained"] * 1e3),
        "ttft_1_cached_schema_ms": rounded(med["schema"] * 1e3),
        "ttft_1_added_ms": rounded((med["schema"] - med["unconstrained"]) * 1e3),
        "ttft_64_unconstrained_ms": rounded(full["unconstrained"] * 1e3),
        "ttft_64_cached_schema_ms": rounded(full["schema"] * 1e3),
        "ttft_64_added_ms": rounded((full["schema"] - full["unconstrained"]) * 1e3),
        "ttft_1_fresh_schema_ms": rounded(fresh_s * 1e3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--model", default="qwen3-0.6b", help="GPU only: a benchmarks/configs folder (e.g. llama-3.1-8b) or config dir"
    )
    parser.add_argument("--tokenizer", default=None, help="GPU only: the tokenizer (default: the bundled SmolLM2's)")
    parser.add_argument("--backend", action="append", choices=["xgrammar", "guidance"], help="repeatable")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 32 on CPU, 256 on GPU")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--no-append", action="store_true", help="print only; do not add to results.jsonl")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    args.max_tokens = args.max_tokens or (256 if device == "cuda" else 32)
    backends = args.backend or installed_backends()
    if not backends:
        raise SystemExit("no structured output backend installed: pip install xgrammar (or llguidance)")
    llm = build_llm(device, args.model, args.tokenizer)
    batch = prompts(args.batch)
    figures = {b: per_token(llm, batch, args, b) | first_token(llm, batch, args, b) for b in backends}
    record = make_record(
        f"structured-output-{device}",
        machine_description(),
        git_commit(),
        batch=args.batch,
        max_tokens=args.max_tokens,
        model=f"{Path(args.model).name} dummy" if device == "cuda" else "SmolLM2-135M-Instruct",
        backends=figures,
    )
    emit(record, append=not args.no_append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
