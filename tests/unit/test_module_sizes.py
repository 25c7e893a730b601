"""Every module of the packages reads in one sitting: none over 450 lines (bench/ has its
own check, tests/unit/test_bench_layout.py). A module that grows past it holds more than
one concern and is split by concern."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "kernels", "render_server", "gpu_worker")
MAX_LINES = 450
MODULES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_the_packages_have_modules() -> None:
    assert len(MODULES) > 100


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_module_is_over_450_lines(path: Path) -> None:
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {num_lines} lines"
