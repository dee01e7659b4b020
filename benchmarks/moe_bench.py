"""Mixture-of-experts on the GPU: Mixtral-8x7B shapes (H=4096, I=14336, 8 experts, top-2, 32 heads / 8 KV heads)
with dummy bf16 weights and a reduced layer count (--layers, default 8 of Mixtral's 32: each layer holds ~1.4 GB of
experts, so 8 layers are ~12 GB and the KV cache gets the rest of one H100).

Workloads, each one JSON line on stdout (appended to benchmarks/results.jsonl unless --no-append):
  moe-decode   per batch size: decode step time = (wall(max_tokens=1 + S) - wall(max_tokens=1)) / S over the same
               prompts (prefix caching off, so both runs prefill alike), decode tokens/s = batch / step time, and
               moe_frac = layers x (CUDA-event time of one FusedMoE.forward at that batch, replayed from a
               CUDA graph like the decode step) / step time
  moe-kernel   per token count: the fused Triton experts against the per-expert torch experts (FusedMoE's CPU path
               run on the GPU) on layer 0's weights, median CUDA-event time; expert_gbps = bytes of the experts the
               tokens touch / Triton time

    PYTHONPATH=. python benchmarks/moe_bench.py --no-append
    PYTHONPATH=. python benchmarks/moe_bench.py --tiny --no-append      # CPU check with tiny shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded

MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    sliding_window=None,
    hidden_act="silu",
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
TINY = dict(MIXTRAL, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=320, max_position_embeddings=1024)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (Mixtral-8x7B has 32)")
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--token-counts", default="1,8,32,128,512,2048")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (float32): checks the script runs")
    p.add_argument("--no-append", action="store_true", help="print only; do not append to results.jsonl")
    return p.parse_args(argv)


def write_config(folder: Path, tiny: bool, layers: int) -> str:
    config = dict(TINY if tiny else MIXTRAL, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs after one warm-up (CUDA events on a GPU, wall clock on a CPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moe_forward_time(experts, hidden: int, num_tokens: int, device, dtype, reps: int) -> float:
    """One FusedMoE.forward (routing included) on random tokens and router logits; on a GPU replayed from a CUDA
    graph, as the decode steps run it (eager launches would overstate small batches)."""
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(num_tokens, experts.num_experts, generator=gen, device=device, dtype=dtype)
    with torch.inference_mode():
        if device.type != "cuda":
            return timed(lambda: experts(x, logits), device, reps)
        experts(x, logits)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            experts(x, logits)
        return timed(graph.replay, device, reps)


def decode_records(llm, args, experts, device, dtype, common: dict) -> list[dict]:
    from pagedllm import SamplingParams

    records = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        gen = torch.Generator().manual_seed(batch)
        prompts = [
            {"prompt_token_ids": torch.randint(10, 300, (args.prompt_len,), generator=gen).tolist()}
            for _ in range(batch)
        ]
        walls = {}
        for steps in (1, 1 + args.decode_steps, 1):  # the first short run also warms this batch size up
            params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            sync(device)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            walls[steps] = time.perf_counter() - t0
        step = (walls[1 + args.decode_steps] - walls[1]) / args.decode_steps
        moe = moe_forward_time(experts, experts.hidden_size, batch, device, dtype, reps=20)
        records.append(
            make_record(
                "moe-decode",
                **common,
                batch_size=batch,
                step_ms=rounded(step * 1e3, 3),
                decode_tok_s=rounded(batch / step, 1),
                moe_ms_per_layer=rounded(moe * 1e3, 3),
                moe_frac=rounded(args.layers * moe / step, 3),
            )
        )
    return records


def kernel_figures(experts, n: int, device, dtype) -> dict:
    """Median times of the per-expert torch experts and (on CUDA) the fused Triton experts on n random tokens."""
    from pagedllm.layers.fused_moe import fused_experts_torch, select_experts

    w13, w2 = experts.w13_weight.data, experts.w2_weight.data
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, experts.hidden_size, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(n, experts.num_experts, generator=gen, device=device)
    weights, ids = select_experts(logits, experts.top_k, True)
    reference = timed(lambda: fused_experts_torch(x, w13, w2, weights, ids), device, reps=10)
    figures = dict(num_tokens=n, torch_ms=rounded(reference * 1e3, 3))
    if device.type == "cuda":
        from pagedllm.layers.fused_moe.triton_moe import fused_experts_triton

        fused = timed(lambda: fused_experts_triton(x, w13, w2, weights, ids), device, reps=10)
        touched = int(ids.unique().numel()) * (w13[0].numel() + w2[0].numel()) * w13.element_size()
        figures.update(triton_ms=rounded(fused * 1e3, 3), speedup=rounded(reference / fused, 2))
        figures.update(expert_gbps=rounded(touched / fused / 1e9, 1))
    return figures


def kernel_records(experts, args, device, dtype, common: dict) -> list[dict]:
    return [
        make_record("moe-kernel", **common, **kernel_figures(experts, int(n), device, dtype))
        for n in args.token_counts.split(",")
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pagedllm import LLM

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    common = dict(machine=machine_description(), commit=git_commit())
    shapes = "tiny" if args.tiny else "mixtral-8x7b"
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(
            write_config(Path(folder), args.tiny, args.layers),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=str(dtype).removeprefix("torch."),
            device=device.type,
            max_model_len=args.prompt_len + args.decode_steps + 16,
            max_num_seqs=max(int(b) for b in args.batch_sizes.split(",")),
            enable_prefix_caching=False,
            **({"kv_cache_memory_bytes": 1 << 26} if device.type == "cpu" else {}),
        )
    experts = llm.llm_engine.core.executor.runner.model.model.layers[0].mlp.experts
    common = dict(common, shapes=shapes, layers=args.layers, dtype=str(dtype).removeprefix("torch."))
    for record in decode_records(llm, args, experts, device, dtype, common) + kernel_records(
        experts, args, device, dtype, common
    ):
        emit(record, append=not args.no_append)


if __name__ == "__main__":
    main()
