"""Streaming detokenization: IncrementalDetokenizer against a full decode per step, same run.

Streams `--seqs` sequences of `--tokens` real SmolLM2 ids (the tokenizer test corpus: prose,
code, CJK, emoji), one id per step as a worker delivers them, with and without 4 stop
strings that never match (the worst case: every step searches and holds back). The naive
baseline decodes the whole output every step and emits the new suffix.

    python -m bench.detokenizer [--tokens 256] [--seqs 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

from bench.common.machine import cpu_name
from bench.common.results_md import BENCH_DIR, command_line, write_section
from render_server.generation.detokenizer import _HAS_DECODE_STREAM, IncrementalDetokenizer
from render_server.templating.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, resolve_model

CORPUS = BENCH_DIR.parent / "tests" / "data" / "tokenizer_corpus.json"
STOPS = ["\n\nUser:", "<|im_end|>", "###END###", "Observation: none of these occur here"]


def sequences(tok: Tokenizer, num_seqs: int, num_tokens: int) -> list[list[int]]:
    """`num_seqs` windows of `num_tokens` ids, taken at staggered offsets of the corpus."""
    texts: list[str] = json.loads(CORPUS.read_text(encoding="utf-8"))
    text = "\n".join(t for t in texts if not any(s in t for s in STOPS))
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens * 2:
        ids += ids
    stride = max(1, (len(ids) - num_tokens) // num_seqs)
    return [ids[i * stride : i * stride + num_tokens] for i in range(num_seqs)]


def incremental(tok: Tokenizer, seqs: list[list[int]], stops: list[str]) -> list[str]:
    outputs = []
    for ids in seqs:
        detok = IncrementalDetokenizer(tok, stop=stops)
        for token_id in ids:
            detok.add([token_id])
        detok.flush()
        outputs.append(detok.output_text)
    return outputs


def naive(tok: Tokenizer, seqs: list[list[int]], stops: list[str]) -> list[str]:
    """Full decode each step; stops searched in the whole text; hold back len(stop)-1 chars."""
    hold = max((len(s) for s in stops), default=1) - 1
    outputs = []
    for ids in seqs:
        sent = ""
        for n in range(1, len(ids) + 1):
            text = tok.decode(ids[:n])
            if text.endswith("\ufffd") or any(s in text for s in stops):
                continue
            sent += text[len(sent) : max(len(sent), len(text) - hold)]
        outputs.append(sent + tok.decode(ids)[len(sent) :])  # flush
    return outputs


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--seqs", type=int, default=64, help="sequences")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case; the best counts")
    args = parser.parse_args()

    tok = Tokenizer.from_source(resolve_model(DEFAULT_MODEL))
    seqs = sequences(tok, args.seqs, args.tokens)
    total = args.seqs * args.tokens
    rows = []
    for label, stops in [("no stop strings", []), (f"{len(STOPS)} stop strings", STOPS)]:
        # Same text out of both, or the comparison means nothing.
        assert incremental(tok, seqs, stops) == naive(tok, seqs, stops)
        ours = total / best_seconds(lambda s=stops: incremental(tok, seqs, s), args.repeats)
        base = total / best_seconds(lambda s=stops: naive(tok, seqs, s), args.repeats)
        rows.append(f"| {label} | {ours:,.0f} | {base:,.0f} | {ours / base:.1f}x |")
        print(f"{label}: incremental {ours:,.0f} tok/s, naive {base:,.0f} tok/s", end=" ")
        print(f"({ours / base:.1f}x)")

    backend = "tokenizers DecodeStream" if _HAS_DECODE_STREAM else "Python window"
    table = "\n".join(
        [
            "| case | IncrementalDetokenizer tok/s | full decode per step tok/s | ratio |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    body = (
        "## Detokenizer\n\n"
        f"`{command_line()}` — Python {platform.python_version()}, {cpu_name()}, "
        f"{args.seqs} sequences × {args.tokens} SmolLM2 tokens fed one id per step, best of "
        f"{args.repeats}; decoder: {backend}. Stop strings never match, so every step "
        "searches and holds back.\n\n" + table
    )
    write_section("detokenizer", body)


if __name__ == "__main__":
    main()
