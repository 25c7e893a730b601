"""Write one benchmark's section of bench/RESULTS.md, replacing its previous run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
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


def command_line() -> str:
    """How this benchmark was run, as RESULTS.md quotes it: `python bench/<script> <args>`."""
    return " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
