"""`gpu-worker`: load a model and serve it over ZeroMQ."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from gpu_worker.engine.config import EngineConfig
from shared.model_source import DEFAULT_MODEL, ModelNotFoundError

DEFAULT_BIND = "tcp://127.0.0.1:5555"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-worker",
        description="Serve a model to duet render servers over ZeroMQ (token ids only).",
    )
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="built-in name, .gguf file or HF directory")
    add("--served-model-name", default=None, help="model id reported to clients")
    add(
        "--bind",
        default=DEFAULT_BIND,
        help="ZMQ address to bind (tcp://HOST:PORT or ipc://PATH); loopback by default",
    )
    add("--worker-id", default=None, help="name in logs and Welcome (default: the bind address)")
    add("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    add("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    add("--block-size", type=int, default=16, help="tokens per KV cache block")
    add("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step (decodes plus prefill chunks)",
    )
    add("--max-model-len", type=int, default=None, help="longest prompt plus output")
    add("--kv-cache-memory-gb", type=float, default=None, help="KV cache size (CPU default 1)")
    add(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of GPU memory for weights, KV cache and activations",
    )
    add("--attention-backend", default="auto", help="auto, torch or triton")
    add(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run every decode step eagerly (graphs are used on CUDA only)",
    )
    add(
        "--cuda-graph-max-batch-size",
        type=int,
        default=None,
        help="largest decode batch captured in a CUDA graph (default min(max-num-seqs, 512))",
    )
    add(
        "--no-cpu-gguf-kernels",
        action="store_true",
        help="on CPU in fp32, multiply on dense fp32 weights only, never on a GGUF file's "
        "quantized blocks (same values, more bytes per step)",
    )
    add("--no-prefix-caching", action="store_true", help="disable prefix caching")
    add("--max-waiting", type=int, default=4096, help="queued requests before queue_full")
    add(
        "--zmq-curve-dir",
        type=Path,
        default=None,
        help="encrypt with CURVE and admit only render servers whose public keys are in "
        "DIR/authorized (see shared/curve.py; `python -m shared.curve DIR` makes keys)",
    )
    add(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds between heartbeats to each render server",
    )
    add(
        "--client-timeout",
        type=float,
        default=10.0,
        help="free the requests of a render server silent this many seconds",
    )
    add("--log-level", default="info", help="debug, info, warning or error")
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
        cpu_gguf_kernels=not args.no_cpu_gguf_kernels,
        enable_prefix_caching=not args.no_prefix_caching,
        max_waiting=args.max_waiting,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from_args(args)
    # Heavy imports after argument parsing, so `--help` is instant.
    from gpu_worker.engine.engine import Engine
    from gpu_worker.runner.device import Nvml
    from gpu_worker.server.zmq_server import WorkerServer

    try:
        engine = Engine(**vars(config))
    except (ModelNotFoundError, ValueError) as exc:
        print(f"gpu-worker: error: {exc}", file=sys.stderr)
        return 2
    curve_dir = args.zmq_curve_dir
    server = WorkerServer(
        engine,
        args.bind,
        worker_id=args.worker_id or args.bind,
        curve_dir=curve_dir,
        heartbeat_interval_s=args.heartbeat_interval,
        client_timeout_s=args.client_timeout,
        gpu_reader=Nvml(engine.device),
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    # A line on stdout that supervisors (and the embedded launcher) can wait for.
    print(f"gpu-worker ready on {server.endpoint}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
