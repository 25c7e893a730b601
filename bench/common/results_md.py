"""Write one benchmark's section of bench/RESULTS.md, replacing its previous run."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
RESULTS = BENCH_DIR / "RESULTS.md"
RESULTS_DIR = BENCH_DIR / "results"
"""Where a benchmark keeps what its section is rendered from (JSON, plots)."""
HEADER = (
    "# Benchmark results\n\nEvery number is a ratio against a baseline measured in the same run.\n"
)


def write_section(name: str, body: str) -> None:
    """Replace the block between `<!-- name:begin -->` and `<!-- name:end -->`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)


def script_module() -> str:
    """The running script as `python -m` names it, e.g. `bench.serving.serve`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return spec.name
    path = Path(sys.argv[0]).resolve().with_suffix("")
    try:
        return ".".join(("bench", *path.relative_to(BENCH_DIR).parts))
    except ValueError:
        return path.name


def command_line(args: Sequence[str] | None = None) -> str:
    """How this benchmark was run, as RESULTS.md quotes it: `python -m bench.<script> <args>`
    (`args`: the arguments to show, by default all of them)."""
    shown = sys.argv[1:] if args is None else list(args)
    return " ".join(["python", "-m", script_module(), *shown])
