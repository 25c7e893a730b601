"""Host work per decode step: the model runner's batch preparation before and after its
block tables became persistent rows (gpu_worker/runner/block_table.py).

    python -m bench.prepare [--steps 48] [--passes 3] [--no-write]

The baseline is the runner's old `_prepare`, kept here verbatim: every step it rebuilds
every block table from the sequences' Python lists (numpy fill, then upload). The new
path is `ModelRunner.prepare` + `ModelRunner.upload` (the eager step: the same tensors,
the block tables gathered from persistent rows that took only the blocks gained), and
`prepare` alone, the host part a CUDA-graph step then packs into one copy. On CPU
(device=cpu tensors, one torch thread): what is measured is host time.

Each case runs decode steps over `num_seqs` sequences of about `context` tokens, staggered
so that every step one sequence in 16 crosses into a new block (a 16-token block each),
as in steady decoding. Both paths see the same steps from the same starting state, one
untimed step first (the new path's rows are written then, once, as at admission); passes
alternate, and the table gives medians over steps and passes (thread CPU time, which a
busy machine disturbs less than wall time; the wall ratio too) and their ratio. Writes
the `prepare` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from bench.common.machine import load_average
from bench.common.results_md import command_line, write_section
from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.core.sequence import Sequence as Seq
from gpu_worker.runner.model_runner import ModelRunner
from shared.sampling import SamplingParams

BLOCK = 16
CASES = [(64, 1024), (64, 8192), (256, 32768)]
CPU = torch.device("cpu")


# ---- the baseline: the runner's `_prepare` before persistent rows, verbatim -------------


def legacy_layout(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> dict[str, Any]:
    num_seqs = len(block_tables)
    num_tokens = int(query_lens.sum())
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = context_lens + query_lens
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens) + np.repeat(context_lens - query_start_loc[:-1], query_lens)
    width = max((len(t) for t in block_tables), default=0)
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = tables[seq_of_token, positions // block_size] * block_size
    slots += positions % block_size
    return {
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "context_lens": context_lens,
        "positions": positions,
        "slot_mapping": slots,
        "block_tables": tables,
    }


def legacy_to_device(arrays: list[np.ndarray], dtype: np.dtype[Any]) -> list[torch.Tensor]:
    sizes = [a.size for a in arrays]
    return list(torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False)).split(sizes))


def legacy_prepare(scheduled: list[ScheduledSequence]) -> list[torch.Tensor]:
    num_seqs = len(scheduled)
    query_lens = np.empty(num_seqs, dtype=np.int64)
    context_lens = np.empty(num_seqs, dtype=np.int64)
    input_ids: list[int] = []
    tables: list[list[int]] = []
    will_sample = np.empty(num_seqs, dtype=bool)
    for i, item in enumerate(scheduled):
        start, num_new = item.num_computed_tokens, item.num_new_tokens
        query_lens[i] = num_new
        context_lens[i] = start
        if num_new == 1:
            input_ids.append(item.seq.all_token_ids[start])
        else:
            input_ids.extend(item.seq.all_token_ids[start : start + num_new])
        tables.append(item.seq.block_table)
        will_sample[i] = item.will_sample
    layout = legacy_layout(query_lens, context_lens, tables, BLOCK)
    extra = [np.asarray(input_ids, dtype=np.int64), layout["positions"]]
    i64 = legacy_to_device([layout["slot_mapping"], *extra], np.dtype(np.int64))
    i32 = [layout[k] for k in ("query_start_loc", "seq_lens", "context_lens")]
    i32_t = legacy_to_device([*i32, layout["block_tables"].ravel()], np.dtype(np.int32))
    layout["query_start_loc"].tolist()
    layout["context_lens"].tolist()
    return [*i64, *i32_t]


# ---- the workload ----------------------------------------------------------------------


class DecodeBatch:
    """`num_seqs` decoding sequences of about `context` tokens; `advance` is one step."""

    def __init__(self, num_seqs: int, context: int, num_steps: int) -> None:
        self.items: list[ScheduledSequence] = []
        next_block = 0
        for i in range(num_seqs):
            # Staggered: sequence i crosses a block boundary when (context + i + step) % 16 == 0.
            length = context + i % BLOCK
            seq = Seq(f"r{i}", [1], SamplingParams(), block_size=BLOCK)
            seq.all_token_ids = [t % 200 for t in range(length + num_steps + 2)]
            num_blocks = -(-(length + 1) // BLOCK)
            seq.block_table = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks + num_steps // BLOCK + 2
            self.items.append(ScheduledSequence(seq, length, 1, True))

    def advance(self) -> None:
        for item in self.items:
            item.num_computed_tokens += 1
            if item.num_computed_tokens % BLOCK == 0:  # the next token opens a new block
                item.seq.block_table.append(item.seq.block_table[-1] + 1)


def per_step_ms(
    num_seqs: int, context: int, num_steps: int, step_fn: Callable[[DecodeBatch], object]
) -> tuple[list[float], list[float]]:
    """(thread CPU ms, wall ms) of each of `num_steps` steps after an untimed first one."""
    work = DecodeBatch(num_seqs, context, num_steps)
    step_fn(work)  # untimed: the new path writes every row once here
    cpu, wall = [], []
    for _ in range(num_steps):
        work.advance()
        start_cpu, start_wall = time.thread_time(), time.perf_counter()
        step_fn(work)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
        wall.append((time.perf_counter() - start_wall) * 1e3)
    return cpu, wall


def new_runner() -> ModelRunner:
    none = cast(Any, None)  # batch preparation needs no model
    return ModelRunner(none, none, [], BLOCK, CPU)


def run_case(num_seqs: int, context: int, num_steps: int, passes: int) -> dict[str, float]:
    """Median per-step CPU ms of each path (and wall ms as `<path>_wall`)."""
    paths: dict[str, Callable[[], Callable[[DecodeBatch], object]]] = {
        "legacy": lambda: lambda w: legacy_prepare(w.items),
        "new": lambda: _eager_step(new_runner()),
        "host": lambda: _host_step(new_runner()),
    }
    times: dict[str, list[float]] = {}
    for _ in range(passes):
        for name, make in paths.items():
            cpu, wall = per_step_ms(num_seqs, context, num_steps, make())
            times.setdefault(name, []).extend(cpu)
            times.setdefault(f"{name}_wall", []).extend(wall)
    return {name: statistics.median(values) for name, values in times.items()}


def _eager_step(runner: ModelRunner) -> Callable[[DecodeBatch], object]:
    return lambda w: runner.upload(runner.prepare(w.items))


def _host_step(runner: ModelRunner) -> Callable[[DecodeBatch], object]:
    return lambda w: runner.prepare(w.items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = load_average()
    rows = []
    for num_seqs, context in CASES:
        result = run_case(num_seqs, context, args.steps, args.passes)
        line = (
            f"| {num_seqs} x {context // 1024}k | {result['legacy']:.3f} | {result['new']:.3f} | "
            f"**{result['legacy'] / result['new']:.1f}x** | "
            f"{result['legacy_wall'] / result['new_wall']:.1f}x | {result['host']:.3f} | "
            f"{result['legacy'] / result['host']:.1f}x |"
        )
        print(line, flush=True)
        rows.append(line)
    load_after = load_average()
    body = "\n".join(
        [
            "## Host work per decode step (bench/prepare.py)",
            "",
            f"`{command_line()}`",
            "",
            f"Machine: {platform.machine()}, torch {torch.__version__}, 1 torch thread, "
            f"device=cpu tensors; load average {load_before} at the start, {load_after} at "
            f"the end. {args.steps} decode steps x {args.passes} alternating passes per case; "
            "every step one sequence in 16 gains a block. Times are medians of per-step "
            "thread CPU time (the machine is shared; the wall-time ratio is beside it).",
            "",
            "| sequences x context | old `_prepare` ms | `prepare` + `upload` ms | old / new "
            "| old / new (wall) | `prepare` alone ms (graph steps) | old / that |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Old: every block table rebuilt from the sequences' lists each step (work in "
            "proportion to the whole context). New: persistent rows take only the blocks "
            "gained; the step's tables are one gather of its rows (`BlockTable.gather`, on the "
            "device on a GPU, here a CPU memcpy still in proportion to sequences x width). "
            "What is left is per sequence: the Python loop over the scheduled items and the "
            "numpy layout. A CUDA-graph decode step adds to `prepare` only the fill of its "
            "staging buffer (a few numpy copies of `bucket` rows) and moves it in one copy, "
            "then at most a scatter (new blocks) and a gather before the replay, where it "
            "launched ~11 copies and fills; that part needs a GPU to time.",
        ]
    )
    if not args.no_write:
        write_section("prepare", body)


if __name__ == "__main__":
    main()
