"""The batched sampler with and without allowed_token_ids / bad_words, and its plain batch
against the sampler of an earlier commit, all in one process.

One step of a batch of 32 sequences (vocab 49,152, fp32 logits, 64 output tokens each):
- sampled: every row samples at temperature 0.8 (no top-k/p: their sort would hide the
  rest), no token filter;
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
The baseline is `gpu_worker/sampling/sampler.py` as of `--baseline` (git), loaded beside
the current one, on the unfiltered batches. Each round calls every case once; the median
call of `--rounds` rounds per case (the order reversed every other round).

    python bench/sampler.py --baseline e18e728 [--rounds 200] [--device cpu] [--no-write]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from results_md import command_line, write_section

from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
VOCAB = 49_152
EOS = 2


def baseline_module(rev: str) -> ModuleType:
    """The sampler module as of `rev`, imported under another name beside the current one."""
    source = subprocess.run(
        ["git", "show", f"{rev}:gpu_worker/sampling/sampler.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("baseline_sampler", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    exec(compile(source, f"{rev}:sampler.py", "exec"), module.__dict__)
    return module


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
        seq = Sequence(f"r{row}", prompt, params, sampler_state=new_sampler_state(params, device))
        for token in output:
            seq.append_token(token)
        seqs.append(seq)
    return seqs


def call_s(fn: Callable[[], object], sync: Callable[[], None], clock: Callable[[], float]) -> float:
    """Seconds of one call of `fn`, device work included."""
    start = clock()
    fn()
    sync()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision of the old sampler")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # On CPU, the thread's own CPU time: with one torch thread it is all the work, and
    # other jobs on a shared machine do not count in it as they do in wall time.
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    rng = random.Random(0)
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    old_sampler = baseline_module(args.baseline).Sampler

    def old(batch: list[Sequence]) -> Callable[[], object]:
        sampler = old_sampler(VOCAB, device, [EOS])
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
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm up
        fn()
    # One call of each case per round, so load drifting on a shared machine hits every
    # case alike, in reverse order every other round, so no case always follows the same
    # one; the median call per case.
    order = list(cases.items())
    for _ in range(args.rounds):
        for name, fn in order:
            times[name].append(call_s(fn, sync, clock))
        order.reverse()
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    this_vs_old = "this commit vs baseline"
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
    clock_name = "wall time" if device.type == "cuda" else "thread CPU time"
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 torch "
        f"thread, device {device}, {clock_name}, load average "
        f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} at the end"
    )
    body = "\n".join(
        [
            "## sampler (bench/sampler.py)",
            "",
            f"`{command_line()}` — {machine}; one `Sampler.sample` call on a batch of "
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
    if not args.no_write:
        write_section("sampler", body)


if __name__ == "__main__":
    main()
