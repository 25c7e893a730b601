"""Speculative decoding on the engine: ngram, suffix and draft-model drafting against none.

    python -m bench.engine --speculative ngram suffix draft_model [--concurrency 1 8]
        [--max-output 128] [--repeats 2] [--threads 2]

Two workloads, each through closed-loop clients (`bench.offline.engines.closed_loop`) on
engines that differ only in `--speculative-config` (adaptive draft length, the default),
taking turns:
- copy-heavy: chat prompts asking to repeat a given text (prose and code), greedy, up to
  --max-output tokens, ending at EOS: the output copies the prompt;
- mixed: bench/engine.py's chat workload (100-150-token prompts, outputs 16..--max-output
  with ignore_eos, greedy).
Reported per workload, method and concurrency: output tok/s and its ratio to no
speculation, the share of drafted tokens accepted, the mean accepted length (1 + accepted
drafts per verification, vLLM's definition), and output tokens per engine step. The only
draft model with the built-in's tokenizer is the built-in itself, as costly as the target:
its row shows what the draft-length controller makes of a draft that cannot pay.
Greedy outputs are compared with no speculation's: a verify row's attention is a plain
decode's, but its matmuls run in a batch of other rows, whose fp32 sums may differ in the
last bits, as a different batch's do without speculation, so a near-tie may flip; the
table counts the identical outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from bench.common.machine import cpu_model, load_average, machine
from bench.common.results_md import command_line, write_section
from bench.common.workload import build_workload
from bench.offline.engines import closed_loop
from gpu_worker import Engine
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, resolve_model

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # The only model here with the built-in's tokenizer is the built-in itself: a draft as
    # costly as the target, which the draft-length controller should find not paying.
    "draft_model": {"method": "draft_model", "model": DEFAULT_MODEL, "num_speculative_tokens": 4},
}  # fmt: skip

TEXTS = [
    "The river runs past the old mill, under the stone bridge and through the meadow where "
    "the horses graze. In spring the water rises and the fields turn green; in autumn the "
    "leaves drift down and gather in the slow pools below the weir.",
    "def moving_average(values, window):\n    total = 0.0\n    out = []\n"
    "    for i, value in enumerate(values):\n        total += value\n"
    "        if i >= window:\n            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n    return out\n",
    "Our office opens at nine and closes at five. Visitors sign in at the front desk, wear "
    "a badge at all times and are accompanied by a member of staff in every area beyond "
    "the lobby. Deliveries go to the loading bay at the back of the building.",
    "SELECT customers.name, COUNT(orders.id) AS orders\nFROM customers\n"
    "JOIN orders ON orders.customer_id = customers.id\nWHERE orders.created_at >= '2024-01-01'\n"
    "GROUP BY customers.name\nORDER BY orders DESC\nLIMIT 10;\n",
]
ASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this out again, unchanged:\n\n{}",
]


@dataclass
class Case:
    workload: str
    method: str
    concurrency: int
    tokens: int
    tok_s: float
    drafted: int
    accepted: int
    verifies: int
    steps: int
    identical: int
    requests: int


def copy_workload(renderer: ChatRenderer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = TEXTS[i % len(TEXTS)]
        ask = ASKS[(i // len(TEXTS)) % len(ASKS)]
        messages = [{"role": "user", "content": ask.format(text)}]
        prompts.append(renderer.render(messages, add_generation_prompt=True).token_ids)
    return prompts


def run_case(
    engine: Engine, prompts: list[list[int]], lens: list[int], concurrency: int, eos: bool
) -> tuple[float, list[list[int]], tuple[int, int, int, int]]:
    """One closed-loop pass; (seconds, outputs, (drafted, accepted, verifies, steps) during
    it): a verify is one request's drafts checked in one step (vLLM's num_drafts)."""
    before = engine.stats()
    seconds, outputs = closed_loop(engine, prompts, lens, concurrency, ignore_eos=not eos)
    after = engine.stats()
    counts = (
        after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
        after.spec_num_drafts - before.spec_num_drafts,
        after.steps - before.steps,
    )
    engine.reset_prefix_cache()
    return seconds, outputs, counts


def run_speculative(args: argparse.Namespace) -> None:
    """The comparison for `args.methods`, `args.concurrency`, `args.max_output` and
    `args.repeats`; the table goes to RESULTS.md unless `args.no_write`."""
    renderer = ChatRenderer(Tokenizer.from_source(resolve_model(DEFAULT_MODEL)))
    max_seqs = max(args.concurrency)
    engines = {"none": Engine(device="cpu", max_num_seqs=max_seqs)}
    for method in args.methods:
        engines[method] = Engine(
            device="cpu", max_num_seqs=max_seqs, speculative_config=json.dumps(CONFIGS[method])
        )
    cases: list[Case] = []
    for concurrency in args.concurrency:
        count = 2 if concurrency == 1 else 2 * concurrency
        mixed = build_workload(renderer, count, args.max_output, seed=concurrency)
        workloads = {
            "copy-heavy": (copy_workload(renderer, count), [args.max_output] * count, True),
            "mixed": (mixed.prompts, mixed.output_lens, False),
        }
        for name, (prompts, lens, eos) in workloads.items():
            rates: dict[str, list[float]] = {m: [] for m in engines}
            outputs: dict[str, list[list[int]]] = {}
            counts: dict[str, tuple[int, int, int, int]] = {}
            for engine in engines.values():  # warm-up: compile, allocate, fill the caches
                run_case(engine, prompts[:1], [8], 1, eos)
            for _ in range(args.repeats):
                for method, engine in engines.items():
                    seconds, outputs[method], counts[method] = run_case(
                        engine, prompts, lens, concurrency, eos
                    )
                    rates[method].append(sum(map(len, outputs[method])) / seconds)
            for method in engines:
                identical = sum(
                    a == b for a, b in zip(outputs[method], outputs["none"], strict=True)
                )
                drafted, accepted, verifies, steps = counts[method]
                tokens = sum(map(len, outputs[method]))
                case = Case(name, method, concurrency, tokens, statistics.median(rates[method]),
                            drafted, accepted, verifies, steps, identical,
                            len(prompts))  # fmt: skip
                cases.append(case)
                print(case, flush=True)
    rows = []
    base = {(c.workload, c.concurrency): c.tok_s for c in cases if c.method == "none"}
    for c in cases:
        share = f"{c.accepted / c.drafted:.0%}" if c.drafted else "-"
        length = f"{1 + c.accepted / c.verifies:.2f}" if c.verifies else "-"
        rows.append(
            f"| {c.workload} | {c.concurrency} | {c.method} | {c.tokens:,} | {c.tok_s:.1f} "
            f"| **{c.tok_s / base[(c.workload, c.concurrency)]:.2f}x** | {share} | {length} "
            f"| {c.tokens / max(c.steps, 1):.2f} | {c.identical}/{c.requests} |"
        )
    body = "\n".join(
        [
            "## speculative",
            "",
            f"`{command_line()}`",
            "",
            f"Machine: {cpu_model()}; {machine()}; load average {load_average()}. SmolLM2-135M, "
            f"fp32, greedy, medians of {args.repeats} alternating passes (drafts, acceptances "
            "and steps of the last). Issue targets on CPU: >= 1.8x single-stream on "
            "copy-heavy, >= 0.95x on mixed.",
            "",
            "| workload | concurrency | method | output tokens | tok/s | vs none "
            "| drafts accepted | mean accepted length | tokens per step "
            "| greedy outputs as none's |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(body)
    if not args.no_write:
        write_section("speculative", body)
