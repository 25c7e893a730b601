"""The render tier's per-token path of a streamed chat: this tree against a git revision.

Each generated id goes through what a worker delta meets in render-serve: `Choice.on_delta`
(detokenizer, stop strings) and `ChatFormatter.delta_events` (the SSE chunk), one id per
delta, for `--seqs` sequences of `--tokens` SmolLM2 ids (the tokenizer test corpus). The
working tree and `--baseline` (its `render_server` and `shared` packages read from git)
run in alternating child processes, so both see the same machine load; each side keeps
its best run.

    python bench/stream_ab.py --baseline REV [--tokens 256] [--seqs 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "tokenizer_corpus.json"
PACKAGES = ("render_server", "shared")
STOPS = ["\n\nUser:", "<|im_end|>", "###END###", "Observation: none of these occur here"]
CASES = {
    "plain": {},
    "4 stop strings": {"stop": STOPS},
    "logprobs, top 5": {"logprobs": True, "top_logprobs": 5},
    # vLLM's fields, new in this tree (the baseline ignores them): what asking costs.
    "return_token_ids + continuous usage*": {
        "return_token_ids": True,
        "stream_options": {"continuous_usage_stats": True},
    },
}


class GitRevisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `PACKAGES` as they are at a git revision (other packages as installed)."""

    def __init__(self, rev: str) -> None:
        self.rev = rev
        listing = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, *PACKAGES],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        self.files = set(listing.stdout.split())

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in PACKAGES:
            return None
        base = fullname.replace(".", "/")
        for name, is_package in ((f"{base}/__init__.py", True), (f"{base}.py", False)):
            if name in self.files:
                spec = importlib.util.spec_from_loader(fullname, self, is_package=is_package)
                if spec is not None:
                    spec.origin = name
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = module.__spec__.origin if module.__spec__ is not None else None
        assert name is not None
        source = subprocess.run(
            ["git", "show", f"{self.rev}:{name}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        module.__file__ = str(ROOT / name)  # resources (templates) resolve in the tree
        exec(compile(source, f"{self.rev}:{name}", "exec"), module.__dict__)  # noqa: S102


def sequences(tok: Any, num_seqs: int, num_tokens: int) -> list[list[int]]:
    texts: list[str] = json.loads(CORPUS.read_text(encoding="utf-8"))
    ids = tok.encode("\n".join(t for t in texts if not any(s in t for s in STOPS)), False)
    while len(ids) < num_tokens * 2:
        ids += ids
    stride = max(1, (len(ids) - num_tokens) // num_seqs)
    return [ids[i * stride : i * stride + num_tokens] for i in range(num_seqs)]


def child(args: argparse.Namespace) -> None:
    """Time every case on one side; print {case: tokens per second}."""
    if args.child != "tree":
        sys.meta_path.insert(0, GitRevisionFinder(args.child))
    from render_server.generation.lifecycle import ChoiceSpec, Generation, PromptSpec
    from render_server.http.api.chat import ChatFormatter
    from render_server.parsing.chat_output import ChoiceProcessor
    from render_server.parsing.tool_choice import plan_tools
    from render_server.schemas.generation import ChatCompletionRequest
    from render_server.templating.token_text import TokenText
    from render_server.templating.tokenizer import Tokenizer
    from shared.model_source import DEFAULT_MODEL, resolve_model
    from shared.protocol import RequestDelta, TokenLogprobs
    from shared.sampling import SamplingParams

    tok = Tokenizer.from_source(resolve_model(DEFAULT_MODEL))
    state = SimpleNamespace(
        model_id="m", token_text=TokenText(tok), tokenizer=tok, system_fingerprint="fp_0"
    )
    seqs = sequences(tok, args.seqs, args.tokens)
    plan = plan_tools(None, None, None, enable_auto_tool_choice=False, tool_call_parser=None)
    results = {}
    for case, fields in CASES.items():
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
        )
        spec = ChoiceSpec(SamplingParams(), body.stop_strings(), False, True)
        # The deltas a worker would send: one id each, the last one finishing.
        deltas = []
        for ids in seqs:
            one = []
            for i, token_id in enumerate(ids):
                logprobs = None
                if body.logprobs:
                    alts = ids[i : i + 5]
                    logprobs = [TokenLogprobs(-0.5, 1, alts, [-0.5] * len(alts))]
                finish = "length" if i == len(ids) - 1 else None
                one.append(RequestDelta("r-0", [token_id], finish, logprobs=logprobs))
            deltas.append(one)

        def run(body: Any = body, spec: Any = spec, deltas: list[list[Any]] = deltas) -> None:
            for sequence in deltas:
                generation = Generation(None, tok, "r", [PromptSpec([1, 2, 3], [spec])])
                formatter = ChatFormatter(state, body, [ChoiceProcessor(plan, None)])
                choice = generation.choices[0]
                for delta in sequence:
                    formatter.delta_events(generation, choice.on_delta(delta))

        run()  # warm the caches (token text, tokenizer)
        start = time.perf_counter()
        run()
        results[case] = args.seqs * args.tokens / (time.perf_counter() - start)
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=False, help="git revision to compare with")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--seqs", type=int, default=32, help="sequences")
    parser.add_argument("--repeats", type=int, default=5, help="runs per side; the best counts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if not args.baseline:
        parser.error("--baseline is required")
    sides = {"baseline": args.baseline, "tree": "tree"}
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    for _ in range(args.repeats):
        for side, rev in sides.items():
            command = [sys.executable, __file__, "--child", rev]
            command += ["--tokens", str(args.tokens), "--seqs", str(args.seqs)]
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            for case, rate in json.loads(out.stdout.splitlines()[-1]).items():
                best[side][case] = max(best[side].get(case, 0.0), rate)
    rows = []
    for case in CASES:
        base, tree = best["baseline"][case], best["tree"][case]
        rows.append(f"| {case} | {base:,.0f} | {tree:,.0f} | {tree / base:.2f}x |")
        print(f"{case}: baseline {base:,.0f} tok/s, tree {tree:,.0f} tok/s ({tree / base:.2f}x)")
    sys.path.insert(0, str(ROOT / "bench"))
    from results_md import command_line, write_section

    body = (
        "## Streamed chat, per token: this tree against a revision (bench/stream_ab.py)\n\n"
        f"`{command_line()}` — Python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}; {args.seqs} sequences × "
        f"{args.tokens} SmolLM2 ids, one per delta, through Choice.on_delta and "
        f"ChatFormatter.delta_events; the two sides alternate in child processes, best of "
        f"{args.repeats} each; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs shared with other work at the end.\n\n"
        "| case | baseline tok/s | this tree tok/s | ratio |\n|---|---:|---:|---:|\n"
        + "\n".join(rows)
        + "\n\n\\* fields the baseline does not know and ignores: the row is what a client "
        "pays for asking, not a like-for-like comparison."
    )
    write_section("stream_ab", body)


if __name__ == "__main__":
    main()
