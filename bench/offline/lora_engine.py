"""bench/engine.py --lora N...: tok/s at 32 concurrent requests spread over N random PEFT
adapters against the base model on the same engine; the `engine-lora` section."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common.machine import cpu_model, load_average, machine
from bench.common.results_md import command_line, write_section
from bench.common.timing import Clock
from bench.common.workload import Workload
from gpu_worker import Engine
from gpu_worker.lora.adapter import target_shapes
from shared.sampling import SamplingParams

LORA_RANK = 16
CONCURRENCY = 32


def write_random_adapters(engine: Engine, count: int, out: Path) -> list[str]:
    """`count` random PEFT adapters (rank 16, all 7 targets of every layer) in `out`;
    returns `--lora-modules` entries (name=path)."""
    shapes = target_shapes(engine.model_config)
    modules = []
    for index in range(count):
        name = f"adapter{index}"
        gen = torch.Generator().manual_seed(index)
        tensors = {}
        for (layer, target), (in_f, out_f) in shapes.items():
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            a = torch.randn(LORA_RANK, in_f, generator=gen) / in_f**0.5
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, LORA_RANK, generator=gen) * 0.01
        adapter_dir = out / name
        adapter_dir.mkdir()
        save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": LORA_RANK,
            "lora_alpha": 2 * LORA_RANK,
            "target_modules": sorted({target for _, target in shapes}),
        }
        (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
        modules.append(f"{name}={adapter_dir}")
    return modules


def run_lora(args: argparse.Namespace, work: Workload) -> list[str]:
    """tok/s at 32 concurrent, requests round-robin over N adapters, against the base model
    on the same engine (LoRA on, base-only steps skip the adapters), for each N."""
    case = work.head(CONCURRENCY)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in case.output_lens
    ]
    most = max(args.lora)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = Engine(model=args.model, device=args.device, kv_cache_memory_gb=0.01)
        modules = write_random_adapters(probe, most, Path(tmp))
        del probe
        engine = Engine(
            model=args.model,
            device=args.device,
            dtype=args.dtypes[0],
            max_num_seqs=CONCURRENCY,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_lora=True,
            max_loras=most,
            max_lora_rank=LORA_RANK,
            lora_modules=modules,
        )
        names = [module.split("=", 1)[0] for module in modules]

        def rate(adapters: int) -> float:
            lora_names: list[str | None] = [
                None if adapters == 0 else names[i % adapters] for i in range(len(case.prompts))
            ]
            engine.reset_prefix_cache()
            clock = Clock.measure(
                lambda: engine.generate(case.prompts, params, lora_names=lora_names)
            )
            return case.useful_tokens / clock.wall

        rate(0)  # warm-up
        for adapters in [0, *args.lora]:
            rate(adapters)  # each side warm once (slot fills), then timed
        for adapters in args.lora:
            base = statistics.median(rate(0) for _ in range(args.repeats))
            lora = statistics.median(rate(adapters) for _ in range(args.repeats))
            rows.append(
                f"| {adapters} | {base:.1f} | {lora:.1f} | **{lora / base:.2f}x** "
                f"| {(1 - lora / base) * 100:.0f}% |"
            )
            print(rows[-1], flush=True)
    return rows


def write_lora_section(args: argparse.Namespace, work: Workload, rows: list[str]) -> None:
    case = work.head(CONCURRENCY)
    lens = [len(p) for p in case.prompts]
    case_tokens = f"prompts of {min(lens)}-{max(lens)} tokens, {case.useful_tokens} output tokens"
    body = "\n".join(
        [
            "## engine-lora",
            "",
            f"`{command_line()}`",
            "",
            f"Machine: {cpu_model()}; {machine()}; load average {load_average()}.",
            "",
            f"SmolLM2-135M-Instruct, {args.dtypes[0]}, 32 concurrent requests ({case_tokens}), "
            "greedy with ignore_eos, whole-workload tok/s (decode-dominated); the LoRA side "
            "spreads the requests round-robin over N random PEFT adapters (rank 16, all 7 "
            "targets of every layer), the base side names none, both on one engine with "
            f"--enable-lora --max-loras {max(args.lora)}, alternating, medians of "
            f"{args.repeats}. Issue target: 8 adapters at most 30% slower than the base.",
            "",
            "| adapters | base tok/s | LoRA tok/s | LoRA / base | slower by |",
            "|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(body)
    if not args.no_write:
        write_section("engine-lora", body)
