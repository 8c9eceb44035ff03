"""Optional plots for ``quire bench serve --plot`` (needs the ``plot`` extra: matplotlib)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install 'quire-cli[plot]'") from None
    return plt


def plot_latencies(results, path: Path) -> None:
    """Histograms of time to first token, inter-token latency and end-to-end latency (ms)."""
    plt = _pyplot()
    done = [r for r in results if r.success]
    series = {"time to first token": [r.ttft * 1000 for r in done],
              "inter-token latency": [gap * 1000 for r in done for gap in r.itl],
              "end-to-end latency": [r.latency * 1000 for r in done]}
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, (title, values) in zip(axes, series.items()):
        axis.hist(values or [0], bins=30)
        axis.set_title(title)
        axis.set_xlabel("ms")
    axes[0].set_ylabel("requests")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_rate_sweep(summaries: list[dict], path: Path) -> None:
    """Output throughput against p99 end-to-end latency, one point per request rate."""
    plt = _pyplot()
    p99 = next((key for key in summaries[0] if key.startswith("p") and key.endswith("_e2el_ms")), None)
    p99 = p99 or next(key for key in summaries[0] if key.startswith("p") and key.endswith("_ttft_ms"))
    figure, axis = plt.subplots(figsize=(6, 4))
    xs = [s[p99] for s in summaries]
    ys = [s["output_throughput"] for s in summaries]
    axis.plot(xs, ys, marker="o")
    for s, x, y in zip(summaries, xs, ys):
        axis.annotate(f"{s['request_rate']} req/s", (x, y))
    axis.set_xlabel(f"{p99.replace('_', ' ')}")
    axis.set_ylabel("output tokens/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
