"""Serving benchmark in the manner of `vllm bench serve`: streamed requests against an
OpenAI-compatible server, with per-request TTFT, TPOT, ITL and end-to-end latency.

Sweep request rates (Poisson arrivals, or `inf` for all at once) and client
concurrency against any base URL, or let the script start the servers:

    python -m bench.serving.serve --base-url http://127.0.0.1:8000 --dataset chat \\
        --num-prompts 200 --request-rate inf 4 --max-concurrency 8 32 --goodput ttft:500 tpot:100
    python -m bench.serving.serve --launch real --num-prompts 64 --max-concurrency 8 32
    python -m bench.serving.serve --launch synthetic --itl-ms 10 --max-concurrency 64 256

and the two figures of the `serve` section of bench/RESULTS.md:

    python -m bench.serving.serve --figure frontend-tax       # HTTP tok/s / offline Engine tok/s
    python -m bench.serving.serve --figure frontend-capacity  # one render-serve, synthetic worker
    python -m bench.serving.serve --figure token-path         # chat text vs /inference/v1/generate

Timing: TTFT is the arrival of the first chunk carrying generated text; ITL is every gap
between consecutive such chunks (a chunk holding several tokens counts once, as in
vLLM); TPOT is (E2E - TTFT) / (output tokens - 1); output tokens come from the final
usage chunk (`stream_options.include_usage`). Every request sends `ignore_eos`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common.machine import machine_line
from bench.common.results_md import RESULTS_DIR, command_line
from bench.serving.data import BenchRequest, chat_requests, random_requests
from bench.serving.figures import (
    capacity_markdown,
    frontend_capacity,
    frontend_tax,
    tax_markdown,
    token_path,
    token_path_markdown,
    write_results_section,
)
from bench.serving.load import open_loop, parse_goodput, run_coroutine, summarize
from bench.serving.report import plot, save_json, sweep_table
from bench.serving.servers import launch, served_model

# ---- a sweep -------------------------------------------------------------------------


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "chat":
        return chat_requests(
            args.num_prompts, args.output_len, range_ratio=args.range_ratio, seed=args.seed
        )
    return random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
    )


def run_sweep(args: argparse.Namespace) -> None:
    requests = build_requests(args)
    warmup = random_requests(4, 16, 4, seed=args.seed + 1)
    slos = parse_goodput(args.goodput)
    rows: list[dict] = []
    with (
        launch(args.launch, worker_args=args.worker_arg, itl_ms=args.itl_ms)
        if args.launch
        else (_nothing()) as launched
    ):
        base_url = launched.base_url if launched else args.base_url
        model = args.model or served_model(base_url)
        run_coroutine(open_loop(base_url, model, warmup, math.inf, None))
        for rate in args.request_rate:
            for concurrency in args.max_concurrency or [None]:
                results, duration = run_coroutine(
                    open_loop(
                        base_url,
                        model,
                        requests,
                        rate,
                        concurrency,
                        burstiness=args.burstiness,
                        seed=args.seed,
                    )
                )
                shown_rate = "inf" if math.isinf(rate) else rate
                row = {"request_rate": shown_rate, "max_concurrency": concurrency}
                rows.append(row | summarize(results, duration, slos))
                print(sweep_table(rows[-1:]).splitlines()[-1], flush=True)
    table = sweep_table(rows)
    print(table)
    json_path = Path(args.result_json)
    save_json(json_path, {"command": command_line(), "machine": machine_line(), "runs": rows})
    png = plot(rows, "max_concurrency", json_path.with_suffix(".png"), f"{args.dataset} set")
    print(f"wrote {json_path}" + (f" and {png}" if png else ""))


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


# ---- command line --------------------------------------------------------------------


def _rate(value: str) -> float:
    return math.inf if value == "inf" else float(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    add(
        "--figure",
        choices=["frontend-tax", "frontend-capacity", "token-path"],
        help="a RESULTS.md figure",
    )
    add("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server")
    add("--launch", choices=["real", "synthetic"], help="start a worker and render-serve")
    add("--worker-arg", action="append", default=[], help="extra flag for a launched worker")
    add("--itl-ms", type=float, default=10.0, help="step interval of a synthetic worker")
    add("--model", default=None, help="model id (default: the server's first)")
    add("--dataset", choices=["random", "chat"], default="random")
    add("--num-prompts", type=int, default=None, help="requests per run")
    add("--input-len", type=int, default=None, help="random set: prompt tokens")
    add("--output-len", type=int, default=None, help="max_tokens (with ignore_eos)")
    add("--range-ratio", type=float, default=None, help="lengths vary by +/- this share")
    add("--request-rate", type=_rate, nargs="+", default=[math.inf], help="req/s or inf")
    add("--max-concurrency", type=int, nargs="+", default=None, help="in-flight limits")
    add("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    add("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:100")
    add("--seed", type=int, default=0)
    add("--result-json", default=str(RESULTS_DIR / "serve.json"), help="sweep results")
    add("--tax-concurrency", type=int, default=32, help="frontend-tax streams and batch size")
    add("--rounds", type=int, default=2, help="frontend-tax: HTTP passes (between offline)")
    add(
        "--torch-threads",
        type=int,
        default=1,
        help="frontend-tax: torch threads of the engine, offline and in the worker",
    )
    add("--offered-tok-s", type=float, default=25_600, help="frontend-capacity offered load")
    add("--warmup-s", type=float, default=3.0, help="frontend-capacity warm-up")
    add("--measure-s", type=float, default=10.0, help="frontend-capacity measured window")
    add("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    return parser


# Per mode: (num_prompts, input_len, output_len, range_ratio) unless given.
_DEFAULTS = {
    "frontend-tax": (64, 100, 48, 1 / 3),
    "frontend-capacity": (1024, 128, 256, 0.5),
    "token-path": (48, 0, 48, 1 / 3),
    None: (200, 256, 64, 0.0),
}


def main() -> None:
    args = build_parser().parse_args()
    defaults = _DEFAULTS[args.figure]
    for name, value in zip(
        ("num_prompts", "input_len", "output_len", "range_ratio"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.figure is None:
        run_sweep(args)
        return
    name = args.figure.replace("-", "_")
    figure, markdown_of = {
        "frontend_tax": (frontend_tax, tax_markdown),
        "frontend_capacity": (frontend_capacity, capacity_markdown),
        "token_path": (token_path, token_path_markdown),
    }[name]
    result = figure(args)
    markdown = markdown_of(result)
    print(markdown)
    save_json(RESULTS_DIR / f"serve_{name}.json", result)
    if not args.no_write:
        write_results_section()


if __name__ == "__main__":
    main()
