"""The engine on a GPU: decode CUDA graphs against eager, by concurrency and model size.

    python -m bench.gpu_engine [--models smollm2 llama-1b] [--concurrency 1 32 256]
        [--max-output 128] [--repeats 2] [--kv-cache-gb 8] [--device cpu]

For each model, three engines load once, one with decode CUDA graphs, one with
`enforce_eager=True` and one with graphs and `async_scheduling=True`, each with an explicit
KV cache (sized from free memory, the first would leave the others none). At each
concurrency C a closed-loop client keeps C requests in flight, submitting the next prompt
as one finishes, as C users of a server would: bench/engine.py's chat prompts (100-150
tokens), outputs uniform over 16..--max-output with ignore_eos, greedy; 2 prompts at C=1
and 2C above. The engines take turns, so drift hits them alike.

Models: `smollm2` is whatever `resolve_model` finds for the built-in model (on the device,
bench/gpu_check.sh's random-weight stand-in at SmolLM2-135M's shapes and quantization);
`llama-1b` is a random-weight Llama at Llama-3.2-1B's shapes in bf16 (bench/offline/stand_ins.py),
written to a temporary folder; `llama-tiny` is the same code path at toy size for the CPU.

Time outside the forward: at the largest concurrency, C requests of 64 tokens start together
on the graphs engine; in each pure decode step at batch C (every sequence already has its
first token), the forward and LM head (graph replay or eager call, the device synchronized at
both ends) are timed against the whole `Engine.step` call. The remainder is the engine's own
work: scheduling, the batch layout and its upload, sampling and the token's return to the host.
The async engine's step is timed whole, against the graphs engine's forward (timing its own
would synchronize the device and undo the overlap): what it leaves outside is host work the
overlap did not hide.

On CUDA writes the `kernels-engine` section of bench/RESULTS.md; always `$OUT/kernels-engine.json`
when OUT is set (bench/gpu_check_report.py collects its `engine_section`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common.results_md import command_line, write_section
from bench.common.workload import build_workload
from bench.offline.engines import closed_loop, time_forward
from bench.offline.stand_ins import write_random_llama
from gpu_worker import Engine
from shared.protocol import Generate
from shared.sampling import SamplingParams

OUTSIDE_TARGET = 0.10  # of a decode step at the largest batch, with graphs
PROFILE_TOKENS = 64


@dataclass
class ConcurrencyResult:
    """One concurrency: both engines' output tok/s per pass."""

    concurrency: int
    num_prompts: int
    output_tokens: int
    eager_tok_s: list[float] = field(default_factory=list)
    graphs_tok_s: list[float] = field(default_factory=list)
    async_tok_s: list[float] = field(default_factory=list)
    """Graphs with async scheduling (`--async-scheduling`)."""
    outputs_equal: int = 0
    """Requests whose greedy tokens were identical in both modes (last pass)."""
    async_equal: int = 0
    """Requests whose greedy tokens with async scheduling were the graphs engine's."""

    @property
    def ratio(self) -> float:
        return statistics.median(self.graphs_tok_s) / statistics.median(self.eager_tok_s)

    @property
    def async_ratio(self) -> float:
        return statistics.median(self.async_tok_s) / statistics.median(self.graphs_tok_s)


@dataclass
class StepProfile:
    """Pure decode steps at one batch size: whole step against forward + LM head."""

    batch: int
    steps: int
    step_ms: float
    forward_ms: float

    @property
    def outside_share(self) -> float:
        return 1.0 - self.forward_ms / self.step_ms


@dataclass
class ModelResult:
    model: str
    model_file: str
    dtype: str
    graph_steps: int
    cases: list[ConcurrencyResult]
    profile: StepProfile | None
    eager_profile: StepProfile | None
    async_profile: StepProfile | None = None
    """Graphs with async scheduling: the whole step timed, the forward taken as the graphs
    engine's (timing it would synchronize the device and undo the overlap)."""


def model_path(name: str, device: str, scratch: Path) -> str | None:
    """The model argument for `Engine`: None is the built-in model."""
    if name == "smollm2":
        return None
    shape = name.removeprefix("llama-")
    return str(write_random_llama(scratch / name, shape, device=device))


def profile_steps(
    engine: Engine, prompts: list[list[int]], forward_ms: float | None = None
) -> StepProfile:
    """Start every prompt at once and time the pure decode steps at the full batch; the
    forward is timed too unless `forward_ms` gives it (an async engine's)."""
    timer = time_forward(engine) if forward_ms is None else None
    sampling = SamplingParams(temperature=0.0, max_tokens=PROFILE_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        key = f"profile-{i}"
        engine.add_request(
            Generate(request_id=key, prompt_token_ids=prompt, sampling=sampling), key
        )
    started: set[str] = set()
    step_s: list[float] = []
    forward_s: list[float] = []
    while engine.has_unfinished_requests():
        if timer is not None:
            timer.seconds = 0.0
        begin = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - begin
        got = {d.request_id for d in deltas}
        if len(got) == len(prompts) and got <= started:
            step_s.append(elapsed)
            forward_s.append(timer.seconds if timer is not None else (forward_ms or 0) / 1e3)
        started |= got
    engine.reset_prefix_cache()
    assert step_s, "no pure decode step at the full batch"
    return StepProfile(
        batch=len(prompts),
        steps=len(step_s),
        step_ms=statistics.median(step_s) * 1e3,
        forward_ms=statistics.median(forward_s) * 1e3,
    )


def bench_model(args: argparse.Namespace, name: str, scratch: Path) -> ModelResult:
    from render_server.templating.chat_template import ChatRenderer
    from render_server.templating.tokenizer import Tokenizer
    from shared.model_source import DEFAULT_MODEL, resolve_model

    path = model_path(name, args.device, scratch)
    max_seqs = max(args.concurrency)
    engines = {
        eager: Engine(
            model=path,
            device=args.device,
            max_num_seqs=max_seqs,
            enforce_eager=eager,
            kv_cache_memory_gb=args.kv_cache_gb,
        )
        for eager in (True, False)
    }
    async_engine = Engine(
        model=path,
        device=args.device,
        max_num_seqs=max_seqs,
        kv_cache_memory_gb=args.kv_cache_gb,
        async_scheduling=True,
    )
    vocab = engines[True].vocab_size
    renderer = ChatRenderer(Tokenizer.from_source(resolve_model(DEFAULT_MODEL)))

    def workload(num_prompts: int, seed: int) -> tuple[list[list[int]], list[int]]:
        work = build_workload(renderer, num_prompts, args.max_output, seed=seed)
        # The built-in tokenizer's ids, folded into a smaller vocabulary where there is one.
        return [[t % vocab for t in p] for p in work.prompts], work.output_lens

    warm, warm_lens = workload(min(8, max_seqs), seed=99)
    for engine in [*engines.values(), async_engine]:  # compile, autotune, settle the allocator
        closed_loop(engine, warm, [min(n, 16) for n in warm_lens], max_seqs)
        engine.reset_prefix_cache()
    cases = []
    for concurrency in args.concurrency:
        num_prompts = 2 if concurrency == 1 else 2 * concurrency
        prompts, lens = workload(num_prompts, seed=concurrency)
        case = ConcurrencyResult(concurrency, num_prompts, sum(lens))
        outputs: dict[bool, list[list[int]]] = {}
        for _ in range(args.repeats):
            for eager, engine in engines.items():
                seconds, outputs[eager] = closed_loop(engine, prompts, lens, concurrency)
                engine.reset_prefix_cache()
                rates = case.eager_tok_s if eager else case.graphs_tok_s
                rates.append(case.output_tokens / seconds)
            seconds, async_outputs = closed_loop(async_engine, prompts, lens, concurrency)
            async_engine.reset_prefix_cache()
            case.async_tok_s.append(case.output_tokens / seconds)
        case.outputs_equal = sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True))
        case.async_equal = sum(a == b for a, b in zip(async_outputs, outputs[False], strict=True))
        cases.append(case)
        print(
            f"{name} C={concurrency}: eager {statistics.median(case.eager_tok_s):,.0f} tok/s, "
            f"graphs {statistics.median(case.graphs_tok_s):,.0f} tok/s ({case.ratio:.2f}x), "
            f"identical outputs {case.outputs_equal}/{num_prompts}; async "
            f"{statistics.median(case.async_tok_s):,.0f} tok/s ({case.async_ratio:.2f}x graphs), "
            f"identical {case.async_equal}/{num_prompts}",
            flush=True,
        )
    profile_prompts, _ = workload(max_seqs, seed=7)
    profiles = {eager: profile_steps(engines[eager], profile_prompts) for eager in (False, True)}
    for eager, profile in profiles.items():
        print(
            f"{name} {'eager' if eager else 'graphs'} decode step at batch {profile.batch}: "
            f"{profile.step_ms:.2f} ms, forward {profile.forward_ms:.2f} ms, "
            f"outside {profile.outside_share:.1%}",
            flush=True,
        )
    async_profile = profile_steps(async_engine, profile_prompts, profiles[False].forward_ms)
    print(
        f"{name} graphs + async decode step at batch {async_profile.batch}: "
        f"{async_profile.step_ms:.2f} ms, outside {async_profile.outside_share:.1%}",
        flush=True,
    )
    graphs_engine = engines[False]
    result = ModelResult(
        model=name,
        model_file=path or str(resolve_model(DEFAULT_MODEL).path),
        dtype=str(graphs_engine.dtype).removeprefix("torch."),
        graph_steps=graphs_engine.runner.num_graph_steps,
        cases=cases,
        profile=profiles[False] if graphs_engine.runner.decode_graphs is not None else None,
        eager_profile=profiles[True],
        async_profile=async_profile if graphs_engine.runner.decode_graphs is not None else None,
    )
    for engine in [*engines.values(), async_engine]:
        engine.close()
    del engines, graphs_engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def render_model(result: ModelResult) -> list[str]:
    lines = [
        "",
        f"### {result.model} ({result.dtype}; `{result.model_file}`)",
        "",
        "| concurrency | prompts | output tokens | eager tok/s | graphs tok/s | graphs / eager "
        "| identical greedy outputs | graphs + async tok/s | async on / off | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in result.cases:
        lines.append(
            f"| {case.concurrency} | {case.num_prompts} | {case.output_tokens:,} "
            f"| {statistics.median(case.eager_tok_s):,.0f} "
            f"| {statistics.median(case.graphs_tok_s):,.0f} | **{case.ratio:.2f}x** "
            f"| {case.outputs_equal}/{case.num_prompts} "
            f"| {statistics.median(case.async_tok_s):,.0f} | **{case.async_ratio:.2f}x** "
            f"| {case.async_equal}/{case.num_prompts} |"
        )
    lines += ["", f"{result.graph_steps:,} decode steps replayed a graph."]
    profiles = (
        ("graphs", result.profile),
        ("eager", result.eager_profile),
        ("graphs + async scheduling", result.async_profile),
    )
    for label, profile in profiles:
        if profile is None:
            continue
        mark = ""
        if label != "eager":
            mark = " ✓" if profile.outside_share < OUTSIDE_TARGET else " ✗"
        lines.append(
            f"Decode step at batch {profile.batch}, {label} (median of {profile.steps} steps): "
            f"{profile.step_ms:.2f} ms, of which forward + LM head {profile.forward_ms:.2f} ms; "
            f"**{profile.outside_share:.1%} outside the forward**{mark}."
        )
    return lines


def render(args: argparse.Namespace, results: list[ModelResult]) -> str:
    if args.device == "cuda":
        import triton

        where = (
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}; Triton attention"
        )
    else:
        where = f"the CPU, torch {torch.__version__}; torch attention, no graphs"
    lines = [
        f"## Engine on the {args.device.upper()}: decode CUDA graphs by concurrency "
        "(bench/gpu_engine.py)",
        "",
        f"Command: `{command_line()}` on {where}. Closed-loop clients at each concurrency, "
        f"outputs 16-{args.max_output} tokens (ignore_eos, greedy), {args.repeats} passes per "
        "mode alternating, medians. Outside the forward: target < "
        f"{OUTSIDE_TARGET:.0%} of a decode step at the largest batch with graphs.",
    ]
    for result in results:
        lines += render_model(result)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "llama-1b"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--max-output", type=int, default=128, help="longest output")
    parser.add_argument("--repeats", type=int, default=2, help="passes per mode")
    parser.add_argument("--kv-cache-gb", type=float, default=8.0, help="per engine")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_engine.py needs a CUDA GPU (or --device cpu for a dry run).")
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter is for CPU tests, not for timing.")
        return 2
    payload: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "models": []}
    results = []
    with tempfile.TemporaryDirectory(prefix="duet-gpu-engine-") as scratch:
        for name in args.models:
            result = bench_model(args, name, Path(scratch))
            results.append(result)
            payload["models"].append(asdict(result))
    section = render(args, results)
    payload["engine_section"] = section
    print(section)
    if args.device == "cuda":
        write_section("kernels-engine", section)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "kernels-engine.json").write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
