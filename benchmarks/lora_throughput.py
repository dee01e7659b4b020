"""Multi-LoRA throughput against the base model alone, in the same run (GPU; Llama-3.1-8B shapes, dummy weights).

Adapters: rank 16 on q/k/v/o/gate/up/down of every layer, random A and B, written as PEFT folders in a temp dir.
Workloads, each one JSON line on stdout (appended to benchmarks/results.jsonl unless --no-append):
  nanovllm-bench-lora     nano-vllm's bench.py draws (gpu_throughput.nano_workload): 256 sequences, temperature 0.6,
                          ignore_eos; the requests take --num-adapters adapters round-robin (max_loras of them in a
                          step); the base model runs the same prompts in a separate engine. ratio = LoRA output
                          tokens/s over the base model's (goal >= 0.8)
  decode-bs1-lora         one request, 128-token prompt, 512 output tokens, one adapter vs the base (goal >= 0.9)

    python benchmarks/lora_throughput.py --no-append
    python benchmarks/lora_throughput.py --num-seqs 32 --no-append   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

try:
    from benchmarks.common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded
    from benchmarks.gpu_throughput import nano_workload
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded
    from gpu_throughput import nano_workload

LLAMA = str(BENCH_DIR / "configs" / "llama-3.1-8b")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOADS = ("nanovllm-bench-lora", "decode-bs1-lora")


def write_adapters(folder: str, num: int, rank: int) -> list[str]:
    """num PEFT adapter folders for the Llama-3.1-8B config (bf16 safetensors, random A and B)."""
    from safetensors.torch import save_file

    with open(os.path.join(LLAMA, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    paths = []
    for i in range(num):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module in TARGETS:
                group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{group}.{module}"
                n_in, n_out = shapes[module]
                tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in**0.5).bfloat16()
                tensors[f"{name}.lora_B.weight"] = (0.01 * torch.randn(n_out, rank, generator=g)).bfloat16()
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        paths.append(path)
    return paths


def timed_generate(llm, prompts, params, loras) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_pair(prompts, params, lora_paths: list[str] | None, max_loras: int, engine_kwargs: dict) -> dict[str, float]:
    """Seconds of the base engine and of the LoRA engine (adapters round-robin) on the same requests."""
    from pagedllm import LLM, LoRARequest

    out = {}
    for name in ("base", "lora"):
        lora_kwargs = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=16) if name == "lora" else {}
        llm = LLM(LLAMA, load_format="dummy", skip_tokenizer_init=True, **engine_kwargs, **lora_kwargs)
        loras = None
        if name == "lora":
            reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(lora_paths)]
            loras = [reqs[i % len(reqs)] for i in range(len(prompts))]
        timed_generate(llm, prompts[:2], params[:2] if isinstance(params, list) else params, loras and loras[:2])
        out[name] = timed_generate(llm, prompts, params, loras)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args(argv)
    from pagedllm import SamplingParams

    machine, commit = machine_description(), git_commit()
    engine_kwargs = dict(max_model_len=4096, gpu_memory_utilization=0.85)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_adapters(folder, args.num_adapters, 16)
        workloads = args.workloads.split(",")
        if "nanovllm-bench-lora" in workloads:
            prompts, max_tokens = nano_workload(args.num_seqs)
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
            t = run_pair(prompts, params, paths, args.num_adapters, engine_kwargs)
            tokens = sum(max_tokens)
            figures = {k: rounded(tokens / v, 1) for k, v in t.items()}
            ratio = rounded(t["base"] / t["lora"], 3)
            record = make_record(
                "nanovllm-bench-lora", machine, commit, num_seqs=args.num_seqs, num_adapters=args.num_adapters,
                rank=16, base_tok_s=figures["base"], lora_tok_s=figures["lora"], ratio=ratio,
            )  # fmt: skip
            emit(record, not args.no_append)
        if "decode-bs1-lora" in workloads:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=512)
            t = run_pair([list(range(1, 129))], params, paths[:1], 1, engine_kwargs)
            record = make_record(
                "decode-bs1-lora", machine, commit, rank=16, base_tok_s=rounded(512 / t["base"], 1),
                lora_tok_s=rounded(512 / t["lora"], 1), ratio=rounded(t["base"] / t["lora"], 3),
            )  # fmt: skip
            emit(record, not args.no_append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
