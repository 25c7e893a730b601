"""The small hot-path choices the code makes, each timed against the obvious alternative.

Comments in the code say why a choice was made and point here for how much it buys:
- sampler: `max(dim).indices` vs `argmax` for the greedy pick (gpu_worker/sampling/sampler.py);
- parsers: state enums hashed by identity vs Enum's own `__hash__`
  (render_server/parsing/tool_parsers/json_scan.py);
- HTTP bodies encoded by msgspec vs FastAPI's `jsonable_encoder` + `json.dumps`
  (render_server/http/serving.py).

Each pair alternates in one process, median of `--repeats` rounds; the ratio is
alternative / choice (above 1: the choice is faster).

    python bench/design_choices.py [--repeats 15] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_md import command_line, write_section  # noqa: E402

from render_server.parsing.tool_parsers.json_scan import StateEnum  # noqa: E402
from render_server.schemas.responses import (  # noqa: E402
    ChatChoice,
    ChatCompletion,
    ChatMessageOut,
    Usage,
)

Timed = Callable[[], object]


def per_call_s(fn: Timed, seconds: float = 0.05) -> float:
    """Seconds per call of `fn`, over at least `seconds` of calls."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def compare(choice: Timed, alternative: Timed, repeats: int) -> tuple[float, float, float]:
    """(choice s, alternative s, alternative / choice), medians of alternating rounds."""
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(per_call_s(choice))
        theirs.append(per_call_s(alternative))
    a, b = statistics.median(ours), statistics.median(theirs)
    return a, b, b / a


def sampler_pairs() -> list[tuple[str, str, Timed, Timed]]:
    logits = torch.randn(32, 49_152)
    return [
        (
            "greedy pick, 32 x 49,152 fp32",
            "`max(dim=-1).indices` vs `argmax(dim=-1)`",
            lambda: logits.max(dim=-1).indices,
            lambda: logits.argmax(dim=-1),
        ),
    ]


class _IdentityState(StateEnum):
    A = 1
    B = 2
    C = 3


class _PlainState(Enum):
    A = 1
    B = 2
    C = 3


def enum_pair() -> tuple[str, str, Timed, Timed]:
    fast = {state: state.value for state in _IdentityState}
    plain = {state: state.value for state in _PlainState}
    fast_keys = list(_IdentityState) * 300
    plain_keys = list(_PlainState) * 300
    return (
        "parser step-table lookups, 900 per call",
        "`StateEnum` (identity hash) vs `Enum` keys",
        lambda: [fast[key] for key in fast_keys],
        lambda: [plain[key] for key in plain_keys],
    )


def encoder_pair() -> tuple[str, str, Timed, Timed]:
    from fastapi.encoders import jsonable_encoder

    body = ChatCompletion(
        id="chatcmpl-1",
        created=0,
        model="m",
        choices=[
            ChatChoice(
                index=i,
                message=ChatMessageOut(role="assistant", content="word " * 200),
                logprobs=None,
                finish_reason="stop",
            )
            for i in range(4)
        ],
        usage=Usage(prompt_tokens=100, completion_tokens=800, total_tokens=900),
    )
    encode = msgspec.json.Encoder().encode
    return (
        "chat completion body, 4 choices x 200 words",
        "`msgspec.json.Encoder().encode` vs FastAPI's `jsonable_encoder` + `json.dumps`",
        lambda: encode(body),
        lambda: json.dumps(jsonable_encoder(msgspec.to_builtins(body))).encode(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = [*sampler_pairs(), enum_pair(), encoder_pair()]
    rows = []
    for what, how, choice, alternative in pairs:
        ours, theirs, ratio = compare(choice, alternative, args.repeats)
        rows.append(
            f"| {what} | {how} | {ours * 1e6:,.1f} | {theirs * 1e6:,.1f} | **{ratio:.2f}x** |"
        )
        print(rows[-1], flush=True)
    body = "\n".join(
        [
            "## Design choices (bench/design_choices.py)",
            "",
            f"`{command_line()}` — torch {torch.__version__}, 1 torch thread; each pair "
            f"alternates in one process, medians of {args.repeats} rounds. Ratio = "
            "alternative / choice.",
            "",
            "| case | choice vs alternative | choice µs | alternative µs | ratio |",
            "|---|---|---:|---:|---:|",
            *rows,
        ]
    )
    if not args.no_write:
        write_section("design_choices", body)


if __name__ == "__main__":
    main()
