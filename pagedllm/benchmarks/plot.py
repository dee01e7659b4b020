"""The serving benchmark's plot: latency percentiles (TTFT, ITL) and throughput against the request rate, one
point per `pagedllm bench serve` result, written as a PNG. Needs matplotlib (`pip install 'pagedllm[plot]'`)."""

from __future__ import annotations

import json
import re

_PERCENTILE = re.compile(r"^(p[\d.]+|median)_(ttft|itl|tpot)_ms$")
_COLOURS = {"ttft": "tab:blue", "itl": "tab:orange", "tpot": "tab:green"}


def require_matplotlib() -> None:
    """ValueError (the one the commands report) when matplotlib is missing, before any benchmark runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, an optional dependency: pip install 'pagedllm[plot]' (or matplotlib)"
        ) from None


def _rate(result: dict) -> float:
    rate = result.get("request_rate", "inf")
    return float("inf") if rate in ("inf", None) else float(rate)


def plot_serving(results: list[dict], path: str, title: str | None = None) -> None:
    """Two panels against the request rate (infinite last): each percentile of TTFT / ITL / TPOT the results hold
    (ms, log scale), and output and total token throughput (tokens/s)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("nothing to plot: no benchmark results")
    results = sorted(results, key=_rate)
    labels = ["inf" if _rate(r) == float("inf") else f"{_rate(r):g}" for r in results]
    x = list(range(len(results)))
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    latency, throughput = fig.subplots(1, 2)
    keys = sorted({k for r in results for k in r if _PERCENTILE.match(k)}, key=lambda k: (k.split("_")[1], k))
    for key in keys:
        stat, metric = _PERCENTILE.match(key).groups()
        style, marker = ("--", "s") if stat == "median" else ("-", "^" if float(stat[1:]) >= 90 else "o")
        ys = [r.get(key, float("nan")) for r in results]
        latency.plot(x, ys, style, marker=marker, color=_COLOURS[metric], label=f"{metric.upper()} {stat}")
    latency.set(ylabel="latency (ms)", xlabel="request rate (requests/s)", title="Latency")
    if any(v > 0 for k in keys for v in (r.get(k, 0) for r in results)):
        latency.set_yscale("log")
    for key, label in (("output_throughput", "output tokens/s"), ("total_token_throughput", "total tokens/s")):
        throughput.plot(x, [r.get(key, float("nan")) for r in results], marker="o", label=label)
    throughput.set(ylabel="tokens/s", xlabel="request rate (requests/s)", title="Throughput")
    for ax in (latency, throughput):
        ax.set_xticks(x, labels)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    model = results[0].get("model_id")
    fig.suptitle(title or f"pagedllm bench serve{f': {model}' if model else ''}")
    fig.savefig(path, format="png", dpi=100)


def _plot_command(args) -> int:
    results = []
    for name in args.results:
        with open(name, encoding="utf-8") as f:
            try:
                results.append(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}: not a `bench serve` result (JSON): {e}") from None
    plot_serving(results, args.output, args.title)
    return 0


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot saved `bench serve` results (--save-result files) against request rate")
    p.add_argument("results", nargs="+", help="result JSON files, one per request rate")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--title", default=None)
    p.set_defaults(func=_plot_command)
