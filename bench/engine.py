"""Engine throughput: duet's continuous-batching Engine against transformers, same run.

(a) throughput: N chat prompts (100-150 tokens, seeded made-up content), output lengths
    spread uniformly over [16, --max-output] with ignore_eos. duet runs them all through one
    Engine with `--max-num-seqs C`; transformers runs `generate` on static batches of C
    (left-padded, each batch decoding until its longest request). Only useful tokens count:
    each prompt's own requested length.
(b) single-stream decode: one request, 128 new tokens, timed as generate(1 + n) - generate(1)
    on both sides so the prefill cancels out.
(c) the share of engine time spent outside the model forward (scheduling, batch building,
    sampling, bookkeeping), from perf_counter around the model's forward and LM head.

The machine may be shared, so every case runs both systems back to back in one process,
`--repeats` times, and the table gives medians and their ratio. Besides wall time, each
case records the process's CPU time: with `--threads 1` that ratio does not move when
other jobs take the core away, so it is the steadier comparison on a busy box.

With `--tensor-parallel-size N` (N > 1) the run is instead duet against itself: TP=N
(N ranks of `--threads` torch threads each, default 1) against TP=1 (one process of
N x `--threads` threads), the same cases (a) and (b) in turns, and the transformers
baseline is skipped. TP=1 runs without the CPU GGUF decode kernel, on dense weights as
every rank of TP=N does (the loader keeps that kernel to one rank alone), so the split is
the only difference. The spawned ranks take their thread count from OMP_NUM_THREADS,
which the bench sets before starting them. Each case then runs TP=N once more under
torch.profiler, in rank 0's process, for the share of that run's wall time spent in each
collective: the layers' all-reduces, the gather of the logits to rank 0 and the
broadcast of each step's batch. On CPU these are gloo's "gloo:<op>" ranges, which last
until every rank has joined, so they include waiting for the slower rank. The section
goes to RESULTS.md as `engine-tp`. On a machine with N GPUs the same command with
`--device cuda` is the multi-GPU benchmark (one GPU per rank,
NCCL); there the shares count NCCL's kernels, whose names have not yet been checked on
such a machine (none was available).

    python -m bench.engine                      # the full run (long on a 2-core CPU)
    python -m bench.engine --quick --threads 1  # 32 prompts, outputs up to 64 tokens
    python -m bench.engine --dtypes float32 bfloat16
    python -m bench.engine --quick --tensor-parallel-size 2  # 2 ranks x 1 vs 1 x 2 threads
    python -m bench.engine --lora 1 4 8         # LoRA adapters against the base model
    python -m bench.engine --speculative ngram suffix draft_model  # against no speculation
    python -m bench.engine --async-scheduling on off  # host work hidden, device stand-in

With `--async-scheduling` the run is instead the overlap stand-in (bench/offline/
async_overlap.py): the model's work becomes a timer the host is free during, as a GPU's
is, and the table gives the share of a decode step at `--batch` that is host work outside
the device's time, with async scheduling on and off.

The cases live in bench/offline/ (comparison, tensor_parallel, lora_engine, speculative);
this module is their command line."""

from __future__ import annotations

import argparse
import logging

import torch

from bench.common.machine import load_average
from bench.common.workload import build_workload
from bench.offline.async_overlap import run_async_overlap
from bench.offline.comparison import run_comparison, write_engine_section
from bench.offline.lora_engine import run_lora, write_lora_section
from bench.offline.speculative import run_speculative
from bench.offline.tensor_parallel import run_tp_dtype, write_tp_section
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, resolve_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32"], help="each runs on both systems"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256, help="longest requested output")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--serial-prompts",
        type=int,
        default=None,
        help="prompts for concurrency 1 (default: all); the serial case is the slowest",
    )
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each throughput case")
    parser.add_argument("--single-stream-repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (per rank at TP > 1)"
    )
    parser.add_argument(
        "--thread-counts",
        type=int,
        nargs="+",
        default=None,
        help="instead of --threads: every case at each count in turn, and each system's "
        "speedup from the first count to the last",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="above 1: duet at this TP against duet at TP=1 with as many threads in all",
    )
    parser.add_argument("--dist-timeout-s", type=float, default=120.0, help="at TP > 1")
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="the KV cache size (default: profiled on CUDA, 1 GiB on CPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="32 prompts, outputs up to 64, 8 prompts serially, 64-token single stream",
    )
    parser.add_argument(
        "--lora",
        type=int,
        nargs="+",
        help="instead: 32 concurrent requests over N random adapters against the base model",
    )
    parser.add_argument(
        "--speculative",
        dest="methods",
        nargs="+",
        choices=["ngram", "suffix", "draft_model"],
        help="instead: speculative decoding with these methods against none on copy-heavy "
        "and mixed chat workloads at --concurrency (bench/offline/speculative.py)",
    )
    parser.add_argument(
        "--async-scheduling",
        nargs="+",
        choices=["on", "off"],
        help="instead: the overlap stand-in with async scheduling on and/or off",
    )
    parser.add_argument("--batch", type=int, default=256, help="--async-scheduling's batch")
    parser.add_argument("--steps", type=int, default=64, help="--async-scheduling's steps")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=None,
        help="--async-scheduling: the stand-in device's step (default: the host's own)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.num_prompts, args.max_output, args.serial_prompts = 32, 64, 8
        args.single_stream_tokens = 64
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.methods:
        run_speculative(args)
        return
    if args.async_scheduling:
        run_async_overlap(args)
        return

    source = resolve_model(args.model)
    renderer = ChatRenderer(Tokenizer.from_source(source))
    work = build_workload(renderer, args.num_prompts, args.max_output, args.seed)
    print(work.describe(), flush=True)
    load_at_start = load_average()
    if args.lora:
        write_lora_section(args, work, run_lora(args, work))
        return
    if args.tensor_parallel_size > 1:
        tp_rows = [row for dtype in args.dtypes for row in run_tp_dtype(args, dtype, work)]
        write_tp_section(args, work, tp_rows, load_at_start)
        return
    table = run_comparison(args, work, source)
    print("\n".join(table))
    if not args.no_write:
        write_engine_section(args, work, table, load_at_start)


if __name__ == "__main__":
    main()
