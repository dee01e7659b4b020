"""Where a decode step's device time goes: per-kernel time of the decode steps of `--batch` requests (one by default)
on Llama-3.1-8B shapes (dummy weights), kernels inside the CUDA graphs included (torch profiler), plus the step time
measured without the profiler. With -tp N the first rank (the engine's process) is profiled. The prompts are in the
prefix cache after the warm-up, so the profiled steps are decode steps but the first (their last, uncached block:
a prefill of batch x block rows), which the per-kernel table leaves out: the kernels up to its sampling kernel.

    python benchmarks/decode_profile.py [--quantization fp8] [--kv-cache-dtype fp8] [-tp 2] [--steps 64]
        [--batch 256 --prompt-len 512]
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams

STEP_END = {"race_kernel", "sample_kernel", "row_argmax_kernel"}  # one a step: the kernel that draws its tokens

try:
    from benchmarks.common import BENCH_DIR
except ImportError:  # run as a script
    from common import BENCH_DIR


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=64, help="decode steps profiled")
    p.add_argument("--top", type=int, default=30, help="kernels listed")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (a step of this many rows)")
    p.add_argument("--prompt-len", type=int, default=128, help="each request's prompt tokens")
    args = p.parse_args()
    llm = LLM(
        str(BENCH_DIR / "configs" / "llama-3.1-8b"), load_format="dummy", skip_tokenizer_init=True,
        max_model_len=8192, quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    rng = random.Random(1)
    prompt = [{"prompt_token_ids": [rng.randint(0, 100000) for _ in range(args.prompt_len)]} for _ in range(args.batch)]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    step = (time.perf_counter() - start) / 256
    print(f"step {step * 1e3:.3f} ms ({args.batch / step:.1f} tok/s) without the profiler (prefill included)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    n = args.steps
    ends = [i for i, e in enumerate(kernels) if e.name in STEP_END]
    if len(ends) > 1:  # leave out the first step (the prompts' uncached last block: batch x block rows of prefill)
        kernels, n = kernels[ends[0] + 1 :], len(ends) - 1
    total, count = collections.defaultdict(float), collections.Counter()
    busy, span_start, span_end = 0.0, None, None
    for e in kernels:
        s, t = e.time_range.start, e.time_range.end
        total[e.name] += t - s
        count[e.name] += 1
        if span_end is None or s > span_end:  # kernels may overlap (PDL): count covered time once
            busy += 0.0 if span_end is None else span_end - span_start
            span_start, span_end = s, t
        else:
            span_end = max(span_end, t)
    busy += 0.0 if span_end is None else span_end - span_start
    print(f"{len(kernels) / n:.1f} kernels a step, device busy {busy / n:.1f} us a step (profiled)")
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{t / n:9.1f} us/step {count[name] / n:6.1f}/step {t / count[name]:7.2f} us/call  {name[:100]}")


if __name__ == "__main__":
    main()
