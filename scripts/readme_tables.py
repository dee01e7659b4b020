"""Rewrites README.md's generated tables (each between its marker comments): the architectures (from the model
registry) and the environment variables (from pagedllm/envs.py).

python scripts/readme_tables.py           # rewrite README.md
python scripts/readme_tables.py --check   # exit 1 if a table in README.md is stale
"""

from __future__ import annotations

import pathlib
import sys

from pagedllm import envs
from pagedllm.models.registry import get_model_class, native_architectures
from pagedllm.models.transformers_fallback import check_transformers_supported

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# architecture -> family / notes (short); every native architecture needs one
NOTES = {
    "BertForSequenceClassification": "BERT cross-encoder (classify, score)",
    "BertModel": "BERT encoder (embed)",
    "BloomForCausalLM": "BLOOM: ALiBi",
    "CohereForCausalLM": "Cohere Command-R: parallel block, optional q/k norm",
    "DeepseekV2ForCausalLM": "DeepSeek-V2: MLA attention (decompressed K/V cache), MoE with shared experts",
    "DeepseekV3ForCausalLM": "DeepSeek-V3: MLA, sigmoid-scored grouped MoE with score-correction bias",
    "FalconForCausalLM": "Falcon: multi-query or GQA, rotary or ALiBi",
    "Gemma2ForCausalLM": "Gemma 2: soft-capping, alternating sliding window",
    "Gemma3ForCausalLM": "Gemma 3 (text): q/k norm, local and global rotary",
    "Gemma3ForConditionalGeneration": "Gemma 3: SigLIP tower + pooled projector, bidirectional image tokens (images)",
    "LlavaForConditionalGeneration": "LLaVA: CLIP vision tower + projector + Llama/Mistral/Qwen2 (images)",
    "GemmaForCausalLM": "Gemma",
    "GPT2LMHeadModel": "GPT-2: learned positions",
    "GPTBigCodeForCausalLM": "StarCoder, SantaCoder: multi-query",
    "GPTJForCausalLM": "GPT-J: interleaved rotary, parallel block",
    "GPTNeoXForCausalLM": "GPT-NeoX, Pythia: partial rotary",
    "GraniteForCausalLM": "Granite: Llama with multipliers",
    "InternLM2ForCausalLM": "InternLM2: Llama under other weight names",
    "LlamaForCausalLM": "Llama: rope scaling (linear, dynamic NTK, YaRN, llama3)",
    "MistralForCausalLM": "Mistral: sliding window",
    "MixtralForCausalLM": "Mixtral: sparse mixture of experts (top-2 of 8)",
    "MPTForCausalLM": "MPT: ALiBi",
    "MptForCausalLM": "MPT (transformers' name)",
    "Olmo2ForCausalLM": "OLMo 2: norms after each block",
    "OlmoeForCausalLM": "OLMoE: mixture of experts, q/k norm",
    "OlmoForCausalLM": "OLMo: non-parametric LayerNorm, q/k/v clipping",
    "OPTForCausalLM": "OPT: learned positions",
    "Phi3ForCausalLM": "Phi-3, Phi-4-mini: LongRoPE",
    "PhiForCausalLM": "Phi-1/1.5/2: parallel block, partial rotary",
    "Qwen2ForCausalLM": "Qwen2, Qwen2.5: QKV bias",
    "Qwen2VLForConditionalGeneration": "Qwen2-VL: dynamic-resolution ViT + patch merger, M-RoPE (images, video)",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL: windowed ViT (RMSNorm, gated MLP), M-RoPE (images, video)",
    "Qwen2MoeForCausalLM": "Qwen1.5-MoE, Qwen2-MoE: experts plus a gated shared expert",
    "Qwen3ForCausalLM": "Qwen3: q/k norm",
    "Qwen3MoeForCausalLM": "Qwen3-MoE: mixture of experts, q/k norm",
    "Starcoder2ForCausalLM": "StarCoder2: sliding window, biases",
    "RobertaModel": "RoBERTa encoder (embed)",
    "RobertaForSequenceClassification": "RoBERTa cross-encoder (classify, score)",
    "XLMRobertaModel": "XLM-RoBERTa encoder, bge-m3 (embed)",
    "XLMRobertaForSequenceClassification": "XLM-RoBERTa cross-encoder, bge-reranker (classify, score)",
    "LlamaModel": "Llama without LM head: embedder (last-token pooling)",
    "MistralModel": "Mistral without LM head, e5-mistral: embedder (last-token pooling)",
    "Qwen2Model": "Qwen2 without LM head, gte-Qwen2: embedder (last-token pooling)",
    "Qwen3Model": "Qwen3 without LM head, Qwen3-Embedding: embedder (last-token pooling)",
    "LlamaForSequenceClassification": "Llama classifier: score head on the last token (classify, score)",
    "MistralForSequenceClassification": "Mistral classifier: score head on the last token (classify, score)",
    "Qwen2ForSequenceClassification": "Qwen2, Qwen2.5 classifier: score head on the last token (classify, score)",
    "Qwen3ForSequenceClassification": "Qwen3 classifier: score head on the last token (classify, score)",
    "GemmaForSequenceClassification": "Gemma classifier: score head on the last token (classify, score)",
    "Phi3ForSequenceClassification": "Phi-3 classifier: score head on the last token (classify, score)",
    "Starcoder2ForSequenceClassification": "StarCoder2 classifier: score head on the last token (classify, score)",
    "BertForTokenClassification": "BERT token classifier, NER (token_classify)",
    "RobertaForTokenClassification": "RoBERTa token classifier, NER (token_classify)",
    "XLMRobertaForTokenClassification": "XLM-RoBERTa token classifier, NER (token_classify)",
}


def path_of(architecture: str) -> str:
    """Which implementations run it: the native class ("auto" takes it), and the transformers fallback where
    `model_impl="transformers"` can run it too."""
    try:
        check_transformers_supported(architecture)
    except ValueError:
        return "native"
    return "native; `transformers` too"


def architectures_table() -> str:
    """The markdown table of the native architectures, sorted by name."""
    archs = native_architectures()
    missing = [a for a in archs if a not in NOTES]
    if missing:
        raise SystemExit(f"scripts/readme_tables.py: add a NOTES entry for {missing}")
    rows = [f"| `{a}` | {NOTES[a]} | {path_of(a)} | {parallelism_of(a)} |" for a in archs]
    header = "| Architecture | Family / notes | Path | Parallel |"
    return "\n".join([header, "| --- | --- | --- | --- |", *rows])


def parallelism_of(architecture: str) -> str:
    """Which of tensor (TP) and pipeline (PP) parallelism the native class supports (its class flags)."""
    cls = get_model_class(architecture, "pagedllm")
    kinds = [k for k, flag in (("TP", "supports_tensor_parallel"), ("PP", "supports_pipeline_parallel"))
             if getattr(cls, flag, False)]  # fmt: skip
    return ", ".join(kinds) or "one GPU"


def environment_table() -> str:
    """The markdown table of the environment variables pagedllm reads (envs.ENV_VARS)."""
    rows = []
    for name, (default, meaning) in envs.ENV_VARS.items():
        other = "PAGEDLLM_" + name.removeprefix("VLLM_")
        rows.append(f"| `{name}` (`{other}`) | `{default}` | {meaning} |")
    return "\n".join(["| Variable (pagedllm's spelling) | Default | Meaning |", "| --- | --- | --- |", *rows])


def ignored_environment_table() -> str:
    """vLLM's documented variables that pagedllm accepts and ignores (envs.IGNORED_ENV_VARS)."""
    rows = [f"| `{name}` | {why} |" for name, why in envs.IGNORED_ENV_VARS.items()]
    return "\n".join(["| Variable | Why it has no effect |", "| --- | --- |", *rows])


def engine_args_table() -> str:
    """Every EngineArgs field (an LLM keyword and a flag): works, a no-op, or supported at one value only; the ones
    that work first, each group in definition order."""
    from dataclasses import fields

    from pagedllm.engine_args import EngineArgs
    from pagedllm.engine_compat import COMPAT_ARGS, SERVER_FLAGS

    rows = []
    for f in sorted(fields(EngineArgs), key=lambda f: f.name in COMPAT_ARGS):
        flag = "MODEL / `--model`" if f.name == "model" else f"`--{f.name.replace('_', '-')}`"
        if f.name in SERVER_FLAGS:
            flag += " (server)"
        kind, _, why = COMPAT_ARGS.get(f.name, ("works", None, ""))
        status = {"no-op": "accepted, no effect", "only": "default only (else an error)"}.get(kind, "works")
        rows.append(f"| `{f.name}` | {flag} | {status} | {why} |")
    return "\n".join(["| Keyword | Flag | Status | Why |", "| --- | --- | --- | --- |", *rows])


def serve_compat_table() -> str:
    """vLLM's server flags that pagedllm accepts for compatibility only (entrypoints/openai/serve_compat.py)."""
    from pagedllm.entrypoints.openai.serve_compat import SERVE_COMPAT

    rows = []
    for name, (kind, _, why) in SERVE_COMPAT.items():
        status = "accepted, no effect" if kind == "no-op" else "default only (else an error)"
        rows.append(f"| `--{name.replace('_', '-')}` | {status} | {why} |")
    return "\n".join(["| Flag | Status | Why |", "| --- | --- | --- |", *rows])


TABLES = {
    "architectures": architectures_table,
    "environment": environment_table,
    "environment-ignored": ignored_environment_table,
    "engine-args": engine_args_table,
    "serve-compat": serve_compat_table,
}


def rewrite(text: str) -> str:
    """text with the block between each table's markers replaced by the current table."""
    for name, table in TABLES.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, sep, rest = text.partition(begin)
        _, sep2, tail = rest.partition(end)
        if not sep or not sep2:
            raise SystemExit(f"README.md needs the markers {begin} and {end}")
        text = f"{head}{begin}\n{table()}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = rewrite(text)
    if "--check" in argv:
        if new != text:
            print("a table in README.md is stale: run python scripts/readme_tables.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
