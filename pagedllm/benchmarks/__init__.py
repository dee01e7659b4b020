"""`pagedllm bench latency | throughput | serve`: vLLM's benchmarks with vLLM's flags and result fields;
`pagedllm bench plot`: saved serving results against request rate, as a PNG."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    from pagedllm.benchmarks.offline import add_offline_parsers
    from pagedllm.benchmarks.serve import add_serve_bench_parser

    bench = sub.add_parser("bench", help="benchmark the engine (latency, throughput) or a server (serve)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_offline_parsers(kinds)
    add_serve_bench_parser(kinds)
    from pagedllm.benchmarks.plot import add_plot_parser

    add_plot_parser(kinds)
