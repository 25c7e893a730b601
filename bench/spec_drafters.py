"""The model-free drafters of issue 21 against plain-Python references of the same
definitions, in one process: what one draft costs the engine's host side per request.

- ngram: `ngram_draft` (vectorized numpy over an int32 array) vs the plain search (for n
  from max down, the earliest earlier copy of the last n tokens), on a sequence whose
  last tokens copy an earlier span ("copy") and on one where they occur nowhere ("no
  match", the search's worst case: every n scanned in full); and one decode step of a
  request through `NgramProposer` (its buffer grows by the new token) and through
  `ngram_draft` on a list[int] (what converting the engine's list every call costs).
- suffix, one decode step of a request (append one token, draft up to 8): the incremental
  per-request trie (`SuffixProposer`) vs recomputing the draft by plain search over the
  request's tokens (every match length, continuation counts). The output copies the
  prompt, so drafts are long. Both produce the same drafts (checked every step).
- suffix, setup: `start_request` on the prompt (the trie's O(len * depth) build) and the
  nodes it holds per prompt token; and one step drafting from a global cache of 1,000
  finished outputs.

Thread CPU time, median call of `--calls` calls per case.

    python -m bench.spec_drafters [--calls 40] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections.abc import Callable

import numpy as np

from bench.common.machine import load_average
from bench.common.results_md import command_line, write_section
from bench.common.timing import median_ms
from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.ngram import NgramProposer, ngram_draft
from gpu_worker.spec_decode.suffix import SuffixProposer
from tests.helpers.spec_reference import naive_ngram_draft, naive_suffix_draft

VOCAB = 32_000
NGRAM_MIN, NGRAM_MAX, K = 2, 5, 8
DEPTH = 24


def naive_ngram(tokens: list[int], k: int) -> list[int]:
    return naive_ngram_draft(tokens, NGRAM_MIN, NGRAM_MAX, k)


def naive_suffix(tokens: list[int], k: int, min_prob: float = 0.1) -> list[int]:
    return naive_suffix_draft(tokens, k, DEPTH, min_prob)


def median_call_ms(calls: int, run: Callable[[int], object]) -> float:
    """Thread CPU ms of the median of `calls` calls of `run`, each given its call's index."""
    index = iter(range(calls))
    return median_ms(lambda: run(next(index)), calls, clock=time.thread_time, warmup=False)


def ngram_row(
    calls: int, case: str, tokens: list[int], length: int
) -> tuple[str, str, float, float]:
    array = np.array(tokens, dtype=np.int32)
    assert ngram_draft(array, K, NGRAM_MIN, NGRAM_MAX) == naive_ngram(tokens, K)
    fast = median_call_ms(calls, lambda _: ngram_draft(array, K, NGRAM_MIN, NGRAM_MAX))
    slow = median_call_ms(max(3, calls // 4), lambda _: naive_ngram(tokens, K))
    return (f"ngram {NGRAM_MIN}-{NGRAM_MAX}, {case}", f"{length} tokens", fast, slow)


def ngram_step_rows(calls: int, prompt: list[int]) -> list[tuple[str, str, float, float]]:
    """A decode step of a request whose output copies its prompt: `NgramProposer` (its
    int32 buffer grows by the new token) and `ngram_draft` on the engine's list[int]
    (converted every call), each against the plain search on the list."""
    size = f"{len(prompt)}-token prompt"
    output = prompt[len(prompt) // 3 : len(prompt) // 3 + calls]
    config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=K,
        prompt_lookup_min=NGRAM_MIN,
        prompt_lookup_max=NGRAM_MAX,
    )
    proposer = NgramProposer(config)
    proposer.start_request("r", prompt)
    tokens = list(prompt)
    fast, slow = decode_steps(proposer, naive_ngram, tokens, output, calls)
    from_list = median_call_ms(calls, lambda _: ngram_draft(tokens, K, NGRAM_MIN, NGRAM_MAX))
    return [
        ("ngram step (append 1, draft 8), NgramProposer", size, fast, slow),
        ("ngram_draft on a list[int] (converted each call)", size, from_list, slow),
    ]


def decode_steps(
    proposer: NgramProposer | SuffixProposer,
    naive: Callable[[list[int], int], list[int]],
    tokens: list[int],
    output: list[int],
    calls: int,
) -> tuple[float, float]:
    """Median ms of one decode step (append the next output token, draft K) of request "r"
    in `proposer` and by the plain search over `tokens` (its prompt, extended in place);
    the two must draft alike at the end."""

    def step(call: int) -> None:
        proposer.add_tokens("r", [output[call]])
        proposer.propose("r", K)

    def naive_step(call: int) -> None:
        tokens.append(output[call])
        naive(tokens, K)

    fast = median_call_ms(calls, step)
    slow = median_call_ms(calls, naive_step)
    assert proposer.propose("r", K) == naive(tokens, K)
    return fast, slow


def ngram_rows(calls: int, rng: random.Random) -> list[tuple[str, str, float, float]]:
    rows = []
    for length in (512, 2048, 8192):
        body = [rng.randrange(VOCAB) for _ in range(length - 6)]
        copy = body + body[length // 2 : length // 2 + 6]
        unique = body + [VOCAB + i for i in range(6)]
        rows.append(ngram_row(calls, "copy", copy, length))
        rows.append(ngram_row(calls, "no match", unique, length))
    rows += ngram_step_rows(calls, [rng.randrange(VOCAB) for _ in range(8192)])
    return rows


def suffix_config(max_cached_requests: int = 10_000) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=K,
        suffix_decoding_max_cached_requests=max_cached_requests,
    )


def suffix_step_row(calls: int, prompt: list[int]) -> tuple[tuple[str, str, float, float], str]:
    """One decode step of a request whose output copies its prompt, both ways."""
    length = len(prompt)
    output = prompt[length // 3 : length // 3 + calls]
    proposer = SuffixProposer(suffix_config(max_cached_requests=0))
    start = time.thread_time_ns()
    proposer.start_request("r", prompt)
    build_ms = (time.thread_time_ns() - start) / 1e6
    nodes = proposer.num_nodes("r")
    fast, slow = decode_steps(proposer, naive_suffix, list(prompt), output, calls)
    note = (
        f"{length}-token prompt: `start_request` {build_ms:.1f} ms, "
        f"{nodes / length:.1f} trie nodes per prompt token"
    )
    return ("suffix step (append 1, draft 8)", f"{length}-token prompt", fast, slow), note


def suffix_rows(calls: int, rng: random.Random) -> tuple[list[tuple[str, str, float, float]], str]:
    rows = []
    notes = []
    for length in (512, 2048):
        row, note = suffix_step_row(calls, [rng.randrange(VOCAB) for _ in range(length)])
        rows.append(row)
        notes.append(note)
    cached = SuffixProposer(suffix_config())
    for request in range(1_000):
        rid = f"c{request}"
        cached.start_request(rid, [rng.randrange(VOCAB) for _ in range(16)])
        cached.add_tokens(rid, [rng.randrange(2_000) for _ in range(64)])
        cached.finish_request(rid)
    cached.start_request("r", [rng.randrange(2_000) for _ in range(256)])
    global_ms = median_call_ms(calls, lambda _: cached.propose("r", K))
    notes.append(
        f"global cache fed 1,000 outputs x 64 tokens, holding the last "
        f"{len(cached.global_cache):,} ({cached.global_cache.trie.num_nodes:,} nodes, the "
        f"default bound {cached.global_cache.max_nodes:,}): one `propose` {global_ms:.3f} ms"
    )
    return rows, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    rows = ngram_rows(args.calls, rng)
    suffix, notes = suffix_rows(args.calls, rng)
    rows += suffix
    load = load_average(", ")
    lines = [
        "## spec-drafters (bench/spec_drafters.py)",
        "",
        f"`{command_line()}` — {platform.machine()}, {os.cpu_count()} CPUs, thread CPU time, "
        f"load average {load} at the end; median call of {args.calls}. Ratio = drafter / "
        "plain-Python reference of the same definition (below 1: faster); both give the "
        "same drafts.",
        "",
        "| case | size | drafter ms | reference ms | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for case, size, fast, slow in rows:
        lines.append(f"| {case} | {size} | {fast:.4f} | {slow:.4f} | **{fast / slow:.3f}** |")
    lines += ["", f"Suffix setup and global cache: {notes}."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("spec-drafters", body)


if __name__ == "__main__":
    main()
