"""Multi-LoRA throughput against the base model alone, in the same run (GPU; Llama-3.1-8B shapes, dummy weights).

Adapters: rank 16 on q/k/v/o/gate/up/down of every layer, random A and B, written as PEFT folders in a temp dir.
Two engines, one after the other, on the same requests: the base model (no LoRA) and the LoRA engine
(enable_lora, max_loras = --num-adapters, every adapter read before the timing). Workloads:
  nanovllm-bench   nano-vllm's bench.py draws (gpu_throughput.nano_workload): 256 sequences, temperature 0.6,
                   ignore_eos; the LoRA engine's requests take the adapters round-robin. ratio = LoRA output
                   tokens/s over the base model's (goal >= 0.8)
  decode-bs1       one request, 128-token prompt, 512 output tokens, one adapter (goal >= 0.9)
One JSON line on stdout (workload "lora-llama-3.1-8b"; appended to benchmarks/results.jsonl unless --no-append),
with the LoRA engine's CUDA-graph replays (decode steps with adapters replay the graphs).

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
RANK = 16


def write_adapters(folder: str, model: str, num: int, rank: int) -> list[str]:
    """num PEFT adapter folders for the model's config (bf16 safetensors, random A and B)."""
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(llm, prompts, params, loras) -> float:
    sync()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    sync()
    return time.perf_counter() - start


def run_engine(model: str, lora_paths: list[str] | None, workloads: dict, engine_kwargs: dict) -> dict:
    """Seconds per workload on one engine (LoRA on when lora_paths is given: each workload's requests take the
    adapters round-robin, its `num_adapters` of them), and the engine's CUDA-graph replays."""
    from pagedllm import LLM, LoRARequest

    lora_kwargs = {}
    if lora_paths is not None:
        lora_kwargs = dict(enable_lora=True, max_loras=len(lora_paths), max_lora_rank=RANK)
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, **engine_kwargs, **lora_kwargs)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(lora_paths or [])]
    for req in reqs:  # read and checked before the timing (host copies: max_cpu_loras = max_loras)
        llm.llm_engine.add_lora(req)
    out = {}
    for name, (prompts, params, num_adapters) in workloads.items():
        loras = [reqs[i % num_adapters] for i in range(len(prompts))] if reqs else None
        one = params[:2] if isinstance(params, list) else params
        timed_generate(llm, prompts[:2], one, loras and loras[:2])  # warm-up: kernels of this workload's shapes
        out[name] = timed_generate(llm, prompts, params, loras)
    graphs = llm.llm_engine.core.executor.runner.graphs
    out["graph_replays"] = graphs.num_replays if graphs is not None else 0
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=LLAMA, help="a config folder (dummy weights); default Llama-3.1-8B shapes")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--bs1-tokens", type=int, default=512)
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args(argv)
    from pagedllm import SamplingParams

    machine, commit = machine_description(), git_commit()
    engine_kwargs = dict(max_model_len=4096, gpu_memory_utilization=0.85)
    prompts, max_tokens = nano_workload(args.num_seqs)
    workloads = {
        "nano": (prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens],
                 args.num_adapters),
        "bs1": ([list(range(1, 129))], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.bs1_tokens),
                1),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        paths = write_adapters(folder, args.model, args.num_adapters, RANK)
        base = run_engine(args.model, None, workloads, engine_kwargs)
        lora = run_engine(args.model, paths, workloads, engine_kwargs)
    nano_tokens = sum(max_tokens)
    record = make_record(
        "lora-llama-3.1-8b" if args.model == LLAMA else "lora-custom", machine, commit,
        model=os.path.basename(os.path.normpath(args.model)), num_seqs=args.num_seqs,
        num_adapters=args.num_adapters, rank=RANK,
        nano_base_tok_s=rounded(nano_tokens / base["nano"], 1), nano_lora_tok_s=rounded(nano_tokens / lora["nano"], 1),
        nano_ratio=rounded(base["nano"] / lora["nano"], 3),
        bs1_base_tok_s=rounded(args.bs1_tokens / base["bs1"], 1),
        bs1_lora_tok_s=rounded(args.bs1_tokens / lora["bs1"], 1), bs1_ratio=rounded(base["bs1"] / lora["bs1"], 3),
        goals={"nano_ratio": 0.8, "bs1_ratio": 0.9}, lora_graph_replays=lora["graph_replays"],
    )  # fmt: skip
    emit(record, not args.no_append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
