"""Where the devices of a tensor-parallel engine wait for their hosts: decode steps of `--rows` requests on
Llama-3.1-8B shapes (dummy weights) at TP=N under LLM.start_profile (one trace per rank), then, for each rank, the
step time, the device's idle time (no kernel running; a kernel spinning in an all-reduce for a late peer counts as
busy) and the longest gaps: the kernels before and after each, and how late the host launched the one after (its
launch time from the CUDA runtime events, minus the end of the work before the gap), with the host op that
launched it.

    python benchmarks/rank_gaps.py -tp 4 --rows 1 [--steps 30] [--traces DIR]
    python benchmarks/rank_gaps.py --read DIR   # the traces of an earlier run (any engine's start_profile)
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import json
import os
import random
import tempfile
import time


def kernel_gaps(events: list[dict]) -> tuple[float, list[tuple[float, float, dict, dict]]]:
    """(span, gaps) of a trace's device work (kernels, copies, memsets; overlapping ones merged): each gap as
    (length, end of the work before it, the event before, the event after), in microseconds."""
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not work:
        return 0.0, []
    gaps, end, prev = [], None, None
    for e in work:
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, end, prev, e))
        end = e["ts"] + e.get("dur", 0) if end is None else max(end, e["ts"] + e.get("dur", 0))
        prev = e
    return end - work[0]["ts"], gaps


class HostOps:
    """The host ops of a trace, to name the one that launched a kernel (the innermost op around a runtime call)."""

    def __init__(self, events: list[dict]) -> None:
        self.runtime = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
        }
        self.ops = sorted(
            (e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and e.get("dur", 0) > 0),
            key=lambda e: e["ts"],
        )
        self.starts = [o["ts"] for o in self.ops]

    def launch(self, kernel: dict) -> dict | None:
        return self.runtime.get(kernel.get("args", {}).get("correlation"))

    def op_around(self, ts: float) -> str:
        best = None
        i = bisect.bisect_right(self.starts, ts)
        for op in self.ops[max(0, i - 400) : i]:
            if op["ts"] + op["dur"] >= ts and (best is None or op["dur"] < best["dur"]):
                best = op
        return best["name"] if best else "?"


def report(trace_dir: str, steps: int, top: int) -> list[dict]:
    """One summary per rank's trace in trace_dir (printed, and returned)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "*.pt.trace.json"))):
        with open(path, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        span, gaps = kernel_gaps(events)
        host = HostOps(events)
        launches = [host.launch(after) for _, _, _, after in gaps]  # None: inside a graph (no runtime call)
        via = [host.op_around(launch["ts"]) if launch is not None else "-" for launch in launches]
        late = collections.Counter()
        for (length, end, _, _), launch, op in zip(gaps, launches, via):
            if launch is not None and launch["ts"] > end:  # launched after the device had run out of work
                late[op] += length
        idle = sum(g[0] for g in gaps)
        rank = os.path.basename(path).split(".")[0]
        print(
            f"{rank}: span {span / 1e3:.1f} ms, idle {idle / 1e3:.2f} ms ({idle / max(steps, 1) / 1e3:.3f} ms a step) "
            f"in {len(gaps)} gaps; idle after late launches, by host op: "
            + ", ".join(f"{name} {t / 1e3:.2f} ms" for name, t in late.most_common(4))
        )
        longest = sorted(range(len(gaps)), key=lambda i: -gaps[i][0])[:top]
        for i in longest:
            length, end, before, after = gaps[i]
            lag = f"{launches[i]['ts'] - end:+8.1f} us" if launches[i] is not None else "  (in a graph)"
            kernels = f"{before['name'][:36]} -> {after['name'][:36]}"
            print(f"   gap {length:7.1f} us, launched {lag}: {kernels} via {via[i]}")
        rows.append({"rank": rank, "span_ms": span / 1e3, "idle_ms": idle / 1e3, "gaps": len(gaps)})
    return rows


def run(args: argparse.Namespace) -> str:
    """Decode steps at TP=N under the profiler; returns the trace folder."""
    trace_dir = args.traces or tempfile.mkdtemp(prefix="pagedllm-traces-")
    os.environ["VLLM_TORCH_PROFILER_DIR"] = trace_dir
    import torch

    from pagedllm import LLM, SamplingParams

    try:
        from benchmarks.common import BENCH_DIR
    except ImportError:  # run as a script
        from common import BENCH_DIR

    llm = LLM(
        str(BENCH_DIR / "configs" / args.model), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
        tensor_parallel_size=args.tensor_parallel_size,
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(args.prompt_len)]} for _ in range(args.rows)]
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up; the prompts stay cached
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.steps + 1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"TP={args.tensor_parallel_size}, {args.rows} rows: {(time.perf_counter() - start) / args.steps * 1e3:.3f} "
          "ms a step without the profiler (the first step's prefill of the last block included)")  # fmt: skip
    llm.start_profile()
    llm.generate(prompts, params, use_tqdm=False)
    llm.stop_profile()
    llm.llm_engine.shutdown()
    return trace_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    p.add_argument("--rows", type=int, default=1, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=30, help="decode steps, timed and profiled")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--model", default="llama-3.1-8b", help="a config folder of benchmarks/configs")
    p.add_argument("--traces", default=None, help="where the traces go (default: a new temporary folder)")
    p.add_argument("--read", default=None, help="only read the traces in this folder")
    p.add_argument("--top", type=int, default=6, help="longest gaps listed per rank")
    args = p.parse_args()
    trace_dir = args.read or run(args)
    report(trace_dir, args.steps, args.top)


if __name__ == "__main__":
    main()
