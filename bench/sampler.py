"""The batched sampler against the one before issue 18 (kept as the baseline in
bench/offline/baseline_sampler.py), all in one process, in two modes.

`--mode large` (issue 18): one step of a batch of 64 sequences over a 128,256-token
vocabulary (Llama 3's), fp32 logits N(0, 4^2) per token (the top 1,024 hold about 94% of a
row's mass, as a language model's next-token distribution holds most of it in a few
hundred tokens), 128-token prompts, 256 output tokens each and one more after every call:
greedy (the argmax shortcut), plain sampling at temperature 0.8, top-k 50, top-p 0.9,
top-k 50 + top-p 0.9, the three penalties, seeded rows (plain, then with top-p 0.9), and
top-p 0.9 on flat logits N(0, 1) (every row's nucleus runs past its candidates: the
fallback's worst case).

`--mode filters`: one step of a batch of 32 sequences (vocab 49,152, 64 output tokens
each):
- sampled: every row samples at temperature 0.8 (no top-k/p), no token filter;
- greedy: every row greedy, no token filter (the argmax fast path);
- filtered: the same batch where 8 rows take `allowed_token_ids` (256 ids) and 8 others
  take 64 bad words (32 one-token, 32 of two or three tokens, two of whose prefixes end
  the row's output, so their bans fire every step);
- filtered, masks rebuilt: as filtered, but the rows change places every call, so the
  batch's masks are rebuilt each time (the step after a request joins or leaves);
- greedy with logit_bias on 16 rows: any logits processing leaves the greedy batch's
  argmax shortcut (a copy of the logits, then the full path), the fair yardstick for a
  filtered greedy batch;
- and the design choice behind allowed_token_ids: adding a 0/-inf bias to 8 rows with
  `index_add_` vs selecting them, a bool `masked_fill_` and `index_copy_` back.

Each round calls every case once; the median call of `--rounds` rounds per case (the
order reversed every other round).

    python -m bench.sampler --mode large [--rounds 12] [--device cpu] [--no-write]
    python -m bench.sampler --mode filters [--rounds 200] [--device cpu] [--no-write]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common.machine import load_average
from bench.common.results_md import command_line, write_section
from bench.common.timing import median_ms_each
from bench.offline.baseline_sampler import BaselineSampler
from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from shared.sampling import SamplingParams

BATCH = 32
VOCAB = 49_152
EOS = 2


def batch(
    device: torch.device,
    rng: random.Random,
    *,
    greedy: bool = False,
    filtered: bool = False,
    biased: bool = False,
) -> list[Sequence]:
    """32 sequences mid-decode; with `filtered`, rows 0-7 allowed ids, rows 8-15 bad words;
    with `biased`, rows 0-15 a one-token logit_bias."""
    seqs = []
    for row in range(BATCH):
        prompt = [rng.randrange(VOCAB) for _ in range(100)]
        output = [rng.randrange(VOCAB) for _ in range(64)]
        fields: dict[str, Any] = {"temperature": 0.0 if greedy else 0.8}
        if filtered and row < 8:
            fields["allowed_token_ids"] = rng.sample(range(VOCAB), 256)
        if filtered and 8 <= row < 16:
            words = [[rng.randrange(VOCAB)] for _ in range(32)]
            words += [[rng.randrange(VOCAB) for _ in range(2 + i % 2)] for i in range(30)]
            words += [[output[-1], 11], [*output[-2:], 12]]  # their prefixes end the output
            fields["bad_words_token_ids"] = words
        if biased and row < 16:
            fields["logit_bias"] = {rng.randrange(VOCAB): 1.0}
        params = SamplingParams(max_tokens=1000, **fields)
        seq = Sequence(f"r{row}", prompt, params, sampler_state=new_sampler_state(params))
        for token in output:
            seq.append_token(token)
        seqs.append(seq)
    return seqs


def conditions(device: torch.device) -> str:
    """The machine, the device and the clock the medians are in."""
    clock_name = "wall time" if device.type == "cuda" else "thread CPU time"
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 torch "
        f"thread, device {device}, {clock_name}, load average {load_average()} at the end"
    )


LARGE_BATCH = 64
LARGE_VOCAB = 128_256
LARGE_CASES: dict[str, dict[str, Any]] = {
    "greedy (argmax shortcut)": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
    "top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "top-k 50 + top-p 0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "penalties (repetition 1.1, frequency 0.5, presence 0.5)": {
        "temperature": 0.8,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
    },
    "seeded": {"temperature": 0.8, "seed": 0},
    "seeded + top-p 0.9": {"temperature": 1.0, "top_p": 0.9, "seed": 0},
    "top-p 0.9, flat logits (all rows fall back)": {"temperature": 1.0, "top_p": 0.9},
}


def large_batch(device: torch.device, fields: dict[str, Any]) -> list[Sequence]:
    """64 sequences with `fields`, each its own seed when seeded; the same every call."""
    rng = random.Random(0)
    seqs = []
    for row in range(LARGE_BATCH):
        row_fields = dict(fields)
        if "seed" in row_fields:
            row_fields["seed"] = 1000 + row
        params = SamplingParams(max_tokens=100_000, **row_fields)
        prompt = [rng.randrange(LARGE_VOCAB) for _ in range(128)]
        seq = Sequence(f"r{row}", prompt, params, sampler_state=new_sampler_state(params))
        for _ in range(256):
            seq.append_token(rng.randrange(LARGE_VOCAB))
        seqs.append(seq)
    return seqs


def run_large(args: argparse.Namespace, device: torch.device) -> str:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    gen = torch.Generator().manual_seed(0)
    peaked = (torch.randn(LARGE_BATCH, LARGE_VOCAB, generator=gen) * 4).to(device)
    flat = torch.randn(LARGE_BATCH, LARGE_VOCAB, generator=gen).to(device)

    def step(make: Callable[..., Sampler], name: str) -> Callable[[], object]:
        # A sampler and a batch per case; every call appends the sampled token, as a run
        # of decode steps does (the penalties' counts grow by one per row per step).
        sampler = make(LARGE_VOCAB, device, [EOS])
        seqs = large_batch(device, LARGE_CASES[name])
        logits = flat if "flat" in name else peaked

        def call() -> object:
            out = sampler.sample(logits, seqs)
            for seq, token in zip(seqs, out.token_ids, strict=True):
                seq.append_token(token)
            return out

        return call

    cases: dict[str, Callable[[], object]] = {}
    for name in LARGE_CASES:
        cases[f"{name}, baseline"] = step(BaselineSampler, name)
        cases[name] = step(Sampler, name)
    ms = median_ms_each(cases, args.rounds, sync=sync, clock=clock)
    table = [
        f"| {name} | {ms[name + ', baseline']:.2f} | {ms[name]:.2f} | "
        f"**{ms[name] / ms[name + ', baseline']:.3f}** |"
        for name in LARGE_CASES
    ]
    print("\n".join(table))
    return "\n".join(
        [
            "## sampler at batch 64 x 128k vocabulary (bench/sampler.py --mode large)",
            "",
            f"`{command_line()}` — {conditions(device)}; one `Sampler.sample` call on "
            f"{LARGE_BATCH} x {LARGE_VOCAB:,} fp32 logits, then one token appended to each "
            f"row (128-token prompts, 256 output tokens to start); every row of a batch "
            f"takes the options named; logits N(0, 4^2), flat ones N(0, 1). Baseline: the "
            f"sampler before issue 18, kept in bench/offline/baseline_sampler.py "
            f"(`BaselineSampler`). Each round calls every case once, median call of "
            f"{args.rounds} rounds. Ratio = this commit / baseline (below 1: faster).",
            "",
            "| batch of 64 | baseline ms | this commit ms | ratio |",
            "|---|---:|---:|---:|",
            *table,
            "",
            "Top-k and top-p keep a row's best logits (`torch.topk`: 1,024 for top-p alone, "
            "top_k + 64 for top-k) instead of a stable sort of 128k, and a row draws once "
            "over its candidates from one uniform per row (an inverse CDF), where the "
            "baseline drew 128k exponentials per row; rows without top-k/p draw the same "
            "way over the vocabulary. Seeded rows share that one call (their uniform is a "
            "hash of seed and position), where the baseline ran one generator per row. The "
            "penalties scatter each step's one new token per row into persistent rows (what "
            "frequency and presence subtract, and a seen-token mask) and apply them with a "
            "gather and a subtraction, where the baseline rebuilt dense counts from every "
            "output token. A flat row, whose nucleus the candidates do not cover, pays the "
            "top-1,024 and the full sort: the fallback's cost over the baseline's sort "
            "alone. Greedy runs the same code in both (the argmax shortcut): its ratio is "
            "the run's noise.",
        ]
    )


def run_filters(args: argparse.Namespace, device: torch.device) -> str:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    rng = random.Random(0)
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)

    def old(batch: list[Sequence]) -> Callable[[], object]:
        sampler = BaselineSampler(VOCAB, device, [EOS])
        return lambda: sampler.sample(logits, batch)

    def new(*batches: list[Sequence]) -> Callable[[], object]:
        # A sampler per case: it keeps the masks of the batch it saw last, as the engine's
        # one sampler does through a run of steps. Several batches take turns.
        sampler = Sampler(VOCAB, device, [EOS])
        turns = itertools.cycle(batches)
        return lambda: sampler.sample(logits, next(turns))

    sampled, greedy = batch(device, rng), batch(device, rng, greedy=True)
    sampled_f = batch(device, rng, filtered=True)
    greedy_f = batch(device, rng, greedy=True, filtered=True)
    greedy_b = batch(device, rng, greedy=True, biased=True)

    # The design choice of token_filters.BatchMasks: restricted rows get a 0/-inf bias
    # added, rather than a bool mask filled in.
    x = logits.clone()
    rows8 = torch.arange(8, device=device)
    disallowed = torch.rand(8, VOCAB, device=device) > 256 / VOCAB
    bias = torch.zeros(8, VOCAB, device=device).masked_fill_(disallowed, -torch.inf)

    def masked_fill() -> object:
        return x.index_copy_(
            0, rows8, x.index_select(0, rows8).masked_fill_(disallowed, -torch.inf)
        )

    cases: dict[str, Callable[[], object]] = {
        "mask 8 rows, index_add_ bias": lambda: x.index_add_(0, rows8, bias).zero_(),
        "mask 8 rows, masked_fill_": lambda: (masked_fill(), x.zero_()),
        "sampled, baseline": old(sampled),
        "sampled": new(sampled),
        "sampled, filtered": new(sampled_f),
        "sampled, filtered, rebuilt": new(sampled_f, sampled_f[1:] + sampled_f[:1]),
        "greedy, baseline": old(greedy),
        "greedy": new(greedy),
        "greedy, filtered": new(greedy_f),
        "greedy, filtered, rebuilt": new(greedy_f, greedy_f[1:] + greedy_f[:1]),
        "greedy, logit_bias": new(greedy_b),
    }
    ms = median_ms_each(cases, args.rounds, sync=sync, clock=clock)
    this_vs_old = "this commit vs baseline (before issue 18)"
    filtered = "8 rows allowed ids + 8 rows bad words"
    yardstick = "vs greedy, 16 rows logit_bias (the same path off the argmax shortcut)"
    rows = [
        ("sampled, no filter", this_vs_old, "sampled", "sampled, baseline"),
        ("greedy, no filter", this_vs_old, "greedy", "greedy, baseline"),
        (f"sampled, {filtered}", "vs sampled", "sampled, filtered", "sampled"),
        ("same, masks rebuilt every call", "vs sampled", "sampled, filtered, rebuilt", "sampled"),
        (f"greedy, {filtered}", yardstick, "greedy, filtered", "greedy, logit_bias"),
        (
            "same, masks rebuilt every call",
            yardstick,
            "greedy, filtered, rebuilt",
            "greedy, logit_bias",
        ),
        (f"greedy, {filtered}", "vs greedy (the argmax shortcut)", "greedy, filtered", "greedy"),
        (
            "allowed ids on 8 rows: add a 0/-inf bias (`index_add_`)",
            "vs select + bool `masked_fill_` + `index_copy_` (then `zero_()` on both)",
            "mask 8 rows, index_add_ bias",
            "mask 8 rows, masked_fill_",
        ),
    ]
    table = [
        f"| {what} | {how} | {ms[a]:.3f} | {ms[b]:.3f} | **{ms[a] / ms[b]:.3f}** |"
        for what, how, a, b in rows
    ]
    print("\n".join(table))
    return "\n".join(
        [
            "## sampler (bench/sampler.py)",
            "",
            f"`{command_line()}` — {conditions(device)}; one `Sampler.sample` call on a batch of "
            f"{BATCH} x {VOCAB:,} fp32 logits; each round calls every case once, median "
            f"call of {args.rounds} rounds. Ratio = first / second (below 1: faster).",
            "",
            "| batch | comparison | first ms | second ms | ratio |",
            "|---|---|---:|---:|---:|",
            *table,
            "",
            "A batch without allowed_token_ids or bad_words pays one list and one `any()` "
            "over its rows: the same time as before. With them, a step costs one "
            "`index_add_` of the restricted rows' 0/-inf biases, one scatter of the one-token "
            "bans, and prefix lookups on the rows with longer words; the masks are rebuilt "
            "only on the step the batch's rows change (the rebuilt rows). A greedy batch "
            "that has them leaves the argmax shortcut, as any logits processing does "
            "(logit_bias, penalties): compare it with logit_bias, not with the shortcut.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["large", "filters"], default="large")
    parser.add_argument("--rounds", type=int, default=None, help="large: 12, filters: 200")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 12 if args.mode == "large" else 200
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if args.mode == "large":
        body = run_large(args, device)
        section = "sampler-large"
    else:
        body = run_filters(args, device)
        section = "sampler"
    if not args.no_write:
        write_section(section, body)


if __name__ == "__main__":
    main()
