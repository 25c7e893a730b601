"""Where the tests' checked-in data lives (tests/data/README.md says what each file is)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parents[1] / "data"
"""tests/data: chat conversations, parser outputs, templates, the tokenizer corpus."""
