"""``quire bench latency|throughput|serve``: options named as in vLLM's ``bench`` commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quire.cli.engine_options import with_engine_options
from quire.core.engine_args import EngineArgs

OutputJson = Annotated[Path | None, typer.Option(help="Also write the results to this JSON file.")]


def register(bench_app: typer.Typer) -> None:
    @bench_app.command()
    @with_engine_options
    def latency(
        engine_args: EngineArgs,
        input_len: Annotated[int, typer.Option(min=1)] = 32,
        output_len: Annotated[int, typer.Option(min=1)] = 128,
        batch_size: Annotated[int, typer.Option(min=1)] = 8,
        n: Annotated[int, typer.Option(min=1)] = 1,
        num_iters_warmup: Annotated[int, typer.Option(min=0)] = 2,
        num_iters: Annotated[int, typer.Option(min=1)] = 10,
        output_json: OutputJson = None,
    ):
        """Latency of one batch: Avg latency and percentiles over iterations (offline)."""
        from quire.cli.bench_offline import run_latency

        run_latency(engine_args, input_len, output_len, batch_size, n, num_iters_warmup, num_iters,
                    output_json)

    @bench_app.command()
    @with_engine_options
    def throughput(
        engine_args: EngineArgs,
        backend: Annotated[str, typer.Option(help="quire, or hf (transformers' padded batched generate).")] = "quire",
        dataset_name: Annotated[str, typer.Option(help="random (lengths vary by --random-range-ratio) or fixed.")]
        = "random",
        input_len: Annotated[int, typer.Option(min=1)] = 128,
        output_len: Annotated[int, typer.Option(min=1)] = 128,
        random_range_ratio: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.5,
        num_prompts: Annotated[int, typer.Option(min=1)] = 64,
        hf_max_batch_size: Annotated[int | None, typer.Option(min=1, help="hf: prompts per padded batch.")]
        = None,
        output_json: OutputJson = None,
    ):
        """Offline throughput (requests/s, tokens/s) of Quire or transformers on the same workload (the
        dataset is drawn with --seed)."""
        from quire.cli.bench_offline import run_throughput

        if backend not in ("quire", "hf"):
            raise typer.BadParameter("must be quire or hf", param_hint="--backend")
        if dataset_name not in ("random", "fixed"):
            raise typer.BadParameter("must be random or fixed", param_hint="--dataset-name")
        run_throughput(engine_args, backend, dataset_name, input_len, output_len, random_range_ratio,
                       num_prompts, hf_max_batch_size, output_json)

    @bench_app.command()
    def serve(
        base_url: Annotated[str | None, typer.Option(help="Server root, e.g. http://localhost:8000.")] = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        endpoint: Annotated[str, typer.Option(help="/v1/completions or /v1/chat/completions.")]
        = "/v1/completions",
        model: Annotated[str | None, typer.Option(help="Served model name (default: the first).")] = None,
        api_key: Annotated[str | None, typer.Option(envvar="QUIRE_API_KEY")] = None,
        dataset_name: Annotated[str, typer.Option(help="random (token-id prompts).")] = "random",
        random_input_len: Annotated[int, typer.Option(min=1)] = 128,
        random_output_len: Annotated[int, typer.Option(min=1)] = 64,
        random_range_ratio: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.0,
        num_prompts: Annotated[int, typer.Option(min=1)] = 100,
        request_rate: Annotated[str, typer.Option(help="Requests/s (Poisson), or inf for all at once.")] = "inf",
        burstiness: Annotated[float, typer.Option(help="1 = Poisson; larger = more regular; "
                                                       "0 = a fixed interval.")] = 1.0,
        request_rates: Annotated[str | None, typer.Option(help="Sweep rates, e.g. 1,2,4 (one run each).")]
        = None,
        max_concurrency: Annotated[int | None, typer.Option(min=1)] = None,
        ignore_eos: Annotated[bool, typer.Option(help="Generate exactly the requested output lengths.")] = True,
        percentile_metrics: str = "ttft,tpot,itl",
        metric_percentiles: str = "99",
        seed: int = 0,
        output_json: OutputJson = None,
        plot: Annotated[Path | None, typer.Option(help="Draw latency distributions (or, with "
                                                         "--request-rates, throughput vs p99) to a PNG.")] = None,
    ):
        """Drive a running server and report throughput and latency percentiles (vLLM's result block)."""
        from quire.cli.bench_serve import ServeBenchConfig, run_serve_bench

        if dataset_name != "random":
            raise typer.BadParameter("only random is available", param_hint="--dataset-name")
        if endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise typer.BadParameter("must be /v1/completions or /v1/chat/completions", param_hint="--endpoint")
        config = ServeBenchConfig(
            base_url=base_url or f"http://{host}:{port}", endpoint=endpoint, model=model, api_key=api_key,
            input_len=random_input_len, output_len=random_output_len, range_ratio=random_range_ratio,
            num_prompts=num_prompts, burstiness=burstiness, max_concurrency=max_concurrency, ignore_eos=ignore_eos,
            percentile_metrics=[m.strip() for m in percentile_metrics.split(",") if m.strip()],
            metric_percentiles=[float(p) for p in metric_percentiles.split(",") if p.strip()], seed=seed,
        )
        rates = _rates(request_rates) if request_rates else [_rate(request_rate)]
        raise typer.Exit(run_serve_bench(config, rates, output_json, plot))


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number or inf", param_hint="--request-rate") from None
    if rate <= 0:
        raise typer.BadParameter("must be positive", param_hint="--request-rate")
    return rate


def _rates(text: str) -> list[float]:
    return [_rate(part.strip()) for part in text.split(",") if part.strip()]
